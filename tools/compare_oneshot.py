"""One-shot pruning without fine-tuning: magnitude vs wanda vs sparsegpt, at 50% unstructured
and 2:4, on the text-model recipe's byte-level transformer LM (``recipe=stdlib_lm_24``).

    python tools/compare_oneshot.py                      # the recipe's model and data
    python tools/compare_oneshot.py --smoke              # tiny model, seconds (CI)
    python tools/compare_oneshot.py --out-dir DIR -o train.dense_steps=1200

The dense model is the recipe's cached baseline (trained once by config hash, shared with
``sparsekit recipe=stdlib_lm_24``). Every method prunes a fresh copy of it with the recipe's
layer selection (every Linear except ``lm_head``), layer-wise, calibrated on the recipe's
calibration batches (``prune.calibration_batches`` training batches), then measures perplexity
per byte on the recipe's evaluation batches.

A second experiment shows sensitivity-driven per-layer levels: a magnitude sensitivity scan of
the dense model (each layer alone at 25/50/75/90%, perplexity on a quarter of the evaluation
batches), ``sk.allocate`` to ``--target`` overall, then magnitude and sparsegpt at that target
with uniform vs allocated per-layer levels. Writes ``oneshot.json`` and ``oneshot.md`` to
``--out-dir``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import sparsekit as sk
from sparsekit.run.config import Config
from sparsekit.data import build_data
from sparsekit.run.pipeline import dense_model
from sparsekit.run.tracking import Tracker
from sparsekit.run.train import eval_batches, evaluate

CRITERIA = ("magnitude", "wanda", "sparsegpt")
SETTINGS = (("50% unstructured", "unstructured", 0.5), ("2:4", "2:4", None))
SCAN_LEVELS = (0.25, 0.5, 0.75, 0.9)
SMOKE = [
    "model.kwargs.d_model=32",
    "model.kwargs.n_layers=1",
    "model.kwargs.n_heads=2",
    "model.kwargs.seq_len=32",
    "data.kwargs.seq_len=32",
    "data.kwargs.max_bytes=100000",
    "data.batch_size=8",
    "data.eval_batches=2",
    "train.dense_steps=20",
    "train.warmup_steps=2",
    "prune.calibration_batches=2",
    "train.quiet=true",
]


def recipe_config(overrides: list[str]) -> Config:
    """The composed, validated config of ``recipe=stdlib_lm_24`` plus ``overrides``."""
    from hydra import compose, initialize_config_dir

    from sparsekit.run.cli import register_configs, to_config
    from sparsekit.run.resources import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(compose("config", overrides=["recipe=stdlib_lm_24", *overrides]))


def markdown(result: dict) -> str:
    """Perplexity table: one row per criterion, one column per sparsity setting."""
    head = ["criterion", *(label for label, _, _ in SETTINGS)]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(SETTINGS)]
    lines.append(
        "| dense | " + " | ".join([f"{result['dense_perplexity']:.3f}"] * len(SETTINGS)) + " |"
    )
    for crit in CRITERIA:
        cells = [
            f"{result['runs'][f'{crit}/{label}']['perplexity']:.3f}" for label, _, _ in SETTINGS
        ]
        lines.append(f"| {crit} | " + " | ".join(cells) + " |")
    target = result["allocation"]["target"]
    lines += [
        "",
        f"| criterion | {target:.0%} uniform | {target:.0%} allocated |",
        "| --- | ---: | ---: |",
    ]
    for crit in ("magnitude", "sparsegpt"):
        cells = [
            f"{result['allocation']['runs'][f'{crit}/{k}']['perplexity']:.3f}"
            for k in ("uniform", "allocated")
        ]
        lines.append(f"| {crit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and data, seconds (CI)")
    ap.add_argument("--out-dir", default="oneshot_results", help="where the JSON/markdown go")
    ap.add_argument("-o", "--override", action="append", default=[], help="config key=value")
    ap.add_argument("--target", type=float, default=0.7, help="overall sparsity to allocate")
    args = ap.parse_args(argv)
    overrides = [*(SMOKE if args.smoke else []), *args.override]
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # keep the CI smoke model out of the user's baseline cache
            overrides.append(f"cache_dir={tmp}")
        cfg = recipe_config(overrides)
        result = compare(cfg, overrides, args.target)
    result["command"] = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oneshot.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "oneshot.md").write_text(markdown(result) + "\n")
    print(markdown(result))


def compare(cfg: Config, overrides: list[str], target: float) -> dict:
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    cfg.train.device = "cpu"
    data = build_data(cfg.data.name, cfg.data._target_, cfg.data.kwargs, cfg.cache_dir)
    t0 = time.perf_counter()
    dense, source = dense_model(cfg, data, device, Tracker("unused", enabled=False))
    dense_seconds = time.perf_counter() - t0
    dense.eval()

    def perplexity(model: torch.nn.Module, batches: int = cfg.data.eval_batches) -> float:
        return evaluate(model, data.eval, "lm", cfg.data.eval_batch_size, batches, quiet=True)[
            "perplexity"
        ]

    calibration = [
        b[0] for b in eval_batches(data.train, cfg.data.batch_size, cfg.prune.calibration_batches)
    ]
    select = {"include": list(cfg.prune.include), "exclude": list(cfg.prune.exclude)}

    def run(crit: str, pattern: str, sparsity: float | dict | None) -> dict:
        model = copy.deepcopy(dense)
        t0 = time.perf_counter()
        report = sk.prune_(
            model,
            sparsity=sparsity,
            pattern=pattern,
            criterion=crit,
            calibration=calibration if crit != "magnitude" else None,
            **select,
        )
        seconds = time.perf_counter() - t0
        pruned = [s for s in report.layers.values() if not s.skipped]
        out = {
            "criterion": crit,
            "pattern": pattern,
            "perplexity": perplexity(model),
            "sparsity": sum(s.zeros for s in pruned) / sum(s.numel for s in pruned),
            "layers": len(pruned),
            "skipped": report.skipped,
            "prune_seconds": round(seconds, 3),
        }
        print(f"{crit:>10} {pattern:>12} {out['sparsity']:.3f}: perplexity {out['perplexity']:.3f}")
        return out

    runs = {
        f"{crit}/{label}": run(crit, pattern, sparsity)
        for crit in CRITERIA
        for label, pattern, sparsity in SETTINGS
    }

    scan_batches = max(1, cfg.data.eval_batches // 4)
    t0 = time.perf_counter()
    table = sk.sensitivity(
        copy.deepcopy(dense),
        lambda m: perplexity(m, scan_batches),
        sparsities=SCAN_LEVELS,
        **select,
    )
    scan_seconds = time.perf_counter() - t0
    print(table)
    levels = sk.allocate(table, target)
    allocation = {
        "target": target,
        "scan": {
            **table.to_dict(),
            "eval_batches": scan_batches,
            "seconds": round(scan_seconds, 1),
        },
        "levels": levels,
        "runs": {
            f"{crit}/{kind}": run(crit, "unstructured", target if kind == "uniform" else levels)
            for crit in ("magnitude", "sparsegpt")
            for kind in ("uniform", "allocated")
        },
    }
    m = cfg.model.kwargs
    return {
        "dense_perplexity": perplexity(dense),
        "runs": runs,
        "allocation": allocation,
        "model": {
            "name": cfg.model.name,
            **dict(m),
            "params": sum(p.numel() for p in dense.parameters()),
        },
        "dense_source": source,
        "dense_seconds": round(dense_seconds, 1),
        "calibration": {"batches": len(calibration), "batch_size": cfg.data.batch_size},
        "eval": {"batches": cfg.data.eval_batches, "batch_size": cfg.data.eval_batch_size},
        "exclude": list(cfg.prune.exclude),
        "overrides": overrides,
        "device": f"cpu {platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


if __name__ == "__main__":
    main()
