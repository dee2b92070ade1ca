"""Sibling fusion: linear layers that read the same input tensor (q/k/v, gate/up) as one GEMM
over their concatenated weights, with no data-dependent Python in the forward.

At accelerate time one eager forward records which selected layers receive the very same tensor
(:func:`first_calls`, the forward that also counts each layer's tokens). Each group becomes one
accelerated layer over the concatenated weights (:func:`concat_linears`: rows of the weights,
biases, per-channel scales; a 2:4 weight stays 2:4 along its input), shared by the members,
which are replaced by :class:`SiblingSlice` modules returning ``group(x)[..., start:end]``.
The model's code still calls q, k and v one by one, so the traced graph holds the same
computation three times, on the same input and the same buffers; :class:`MergeSameCalls`, an
inductor post-grad pass that ``accelerate(plan=PlanOptions(siblings=True))`` installs, keeps one
of them.
(Inductor's own ``freezing`` does that merge too, but under CUDA graphs it measured slower: on
the H200 the rows with freezing ran 197 / 453 device copies per forward on the 32-layer Llama,
as many as its weight and scale tensors, and dense with freezing alone ran 12% slower;
journal/gpu.md.) Nothing is fused when the model is not compiled (eagerly each slice
would run the whole GEMM).
"""

from __future__ import annotations

import functools

import hashlib
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel.layers import one_scale
from sparsekit.nn.calibration import call_model, feed
from sparsekit.quant.modules import QuantLinear


_MARK = "_sparsekit_sibling_input"


def first_calls(model: nn.Module, inputs: Any,
                names: list[str]) -> tuple[dict[str, int], list[list[str]]]:
    """One eager forward on ``inputs``: the number of input rows each layer of ``names`` is
    first called with (layers never called are left out), and the groups (2 or more, in call
    order) of those called with one and the same input tensor (same object, unmodified). A
    wrong group would cost time, not correctness: every member computes its slice of its own
    input."""
    tokens: dict[str, int] = {}
    seen: dict[str, tuple] = {}
    handles = []
    marked: list[weakref.ref] = []
    for name in names:
        def hook(module: nn.Module, args: tuple, name: str = name) -> None:
            x = args[0]
            if name in tokens:
                return
            tokens[name] = x.numel() // module.in_features
            # a mark on the tensor object itself: a later tensor may reuse a freed one's id()
            # and memory, never its attributes
            if not hasattr(x, _MARK):
                setattr(x, _MARK, len(marked))
                marked.append(weakref.ref(x))
            seen[name] = (getattr(x, _MARK), x._version)

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():  # a failing layer: ModelCallError naming it and the shapes
            call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
        for ref in marked:  # no mark left on a tensor that outlives the forward (the input)
            if (t := ref()) is not None:
                delattr(t, _MARK)
    by_input: dict[tuple, list[str]] = {}
    for name, key in seen.items():  # dicts keep insertion (= call) order
        by_input.setdefault(key, []).append(name)
    return tokens, [group for group in by_input.values() if len(group) > 1]


