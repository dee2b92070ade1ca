"""Accuracy over several training seeds: each run of a list through the CLI once per seed,
then a markdown table of dense and compressed accuracy (per seed, mean, and the difference).

    python tools/seed_sweep.py --out-dir sweep                  # the README's quantization table
    python tools/seed_sweep.py --out-dir sweep --seeds 0 --runs ptq_int8   # a subset
    python tools/seed_sweep.py --smoke --out-dir /tmp/sweep     # seconds (CI)

A seed changes the dense model's initialization and the order of training batches (dense and
fine-tuning); the data set (MNIST-1D, seed 42) and its 1,000 test samples stay the same, so
each run is compared with the dense model of its own seed. Runs reuse cached dense baselines
(one per seed) from ``<out-dir>/cache``. Writes ``seed_sweep.json`` and ``seed_sweep.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = {  # name: CLI arguments
    "ptq_int8": ["prune=none", "prune.fine_tune=false", "quant=int8"],
    "ptq_fp8": ["prune=none", "prune.fine_tune=false", "quant=fp8"],
    "24_int8_qat": ["recipe=mnist1d_24_int8_qat"],
    "24_fp8_qat": ["recipe=mnist1d_24_fp8_qat"],
    "24": ["prune.exclude=[linear]"],
    "24_int8_qat_all_layers": ["recipe=mnist1d_24_int8_qat", "prune.exclude=[]"],
    "24_fp8_qat_all_layers": ["recipe=mnist1d_24_fp8_qat", "prune.exclude=[]"],
    "24_all_layers": [],
    "unstructured90": ["recipe=mnist1d_cnn_unstructured90_cubic"],
    "unstructured80": ["recipe=mnist1d_cnn_unstructured90_cubic", "prune.sparsity=0.8"],
}
SMOKE = ["data.kwargs.num_samples=300", "train.dense_steps=20", "train.finetune_steps=10",
         "schedule.end=5", "bench=off"]


def run_one(name: str, seed: int, out_dir: Path, smoke: bool) -> dict:
    """One CLI run; reused from an earlier sweep only if it ran with the same arguments."""
    run_dir = out_dir / "runs" / f"{name}_s{seed}"
    summary, used = run_dir / "summary.json", run_dir / "sweep_args.json"
    args = [*RUNS[name], f"train.seed={seed}", f"cache_dir={out_dir / 'cache'}",
            f"hydra.run.dir={run_dir}", *(SMOKE if smoke else [])]
    if not (summary.exists() and used.exists() and json.loads(used.read_text()) == args):
        summary.unlink(missing_ok=True)
        env = {**os.environ, "SPARSEKIT_QUIET": "1"}
        done = subprocess.run([sys.executable, "-m", "sparsekit", *args], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name} seed {seed} failed:\n{done.stderr[-2000:]}")
        used.write_text(json.dumps(args))
    s = json.loads(summary.read_text())
    return {"dense": s["dense"]["accuracy"], "compressed": s["compressed"]["accuracy"],
            "size_bytes": s["compressed"]["size_bytes"]}


def table(results: dict[str, dict[int, dict]], seeds: list[int]) -> str:
    head = ("| run | " + " | ".join(f"seed {s}: dense -> run" for s in seeds)
            + " | mean dense | mean run | mean diff (min, max) |")
    lines = [head, "| --- " * (len(seeds) + 4) + "|"]
    for name, per_seed in results.items():
        diffs = [100 * (r["compressed"] - r["dense"]) for r in per_seed.values()]
        cells = [f"{100 * r['dense']:.1f} -> {100 * r['compressed']:.1f}"
                 for r in per_seed.values()]
        md = statistics.mean(100 * r["dense"] for r in per_seed.values())
        mc = statistics.mean(100 * r["compressed"] for r in per_seed.values())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {md:.2f} | {mc:.2f} | "
                     f"{statistics.mean(diffs):+.2f} ({min(diffs):+.1f}, {max(diffs):+.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--smoke", action="store_true", help="tiny data and steps (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seeds, args.runs = args.seeds[:1], args.runs[:2]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: {s: run_one(name, s, args.out_dir, args.smoke) for s in args.seeds}
               for name in args.runs}
    (args.out_dir / "seed_sweep.json").write_text(json.dumps(results, indent=1))
    md = table(results, args.seeds)
    (args.out_dir / "seed_sweep.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
