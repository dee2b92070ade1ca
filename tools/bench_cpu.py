"""CPU latency, parameters and MACs of a model before and after structured channel pruning.

    python tools/bench_cpu.py                                  # ResNet-18, 50% channels, 224 px
    python tools/bench_cpu.py --model mobilenet_v2 --ratio 0.3 --threads 2
    python tools/bench_cpu.py --fuse                           # conv+BN folded in both first
    python tools/bench_cpu.py --smoke                          # tiny, seconds (CI)

Builds the model twice (random weights: speed does not depend on the values), prunes one copy
with ``sk.prune_channels_`` and times both in eval mode under ``torch.no_grad`` at each batch
size. Dense and pruned are timed alternately, ``--rounds`` times, each round the median of
``--repeats`` calls, so a noisy neighbour slows both alike; the figure kept is the median over
rounds. ``--fuse`` folds each batch norm into its convolution in both models first
(torch.fx, as inference deployments do), so elementwise passes weigh less. Writes JSON
(``--out``) and a markdown table (``--md``) with the dense / pruned ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.fx.experimental.optimization import fuse

import sparsekit as sk
from sparsekit.nn.timing import time_ms
from sparsekit.models import build_model


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def example_input(model_name: str, batch: int, image_size: int) -> torch.Tensor:
    if model_name == "mnist1d_cnn":
        return torch.randn(batch, 1, 40)
    return torch.randn(batch, 3, image_size, image_size)


@torch.no_grad()
def latency_ms(
    dense: nn.Module, pruned: nn.Module, x: torch.Tensor, warmup: int, repeats: int, rounds: int
) -> tuple[float, float]:
    """Median over ``rounds`` of each model's median forward time (ms), timed alternately."""
    cpu = torch.device("cpu")
    d, p = [], []
    for _ in range(rounds):
        d.append(time_ms(lambda: dense(x), cpu, warmup=warmup, repeats=repeats))
        p.append(time_ms(lambda: pruned(x), cpu, warmup=warmup, repeats=repeats))
    return statistics.median(d), statistics.median(p)


def markdown(result: dict) -> str:
    r = result
    lines = [
        f"### {r['model']}: {r['ratio']:.0%} of channels removed ({r['importance']}, "
        f"round_to={r['round_to']}, {r['image_size']} px"
        f"{', conv+BN folded' if r['fused'] else ''})",
        "",
        f"{r['date']}, {r['device']}, {r['threads']} threads, torch {r['torch']}",
        "",
        "| metric | dense | pruned | dense / pruned |",
        "|---|---:|---:|---:|",
        f"| parameters | {r['params_dense']:,} | {r['params_pruned']:,} | "
        f"{r['params_dense'] / r['params_pruned']:.2f}x |",
        f"| MACs | {r['macs_dense']:,} | {r['macs_pruned']:,} | "
        f"{r['macs_dense'] / r['macs_pruned']:.2f}x |",
    ]
    for b in r["latency"]:
        lines.append(
            f"| latency, batch {b['batch']} (ms) | {b['dense_ms']:.2f} | {b['pruned_ms']:.2f} | "
            f"{b['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="built-in or torchvision model name")
    ap.add_argument("--ratio", type=float, default=0.5, help="fraction of channels removed")
    ap.add_argument("--importance", default="magnitude", choices=["magnitude", "lamp"])
    ap.add_argument("--round-to", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating dense/pruned rounds")
    ap.add_argument("--fuse", action="store_true", help="fold batch norms into convs first")
    ap.add_argument("--smoke", action="store_true", help="tiny model and batches (CI)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.batches, args.warmup, args.repeats, args.rounds = (
            "mnist1d_cnn",
            [1, 4],
            1,
            2,
            1,
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    dense = build_model(args.model).eval()
    pruned = build_model(args.model).eval()
    pruned.load_state_dict(dense.state_dict())
    example = example_input(args.model, 1, args.image_size)
    report = sk.prune_channels_(
        pruned, example, ratio=args.ratio, criterion=args.importance, round_to=args.round_to
    )

    if args.fuse:
        dense, pruned = fuse(dense), fuse(pruned)

    latency = []
    for batch in args.batches:
        x = example_input(args.model, batch, args.image_size)
        d, p = latency_ms(dense, pruned, x, args.warmup, args.repeats, args.rounds)
        latency.append({"batch": batch, "dense_ms": d, "pruned_ms": p, "speedup": d / p})
    result = {
        "model": args.model,
        "ratio": args.ratio,
        "importance": args.importance,
        "round_to": args.round_to,
        "fused": args.fuse,
        "image_size": args.image_size,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "params_dense": report.params_before,
        "params_pruned": report.params_after,
        "params_removed": report.params_removed,
        "macs_dense": report.macs_before,
        "macs_pruned": report.macs_after,
        "macs_removed": report.macs_removed,
        "channels_removed": report.channels_removed,
        "latency": latency,
    }
    table = markdown(result)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(table)
    return result


if __name__ == "__main__":
    main()
