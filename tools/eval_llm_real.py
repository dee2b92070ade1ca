"""2:4 (and int4) on a real pretrained causal LM: perplexity relative to dense on held-out text
of domains used for neither calibration nor training, one shot, with block reconstruction,
with recovery distillation (bf16, resumable), data-free (teacher-sampled text) or on text.

    python tools/eval_llm_real.py --prepare-text .evaltext       # code.txt, man.txt, info.txt
    python tools/eval_llm_real.py --model SmolLM2.gguf --text .evaltext --train code \\
        --eval man,info --stages dense,alps@code,alps+recon@code,alps+recon@teacher \\
        --out results.json
    python tools/eval_llm_real.py --model M --text T --stages "alps+recon@mix>distill@mix" \\
        --distill-minutes 8 --state-dir state/      # a second call with the same --state-dir
                                                    # resumes the distillation
    python tools/eval_llm_real.py --smoke --out /tmp/real.json   # tiny random Llama (CI)

Text domains (``--prepare-text`` writes them from this machine's own files): ``code`` the
Python standard library's sources, ``man`` section-1 manual pages rendered by groff, ``info``
the GNU info manuals. ``--train`` names the domain that calibration and distillation may read;
every perplexity is measured on the ``--eval`` domains (never read before) and, for reference,
on a held-out part of the train domain. ``teacher``: sequences sampled from the dense model
itself (``sparsekit.data.teacher``); ``mix``: half teacher samples, half train-domain windows.

A stage is ``METHOD@CALIBRATION`` with METHOD one of ``sparsegpt``, ``alps``, ``wanda``,
``magnitude`` (2:4 one shot), optionally ``+recon`` (block reconstruction, ``--recon-steps``),
followed by ``>distill@DATA`` (recovery distillation from the dense model: KL on the logits plus
hidden-state cosine, bf16) and/or ``>gptq4`` (GPTQ int4, group ``--group-size``); ``gptq4@DATA``
alone quantizes the dense model; ``dense`` measures the dense model. One-shot and distilled
weights are kept in ``--state-dir`` so later stages and later calls reuse them.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

import sparsekit as sk
from sparsekit.data.teacher import teacher_samples
from sparsekit.prune.distill import distill_

DOMAINS = ("code", "man", "info")


# ----------------------------------------------------------------------------- text domains
def _collapse(text: str) -> str:
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _python_sources() -> list[Path]:
    """This interpreter's standard library sources (tests left out), then its installed
    packages' sources, each group in a fixed shuffled order."""
    import random

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    groups = []
    for root, skip in ((stdlib, ("site-packages", "test", "tests")), (site, ("test", "tests"))):
        files = sorted(f for f in root.rglob("*.py")
                       if not any(part in skip for part in f.relative_to(root).parts[:-1]))
        random.Random(0).shuffle(files)
        groups.append(files)
    return groups[0] + groups[1]


def prepare_text(out: Path, domains: list[str], chars: dict[str, int]) -> dict[str, int]:
    """Write ``DOMAIN.txt`` for each of ``domains`` (about ``chars[domain]`` characters) from
    this machine's Python sources (``code``), section-1 manual pages rendered by groff
    (``man``) and GNU info manuals (``info``); returns their sizes."""
    out.mkdir(parents=True, exist_ok=True)
    sources = {
        "code": lambda: (f.read_text(errors="ignore") for f in _python_sources()),
        "man": lambda: (_collapse(subprocess.run(
            ["bash", "-c", f"zcat '{f}' | groff -man -Tascii -P -c 2>/dev/null | col -bx"],
            capture_output=True, text=True).stdout)
            for f in sorted(Path("/usr/share/man/man1").glob("*.1.gz"))),
        "info": lambda: (_collapse(re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "",
                                          gzip.open(f, "rt", errors="ignore").read()))
                         for f in sorted(Path("/usr/share/info").glob("*.info*.gz"))),
    }
    sizes = {}
    for d in domains:
        parts, size = [], 0
        for text in sources[d]():
            if size >= chars[d]:
                break
            if len(text) > 200:
                parts.append(text)
                size += len(text) + 2
        (out / f"{d}.txt").write_text("\n\n".join(parts)[:chars[d]])
        sizes[d] = min(size, chars[d])
    return sizes


