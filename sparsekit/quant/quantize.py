"""Post-training quantization: ``quantize_`` swaps float layers for quantized ones in place,
rounding to nearest (RTN) or, for int4 weights, with GPTQ (:mod:`sparsekit.quant.gptq`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from sparsekit.errors import UsageError
from sparsekit.nn import shards
from sparsekit.nn.calibration import CalibrationFn, run_calibration
from sparsekit.quant.formats import Scheme, get_scheme
from sparsekit.quant.gptq import GPTQ, as_method, gptq_quantize
from sparsekit.quant.layers import (
    after_swap,
    foreign_parametrizations,
    plan_layers,
    select_float_layers,
    set_module,
)
from sparsekit.quant.modules import quantized_module
from sparsekit.quant.numerics import absmax_scale
from sparsekit.quant.report import QuantReport


def _check_no_masks(chosen: dict[str, nn.Module]) -> None:
    """UsageError naming a chosen layer under a live (not finalized) pruning mask."""
    for name, m in chosen.items():
        foreign = foreign_parametrizations(m)
        if foreign:
            raise UsageError(
                f"quantize_: layer {name!r} has parametrizations {foreign} on its weight (a "
                "Pruner that is not finalized?): call pruner.finalize() first, or use "
                "prepare_qat_ to fine-tune under the pruner"
            )


def _static_scales(model: nn.Module, scheme: Scheme, report: QuantReport,
                   chosen_ok: dict[str, nn.Module], calibration: Iterable[Any] | None,
                   calibration_fn: CalibrationFn | None, strict: bool) -> dict[str, torch.Tensor]:
    """A static scheme's activation scale per layer from the calibration batches (a layer
    they never call is dropped from ``chosen_ok``, skipped in ``report``)."""
    if calibration is None:
        raise UsageError(
            f"quantize_: scheme {scheme.name!r} fixes one activation scale per layer from "
            "calibration data: pass calibration=<iterable of batches> (or use the dynamic "
            f"scheme {scheme.name.removesuffix('_static')!r})"
        )
    amax = input_absmax(model, chosen_ok, calibration, calibration_fn)
    for layer in report.layers:
        if layer.name in chosen_ok and layer.name not in amax:
            layer.status, layer.reason = "skipped", "not called by the calibration batches"
            del chosen_ok[layer.name]
    if strict and report.skipped:
        raise UsageError(f"quantize_({scheme.name!r}, strict=True) cannot take: "
                         f"{report.skipped}")
    return {n: absmax_scale(amax[n], scheme.activation) for n in chosen_ok}


def quantize_(
    model: nn.Module,
    scheme: str | Scheme,
    *,
    include: str | Sequence[str] = ("*",),
    exclude: str | Sequence[str] = (),
    calibration: Iterable[Any] | None = None,
    calibration_fn: CalibrationFn | None = None,
    strict: bool = False,
    method: str | GPTQ = "rtn",
    group_size: int | str | None = None,
) -> QuantReport:
    """Replace the selected Linear/ConvNd layers of ``model`` by quantized ones, in place.

    ``scheme``: "int8_weight_only", "int8" (W8A8), "fp8" (e4m3 W8A8), "int4_weight" (int4
    weights, one scale per 128 inputs; Linear only) or "int4_weight_channel", ...; see
    :mod:`sparsekit.quant.modules` for the scales. ``method``: "rtn" rounds every weight to
    nearest; "gptq" (int4 schemes, needs ``calibration``) quantizes layer by layer with GPTQ's
    error compensation (:mod:`sparsekit.quant.gptq`; the report's ``rel_error`` is then each
    layer's relative output error on the inputs the sweep gave it), and
    ``GPTQ(pattern="2:4", act_order=..., percdamp=...)`` sets its options, a pattern pruning
    N:M in the same sweep (joint SparseGPT + GPTQ, on a model with no pruner attached).
    ``group_size`` (int4; None: the scheme's own): 128, 64 or 32 inputs per scale,
    ``"channel"`` or ``"auto"`` (per layer the largest of 128, 64, 32 dividing its input
    size, else per channel); a group that does not divide a layer's input size is a one-line
    ValueError naming the layer, its input size and the sizes that fit. Weights are quantized
    from their current values, so pruned zeros stay exactly zero: prune (and finalize) first.
    A layer the scheme cannot take is skipped with the reason in the report (``strict=True``:
    raises).
    Dynamic schemes need no calibration: ``calibration`` batches (fed as in
    :func:`sparsekit.nn.calibration.call_model`) then only measure each layer's output error,
    which the report lists. Static schemes (``int8_static``, ``fp8_static``) require them: each
    layer's ``input_scale`` is the largest input magnitude seen on them (over all ranks under
    torchrun) divided by the format's ``qmax``; a selected layer the batches never call is
    skipped with that reason. Raises ValueError for an unknown scheme, a layer that is already
    quantized or prepared for QAT, or one under a live pruning mask (finalize the pruner).

    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> report = quantize_(model, "int8", exclude="2")
    >>> report.quantized, type(model[0]).__name__
    (['0'], 'QuantLinear')
    """
    scheme, gptq = get_scheme(scheme), _method(method, calibration)
    chosen = select_float_layers(model, include, exclude, "quantize_")
    _check_no_masks(chosen)
    report, chosen_ok, schemes = plan_layers(model, chosen, scheme, "quantized", "quantize_",
                                             strict, group_size)
    scales: dict[str, torch.Tensor | None] = dict.fromkeys(chosen_ok)
    if scheme.static:
        scales = _static_scales(model, scheme, report, chosen_ok, calibration, calibration_fn,
                                strict)
    todo, errors = _quantized_layers(model, schemes, chosen, chosen_ok, scales, gptq,
                                     calibration, calibration_fn)
    report.set_errors(errors)
    for name, q in todo.items():
        set_module(model, name, q)
    if gptq is None:
        after_swap(model)
    return report


def _method(method: str | GPTQ, calibration: Iterable[Any] | None) -> GPTQ | None:
    """GPTQ's settings (None: round to nearest); GPTQ needs ``calibration``."""
    gptq = as_method(method)
    if gptq is not None and calibration is None:
        raise UsageError("quantize_(method='gptq') solves each layer from its calibration "
                         "inputs: pass calibration=<iterable of batches>")
    return gptq


def _quantized_layers(
    model: nn.Module, schemes: dict[str, Scheme], chosen: dict[str, nn.Module],
    chosen_ok: dict[str, nn.Module], scales: dict[str, torch.Tensor | None],
    gptq: GPTQ | None, calibration: Iterable[Any] | None, calibration_fn: CalibrationFn | None,
) -> tuple[dict[str, nn.Module], dict[str, float]]:
    """The quantized module of each layer of ``chosen_ok`` (not yet swapped in; in its scheme
    of ``schemes``) and each one's relative output error on ``calibration`` (none without
    it): by GPTQ when ``gptq`` is given, else by rounding to nearest."""
    if gptq is not None:
        return gptq_quantize(model, chosen_ok, schemes, list(calibration), gptq, calibration_fn)
    todo = {name: quantized_module(m, schemes[name], input_scale=scales[name])
            for name, m in chosen_ok.items()}
    errors = ({} if calibration is None else
              _layer_errors(model, chosen, todo, calibration, calibration_fn))
    return todo, errors


@torch.no_grad()
def input_absmax(
    model: nn.Module,
    layers: dict[str, nn.Module],
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None,
) -> dict[str, torch.Tensor]:
    """The largest input magnitude of each of ``layers`` (name -> module of ``model``) over the
    calibration batches, shape (1,) float32, the maximum over ranks in a process group; layers
    the batches never call are left out."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            a = args[0].detach().abs().amax().float().reshape(1)
            seen[name] = a if name not in seen else torch.maximum(seen[name], a)

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        run_calibration(model, calibration, calibration_fn)
    finally:
        for h in handles:
            h.remove()
    c = shards.comm()
    if c is not None:  # every rank must hold the same scales: the max over all their data
        names = list(layers)
        local = torch.stack([seen.get(n, torch.full((1,), -1.0)).cpu() for n in names])
        merged = c.all_reduce_max(local)
        seen = {n: merged[i].to(layers[n].weight.device) for i, n in enumerate(names)
                if merged[i].item() >= 0}
    return seen


@torch.no_grad()
def _layer_errors(
    model: nn.Module,
    floats: dict[str, nn.Module],
    quants: dict[str, nn.Module],
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None,
) -> dict[str, float]:
    """Relative L2 error ||q(x) - f(x)|| / ||f(x)|| of each quantized layer against its float
    layer, on the float model's own inputs to that layer (errors do not compound)."""
    sums = {name: [0.0, 0.0] for name in quants}

    def hook(name: str):
        def record(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            ref = out.float()
            sums[name][0] += (quants[name](*args).float() - ref).pow(2).sum().item()
            sums[name][1] += ref.pow(2).sum().item()

        return record

    handles = [floats[n].register_forward_hook(hook(n)) for n in quants]
    try:
        run_calibration(model, calibration, calibration_fn)
    finally:
        for h in handles:
            h.remove()
    return {n: math.sqrt(err / ref) if ref > 0 else 0.0 for n, (err, ref) in sums.items()}
