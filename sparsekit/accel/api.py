"""``accelerate``: run a finalized (2:4-zeroed) model's linear layers on sparse / low-precision
tensor cores, under CUDA graphs, keeping per layer only what measures faster."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sparsekit.accel import algsearch
from sparsekit.accel import fuse as fuse_mod
from sparsekit.accel.convert import (
    Conv1x1AsLinear,
    SplitMultiheadAttention,
    conv_skip_reason,
    mha_skip_reason,
)
from sparsekit.accel.graphs import CUDAGraphModule, tree_map
from sparsekit.accel.kernels import PRECISIONS, VARIANTS, variant_name
from sparsekit.accel.report import BASELINE, AccelReport, LayerDecision, decide
from sparsekit.accel.timing import graph_time_us
from sparsekit.checkpoint import is_2to4

SPARSITIES = ("2:4", "auto", "dense")
_ALIGN = 32  # in/out features the 8-bit and 2:4 kernels take (cuSPARSELt, _scaled_mm, _int_mm)


class AcceleratedModel(nn.Module):
    """The accelerated model: ``model`` with kernel modules in place of its linears, run
    through CUDA graphs per input-shape bucket. ``sparsekit_report`` (also ``report``) holds the
    :class:`~sparsekit.accel.report.AccelReport`. Floating inputs are cast to bfloat16."""

    _sparsekit_accelerated = True

    def __init__(self, model: nn.Module, report: AccelReport, graphs: bool = True,
                 batch_buckets: Sequence[int] | None = None):
        super().__init__()
        self.model = model
        self.sparsekit_report = report
        # kept out of the module tree: the model's tensors are listed once, under ``model.``
        self.__dict__["runner"] = CUDAGraphModule(model, batch_buckets) if graphs else model

    @property
    def report(self) -> AccelReport:
        return self.sparsekit_report

    def forward(self, *args, **kwargs):
        args, kwargs = tree_map(_as_input, (args, kwargs))
        with torch.no_grad():
            return self.runner(*args, **kwargs)


def _as_input(t: torch.Tensor) -> torch.Tensor:
    t = t.cuda()
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _call(model: nn.Module, inputs: Any):
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def layer_plan(has_2to4: bool, precision: str, sparsity: str, in_features: int,
               out_features: int) -> tuple[list[str], str]:
    """Candidate variants for one linear (bf16 dense always first) and why the list is what it
    is. Pure; the planner times the candidates when there is more than one to choose from."""
    if in_features % _ALIGN or out_features % _ALIGN:
        return [BASELINE], (f"in/out features {in_features}/{out_features} not multiples of "
                            f"{_ALIGN}: stays bf16 dense")
    if sparsity == "dense":
        return list(dict.fromkeys([BASELINE, variant_name(precision, False)])), "sparsity=dense"
    if not has_2to4:
        return (list(dict.fromkeys([BASELINE, variant_name(precision, False)])),
                "weight holds no 2:4 pattern")
    if sparsity == "2:4":
        return [BASELINE, variant_name(precision, True)], "2:4 pattern"
    cands = [BASELINE, variant_name(precision, False), "bf16_2:4", variant_name(precision, True)]
    return list(dict.fromkeys(cands)), "auto: fastest measured"


def _convert(model: nn.Module, exclude: Sequence[str], report: AccelReport) -> None:
    """Replace convertible MultiheadAttention and 1x1 convs (skip reasons into the report)."""
    for name, module in list(model.named_modules()):
        if not name or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        new = None
        if isinstance(module, nn.MultiheadAttention):
            reason = mha_skip_reason(module)
            new = None if reason else SplitMultiheadAttention(module)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            reason = conv_skip_reason(module)
            new = None if reason else Conv1x1AsLinear(module)
        else:
            continue
        if new is None:
            report.skipped[name] = reason
        else:
            model.set_submodule(name, new)


def _plan_layer(lin: nn.Linear, m: int, cands: list[str], decision: LayerDecision,
                sparsity: str, min_speedup: float, search_algs: bool,
                searched: dict[tuple, int]) -> nn.Module | None:
    """Build and time the candidate variants of one linear at ``m`` tokens (under graph
    replay), fill ``decision`` and return the module to use, or None to keep the Linear."""
    x = torch.randn(m, lin.in_features, device="cuda", dtype=torch.bfloat16)
    built: dict[str, nn.Module] = {}
    for v in cands:
        mod = _build(v, lin, m, searched, search_algs)
        if VARIANTS[v].uses_alg:
            decision.alg_ids[v] = mod.alg_id
        built[v] = mod
        with torch.no_grad():
            decision.timings_us[v] = graph_time_us(lambda: mod(x))  # noqa: B023 (called now)
    if sparsity != "auto":
        decision.variant = cands[-1]
        return built[decision.variant]
    decision.variant, _ = decide(decision.timings_us, min_speedup)
    if decision.variant == BASELINE:
        return None
    # time the winner against dense once more: a noisy first pick must not stay
    with torch.no_grad():
        t_new = graph_time_us(lambda: built[decision.variant](x))
        t_base = graph_time_us(lambda: built[BASELINE](x))
    decision.confirmed_speedup = t_base / t_new
    if decision.confirmed_speedup < 1.0:
        decision.variant = BASELINE
        decision.reason += "; reverted: slower than dense when re-timed"
        return None
    return built[decision.variant]


def _build(variant: str, lin: nn.Linear, m: int, searched: dict[tuple, int],
           search_algs: bool) -> nn.Module:
    key = (variant, lin.out_features, lin.in_features, m)
    if VARIANTS[variant].uses_alg and search_algs and key not in searched:
        mod, searched[key], _ = algsearch.search(variant, lin, m)
        return mod
    return VARIANTS[variant](lin, alg_id=searched.get(key, 0))


def _keep_faster_fusion(model: nn.Module, inputs: Any, fused: list, searched: dict,
                        search_algs: bool, report: AccelReport) -> float:
    """Fusion is kept where the whole model measures faster with it. A wider GEMM is faster by
    itself, but its members' outputs are strided slices, and what reads them may slow down (an
    elementwise SwiGLU on two slices leaves PyTorch's vectorized path). So the groups of one
    kind (same member names and shapes, e.g. every layer's gate_proj+up_proj) are split back
    into separate GEMMs together, the model is timed again, and the faster form stays.
    Returns the time (us) of the model as left."""
    kinds: dict[tuple, list] = {}
    for unit, members, decision in fused:
        kind = (tuple(n.rsplit(".", 1)[-1] for n in unit),
                tuple((lin.out_features, lin.in_features) for lin in members))
        kinds.setdefault(kind, []).append((unit, members, decision))
    with torch.no_grad():
        t_best = graph_time_us(lambda: _call(model, inputs), calls=1)
    for kind, groups in kinds.items():
        slices = {n: model.get_submodule(n) for unit, _, _ in groups for n in unit}
        for unit, members, decision in groups:
            for name, lin in zip(unit, members):
                model.set_submodule(name, _build(decision.variant, lin, decision.tokens,
                                                 searched, search_algs))
        with torch.no_grad():
            t_split = graph_time_us(lambda: _call(model, inputs), calls=1)
        label = "+".join(kind[0])
        if t_split < t_best:
            for _, _, decision in groups:
                decision.reason += (f"; run as separate GEMMs: the model measured faster so "
                                    f"({t_split:.1f} us vs {t_best:.1f} us fused)")
            report.notes.append(f"fusion of {label} ({len(groups)} groups) dropped: model "
                                f"{t_split:.1f} us split vs {t_best:.1f} us fused")
            t_best = t_split
        else:
            for name, mod in slices.items():
                model.set_submodule(name, mod)
            report.notes.append(f"fusion of {label} ({len(groups)} groups) kept: model "
                                f"{t_best:.1f} us fused vs {t_split:.1f} us split")
    return t_best


def accelerate(
    model: nn.Module,
    example_inputs: Any,
    precision: str = "bf16",
    sparsity: str = "2:4",
    min_speedup: float = 1.0,
    *,
    exclude: Sequence[str] = (),
    graphs: bool = True,
    batch_buckets: Sequence[int] | None = None,
    search_algs: bool = True,
    fuse: bool = True,
) -> AcceleratedModel:
    """Run ``model``'s linear layers on sparse / low-precision tensor cores.

    ``model``: weights already hold their 2:4 zeros (after ``Pruner.finalize()``); layers
    without a 2:4 pattern stay dense. ``example_inputs``: a tensor, tuple (``model(*x)``) or dict
    (``model(**x)``) of the shape you will serve; per-layer timings are taken at its token count.
    ``precision``: "bf16" | "fp8" (e4m3) | "int8", W8A8 with dynamic activation scales.
    ``sparsity``: "2:4" (every 2:4 layer sparse), "dense" (precision only), or "auto" (per layer
    the fastest measured of bf16 dense, precision dense, bf16 2:4 and precision 2:4, kept only
    when it beats bf16 dense by ``min_speedup``; the whole model reverts to dense if it ends up
    slower). Timings are taken once per GEMM shape (N, K, tokens) under CUDA-graph replay and
    shared by the layers of that shape. ``exclude``: fnmatch globs of module names to leave
    alone. ``graphs``: run through CUDA graphs, one per input-shape bucket (``batch_buckets``
    pads dim 0 to fixed sizes). ``fuse``: linears that read the same input tensor (q/k/v,
    gate/up) and agree on 2:4 run as one wider GEMM (:mod:`sparsekit.accel.fuse`), planned as
    one unit named "a+b+c" in the report.

    Modifies ``model`` in place (moved to CUDA, bfloat16, eval) and returns the
    :class:`AcceleratedModel` wrapping it; ``.sparsekit_report`` says what was done."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if sparsity not in SPARSITIES:
        raise ValueError(f"sparsity must be one of {SPARSITIES}, got {sparsity!r}")
    if not min_speedup > 0:
        raise ValueError(f"min_speedup must be > 0, got {min_speedup}")
    if not torch.cuda.is_available():
        raise RuntimeError("sk.accelerate needs a CUDA GPU (sparse tensor cores); none is visible")
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    report = AccelReport(precision, sparsity, float(min_speedup), torch.cuda.get_device_name())
    model = model.eval().to("cuda", torch.bfloat16)
    inputs = tree_map(_as_input, example_inputs)
    with torch.no_grad():
        report.model_us["dense"] = graph_time_us(lambda: _call(model, inputs), calls=1)
    _convert(model, exclude, report)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    tokens, groups = fuse_mod.observe(model, lambda: _call(model, inputs), names)
    for name in names:
        if name not in tokens:
            report.skipped[name] = "not called on the example inputs"
    # units to plan: single linears, and sibling groups (same input) fused into one GEMM
    units: list[list[str]] = []
    if fuse:
        for group in groups:
            lins = [model.get_submodule(n) for n in group]
            if len({is_2to4(lin.weight) for lin in lins}) == 1 and all(
                    lin.out_features % _ALIGN == 0 for lin in lins):
                units.append(group)
    grouped = {n for g in units for n in g}
    units += [[n] for n in names if n in tokens and n not in grouped]
    units.sort(key=lambda g: names.index(g[0]))
    originals: dict[str, nn.Module] = {}
    searched: dict[tuple, int] = {}
    planned: dict[tuple, LayerDecision] = {}
    fused: list[tuple[list[str], list[nn.Linear], LayerDecision]] = []
    for unit in units:
        members = [model.get_submodule(n) for n in unit]
        lin = members[0] if len(unit) == 1 else fuse_mod.fused_linear(members)
        m = tokens[unit[0]]
        has24 = is_2to4(lin.weight)
        cands, reason = layer_plan(has24, precision, sparsity, lin.in_features, lin.out_features)
        if len(unit) > 1:
            reason = f"{reason}; {len(unit)} siblings (one input) fused into one GEMM"
        decision = LayerDecision("+".join(unit), lin.out_features, lin.in_features, m, has24,
                                 BASELINE, reason)
        report.layers.append(decision)
        if cands == [BASELINE]:
            continue
        shape_key = (lin.out_features, lin.in_features, m, tuple(cands))
        if shape_key in planned:  # same GEMM shape as an earlier layer: same timings
            first = planned[shape_key]
            decision.timings_us, decision.alg_ids = dict(first.timings_us), dict(first.alg_ids)
            decision.variant, decision.reason = first.variant, first.reason
            decision.confirmed_speedup = first.confirmed_speedup
            chosen = None if first.variant == BASELINE else \
                _build(first.variant, lin, m, searched, search_algs)
        else:
            planned[shape_key] = decision
            chosen = _plan_layer(lin, m, cands, decision, sparsity, min_speedup, search_algs,
                                 searched)
        if chosen is None:
            continue
        originals.update(zip(unit, members))
        if len(unit) == 1:
            model.set_submodule(unit[0], chosen)
        else:
            fuse_mod.install(model, unit, chosen, [mem.out_features for mem in members])
            fused.append((unit, members, decision))
    if fused:  # times the model as it leaves it: that is the accelerated time
        report.model_us["accelerated"] = _keep_faster_fusion(model, inputs, fused, searched,
                                                             search_algs, report)
    else:
        with torch.no_grad():
            report.model_us["accelerated"] = graph_time_us(lambda: _call(model, inputs), calls=1)
    if sparsity == "auto" and report.model_us["accelerated"] > report.model_us["dense"]:
        for name, lin in originals.items():
            model.set_submodule(name, lin)
        for d in report.layers:
            d.variant, d.reason = BASELINE, d.reason + "; model reverted: slower than dense"
        report.notes.append("auto: the accelerated model was slower than dense, all layers "
                            "reverted to bf16 dense")
        with torch.no_grad():
            report.model_us["accelerated"] = graph_time_us(lambda: _call(model, inputs), calls=1)
    del originals
    torch.cuda.empty_cache()
    return AcceleratedModel(model, report, graphs=graphs, batch_buckets=batch_buckets)


__all__ = ["AcceleratedModel", "accelerate", "layer_plan"]
