"""Timing: medians of repeats after warm-up; latency at batch 1, throughput at a large batch."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from sparsekit.nn.timing import flush_l2, time_ms
from sparsekit.run.bench import benchmark, generation_speed, overlap, spread


def test_time_ms_is_the_median_after_warmup():
    durations = iter([0.2, 0.2] + [0.01, 0.04, 0.02])  # two slow warm-up calls
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    ms = time_ms(fn, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5
    # the median of 10, 40, 20 ms, warm-up excluded, plus sleep overshoot: milliseconds when
    # the other test worker keeps both cores busy
    assert 20.0 <= ms < 39.0


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


def test_spread_matches_numpy_percentiles_and_overlap_is_symmetric():
    import numpy as np

    values = [3.1, 0.2, 7.7, 5.0, 1.4, 2.2, 9.9]
    s = spread(values)
    assert s["median"] == np.median(values)
    assert s["p10"] == pytest.approx(np.percentile(values, 10))
    assert s["p90"] == pytest.approx(np.percentile(values, 90))
    assert spread([4.0]) == {"median": 4.0, "p10": 4.0, "p90": 4.0}
    a, b, c = spread([1, 2, 3]), spread([2.5, 3.5]), spread([10, 11])
    assert overlap(a, b) and overlap(b, a) and not overlap(a, c) and not overlap(c, a)
    with pytest.raises(ValueError, match="at least one"):
        spread([])
    same = spread([0.1 + 0.2] * 3)  # equal timings: no percentile on the wrong side by 1 ulp
    assert same["p10"] <= same["median"] <= same["p90"]


def test_benchmark_reports_the_spread_of_its_repeats(monkeypatch):
    """Latency percentiles are those of the timed calls; throughput's p10 comes from the
    slowest calls (samples/s = batch / time)."""
    import sparsekit.run.bench as bench

    times = iter([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0]])
    monkeypatch.setattr(bench, "time_samples_ms", lambda *a, **k: next(times))
    out = bench.benchmark(nn.Linear(3, 2), torch.randn(2, 3), batch_size=10, quiet=True)
    assert (out["latency_ms_p10"], out["latency_ms"], out["latency_ms_p90"]) == (1.4, 3.0, 4.6)
    assert out["throughput"] == pytest.approx(10 / 0.030)
    assert out["throughput_p10"] == pytest.approx(np.percentile([10 / t * 1e3 for t in
                                                                  (10, 20, 30, 40, 50)], 10))
    assert out["throughput_p10"] < out["throughput"] < out["throughput_p90"]


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_generation_speed_counts_the_tokens_generate_returns(tiny_llama, monkeypatch):
    """Plain HF generate on CPU: tokens/s = new tokens over the batch / the call's time."""
    import sparsekit.run.bench as bench

    ids = torch.randint(0, 64, (2, 5))
    outputs = []

    def generate(x):
        out = tiny_llama.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
        outputs.append(out)
        return out

    r = bench.generation_speed(generate, ids, new_tokens=4, repeats=3)
    assert len(outputs) == 4 and all(o.shape == (2, 9) for o in outputs)  # 1 warm-up + 3
    assert 0 < r["p10"] <= r["median"] <= r["p90"]
    # with the clock fixed, the figure is exactly tokens / time: 2 sequences x 4 tokens
    def fixed_clock(fn, device, *, warmup, repeats, **kwargs):
        for _ in range(warmup + repeats):
            fn()
        return [8.0] * repeats

    monkeypatch.setattr(bench, "time_samples_ms", fixed_clock)
    fixed = bench.generation_speed(generate, ids, new_tokens=4, repeats=2, warmup=1)
    assert fixed == {"median": 1000.0, "p10": 1000.0, "p90": 1000.0}  # 8 tokens / 8 ms


def test_generation_speed_refuses_a_call_that_stops_early(tiny_llama):
    ids = torch.randint(0, 64, (1, 5))

    def short(x):  # as generate does when it meets an end token and no min_new_tokens
        return tiny_llama.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0)

    with pytest.raises(ValueError, match="fewer than new_tokens=4"):
        generation_speed(short, ids, new_tokens=4, repeats=1, warmup=0)
    with pytest.raises(ValueError, match="at least 1"):
        generation_speed(short, ids, new_tokens=0)
