"""Train a small Llama on the Python standard library's source, then run the LLM recipes
on it and report perplexity before and after each (a random model cannot show that).

    python tools/train_small_llama.py --device cpu --minutes 5                  # ~5M parameters
    python tools/train_small_llama.py --device cuda --minutes 8 --hidden 512 --layers 8
    python tools/train_small_llama.py --smoke --out-dir /tmp/tsl                # seconds (CI)

The corpus is stdlib .py source (tests excluded; ``--text-bytes``) written to
``<out-dir>/corpus.txt``; a byte-level BPE tokenizer is trained on it. The model trains on the
*training part* of the recipes' own split of that file (sparsekit.data.hf_text: the token
stream cut by position into training, calibration and held-out evaluation), so the recipes'
perplexity is measured on text the model never saw. The model and tokenizer are saved to
``<out-dir>/model`` (a from_pretrained directory); each recipe then runs through the command
line (``sparsekit recipe=NAME model.path=<out-dir>/model data.path=<out-dir>/corpus.txt``) into
``<out-dir>/runs/NAME``. Prints and writes ``<out-dir>/train_small_llama.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from llm_common import llama_config, run_recipe, stdlib_corpus, train_tokenizer

from sparsekit.data.hf_text import text_data
from sparsekit.models.hf import hf
from sparsekit.run.train import batch_indices, eval_batches, get_batch

RECIPES = ("llm_sparsegpt_24", "llm_sparsegpt_24_fp8", "llm_wanda_24_distill",
           "llm_sparsegpt_24_fp8_static", "llm_sparsegpt_24_fp8_static_tensor")


@torch.no_grad()
def perplexity(model, dataset, batch_size: int, batches: int, device) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(dataset, batch_size, batches):
        logits = model(x.to(device)).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(),
                                 reduction="sum").item()
        count += y.numel()
    model.train()
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time")
    ap.add_argument("--steps", type=int, default=0,
                    help="train this many steps instead of --minutes (the same on any machine)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--text-bytes", type=int, default=6_000_000)
    ap.add_argument("--finetune-steps", type=int, default=200, help="llm_wanda_24_distill")
    ap.add_argument("--eval-batches", type=int, default=32, help="of 8 sequences, per recipe")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--out-dir", type=Path, default=Path("small_llama"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    ap.add_argument("--recipes", default=",".join(RECIPES),
                    help="comma list of recipes to run on the trained model")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.hidden, a.layers, a.intermediate, a.heads = 60, 32, 2, 64, 2
        a.lr = 1e-2
        a.vocab, a.seq_len, a.batch_size, a.text_bytes = 300, 32, 8, 60_000
        a.finetune_steps, a.eval_batches = 3, 2
    if a.threads:
        torch.set_num_threads(a.threads)
    out = a.out_dir.resolve()
    device = torch.device(a.device)
    corpus = stdlib_corpus(out / "corpus.txt", a.text_bytes)
    tokenizer = train_tokenizer(corpus.read_text(), a.vocab)
    # the recipes' own split (same file, tokenizer, cache): train on its training part only
    data = text_data(corpus, tokenizer, a.seq_len, out / "cache" / "data")
    torch.manual_seed(0)
    config = llama_config(len(tokenizer), a.hidden, a.layers, a.intermediate, a.heads, a.heads,
                          a.seq_len)
    model = hf("causal_lm", config).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    budget = a.minutes * 60
    # the schedule runs on the clock (or on --steps): warm-up over 100 steps (a tenth of
    # --steps if fewer), cosine to 10% at the deadline
    warmup = min(100, max(1, a.steps // 10)) if a.steps else 100
    t0, step = time.perf_counter(), 0
    model.train()
    while (a.steps and step < a.steps) or (
            not a.steps and (elapsed := time.perf_counter() - t0) < budget):
        frac = step / a.steps if a.steps else elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for g in optimizer.param_groups:
            g["lr"] = lr
        x, y = get_batch(data.train, batch_indices(len(data.train), a.batch_size, 0, step))
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
    train_seconds = time.perf_counter() - t0
    held_out = perplexity(model, data.eval, 8, a.eval_batches, device)
    model_dir = out / "model"
    model.cpu().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    result = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "device": a.device if a.device != "cuda" else torch.cuda.get_device_name(),
        "params": params, "config": config, "train_steps": step,
        "train_tokens": step * a.batch_size * a.seq_len,
        "train_seconds": round(train_seconds, 1), "final_train_loss": round(loss.item(), 4),
        "held_out_perplexity": held_out, "split_tokens": data.info["split_tokens"],
        "recipes": {},
    }
    for name in [r for r in a.recipes.split(",") if r]:
        s = run_recipe([
            f"recipe={name}", f"model.path={model_dir}", f"data.path={corpus}",
            f"data.seq_len={a.seq_len}", f"data.eval_batches={a.eval_batches}",
            f"train.device={a.device}", f"train.finetune_steps={a.finetune_steps}",
            f"cache_dir={out / 'cache'}", "tracker=none",
        ], out / "runs" / name)
        result["recipes"][name] = {
            "perplexity_before": s["dense"]["perplexity"],
            "perplexity_after": s["compressed"]["perplexity"],
            "sparsity": s["sparsity"], "size_bytes_before": s["dense"]["size_bytes"],
            "size_bytes_after": s["compressed"]["size_bytes"], "seconds": s["seconds"],
            "run_dir": s["run_dir"],
        }
    (out / "train_small_llama.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
