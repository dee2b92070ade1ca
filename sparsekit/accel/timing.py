"""GPU timing under CUDA-graph replay: the only honest clock for cuSPARSELt through torch,
whose per-call host work (plan building) would otherwise dominate small GEMMs."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[], object], *, calls: int | None = None, replays: int = 15,
                  warmup: int = 3) -> float:
    """Median time of one ``fn()`` in microseconds: ``calls`` calls are captured into one CUDA
    graph (default 10, fewer for calls over 2 ms), the graph is replayed ``replays`` times
    between CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if calls is None:  # 10 calls per replay, fewer once one eager call exceeds 2 ms
        calls = max(1, min(10, int(20.0 / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def eager_time_us(fn: Callable[[], object], *, calls: int = 20, warmup: int = 3) -> float:
    """Median wall time of one eager ``fn()`` (host overhead included) in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)
