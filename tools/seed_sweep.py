"""Accuracy over several training seeds: each run of a list through the CLI once per seed,
then a markdown table of dense and compressed accuracy (per seed, mean, and the difference).

    python tools/seed_sweep.py --out-dir sweep                  # docs/api.md's quantization table
    python tools/seed_sweep.py --out-dir sweep --seeds 0 --runs ptq_int8   # a subset
    python tools/seed_sweep.py --recipes --out-dir sweep        # docs/cli.md's recipe table
    python tools/seed_sweep.py --smoke --out-dir /tmp/sweep     # seconds (CI)

A seed changes the dense model's initialization and the order of training batches (dense and
fine-tuning); the data set (MNIST-1D, seed 42) and its 1,000 test samples stay the same, so
each run is compared with the dense model of its own seed. Runs reuse cached dense baselines
(one per seed) from ``<out-dir>/cache``. Writes ``seed_sweep.md`` and ``seed_sweep.json``
(``runs``: name -> seed -> figures; with the command, the date and the machine it ran on).
``--recipes`` runs every MNIST-1D recipe of docs/cli.md's recipe table and writes its rows
(mean and range over the seeds); the table's stdlib LM and ResNet-18 rows are single runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
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
RECIPES = ["mnist1d_cnn_24", "mnist1d_cnn_unstructured90_cubic", "mnist1d_cnn_24_wanda_oneshot",
           "mnist1d_24_int8_qat", "mnist1d_24_fp8_qat", "mnist1d_channel30",
           "mnist1d_channel25_24_int8"]  # docs/cli.md's MNIST-1D rows, in its order
RUNS.update({name: [f"recipe={name}"] for name in RECIPES})
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
            "size_bytes": s["compressed"]["size_bytes"],
            "dense_size_bytes": s["dense"]["size_bytes"], "sparsity": s["sparsity"],
            "seconds": s["seconds"]}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` says."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def spread(values: list[float], fmt: str = ".1f") -> str:
    """``mean (min to max)``, or the value where all are the same.

    >>> spread([92.3, 93.1, 92.4]), spread([49.0, 49.0])
    ('92.6 (92.3 to 93.1)', '49.0')
    """
    if len({format(v, fmt) for v in values}) == 1:
        return format(values[0], fmt)
    return (f"{format(statistics.mean(values), fmt)} "
            f"({format(min(values), fmt)} to {format(max(values), fmt)})")


def recipe_table(results: dict[str, dict[int, dict]], seeds: list[int]) -> str:
    """docs/cli.md's recipe rows: accuracy in %, mean (min to max) over the seeds."""
    lines = [f"| recipe | dense acc, mean (range) over seeds {'/'.join(map(str, seeds))} | "
             "compressed acc, mean (range) | difference, mean (range) | sparsity | "
             "size (bytes) compressed |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, per_seed in results.items():
        rs = list(per_seed.values())
        lines.append(
            f"| `{name}` | {spread([100 * r['dense'] for r in rs])}% | "
            f"{spread([100 * r['compressed'] for r in rs])}% | "
            f"{spread([100 * (r['compressed'] - r['dense']) for r in rs], '+.1f')} | "
            f"{spread([100 * r['sparsity'] for r in rs])}% | "
            f"{spread([r['size_bytes'] for r in rs], ',.0f')} |")
    return "\n".join(lines)


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
    ap.add_argument("--recipes", action="store_true",
                    help="every MNIST-1D recipe of docs/cli.md's table, and that table")
    ap.add_argument("--smoke", action="store_true", help="tiny data and steps (CI)")
    args = ap.parse_args(argv)
    if args.recipes:
        args.runs = RECIPES
    if args.smoke:
        args.seeds, args.runs = args.seeds[:1], args.runs[:1 if args.recipes else 2]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {"command": " ".join(["python", "tools/seed_sweep.py", *(argv or sys.argv[1:])]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "device": "cpu",
            "machine": f"{cpu_name()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "python": platform.python_version(),
            "seeds": args.seeds}
    results: dict[str, dict[int, dict]] = {}
    for name in args.runs:  # the files grow row by row, so a long sweep shows where it is
        results[name] = {s: run_one(name, s, args.out_dir, args.smoke) for s in args.seeds}
        (args.out_dir / "seed_sweep.json").write_text(
            json.dumps({**meta, "runs": results}, indent=1))
        md = (recipe_table if args.recipes else table)(results, args.seeds)
        (args.out_dir / "seed_sweep.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
