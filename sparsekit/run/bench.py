"""Timing a model's forward pass: latency at batch 1, throughput at a large batch.

On CUDA each repeat is timed with CUDA events after warm-up; on CPU with ``perf_counter``.
The reported figure is the median over repeats (robust to a noisy neighbour).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from sparsekit.prune.calibration import eval_mode
from sparsekit.progress import progress


def time_call(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
    desc: str = "bench", quiet: bool = False,
) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in progress(range(repeats), quiet, desc=desc, leave=False):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        for _ in progress(range(repeats), quiet, desc=desc, leave=False):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def benchmark(
    model: nn.Module,
    example: torch.Tensor,
    batch_size: int = 256,
    warmup: int = 5,
    repeats: int = 20,
    desc: str = "bench",
    quiet: bool = False,
) -> dict[str, float]:
    """Latency (ms, batch 1) and throughput (samples/s at ``batch_size``) of ``model`` in eval
    mode on ``example``'s device. ``example`` is one input batch; its first sample is repeated
    to build both batches.

    >>> r = benchmark(nn.Linear(4, 2), torch.zeros(1, 4), batch_size=8, warmup=1, repeats=3,
    ...               quiet=True)
    >>> sorted(r), r["latency_ms"] > 0
    (['latency_ms', 'throughput'], True)
    """
    one = example[:1]
    big = one.expand(batch_size, *one.shape[1:]).contiguous()
    with eval_mode(model):
        latency = time_call(lambda: model(one), one.device, warmup, repeats, f"{desc} b=1", quiet)
        batch_ms = time_call(
            lambda: model(big), big.device, warmup, repeats, f"{desc} b={batch_size}", quiet
        )
    return {"latency_ms": latency, "throughput": batch_size / (batch_ms / 1e3)}
