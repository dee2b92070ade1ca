"""Finding and replacing the layers a quantization pass acts on."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn
from torch.nn.utils import parametrize

from sparsekit.errors import UsageError
from sparsekit.quant.formats import Scheme, check_scheme_group_size, layer_scheme
from sparsekit.quant.modules import (
    QuantConv,
    QuantLinear,
    _QuantWeight,
    odd_group_reason,
    unsupported_reason,
)
from sparsekit.quant.report import QuantLayer, QuantReport
from sparsekit.nn.select import check_finite_weight
from sparsekit.prune.report import register_reported_types
from sparsekit.nn.select import PRUNABLE_TYPES, select_modules

LAYER_TYPES = (*PRUNABLE_TYPES, QuantLinear, QuantConv)
register_reported_types(QuantLinear, QuantConv)
# Set on a layer by prepare_qat_ (the scheme name) and cleared by convert_. An attribute rather
# than the parametrization itself: folding a pruning mask folds the fake quantization too.
QAT_ATTR = "sparsekit_qat_scheme"


def qat_scheme(module: nn.Module) -> str | None:
    """The scheme ``module`` was prepared for QAT with, or None."""
    return getattr(module, QAT_ATTR, None)


def all_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear/ConvNd layer and quantized layer, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LAYER_TYPES)}


def select_float_layers(
    model: nn.Module, include: str | Sequence[str], exclude: str | Sequence[str], verb: str
) -> dict[str, nn.Module]:
    """The selected layers; ValueError when one is already quantized or prepared for QAT
    (quantizing twice), naming the layer and what to do instead."""
    chosen = select_modules(model, include, exclude, types=LAYER_TYPES)
    for name, m in chosen.items():
        if isinstance(m, _QuantWeight):
            raise UsageError(
                f"{verb}: layer {name!r} is already quantized ({m.scheme}); quantize a float "
                "model once (exclude the layer to quantize the others)"
            )
        if qat_scheme(m) is not None:
            raise UsageError(
                f"{verb}: layer {name!r} is already prepared for QAT ({qat_scheme(m)}); call "
                "convert_(model) to quantize it"
            )
    return chosen


def foreign_parametrizations(module: nn.Module, own: tuple[type, ...] = ()) -> list[str]:
    """Names of the parametrizations on ``module.weight`` that are not instances of ``own``
    (all of them by default)."""
    if not parametrize.is_parametrized(module, "weight"):
        return []
    return [type(p).__name__ for p in module.parametrizations.weight if not isinstance(p, own)]


def kind(module: nn.Module) -> str:
    """The float layer type a (possibly quantized) layer stands for: Linear, Conv1d, ..."""
    if isinstance(module, QuantLinear):
        return "Linear"
    if isinstance(module, QuantConv):
        return f"Conv{module.dims}d"
    return type(module).__name__.removeprefix("Parametrized")


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at qualified ``name``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def _read_by_parent(model: nn.Module) -> dict[str, str]:
    """Linear layers whose parent reads their float weight itself instead of calling them (a
    quantized layer there would hand it 8-bit values): name -> why."""
    found = {}
    for n, m in model.named_modules():
        prefix = f"{n}." if n else ""
        if isinstance(m, nn.MultiheadAttention):
            found[f"{prefix}out_proj"] = (
                "out_proj of an nn.MultiheadAttention, which reads its float weight directly "
                "(sk.accelerate splits the attention into Linear layers and quantizes those)")
        elif isinstance(m, nn.TransformerEncoderLayer):
            for child in ("linear1", "linear2"):
                found[f"{prefix}{child}"] = (
                    "Linear of an nn.TransformerEncoderLayer, whose inference fast path reads "
                    "its float weight directly")
    return found


def plan_layers(
    model: nn.Module,
    chosen: dict[str, nn.Module],
    scheme: Scheme,
    status: str,
    verb: str,
    strict: bool,
    group_size: object = None,
) -> tuple[QuantReport, dict[str, nn.Module], dict[str, Scheme]]:
    """The report of what ``verb`` (quantize_, prepare_qat_) does to every layer, the layers
    it takes (chosen ones whose dtype and shape ``scheme`` supports) and the scheme of each
    (``scheme``, or with ``group_size`` the int4 scheme of the layer's group:
    :func:`~sparsekit.quant.formats.layer_scheme`). ``strict``: ValueError naming the layers
    it cannot take instead of skipping them. A chosen Linear whose input dimension is not a
    multiple of an int4 scheme's group size is always a ValueError naming it and the group
    sizes that fit (a silently unquantized layer would miss the model's size target). A taken
    layer with a NaN or inf weight raises NumericsError naming it (its scales would be NaN)."""
    try:
        group_size = check_scheme_group_size(scheme, group_size)
    except UsageError as e:
        raise UsageError(f"{verb}({scheme.name!r}): {e}") from None
    schemes: dict[str, Scheme] = {}
    todo: dict[str, nn.Module] = {}
    read_by_parent = _read_by_parent(model)
    layers = []
    for name, m in all_layers(model).items():
        layer = QuantLayer(name, kind(m), status)
        if name not in chosen:
            layer.status, layer.reason = "excluded", "not selected by include/exclude"
        elif name in read_by_parent:
            layer.status, layer.reason = "skipped", read_by_parent[name]
        elif (reason := unsupported_reason(m, scheme)) is not None:
            layer.status, layer.reason = "skipped", reason
        else:
            own = scheme
            if group_size is not None:  # an int4 scheme: Linear layers only
                try:
                    own = layer_scheme(scheme, group_size, name, m.in_features)
                except UsageError as e:
                    raise UsageError(f"{verb}({scheme.name!r}): {e}") from None
            if (odd := odd_group_reason(m, own)) is not None:
                raise UsageError(f"{verb}({scheme.name!r}): layer {name!r}: {odd}")
            check_finite_weight(name, m.weight, "quantizing")
            todo[name], schemes[name] = m, own
            if group_size == "auto":
                layer.reason = f"group_size=auto: {own.name}"
        layers.append(layer)
    used = list(dict.fromkeys(s.name for s in schemes.values())) or [scheme.name]
    report = QuantReport(",".join(used), layers)
    if strict and report.skipped:
        raise UsageError(f"{verb}({scheme.name!r}, strict=True) cannot take: {report.skipped}")
    return report, todo, schemes


def check_layer_groups(model: nn.Module, scheme: Scheme, group_size: object,
                       include: str | Sequence[str], exclude: str | Sequence[str],
                       option: str = "quant.group_size") -> None:
    """Before any work: every Linear ``include``/``exclude`` select takes ``scheme`` (an int4
    one) at ``group_size``; else the one-line UsageError :func:`plan_layers` would give when
    quantizing, naming ``option``, the layer, its input size and the group sizes that fit."""
    if not scheme.grouped:
        return
    chosen = select_modules(model, include, exclude, types=(nn.Linear,))
    for name, m in chosen.items():
        try:
            own = layer_scheme(scheme, group_size, name, m.in_features)
            if (odd := odd_group_reason(m, own)) is not None:
                raise UsageError(f"layer {name!r}: {odd}")
        except UsageError as e:
            given = scheme.name if group_size is None else f"{scheme.name}, {option}={group_size}"
            raise UsageError(f"quantization ({given}): {e}") from None


def after_swap(model: nn.Module) -> None:
    """What a model needs once quantized layers replaced some of its own: a transformers
    model's ``save_pretrained`` writes their dequantized weights instead of dropping their
    scales (:func:`sparsekit.models.hf.guard_save_pretrained`)."""
    if "transformers" in sys.modules:  # a transformers model exists only once it is imported
        from sparsekit.models.hf import guard_save_pretrained

        guard_save_pretrained(model)
