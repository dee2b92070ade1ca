"""Timing a model: forward latency at batch 1 and throughput at a large batch
(:func:`benchmark`), and generation speed in tokens per second (:func:`generation_speed`;
:func:`generation_speeds` for several generates timed in alternating rounds).

Each repeat is timed by :func:`sparsekit.nn.timing.time_samples_ms` (CUDA events after
warm-up; on CPU ``perf_counter``). Every figure is reported with its spread over the repeats:
the median (robust to a noisy neighbour) and the 10th and 90th percentiles, so that two models
whose p10-p90 ranges overlap are not called faster or slower than each other.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sparsekit.nn.timing import time_samples_ms
from sparsekit.nn.calibration import eval_mode
from sparsekit.progress import progress


def _bar(desc: str, quiet: bool):
    return lambda steps: progress(steps, quiet, desc=desc, leave=False)


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "p10", "p90"}`` of ``values`` (percentiles interpolated linearly between
    the sorted values, as numpy's default; one value: all three equal it).

    >>> spread([5.0, 1.0, 3.0, 2.0, 4.0])
    {'median': 3.0, 'p10': 1.4, 'p90': 4.6}
    """
    if not values:
        raise ValueError("spread() needs at least one value")
    xs = sorted(float(v) for v in values)

    def pct(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    median = statistics.median(xs)  # p10 <= median <= p90 whatever the rounding
    return {"median": median, "p10": min(pct(0.1), median), "p90": max(pct(0.9), median)}


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two spreads' p10-p90 ranges overlap: their difference is within the noise.

    >>> overlap({"p10": 1.0, "p90": 2.0}, {"p10": 1.9, "p90": 3.0})
    True
    >>> overlap({"p10": 1.0, "p90": 2.0}, {"p10": 2.1, "p90": 3.0})
    False
    """
    return a["p10"] <= b["p90"] and b["p10"] <= a["p90"]


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
    mode on ``example``'s device: each the median over ``repeats`` timed calls, with its 10th
    and 90th percentiles (``latency_ms_p10``/``_p90``, ``throughput_p10``/``_p90``; the
    throughput's p10 comes from the slow calls). ``example`` is one input batch; its first
    sample is repeated to build both batches.

    >>> r = benchmark(nn.Linear(4, 2), torch.zeros(1, 4), batch_size=8, warmup=1, repeats=3,
    ...               quiet=True)
    >>> sorted(r)  # doctest: +NORMALIZE_WHITESPACE
    ['latency_ms', 'latency_ms_p10', 'latency_ms_p90',
     'throughput', 'throughput_p10', 'throughput_p90']
    >>> r["latency_ms_p10"] <= r["latency_ms"] <= r["latency_ms_p90"]
    True
    """
    one = example[:1]
    big = one.expand(batch_size, *one.shape[1:]).contiguous()
    with eval_mode(model):
        latency = time_samples_ms(lambda: model(one), one.device, warmup=warmup,
                                  repeats=repeats, wrap=_bar(f"{desc} b=1", quiet))
        batch_ms = time_samples_ms(lambda: model(big), big.device, warmup=warmup,
                                   repeats=repeats, wrap=_bar(f"{desc} b={batch_size}", quiet))
    lat = spread(latency)
    thr = spread([batch_size / (ms / 1e3) for ms in batch_ms])
    return {"latency_ms": lat["median"], "latency_ms_p10": lat["p10"],
            "latency_ms_p90": lat["p90"], "throughput": thr["median"],
            "throughput_p10": thr["p10"], "throughput_p90": thr["p90"]}


@torch.no_grad()
def generation_speed(
    generate_fn: Callable[[torch.Tensor], Any],
    input_ids: torch.Tensor,
    new_tokens: int,
    repeats: int = 5,
    warmup: int = 1,
    desc: str = "generate",
    quiet: bool = True,
) -> dict[str, float]:
    """Tokens per second of ``generate_fn(input_ids)`` (a causal LM's ``generate``, or an
    :class:`~sparsekit.accel.model.AcceleratedModel`'s, asked for ``new_tokens`` new tokens per
    sequence): ``{"median", "p10", "p90"}`` over ``repeats`` timed calls after ``warmup``
    (which also compiles). Tokens are counted from what each call returns (its sequences minus
    the prompt, over the batch), so a call that stops early is counted as what it gave; a call
    that gives fewer than ``new_tokens`` per sequence is an error (pass ``min_new_tokens``).
    :func:`generation_speeds` times several in alternating rounds.

    >>> def generate(ids):  # stands in for model.generate(ids, max_new_tokens=3, ...)
    ...     return torch.cat([ids, torch.zeros(ids.shape[0], 3, dtype=ids.dtype)], -1)
    >>> r = generation_speed(generate, torch.zeros(2, 4, dtype=torch.long), new_tokens=3,
    ...                      repeats=3)
    >>> sorted(r), r["p10"] <= r["median"] <= r["p90"]
    (['median', 'p10', 'p90'], True)
    """
    return generation_speeds({desc: generate_fn}, input_ids, new_tokens, repeats, warmup,
                             desc, quiet)[desc]


@torch.no_grad()
def generation_speeds(
    generate_fns: dict[str, Callable[[torch.Tensor], Any]],
    input_ids: torch.Tensor,
    new_tokens: int,
    repeats: int = 5,
    warmup: int = 1,
    desc: str = "generate",
    quiet: bool = True,
) -> dict[str, dict[str, float]]:
    """:func:`generation_speed` of each of ``generate_fns`` (name -> generate), paired: after
    ``warmup`` calls of each, ``repeats`` rounds that call every one once, in turn, the order
    reversed every other round (A B, B A, ...), so that a GPU's drifting clock or a neighbour's
    load weighs on each alike. Per name ``{"median", "p10", "p90"}`` tokens/s.

    >>> def generate(ids):
    ...     return torch.cat([ids, torch.zeros(ids.shape[0], 3, dtype=ids.dtype)], -1)
    >>> r = generation_speeds({"a": generate, "b": generate}, torch.zeros(1, 4, dtype=torch.long),
    ...                       new_tokens=3, repeats=2)
    >>> sorted(r), sorted(r["a"])
    (['a', 'b'], ['median', 'p10', 'p90'])
    """
    if new_tokens < 1 or repeats < 1:
        raise ValueError(f"generation_speed: new_tokens ({new_tokens}) and repeats ({repeats}) "
                         "must be at least 1")
    prompt, rows = input_ids.shape[-1], max(input_ids.shape[0], 1)
    names = list(generate_fns)
    made: dict[str, list[int]] = {name: [] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}

    def call(name: str) -> None:
        out = generate_fns[name](input_ids)
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        made[name].append((seqs.shape[-1] - prompt) * seqs.shape[0])

    for name in names:
        for _ in range(warmup):
            call(name)
        made[name].clear()
    for r in _bar(desc, quiet)(range(repeats)):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += time_samples_ms(functools.partial(call, name), input_ids.device,
                                           warmup=0, repeats=1)
    speeds = {}
    for name in names:
        per_seq = min(made[name]) // rows
        if per_seq < new_tokens:
            raise ValueError(f"generation_speed: a call of {name} gave {per_seq} new tokens per "
                             f"sequence, fewer than new_tokens={new_tokens} (stopped at an end "
                             "token? pass min_new_tokens)")
        speeds[name] = spread([n / (ms / 1e3) for n, ms in zip(made[name], times[name])])
    return speeds