def windows(tokenizer, text: str, seq_len: int, count: int, skip: int = 0) -> torch.Tensor:
    """``count`` consecutive non-overlapping windows of ``seq_len`` tokens of ``text``, after
    the first ``skip`` windows (int64, (count, seq_len))."""
    need = (skip + count) * seq_len
    ids: list[int] = []
    step = 200_000
    for i in range(0, len(text), step):
        ids += tokenizer(text[i:i + step], add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than the {need} asked for")
    return torch.tensor(ids[skip * seq_len:need], dtype=torch.long).view(count, seq_len)


@torch.no_grad()
def perplexity(model: nn.Module, data: torch.Tensor, batch: int) -> float:
    """exp of the mean next-token negative log-likelihood over every window of ``data``."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        ids = data[i:i + batch].to(device)
        logits = model(ids).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
            reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    return math.exp(total / count)


# ----------------------------------------------------------------------------- models
def load_model(path: str, device: torch.device):
    from sparsekit.models import hf

    model = hf.load_pretrained(path, "causal_lm", quiet=True)
    tokenizer = hf.load_tokenizer(path)
    model.config.use_cache = False
    return model.float().to(device).eval(), tokenizer


def smoke_model(device: torch.device):
    """A tiny random Llama and a byte-level stand-in tokenizer (CI: no weights on disk)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).eval()

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8", errors="ignore"))}

    return model, tokenizer


def save_state(model: nn.Module, path: Path) -> None:
    """A stage's weights as sparsekit's portable checkpoint (2:4 stored compactly, atomic)."""
    sk.save(model, path)


def load_state(model: nn.Module, path: Path) -> None:
    """The weights :func:`save_state` wrote, into ``model`` (same architecture), in place."""
    device = next(model.parameters()).device
    sk.load(path, model=model, device=device)


# ----------------------------------------------------------------------------- stages
def parse_stage(spec: str) -> list[tuple[str, str | None]]:
    """``"alps+recon@mix>distill@teacher>gptq4"`` -> [("alps+recon", "mix"), ("distill",
    "teacher"), ("gptq4", None)]."""
    steps = []
    for part in spec.split(">"):
        method, _, data = part.partition("@")
        steps.append((method, data or None))
    return steps


