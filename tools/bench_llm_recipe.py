"""Time and memory of the llm_sparsegpt_24 recipe on a config-built Llama (random weights).

    python tools/bench_llm_recipe.py --device cpu                      # ~150M parameters
    python tools/bench_llm_recipe.py --device cuda --hidden 2048 --layers 16 --intermediate 5632
    python tools/bench_llm_recipe.py --smoke --out-dir /tmp/b          # seconds (CI)

The recipe runs in this process exactly as ``sparsekit recipe=llm_sparsegpt_24
model.config=CONFIG data.tokenizer=DIR data.path=TEXT`` does (perplexity before and after,
SparseGPT 2:4 layer by layer, sk.save, the <run>/hf/ export), on stdlib source text with a
BPE tokenizer trained here. Reported: wall seconds of the whole recipe and of the SparseGPT
solve, peak resident memory of the process (and its value before the model existed), peak CUDA
memory, the parameter count, and both per billion parameters. The per-billion figures are a
linear extrapolation from one size, labelled as such: the solver's cost per weight grows with
the layer width (its Hessian is width x width), so for wider models they are a lower bound.
Writes ``<out-dir>/bench_llm_recipe.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from llm_common import llama_config, stdlib_corpus, train_tokenizer

import sparsekit.prune.sparsegpt as sparsegpt
from sparsekit.run.cli import register_configs, to_config
from sparsekit.run.pipeline import run
from sparsekit.run.resources import conf_dir


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calibration-batches", type=int, default=16, help="of 8 sequences")
    ap.add_argument("--eval-batches", type=int, default=4, help="of 8 sequences")
    ap.add_argument("--text-bytes", type=int, default=3_000_000)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench_llm"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads = 64, 2, 128, 4, 2
        a.vocab, a.seq_len, a.calibration_batches, a.eval_batches = 400, 32, 2, 2
        a.text_bytes = 60_000
    a.kv_heads = a.kv_heads or a.heads
    if a.threads:
        torch.set_num_threads(a.threads)
    out = a.out_dir.resolve()
    text = stdlib_corpus(out / "corpus.txt", a.text_bytes)
    tok_dir = out / "tokenizer"
    train_tokenizer(text.read_text(), a.vocab).save_pretrained(tok_dir)
    config = llama_config(a.vocab, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads,
                          a.seq_len)
    (out / "config.json").write_text(json.dumps(config))
    overrides = [
        "recipe=llm_sparsegpt_24", f"model.config={out / 'config.json'}",
        f"data.tokenizer={tok_dir}", f"data.path={text}", f"data.seq_len={a.seq_len}",
        f"prune.calibration_batches={a.calibration_batches}",
        f"data.eval_batches={a.eval_batches}", f"train.device={a.device}", "train.quiet=true",
        "tracker=none", f"cache_dir={out / 'cache'}",
    ]
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = to_config(compose("config", overrides=overrides))
    solve = {"seconds": 0.0}
    inner = sparsegpt.sparsegpt_prune

    def timed(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            solve["seconds"] += time.perf_counter() - t0

    sparsegpt.sparsegpt_prune = timed  # the Pruner imports it at call time
    rss_before = peak_rss_bytes()
    t0 = time.perf_counter()
    summary = run(cfg, out / "run")
    seconds = time.perf_counter() - t0
    params = count_params(out / "run" / "hf")
    peak = peak_rss_bytes()
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    per_b = 1e9 / params
    result = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "device": a.device if a.device != "cuda" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "config": config, "params": params, "seq_len": a.seq_len,
        "calibration_sequences": 8 * a.calibration_batches,
        "recipe_seconds": round(seconds, 3), "sparsegpt_seconds": round(solve["seconds"], 3),
        "peak_rss_bytes": peak, "rss_before_model_bytes": rss_before,
        "cuda_peak_bytes": cuda_peak,
        "perplexity": {"dense": summary["dense"]["perplexity"],
                       "compressed": summary["compressed"]["perplexity"]},
        "sparsity": summary["sparsity"],
        "per_billion_params_linear_extrapolation": {
            "recipe_seconds": round(seconds * per_b, 1),
            "sparsegpt_seconds": round(solve["seconds"] * per_b, 1),
            "peak_rss_gib_above_start": round((peak - rss_before) * per_b / 2**30, 2),
            "cuda_peak_gib": None if cuda_peak is None else round(cuda_peak * per_b / 2**30, 2),
        },
    }
    (out / "bench_llm_recipe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def count_params(hf_dir: Path) -> int:
    """Parameters of the exported model (tied tensors once)."""
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
