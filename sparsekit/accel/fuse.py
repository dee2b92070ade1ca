"""Sibling linears fused into one GEMM: layers called one after another on the very same input
tensor (attention's q/k/v projections, a SwiGLU MLP's gate and up projections) run as one wider
matrix product.

One wide GEMM instead of two or three narrow ones keeps the tensor cores busier (the 2:4 and
8-bit kernels gain most on wide layers) and, for fp8/int8, quantizes the shared activation once
instead of once per layer. Weights are concatenated along the output dimension, so a 2:4
pattern (along the input dimension) and per-output-channel scales carry over unchanged.

The members of a group are replaced by :class:`SiblingOutput` modules: the first member called
in a forward runs the fused GEMM on its input, and every member returns its slice (a view) of
that output. A member called with a different tensor than the one the output was computed for
(or the same tensor written in place since) recomputes, so a model whose call pattern changes
stays correct (it only loses the fusion).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def observe(model: nn.Module, run: Callable[[], Any], names: list[str]
            ) -> tuple[dict[str, int], list[list[str]]]:
    """One forward (``run()``) watching the ``nn.Linear`` modules ``names`` of ``model``:
    returns the token count (input rows) each was first called with, and the sibling groups:
    runs of 2 or more consecutive calls (among these linears) on the very same input tensor
    object, keeping members called exactly once. Only the current run's input is held, so
    memory stays one activation whatever the model's size."""
    tokens: dict[str, int] = {}
    calls: dict[str, int] = {}
    runs: list[list[str]] = []
    current: list[Any] = [None, -1]  # the input of the run being collected, and its version
    hooks = []
    for name in names:

        def hook(m, args, name=name):
            x = args[0]
            tokens.setdefault(name, x.numel() // m.in_features)
            calls[name] = calls.get(name, 0) + 1
            if x is current[0] and x._version == current[1]:  # same tensor, not written since
                runs[-1].append(name)
            else:
                current[0], current[1] = x, x._version
                runs.append([name])

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        current[0] = None
        for h in hooks:
            h.remove()
    groups = [[n for n in r if calls[n] == 1] for r in runs]
    return tokens, [g for g in groups if len(g) > 1]


def fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing all of ``linears`` (same in_features) at once: weights and
    biases concatenated along the output dimension (a missing bias is zeros)."""
    k = linears[0].in_features
    if any(lin.in_features != k for lin in linears):
        raise ValueError(f"fused linears need one in_features, got "
                         f"{[lin.in_features for lin in linears]}")
    w = linears[0].weight
    has_bias = any(lin.bias is not None for lin in linears)
    fused = nn.Linear(k, sum(lin.out_features for lin in linears), bias=has_bias,
                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([
                lin.bias if lin.bias is not None else w.new_zeros(lin.out_features)
                for lin in linears]))
    return fused


class _Shared:
    """The fused module and the output of its last call, handed out slice by slice."""

    def __init__(self, module: nn.Module, sizes: list[int]):
        self.module = module
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        self._input: weakref.ref | None = None
        self._version = -1  # of the input when the output was computed
        self._out: torch.Tensor | None = None
        self._left: set[int] = set()

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if (self._out is None or index not in self._left or self._input() is not x
                or x._version != self._version):  # a new input, or this one written in place
            self._out = self.module(x)
            self._input, self._version = weakref.ref(x), x._version
            self._left = set(range(len(self.sizes)))
        out = self._out
        self._left.discard(index)
        if not self._left:  # every member has its slice: drop the references
            self._out, self._input = None, None
        o = self.offsets[index]
        return out[..., o:o + self.sizes[index]]


class SiblingOutput(nn.Module):
    """One member of a fused group (see the module docstring). The first member holds the fused
    module as its child, so the model's state lists its tensors once."""

    def __init__(self, shared: _Shared, index: int, group: str):
        super().__init__()
        self.__dict__["shared"] = shared  # not a child: registered once, below
        if index == 0:
            self.fused = shared.module
        self.index = index
        self.group = group
        self.out_features = shared.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.take(x, self.index)

    def extra_repr(self) -> str:
        return f"slice {self.index} ({self.out_features} features) of {self.group}"


def install(model: nn.Module, names: list[str], module: nn.Module, sizes: list[int]) -> None:
    """Replace the linears ``names`` of ``model`` by the slices of ``module``'s output."""
    shared = _Shared(module, sizes)
    group = "+".join(names)
    for i, name in enumerate(names):
        model.set_submodule(name, SiblingOutput(shared, i, group))


__all__ = ["SiblingOutput", "fused_linear", "install", "observe"]
