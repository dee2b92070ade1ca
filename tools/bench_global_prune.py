"""Time and peak memory of global magnitude pruning over a large model on CPU.

    python tools/bench_global_prune.py                 # ~101M parameters (12 x Linear(4096, 2048))
    python tools/bench_global_prune.py --smoke         # tiny, for CI

Prints and writes JSON (--out): parameters, seconds for Pruner construction + one-shot global
magnitude step, and the peak resident memory above the model's own (ru_maxrss delta).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from torch import nn

import sparsekit as sk


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build(layers: int, d_in: int, d_out: int) -> nn.Module:
    model = nn.Sequential()
    with torch.no_grad():
        for _ in range(layers):
            layer = nn.Linear(d_in, d_out, bias=False, device="meta")
            layer.weight = nn.Parameter(torch.randn(d_out, d_in))
            model.append(layer)
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, seconds (CI)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    layers, d_in, d_out = (2, 64, 32) if args.smoke else (12, 4096, 2048)

    model = build(layers, d_in, d_out)
    params = sum(p.numel() for p in model.parameters())
    base = peak_rss_bytes()
    t0 = time.perf_counter()
    pruner = sk.Pruner(model, sparsity=args.sparsity, scope="global")
    pruner.step(0)
    seconds = time.perf_counter() - t0
    extra = peak_rss_bytes() - base
    zeros = sum(int((m.weight == 0).sum()) for m in model)
    result = {
        "parameters": params,
        "sparsity": args.sparsity,
        "zeros": zeros,
        "exact": zeros == int(args.sparsity * params + 0.5),
        "seconds": round(seconds, 3),
        "peak_extra_bytes": extra,
        "peak_extra_gib": round(extra / 2**30, 3),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if not result["exact"]:
        raise SystemExit("global pruning did not reach the exact target count")


if __name__ == "__main__":
    main()