def concat_linears(layers: list[nn.Module]) -> tuple[nn.Module | None, str]:
    """One layer computing all of ``layers`` (same input size) side by side, or None and why
    not: float ``nn.Linear`` layers of one dtype (a missing bias becomes zeros when another has
    one), or ``QuantLinear`` layers of one scheme (static schemes: with the same input scale,
    as layers fed the same input calibrate)."""
    first = layers[0]
    if len({m.in_features for m in layers}) != 1:
        return None, "input sizes differ"
    if all(type(m) is nn.Linear for m in layers):
        if len({m.weight.dtype for m in layers}) != 1:
            return None, "weight dtypes differ"
        out = nn.Linear(first.in_features, sum(m.out_features for m in layers),
                        bias=any(m.bias is not None for m in layers),
                        device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(torch.cat([m.weight for m in layers]))
            if out.bias is not None:
                out.bias.copy_(_biases(layers))
        return out, ""
    if all(isinstance(m, QuantLinear) for m in layers):
        if len({m.scheme for m in layers}) != 1:
            return None, "quantization schemes differ"
        scales = [m._buffers.get("input_scale") for m in layers]
        if scales[0] is not None and any(not torch.equal(s, scales[0]) for s in scales):
            return None, "static input scales differ"
        shell = nn.utils.skip_init(nn.Linear, first.in_features,
                                   sum(m.out_features for m in layers),
                                   bias=any(m.bias is not None for m in layers),
                                   device=first.weight.device, dtype=torch.bfloat16)
        out = QuantLinear(shell, first.scheme)
        with torch.no_grad():
            out.weight = torch.cat([m.weight for m in layers])
            out.weight_scale = torch.cat([m.weight_scale for m in layers])
            if out.bias is not None:
                out.bias = nn.Parameter(_biases(layers), requires_grad=False)
            if scales[0] is not None:
                out.input_scale = scales[0].clone()
        return out, ""
    return None, "not all float nn.Linear or all QuantLinear"


def _biases(layers: list[nn.Module]) -> torch.Tensor:
    """The members' biases side by side (zeros for a member without one)."""
    dtype = next(m.bias.dtype for m in layers if m.bias is not None)
    return torch.cat([m.bias.detach().to(dtype) if m.bias is not None else
                      torch.zeros(m.out_features, device=m.weight.device, dtype=dtype)
                      for m in layers])


def _hashable(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return tuple(_hashable(v) for v in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in a.items()))
    return a


@functools.cache
def _mergesamecalls_class() -> type:
    """The class, made on first use: its base (inductor's ``CustomGraphPass``) imports
    dynamo, which ``import sparsekit`` should not."""
    class MergeSameCalls(_compat.custom_graph_pass()):
        """Inductor post-grad pass (``post_grad_custom_pre_pass``): calls of one pure op with the
        same arguments (the same graph nodes and constants) become one, their users moved to the
        first. The members of a sibling group each call the group's GEMM, and its activation
        quantization, on the same input and buffers: one call of each is left."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            seen: dict[tuple, torch.fx.Node] = {}
            for node in list(graph.nodes):
                if node.op != "call_function" or not _compat.pure_op(node.target):
                    continue
                key = (node.target, _hashable(node.args), _hashable(node.kwargs))
                try:
                    first = seen.setdefault(key, node)
                except TypeError:  # an argument that cannot be compared: left as it is
                    continue
                if first is not node:
                    node.replace_all_uses_with(first)
                    graph.erase_node(node)

        def uuid(self) -> str:  # inductor's graph cache key: this file's code
            return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return MergeSameCalls


def __getattr__(name: str) -> Any:
    if name == "MergeSameCalls":
        return _mergesamecalls_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SiblingSlice(nn.Module):
    """One member of a sibling group: ``group(x)[..., start:end]`` (a view of the group's
    output). Compiled with :class:`MergeSameCalls`, the members' identical ``group(x)`` calls
    are one."""

    def __init__(self, group: nn.Module, start: int, end: int, in_features: int):
        super().__init__()
        self.group = group
        self.start, self.end = start, end
        self.in_features, self.out_features = in_features, end - start

    @property
    def uses_alg(self) -> bool:
        return bool(getattr(self.group, "uses_alg", False))

    @property
    def alg_id(self) -> int:
        return int(getattr(self.group, "alg_id", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(x)[..., self.start:self.end]

    def extra_repr(self) -> str:
        return f"[{self.start}:{self.end}] of a {self.group.out_features}-wide sibling group"


def fuse(model: nn.Module, inputs: Any, groups: list[list[str]], chosen: dict,
         build: Callable[[str, nn.Module, int], nn.Module]) -> list[str]:
    """Replace each group of installed layers (``chosen``: name ->
    :class:`~sparsekit.accel.planner.PlannedLayer`) whose members run one variant by slices
    of one layer built with
    ``build(variant, concatenated layer, tokens)`` (bf16 dense float layers become one
    ``bf16_dense`` layer); a group whose members differ is left as it is. Checked with one
    eager forward: a model that needs contiguous outputs gets its layers back. Returns notes."""
    notes, done = [], []
    for group in groups:
        members = [n for n in group if n in chosen]
        variants = {chosen[n].decision.variant for n in members}
        if len(members) < 2 or len(variants) != 1:
            if len(members) > 1:
                notes.append(f"siblings {members} not fused: variants {sorted(variants)} differ")
            continue
        layers = [chosen[n].layer for n in members]
        src, why = concat_linears(layers)
        if src is None:
            notes.append(f"siblings {members} not fused: {why}")
            continue
        # decided before building (which compresses and may search algorithms)
        if any(getattr(model.get_submodule(n), "path", "") == "cslt_alpha" for n in members) \
                and not one_scale(getattr(src, "weight_scale", None)):
            notes.append(f"siblings {members} not fused: their per-tensor weight scales differ, "
                         f"and one GEMM would lose the scale and bias inside it")
            continue
        variant = variants.pop()
        mod = build(variant, src, chosen[members[0]].tokens)
        start = 0
        for name, layer in zip(members, layers):
            done.append((name, model.get_submodule(name), chosen[name].decision.reason))
            model.set_submodule(name, SiblingSlice(mod, start, start + layer.out_features,
                                                   layer.in_features))
            start += layer.out_features
        for name in members:
            chosen[name].decision.reason += (
                f"; one {variant} GEMM ({start}x{layers[0].in_features})"
                f" with {', '.join(m for m in members if m != name)}")
        notes.append(f"siblings fused: {', '.join(members)} (one {variant} GEMM, "
                     f"{start}x{layers[0].in_features})")
    if done:
        try:
            with torch.no_grad():
                feed(model, inputs)
        except Exception as e:  # noqa: BLE001 - a model the slices do not suit runs unfused
            for name, previous, reason in done:
                model.set_submodule(name, previous)
                chosen[name].decision.reason = reason
            return [f"siblings not fused: the model failed with slices ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:120]})"]
    return notes


__all__ = ["MergeSameCalls", "SiblingSlice", "concat_linears", "first_calls",  # noqa: F822
           "fuse"]  # MergeSameCalls: made by the module __getattr__
