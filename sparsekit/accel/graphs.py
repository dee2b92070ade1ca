"""sparsekit's own CUDA graphs around the compiled model: one graph per input signature.

``torch.compile(mode="reduce-overhead")`` replays CUDA graphs too, but each call first runs
dynamo's guard check over every guarded attribute of the model (the kernel modules add theirs)
and the CUDA-graph trees' bookkeeping: on the H200 (``journal/data/probe_host_2026-12-04.json``) an
accelerated BERT-large call spent 782 us on the host before its graph ran (stock dense 661 us),
against 260 us with the compiled model (mode "default") captured here and replayed. A call
whose input signature (:func:`input_key`: the structure, every tensor's shape, strides, dtype
and device, every other leaf's value) was seen before copies its tensors into the captured
graph's static inputs and replays it; a new signature is warmed up (compiled) and captured.

Capture freezes the Python that ran while capturing, so it is only sound where the compiled
model is one graph: :class:`GraphCache` refuses a signature whose warm-up built more than one
graph (a graph break: the Python between the pieces could branch on tensor data), and inputs
holding other objects (an HF ``Cache``, whose tensors the model updates in place) have no
signature. The caller then runs the model another way (``AcceleratedModel`` switches to
``mode="reduce-overhead"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sparsekit import _compat
from sparsekit.nn.calibration import tree_map

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


def input_key(obj: Any, found: list[torch.Tensor] | None = None) -> tuple | None:
    """A hashable signature of a call's inputs (nested tuples, lists, dicts, dataclasses of
    tensors and plain scalars), or None when they hold anything else (not capturable). Their
    tensors are appended to ``found`` (when given), in one fixed order."""
    if isinstance(obj, torch.Tensor):
        if found is not None:
            found.append(obj)
        return ("t", tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, _SCALARS):
        return ("v", type(obj).__name__, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        parts = [input_key(o, found) for o in obj]
        return None if None in parts else (type(obj).__name__, *parts)
    if isinstance(obj, Mapping):
        parts = [(k, input_key(v, found)) for k, v in obj.items()]
        if any(p is None for _, p in parts) or not all(isinstance(k, str) for k, _ in parts):
            return None
        return (type(obj).__name__, *parts)
    return None


class CapturedCall:
    """``fn(*args, **kwargs)`` captured into one CUDA graph (static copies of the inputs, in a
    memory ``pool`` shared by the graphs of one model: they are replayed one at a time)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, pool: Any):
        self.static = tree_map(torch.clone, (args, kwargs))
        self.inputs: list[torch.Tensor] = []
        input_key(self.static, self.inputs)
        sargs, skwargs = self.static
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*sargs, **skwargs)

    def __call__(self, tensors: list[torch.Tensor]) -> Any:
        """Replay on ``tensors`` (a call's inputs, as :func:`input_key` lists them)."""
        for dst, src in zip(self.inputs, tensors):
            dst.copy_(src)
        self.graph.replay()
        return self.out


class GraphCache:
    """The captured graphs of one compiled callable ``fn``, by input signature (at most
    ``max_graphs``). :meth:`run` replays a signature's :class:`CapturedCall`, capturing it on
    first sight after ``warmup`` calls on a side stream (where ``fn`` compiles), or returns
    None (and ``why``) when the inputs have no signature, the limit is reached, or the warm-up
    built more than one graph (the compiled model has graph breaks)."""

    def __init__(self, fn: Callable, max_graphs: int = 16, warmup: int = 2,
                 reset: Callable[[], None] | None = None):
        # reset(): puts back state a call advances (an HF cache's position counters) before
        # each warm-up call and before the first replay of a new capture
        self.fn, self.max_graphs, self.warmup, self.reset = fn, max_graphs, warmup, reset
        self.graphs: dict[tuple, CapturedCall] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.compiled = 0  # graphs torch.compile built during warm-ups
        self.why = ""  # why the last run() returned None

    def run(self, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)``'s output from its signature's graph, or None (see ``why``)."""
        found: list[torch.Tensor] = []
        key = input_key((args, kwargs), found)
        if key is None:
            self.why = "inputs holding objects other than tensors and scalars"
            return None
        call = self.graphs.get(key)
        if call is None:
            call = self._capture(key, args, kwargs)
            if call is not None and self.reset is not None:
                self.reset()
        return None if call is None else call(found)

    def _capture(self, key: tuple, args: tuple, kwargs: dict) -> CapturedCall | None:
        if len(self.graphs) >= self.max_graphs:
            self.why = f"more than {self.max_graphs} input signatures"
            return None
        before = _compat.compiled_graph_count()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # cuBLAS keeps one workspace per stream across calls; the graph must own the one it
        # captures (allocated in its pool), or whoever frees the cached one next (inductor's
        # CUDA-graph trees clear them when they record) frees memory the graph writes: on the
        # H200 a captured BERT replayed after a reduce-overhead model was built failed with
        # "unspecified launch failure". So: no cached workspace into the
        # warm-up or the capture, none kept after either.
        _compat.clear_cublas_workspaces()
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                if self.reset is not None:
                    self.reset()
                self.fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.current_stream().synchronize()
        _compat.clear_cublas_workspaces()
        built = _compat.compiled_graph_count() - before
        self.compiled += built
        if built > 1:
            self.why = f"the compiled model is {built} graphs (graph breaks)"
            return None
        try:
            self.graphs[key] = CapturedCall(self.fn, args, kwargs, self.pool)
        finally:
            _compat.clear_cublas_workspaces()
        return self.graphs[key]


__all__ = ["CapturedCall", "GraphCache", "input_key"]
