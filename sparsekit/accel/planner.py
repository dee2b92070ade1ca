"""The speed-aware planner behind ``sparsity="auto"``: per GEMM shape, time each candidate
variant as it will run, keep the fastest, and remember the timings on disk.

"As it will run": a candidate layer is compiled with ``torch.compile`` (inductor, so its
per-token activation quantization and scale epilogue are fused the way they will be inside the
model) and timed under CUDA-graph replay (the accelerated model runs under CUDA graphs), at the
token count of the example input. 2:4 candidates are timed with their best cuSPARSELt algorithm
(:mod:`sparsekit.accel.algsearch`). On CPU (reference ops) the same candidates are timed by
wall clock, so the code path is the same everywhere; only CUDA timings mean anything for speed.

Timings are cached in ``$SPARSEKIT_CACHE/plans.json`` (default ``~/.cache/sparsekit``) keyed
by device name, torch version, variant, weight shape (N, K), tokens M and input dtype, so a
second ``accelerate`` of the same shapes times nothing. :func:`choose` is the pure decision on
timings (tested on recorded H200 timings).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sparsekit.io.files import atomic_write
from sparsekit.accel.report import BASELINE, decide
from sparsekit.io.cache import cache_root
from sparsekit.accel.timing import graph_time_us

DECODE_TOKENS = 64  # M at or below this is decode-sized: 2:4 often loses there (docs/gpu.md)
DECODE_MARGIN = 1.05  # ... so there a 2:4 variant must beat the best dense one by 5%


def cache_path() -> Path:
    return cache_root() / "plans.json"


def plan_key(device_name: str, torch_version: str, variant: str, out_features: int,
             in_features: int, tokens: int, dtype: str = "bfloat16") -> str:
    """One cache entry's key: everything a variant's time depends on."""
    return (f"{device_name}|torch={torch_version}|{variant}|N={out_features}|K={in_features}|"
            f"M={tokens}|{dtype}")


def load(path: Path | None = None) -> dict[str, dict]:
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a damaged cache is re-measured, not fatal
        return {}


def store(entries: dict[str, dict], path: Path | None = None) -> None:
    """Merge ``entries`` into the cache file (atomic write)."""
    path = path or cache_path()
    data = load(path)
    data.update(entries)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1,
                                                                   sort_keys=True)))


def choose(timings_us: dict[str, float], tokens: int, min_speedup: float = 1.0
           ) -> tuple[str, str]:
    """(variant, why) from one GEMM shape's timings (us). The fastest variant that beats bf16
    dense by ``min_speedup``; bf16 dense otherwise. At decode sizes (``tokens`` <= 64) a 2:4
    variant must also beat the best dense variant (bf16 or fp8/int8 dense) by
    ``DECODE_MARGIN``, else that dense one is kept: small GEMMs time noisily, and there 2:4
    gains least and (for 8-bit) adds the most error."""
    variant, speedup = decide(timings_us, min_speedup)
    if variant == BASELINE:
        return BASELINE, "no variant beat bf16 dense" + (
            f" by {min_speedup}x" if min_speedup != 1.0 else "")
    why = f"fastest measured ({speedup:.2f}x bf16 dense at M={tokens})"
    if tokens <= DECODE_TOKENS and variant.endswith("2:4"):
        dense = {v: t for v, t in timings_us.items() if v.endswith("dense")}
        best_dense = min(dense, key=dense.get)
        if timings_us[variant] * DECODE_MARGIN > dense[best_dense]:
            if best_dense != BASELINE and dense[BASELINE] / dense[best_dense] < min_speedup:
                best_dense = BASELINE
            return best_dense, (f"decode-sized (M={tokens}): 2:4 not {DECODE_MARGIN}x faster "
                                f"than {best_dense}")
    return variant, why


def wall_time_us(fn: Callable[[], object], calls: int = 5) -> float:
    """Median wall time of ``fn()`` on CPU (microseconds)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_module(module: nn.Module, x: torch.Tensor, backend: str = "inductor") -> float:
    """Microseconds per call of ``module(x)`` as it will run: compiled with ``backend`` (no CUDA
    graphs of its own) and timed under CUDA-graph replay on CUDA; wall clock on CPU."""
    fn = torch.compile(module, dynamic=False, backend=backend)
    with torch.no_grad():
        if x.is_cuda:
            return graph_time_us(lambda: fn(x))
        return wall_time_us(lambda: fn(x))


__all__ = ["DECODE_TOKENS", "cache_path", "choose", "load", "plan_key", "store", "time_module"]