class Lab:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if args.smoke:
            self.dense, self.tok = smoke_model(self.device)
        else:
            start = time.perf_counter()
            self.dense, self.tok = load_model(args.model, self.device)
            self.load_seconds = time.perf_counter() - start
        self.dense.requires_grad_(False)
        self.state_dir = Path(args.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.text = {}
        for d in {args.train, *args.eval}:
            self.text[d] = (Path(args.text) / f"{d}.txt").read_text(errors="ignore") \
                if not args.smoke else _smoke_text(d)
        a = args
        # train domain: calibration windows, then training windows, then held-out windows
        self.calib = windows(self.tok, self.text[a.train], a.seq_len, a.calib_n)
        self.train = windows(self.tok, self.text[a.train], a.seq_len, a.train_n, skip=a.calib_n)
        self.evals = {d: windows(self.tok, self.text[d], a.seq_len, a.eval_n) for d in a.eval}
        self.evals[f"{a.train}-heldout"] = windows(self.tok, self.text[a.train], a.seq_len,
                                                   a.eval_n, skip=a.calib_n + a.train_n)
        self._teacher: torch.Tensor | None = None

    def teacher(self) -> torch.Tensor:
        if self._teacher is None:
            a = self.args
            n = a.calib_n + a.teacher_n
            start = time.perf_counter()
            self._teacher = teacher_samples(self.dense, n, a.seq_len, seed=a.seed,
                                            temperature=1.0, top_p=0.95, first_tokens=4,
                                            batch_size=a.sample_batch,
                                            cache_dir=self.state_dir / "teacher")
            self.teacher_seconds = time.perf_counter() - start
        return self._teacher

    def source(self, name: str, calibration: bool) -> torch.Tensor:
        """Windows of the named data source: the train domain, teacher samples or a mix."""
        a = self.args
        text = self.calib if calibration else self.train
        if name == a.train:
            return text
        t = self.teacher()
        t = t[:a.calib_n] if calibration else t[a.calib_n:]
        if name == "teacher":
            return t
        if name == "mix":  # half and half (calibration: as many windows as the text's)
            half = len(text) // 2 if calibration else len(t)
            mixed = torch.cat([text[:half], t[:len(text) - half] if calibration else t])
            return mixed[torch.randperm(len(mixed), generator=torch.Generator().manual_seed(0))]
        raise SystemExit(f"unknown data source {name!r}: use {a.train}, teacher or mix")

    def batches(self, data: torch.Tensor, size: int) -> list[torch.Tensor]:
        return [data[i:i + size] for i in range(0, len(data), size)]

    def measure(self, model: nn.Module) -> dict[str, float]:
        return {d: perplexity(model, w, self.args.eval_batch) for d, w in self.evals.items()}

    # --- the methods
    def oneshot(self, model: nn.Module, method: str, data: str) -> dict:
        a = self.args
        criterion, recon = method.split("+")[0], "+recon" in method
        options = {}
        if recon:
            options = {"reconstruct_steps": a.recon_steps, "reconstruct_lr": a.recon_lr}
        calib = [b.to(self.device) for b in self.batches(self.source(data, True), a.calib_batch)]
        start = time.perf_counter()
        solver_kw = {}
        if criterion in ("sparsegpt", "alps", "wanda"):
            solver_kw = {"calibration": calib}
        if options:
            solver_kw["criterion_options"] = options
        sk.prune_(model, pattern="2:4", criterion=criterion,
                  exclude=["re:lm_head"], **solver_kw)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return {"seconds": round(time.perf_counter() - start, 1), "criterion": criterion,
                "reconstruct": options or None, "calibration": data,
                "calibration_tokens": sum(b.numel() for b in calib)}

    def distill(self, model: nn.Module, data: str, key: str) -> dict:
        a = self.args
        train = self.batches(self.source(data, False), a.train_batch)
        pruner = sk.Pruner(model, pattern="2:4", criterion="magnitude",
                           exclude=["re:lm_head"], schedule=sk.OneShot(step=0))
        pruner.step(0)
        logs = []
        run = distill_(model, self.dense, train, steps=a.distill_steps, lr=a.distill_lr,
                       task="causal_lm", pruner=pruner, warmup=a.distill_steps // 20,
                       precision=a.precision, temperature=1.0, feature_weight=a.feature_weight,
                       max_seconds=a.distill_minutes * 60, dropout=False,
                       checkpoint=self.state_dir / f"{key}.distill.pt",
                       on_log=lambda s, m: logs.append((s, m)) or print(
                           f"  distill step {s}: loss {m['distill/loss']:.4f} "
                           f"{m['distill/tokens_per_s']:.0f} tok/s", flush=True),
                       log_every=50)
        pruner.finalize()
        out = run.summary()
        out.update(data=data, steps=a.distill_steps, lr=a.distill_lr, batch=a.train_batch,
                   seq_len=a.seq_len, feature_weight=a.feature_weight, precision=a.precision,
                   loss_first=run[0] if run else None, loss_last=run[-1] if run else None)
        return out

    def gptq4(self, model: nn.Module, data: str | None) -> dict:
        from sparsekit.quant.formats import INT4, SCHEMES, Scheme, register_scheme

        a = self.args
        scheme = f"int4_weight_g{a.group_size}"
        if scheme not in SCHEMES:
            register_scheme(Scheme(scheme, INT4, None, weight_granularity="group",
                                   group_size=a.group_size))
        calib = [b.to(self.device) for b in self.batches(
            self.source(data or a.train, True), a.calib_batch)]
        start = time.perf_counter()
        sk.quantize_(model, scheme, method="gptq", calibration=calib, exclude=["re:lm_head"])
        return {"seconds": round(time.perf_counter() - start, 1), "group_size": a.group_size,
                "calibration": data or a.train}

    def run_stage(self, spec: str) -> dict:
        model = copy.deepcopy(self.dense).requires_grad_(True)
        detail, key = [], ""
        for i, (method, data) in enumerate(parse_stage(spec)):
            key = f"{key}>{method}@{data}" if key else f"{method}@{data}"
            path = self.state_dir / (re.sub(r"[^A-Za-z0-9_.+@-]", "_", key) + ".safetensors")
            if method == "distill":
                done = path.exists()
                if done:
                    load_state(model, path)
                    detail.append({"step": "distill", "reused": str(path)})
                    continue
                info = self.distill(model, data or self.args.train, key)
                detail.append({"step": "distill", **info})
                if not info["finished"]:  # measured as it stands; a later call resumes it
                    return {"perplexity": self.measure(model), "unfinished": True,
                            "detail": detail}
                save_state(model, path)
            elif method == "gptq4":
                detail.append({"step": "gptq4", **self.gptq4(model, data)})
            elif i == 0 and path.exists():
                load_state(model, path)
                detail.append({"step": method, "reused": str(path)})
            else:
                detail.append({"step": method, **self.oneshot(model, method, data or
                                                              self.args.train)})
                save_state(model, path)
        return {"perplexity": self.measure(model), "detail": detail}


def _smoke_text(domain: str) -> str:
    words = {"code": "def f(x):\n    return x + 1\n", "man": "NAME ls - list directory. ",
             "info": "This manual documents the GNU tools. "}[domain]
    return words * 4000


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare-text", metavar="DIR", help="write DIR/DOMAIN.txt and stop")
    p.add_argument("--domains", default="code,man,info", help="with --prepare-text")
    p.add_argument("--chars", type=lambda v: dict(kv.split("=") for kv in v.split(",")),
                   default={"code": 40_000_000}, help="with --prepare-text: code=N,man=N")
    p.add_argument("--model", help="a GGUF file, or a directory with one or an HF model")
    p.add_argument("--text", default=".evaltext", help="a folder of DOMAIN.txt files")
    p.add_argument("--train", default="code", help="the domain calibration/training may read")
    p.add_argument("--eval", default="man,info", help="held-out domains, comma-separated")
    p.add_argument("--stages", default="dense,sparsegpt@code,alps@code,alps+recon@code")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-n", type=int, default=128, help="calibration windows")
    p.add_argument("--train-n", type=int, default=8192, help="train-domain training windows")
    p.add_argument("--teacher-n", type=int, default=4096, help="teacher-sampled training "
                   "windows (mix: as many train-domain windows beside them)")
    p.add_argument("--eval-n", type=int, default=64, help="windows per held-out domain")
    p.add_argument("--calib-batch", type=int, default=8)
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--sample-batch", type=int, default=512)
    p.add_argument("--recon-steps", type=int, default=400)
    p.add_argument("--recon-lr", type=float, default=1e-4)
    p.add_argument("--distill-steps", type=int, default=4000)
    p.add_argument("--distill-lr", type=float, default=1e-4)
    p.add_argument("--distill-minutes", type=float, default=8.0)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--feature-weight", type=float, default=1.0)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--state-dir", default="eval_llm_state")
    p.add_argument("--out", default=None, help="JSON results (merged into an existing file)")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, small settings")
    args = p.parse_args(argv)
    if args.prepare_text:
        domains = [d for d in args.domains.split(",") if d]
        chars = {d: int(args.chars.get(d, 400_000)) for d in domains}
        sizes = prepare_text(Path(args.prepare_text), domains, chars)
        print(json.dumps(sizes))
        return {"prepared": sizes}
    if args.smoke:
        args.seq_len, args.calib_n, args.train_n, args.eval_n = 32, 4, 8, 2
        args.teacher_n, args.recon_steps, args.distill_steps, args.sample_batch = 4, 5, 6, 4
    elif not args.model:
        p.error("--model is required (or --smoke, or --prepare-text)")
    args.eval = [d for d in args.eval.split(",") if d]
    lab = Lab(args)
    out_path = Path(args.out) if args.out else None
    results = json.loads(out_path.read_text()) if out_path and out_path.exists() else {}
    results.setdefault("stages", {})
    results["setup"] = {
        "model": "smoke" if args.smoke else args.model, "train_domain": args.train,
        "eval_domains": args.eval, "seq_len": args.seq_len, "calib_windows": args.calib_n,
        "train_windows": args.train_n, "teacher_windows": args.teacher_n,
        "eval_windows": args.eval_n, "teacher_sampling_s": getattr(lab, "teacher_seconds", None),
        "load_s": getattr(lab, "load_seconds", None),
        "device": torch.cuda.get_device_name() if lab.device.type == "cuda" else
        platform.processor() or "cpu", "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python tools/eval_llm_real.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)}
    dense = results["stages"].get("dense", {}).get("perplexity")
    for spec in [s for s in args.stages.split(",") if s]:
        print(f"== {spec}", flush=True)
        start = time.perf_counter()
        if spec == "dense":
            res = {"perplexity": lab.measure(lab.dense)}
        else:
            res = lab.run_stage(spec)
        res["seconds"] = round(time.perf_counter() - start, 1)
        res["setup"] = results["setup"]
        if spec == "dense":
            dense = res["perplexity"]
        if dense and "perplexity" in res:
            res["ratio"] = {d: round(v / dense[d], 4) for d, v in res["perplexity"].items()}
        results["stages"][spec] = res
        print(json.dumps({spec: {k: res.get(k) for k in ("perplexity", "ratio", "seconds")}}),
              flush=True)
        if out_path:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
