"""Timing: medians of repeats after warm-up; latency at batch 1, throughput at a large batch."""

from __future__ import annotations

import time

import torch
from torch import nn

from sparsekit.nn.timing import flush_l2, time_ms
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


def test_time_ms_runs_before_ahead_of_each_timed_call_outside_the_span():
    order = []

    def before():
        order.append("before")
        time.sleep(0.03)

    def fn():
        order.append("fn")
        time.sleep(0.002)

    ms = time_ms(fn, torch.device("cpu"), warmup=1, repeats=3, before=before)
    assert order == ["fn"] + ["before", "fn"] * 3  # not before warm-up calls
    assert 2.0 <= ms < 20.0  # the 30 ms of before() are not in it
    flush_l2("cpu")  # off CUDA the L2 flush is a no-op


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
