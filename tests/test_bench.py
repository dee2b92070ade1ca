"""Timing: medians of repeats after warm-up; latency at batch 1, throughput at a large batch."""

from __future__ import annotations

import time

import torch
from torch import nn

from sparsekit.accel.timing import time_ms
from sparsekit.run.bench import benchmark


def test_time_ms_is_the_median_after_warmup():
    durations = iter([0.05, 0.05] + [0.001, 0.004, 0.002])  # two slow warm-up calls
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    ms = time_ms(fn, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5
    assert 2.0 <= ms < 3.9  # the median of 1, 4, 2 ms (plus sleep overshoot), warm-up excluded


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.batches: list[int] = []

    def forward(self, x):
        self.batches.append(x.shape[0])
        assert not self.training and not torch.is_grad_enabled()
        return self.lin(x)


def test_benchmark_batches_mode_and_throughput():
    model = Recorder().train()
    out = benchmark(model, torch.randn(5, 3), batch_size=64, warmup=1, repeats=3, quiet=True)
    assert model.batches == [1] * 4 + [64] * 4
    assert model.training  # restored
    assert out["latency_ms"] > 0
    assert out["throughput"] > 1000 / out["latency_ms"]  # batching amortizes the overhead
