"""One-shot pruning without fine-tuning: magnitude vs wanda vs sparsegpt, at 50% unstructured
and 2:4, on the text-model recipe's byte-level transformer LM (``recipe=stdlib_lm_24``).

    python tools/compare_oneshot.py                      # the recipe's model and data
    python tools/compare_oneshot.py --smoke              # tiny model, seconds (CI)
    python tools/compare_oneshot.py --out-dir DIR -o train.dense_steps=1200

The dense model is the recipe's cached baseline (trained once by config hash, shared with
``sparsekit recipe=stdlib_lm_24``). Every method prunes a fresh copy of it with the recipe's
layer selection (every Linear except ``lm_head``), layer-wise, calibrated on the recipe's
calibration batches (``prune.calibration_batches`` training batches), then measures perplexity
per byte on the recipe's evaluation batches. Writes ``oneshot.json`` and ``oneshot.md`` to
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
from sparsekit.config import Config
from sparsekit.data import build_data
from sparsekit.pipeline import dense_model
from sparsekit.tracking import Tracker
from sparsekit.train import eval_batches, evaluate

CRITERIA = ("magnitude", "wanda", "sparsegpt")
SETTINGS = (("50% unstructured", "unstructured", 0.5), ("2:4", "2:4", None))
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

    from sparsekit.cli import register_configs, to_config
    from sparsekit.resources import conf_dir

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
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and data, seconds (CI)")
    ap.add_argument("--out-dir", default="oneshot_results", help="where the JSON/markdown go")
    ap.add_argument("-o", "--override", action="append", default=[], help="config key=value")
    args = ap.parse_args()
    overrides = [*(SMOKE if args.smoke else []), *args.override]
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # keep the CI smoke model out of the user's baseline cache
            overrides.append(f"cache_dir={tmp}")
        cfg = recipe_config(overrides)
        result = compare(cfg, overrides)
    result["command"] = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oneshot.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "oneshot.md").write_text(markdown(result) + "\n")
    print(markdown(result))


def compare(cfg: Config, overrides: list[str]) -> dict:
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    cfg.train.device = "cpu"
    data = build_data(cfg.data.name, cfg.data._target_, cfg.data.kwargs, cfg.cache_dir)
    t0 = time.perf_counter()
    dense, source = dense_model(cfg, data, device, Tracker("unused", enabled=False))
    dense_seconds = time.perf_counter() - t0
    dense.eval()

    def perplexity(model: torch.nn.Module) -> float:
        return evaluate(
            model, data.eval, "lm", cfg.data.eval_batch_size, cfg.data.eval_batches, quiet=True
        )["perplexity"]

    calibration = [
        b[0] for b in eval_batches(data.train, cfg.data.batch_size, cfg.prune.calibration_batches)
    ]
    runs = {}
    for crit in CRITERIA:
        for label, pattern, sparsity in SETTINGS:
            model = copy.deepcopy(dense)
            t0 = time.perf_counter()
            report = sk.prune_(
                model,
                sparsity=sparsity,
                pattern=pattern,
                criterion=crit,
                include=list(cfg.prune.include),
                exclude=list(cfg.prune.exclude),
                calibration=calibration if crit != "magnitude" else None,
            )
            seconds = time.perf_counter() - t0
            pruned = {n: s for n, s in report.layers.items() if not s.skipped}
            runs[f"{crit}/{label}"] = {
                "criterion": crit,
                "pattern": pattern,
                "perplexity": perplexity(model),
                "sparsity": sum(s.zeros for s in pruned.values())
                / sum(s.numel for s in pruned.values()),
                "layers": len(pruned),
                "skipped": report.skipped,
                "prune_seconds": round(seconds, 3),
            }
            print(f"{crit:>10} {label:>17}: perplexity {runs[f'{crit}/{label}']['perplexity']:.3f}")
    m = cfg.model.kwargs
    return {
        "dense_perplexity": perplexity(dense),
        "runs": runs,
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
