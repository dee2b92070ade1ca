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

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

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


def l2_copies(nbytes: int, device: torch.device | str = "cuda", most: int = 64) -> int:
    """How many copies of ``nbytes`` of operands a timed CUDA graph cycles through so that its
    reads exceed twice the L2 cache (each call then reads them from memory, as a layer of a deep
    model does); at most ``most``, 1 off CUDA.

    >>> l2_copies(1 << 20, "cpu")
    1
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20
    return max(1, min(most, -(-2 * l2 // max(nbytes, 1))))


def _operand_slots(fn: functools.partial) -> list[tuple[dict, Any, torch.Tensor]]:
    """(container, key, tensor) of what ``fn`` reads besides its first argument: a module's
    parameters, buffers and tensor attributes (its submodules' too), or a function's tensor
    arguments after the first (the activations stay)."""
    if isinstance(fn.func, torch.nn.Module):
        return [(table, name, t) for m in fn.func.modules()
                for table in (m._parameters, m._buffers, vars(m))
                for name, t in list(table.items()) if isinstance(t, torch.Tensor)]
    return [(fn.args, i, t) for i, t in enumerate(fn.args) if i and isinstance(t, torch.Tensor)]


def cold_time_us(fn: functools.partial) -> float:
    """Median time of one ``fn()`` in microseconds with its operands read from memory, not the
    L2 cache: ``fn`` is a ``functools.partial`` of a module (its parameters, buffers and tensor
    attributes are the operands) or of a function (its tensor arguments after the first). The
    CUDA graph (:func:`graph_time_us`) cycles through :func:`l2_copies` copies of them, so a
    small layer is timed as it runs in a decode step, where the weights of every other layer
    pass through the L2 between two of its calls. Off CUDA: :func:`graph_time_us` of ``fn``."""
    slots = _operand_slots(fn)
    unique = {id(t): t for _, _, t in slots}
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())
    device = next((t.device for t in unique.values()), torch.device("cpu"))
    copies = l2_copies(nbytes, device)
    if copies == 1:
        return graph_time_us(fn)
    sets = [unique] + [{k: t.clone() for k, t in unique.items()} for _ in range(copies - 1)]
    args = list(fn.args)

    def place(i: int) -> None:
        for table, key, t in slots:
            if table is fn.args:
                args[key] = sets[i][id(t)]
            else:
                table[key] = sets[i][id(t)]

    def call(i: int) -> object:
        place(i)
        return fn.func(*args, **fn.keywords)

    turn = itertools.count()
    try:
        return graph_time_us(lambda: call(next(turn) % copies),
                             calls=copies * max(1, -(-10 // copies)))
    finally:
        place(0)


def eager_time_us(fn: Callable[[], object], *, calls: int = 20, warmup: int = 3) -> float:
    """Median wall time of one eager ``fn()`` (host overhead included) in microseconds."""
    device = torch.device("cuda", torch.cuda.current_device())
    return time_ms(fn, device, warmup=warmup, repeats=calls) * 1000.0
