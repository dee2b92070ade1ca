"""Timing a model's forward pass: latency at batch 1, throughput at a large batch.

Each repeat is timed by :func:`sparsekit.nn.timing.time_ms` (CUDA events after warm-up; on
CPU ``perf_counter``). The reported figure is the median over repeats (robust to a noisy
neighbour).
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekit.nn.timing import time_ms
from sparsekit.nn.calibration import eval_mode
from sparsekit.progress import progress


def _bar(desc: str, quiet: bool):
    return lambda steps: progress(steps, quiet, desc=desc, leave=False)


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
        latency = time_ms(lambda: model(one), one.device, warmup=warmup, repeats=repeats,
                          wrap=_bar(f"{desc} b=1", quiet))
        batch_ms = time_ms(lambda: model(big), big.device, warmup=warmup, repeats=repeats,
                           wrap=_bar(f"{desc} b={batch_size}", quiet))
    return {"latency_ms": latency, "throughput": batch_size / (batch_ms / 1e3)}
