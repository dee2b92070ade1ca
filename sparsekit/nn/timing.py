"""The one timing loop of sparsekit: :func:`time_ms` (CUDA events on a GPU, ``perf_counter`` on
CPU, the median over repeats after warm-up). :func:`eager_time_us` and :func:`graph_time_us`
time GPU calls with it; the benchmark of whole models (:mod:`sparsekit.run.bench`) too.

CUDA-graph replay is the only honest clock for cuSPARSELt through torch, whose per-call host
work (plan building) would otherwise dominate small GEMMs. ``graph_time_us`` captures at most
10 calls per graph rather than using ``triton.testing.do_bench_cudagraph``, which captures
``rep`` milliseconds of calls (thousands for a small GEMM): every captured call keeps its own
output allocation alive in the graph's pool, so large layers would run out of memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch


def time_ms(fn: Callable[[], object], device: torch.device | str = "cuda", *, warmup: int = 3,
            repeats: int = 20,
            wrap: Callable[[range], Iterable[int]] | None = None,
            before: Callable[[], object] | None = None) -> float:
    """Median time of one ``fn()`` in milliseconds over ``repeats`` calls after ``warmup``
    calls: the median of :func:`time_samples_ms` (same arguments).

    >>> time_ms(lambda: sum(range(100)), "cpu", warmup=1, repeats=3) >= 0
    True
    """
    return statistics.median(time_samples_ms(fn, device, warmup=warmup, repeats=repeats,
                                             wrap=wrap, before=before))


def time_samples_ms(fn: Callable[[], object], device: torch.device | str = "cuda", *,
                    warmup: int = 3, repeats: int = 20,
                    wrap: Callable[[range], Iterable[int]] | None = None,
                    before: Callable[[], object] | None = None) -> list[float]:
    """The time of each of ``repeats`` calls of ``fn()`` in milliseconds, after ``warmup``
    calls: between CUDA events (host overhead included) on a CUDA ``device``, with
    ``time.perf_counter`` elsewhere. ``wrap`` (e.g. a progress bar) wraps the repeat range.
    ``before()`` runs ahead of every call, finished (synchronized) and outside the timed span
    (e.g. :func:`flush_l2`).

    >>> len(time_samples_ms(lambda: sum(range(100)), "cpu", warmup=1, repeats=3))
    3
    """
    device = torch.device(device)
    cuda = device.type == "cuda"

    def ready() -> None:
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    steps = range(repeats) if wrap is None else wrap(range(repeats))
    times = []
    for _ in steps:
        ready()
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


_FLUSH: dict[torch.device, torch.Tensor] = {}


def flush_l2(device: torch.device | str = "cuda") -> None:
    """Evict the GPU's L2 cache (writes a buffer of twice its size; a no-op off CUDA), so the
    next call reads its weights from memory, as each block of a deep model does."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device not in _FLUSH:
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        _FLUSH[device] = torch.empty(max(2 * size, 64 << 20), dtype=torch.uint8, device=device)
    _FLUSH[device].zero_()


def graph_time_us(fn: Callable[[], object], *, calls: int | None = None, replays: int = 15,
                  warmup: int = 3) -> float:
    """Median time of one ``fn()`` in microseconds: ``calls`` calls are captured into one CUDA
    graph (default 10, fewer for calls over 2 ms), the graph is replayed ``replays`` times
    between CUDA events."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        one_ms = time_ms(fn, device, warmup=warmup, repeats=1)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if calls is None:  # 10 calls per replay, fewer once one eager call exceeds 2 ms
        calls = max(1, min(10, int(20.0 / max(one_ms, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    try:
        return time_ms(graph.replay, device, warmup=1, repeats=replays) * 1000.0 / calls
    finally:
        del graph


def eager_time_us(fn: Callable[[], object], *, calls: int = 20, warmup: int = 3) -> float:
    """Median wall time of one eager ``fn()`` (host overhead included) in microseconds."""
    device = torch.device("cuda", torch.cuda.current_device())
    return time_ms(fn, device, warmup=warmup, repeats=calls) * 1000.0
