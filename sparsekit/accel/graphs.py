"""Run a module through CUDA graphs, one captured graph per input-shape bucket.

Why graphs rather than cached cuSPARSELt plans: torch builds a cuSPARSELt plan inside every
``_cslt_sparse_mm`` call (0.5-0.9 ms of host time on the H200). Binding cuSPARSELt ourselves to
keep plans would need a compiled extension; a CUDA graph records the kernels once and replays
them with no host work at all, for the sparse GEMMs, the activation-quantization kernels and
every other op of the model alike (measured in docs/gpu.md).

A bucket is the tuple of input shapes. With ``batch_buckets`` the first dimension of every
tensor input is padded up to the next bucket (rows of zeros) and outputs are cut back, so a
serving loop with varying batch sizes captures only a few graphs; this is only valid for models
whose samples do not interact along dim 0 (true in eval mode for ViT, BERT, Llama with batch
first).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def tree_map(fn, obj):
    """``fn`` applied to every tensor in nested lists, tuples (named too), dicts and dataclasses
    (HF ``ModelOutput`` included), each container rebuilt as its own type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: tree_map(fn, getattr(obj, f.name))
                            for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(tree_map(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        out = {k: tree_map(fn, v) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    return obj


class _Captured:
    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        self.static_args = tree_map(lambda t: t.clone(), args)
        self.static_kwargs = tree_map(lambda t: t.clone(), kwargs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up: lazy init, autotuning, workspace allocation
                module(*self.static_args, **self.static_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.static_out = module(*self.static_args, **self.static_kwargs)

    def run(self, args: tuple, kwargs: dict):
        for dst, src in zip(_flat(self.static_args) + _flat(self.static_kwargs),
                            _flat(args) + _flat(kwargs)):
            dst.copy_(src)
        self.graph.replay()
        return self.static_out


def _flat(obj) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(out.append, obj)
    return out


def _signature(obj) -> tuple:
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__,) + tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return ("dict",) + tuple((k, _signature(v)) for k, v in sorted(obj.items()))
    return ("C", repr(obj))


class CUDAGraphModule(nn.Module):
    """Wraps ``module`` (eval, no grad) so each call replays a CUDA graph captured for its
    input-shape bucket. Outputs are cloned out of the graph's static buffers (``clone_outputs``)
    so a later call does not overwrite what an earlier call returned.

    Tensor inputs must be on the GPU; non-tensor arguments are part of the bucket key."""

    def __init__(self, module: nn.Module, batch_buckets: Sequence[int] | None = None,
                 max_graphs: int = 16, clone_outputs: bool = True):
        super().__init__()
        if batch_buckets is not None:
            batch_buckets = sorted(int(b) for b in batch_buckets)
            if not batch_buckets or batch_buckets[0] < 1:
                raise ValueError(f"batch_buckets must be positive sizes, got {batch_buckets}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.module = module
        self.batch_buckets = batch_buckets
        self.max_graphs = max_graphs
        self.clone_outputs = clone_outputs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket(self, n: int) -> int:
        """The padded first-dimension size for ``n`` rows (``n`` itself without buckets or
        beyond the largest bucket)."""
        if self.batch_buckets is None or n > self.batch_buckets[-1]:
            return n
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]

    def forward(self, *args, **kwargs):
        kwargs = dict(sorted(kwargs.items()))
        tensors = _flat(args) + _flat(kwargs)
        n = tensors[0].shape[0] if tensors and tensors[0].dim() else None
        padded = n is not None and self.bucket(n) != n
        if padded:
            target = self.bucket(n)

            def pad(t: torch.Tensor) -> torch.Tensor:
                if t.dim() == 0 or t.shape[0] != n:
                    return t
                return F.pad(t, (0, 0) * (t.dim() - 1) + (0, target - n))

            args, kwargs = tree_map(pad, args), tree_map(pad, kwargs)
        key = _signature((args, kwargs))
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            captured = self._graphs[key] = _Captured(self.module, args, kwargs)
        else:
            self._graphs.move_to_end(key)
        out = captured.run(args, kwargs)
        if padded:
            out = tree_map(lambda t: t[:n] if t.dim() and t.shape[0] == target else t, out)
        if self.clone_outputs:
            out = tree_map(lambda t: t.clone(), out)
        return out
