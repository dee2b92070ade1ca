"""Quantization-aware training: fake quantization with a straight-through estimator, and the
conversion to real 8-bit layers.

``prepare_qat_`` appends a :class:`WeightFakeQuant` parametrization to each selected layer's
weight and, for W8A8 schemes, a forward pre-hook that fake-quantizes the layer's input with the
same per-token / per-sample scales the quantized layer uses. A static scheme's one scale per
layer is tracked in the layer's buffer ``qat_input_amax``: a moving average of each training
batch's input absmax (weight ``AMAX_MOMENTUM``; started from the calibration batches' maximum
when given, else from the first training batch), used as it stands in eval mode, and frozen
into the quantized layer's ``input_scale`` by ``convert_``. Saturated inputs get no gradient.

The fake quantization always comes after the pruning mask in the parametrization chain, so it
sees the masked weight and the pruner keeps updating its masks in the same loop. That holds in
either order: on a layer without a mask ``prepare_qat_`` first attaches an all-ones mask
(:func:`sparsekit.prune.masks.attach_mask`), which a Pruner created later updates in place.
``convert_`` folds the masks (pruned zeros stay exactly zero) and swaps in the quantized layers;
``pruner.finalize()`` before it is the tidy order.

>>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
>>> _ = prepare_qat_(model, "fp8")
>>> model(torch.randn(3, 8)).shape
torch.Size([3, 2])
>>> convert_(model).quantized
['0', '2']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.checks import check_module
from sparsekit.errors import UsageError
from sparsekit.nn import shards
from sparsekit.nn.calibration import CalibrationFn
from sparsekit.prune.masks import WeightMask, attach_mask, find_mask, zero_pruned
from sparsekit.quant.formats import Scheme, get_scheme
from sparsekit.quant.layers import (
    after_swap,
    QAT_ATTR,
    foreign_parametrizations,
    kind,
    qat_scheme,
    plan_layers,
    select_float_layers,
    set_module,
)
from sparsekit.quant.modules import quantized_module
from sparsekit.quant.numerics import (
    absmax_scale,
    expand_groups,
    fake_quantize,
    group_scales,
    row_scales,
    sample_scales,
    weight_scales,
)
from sparsekit.quant.quantize import input_absmax
from sparsekit.quant.report import QuantLayer, QuantReport


class WeightFakeQuant(nn.Module):
    """Parametrization ``w -> dequantize(quantize(w))`` with the scheme's weight scales (per
    output channel, one per tensor, or an int4 scheme's one per group of input channels: the
    same rounding, clamping and grouping as the quantized layer) and a straight-through
    gradient. No state: scales follow the weight as it trains."""

    def __init__(self, scheme: str):
        super().__init__()
        self.scheme = scheme

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        scheme = get_scheme(self.scheme)
        fmt = scheme.weight
        if scheme.grouped:
            group = scheme.layer_group_size(weight.shape[1])
            return fake_quantize(weight, expand_groups(group_scales(weight, fmt, group), group),
                                 fmt)
        scale = weight_scales(weight, fmt, scheme.weight_granularity)
        scale = scale.reshape((-1,) + (1,) * (weight.dim() - 1))
        return fake_quantize(weight, scale, fmt)

    def extra_repr(self) -> str:
        return f"scheme={self.scheme}"


AMAX_BUFFER = "qat_input_amax"
AMAX_MOMENTUM = 0.01  # torch.ao's MovingAverageMinMaxObserver default


class ActivationFakeQuant:
    """Forward pre-hook fake-quantizing a layer's input: per token (row of the input flattened
    to (tokens, features)) for Linear, per sample for ConvNd, or with the layer's one static
    scale -- as the quantized layers do."""

    def __init__(self, scheme: str, conv_dims: int | None):
        self.scheme = scheme
        self.conv_dims = conv_dims

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        scheme = get_scheme(self.scheme)
        fmt = scheme.activation
        if scheme.static:
            return (fake_quantize(x, static_scale(module, x), fmt, clips=True), *rest)
        if self.conv_dims is None:
            scale = row_scales(x.reshape(-1, x.shape[-1]), fmt).reshape(*x.shape[:-1], 1)
        elif x.dim() == self.conv_dims + 2:
            scale = sample_scales(x, fmt)
        else:  # unbatched (channels, *spatial): one sample
            scale = sample_scales(x.unsqueeze(0), fmt).squeeze(0)
        return (fake_quantize(x, scale, fmt), *rest)


@torch.no_grad()
def static_scale(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The static activation scale of a layer under QAT for input ``x``: in training mode its
    ``qat_input_amax`` moves towards ``max |x|`` first (or starts there when unset), the
    maximum over all ranks in a process group, so that every rank keeps the same range. An
    unset range in eval mode takes the batch's own absmax (nothing is stored)."""
    amax = getattr(module, AMAX_BUFFER)
    batch = x.detach().abs().amax().float().reshape(1)
    if module.training:
        c = shards.comm()
        if c is not None:  # every rank moves the same range: towards the max over all ranks
            batch = c.all_reduce_max(batch)
        amax.copy_(torch.where(amax > 0, amax + AMAX_MOMENTUM * (batch - amax), batch))
    fmt = get_scheme(getattr(module, QAT_ATTR)).activation
    return absmax_scale(torch.where(amax > 0, amax, batch), fmt)


def prepare_qat_(
    model: nn.Module,
    scheme: str | Scheme,
    *,
    include: str | Sequence[str] = ("*",),
    exclude: str | Sequence[str] = (),
    strict: bool = False,
    calibration: Iterable[Any] | None = None,
    calibration_fn: CalibrationFn | None = None,
    group_size: int | str | None = None,
) -> QuantReport:
    """Insert fake quantization into the selected Linear/ConvNd layers, in place.

    Parameters stay float and keep training (gradients pass straight through the rounding);
    the forward pass computes what the quantized model will, on the masked weight of a layer
    under pruning (the Pruner may be created before or after). A layer the scheme cannot take
    is skipped with the reason in the report; ``strict=True`` raises instead. ValueError for an
    unknown scheme or a layer already quantized or prepared. A static scheme's ranges start
    from the ``calibration`` batches when given (see the module docstring). ``group_size``:
    an int4 scheme's group, per model or ``"auto"`` per layer, as in
    :func:`~sparsekit.quant.quantize.quantize_`."""
    scheme = get_scheme(scheme)
    chosen = select_float_layers(model, include, exclude, "prepare_qat_")
    report, todo, schemes = plan_layers(model, chosen, scheme, "qat", "prepare_qat_", strict,
                                        group_size)
    start = {}
    if scheme.static and calibration is not None:
        start = input_absmax(model, todo, calibration, calibration_fn)
    for name, m in todo.items():
        if find_mask(m) is None and not parametrize.is_parametrized(m, "weight"):
            attach_mask(m)  # all ones: holds the mask slot ahead of the fake quantization
        parametrize.register_parametrization(m, "weight", WeightFakeQuant(schemes[name].name))
        if scheme.static:
            m.register_buffer(AMAX_BUFFER, start.get(name, torch.zeros(1, device=m.weight.device)))
        if scheme.activation is not None:
            conv_dims = None if isinstance(m, nn.Linear) else m.weight.dim() - 2
            m.register_forward_pre_hook(ActivationFakeQuant(scheme.name, conv_dims))
        setattr(m, QAT_ATTR, schemes[name].name)
    return report


def convert_(model: nn.Module) -> QuantReport:
    """Replace every layer prepared by :func:`prepare_qat_` with its quantized layer, in place,
    quantizing the trained weight with any pruning mask still attached folded in (pruned zeros
    stay exactly zero; call ``pruner.finalize()`` first when a Pruner is running). The converted
    model computes what the fake-quantized one did, up to float32 rounding. ValueError when no
    layer is prepared, or a weight carries a parametrization other than a mask."""
    check_module(model, where="convert_: ")
    prepared = {n: m for n, m in model.named_modules() if qat_scheme(m) is not None}
    if not prepared:
        raise UsageError(
            "convert_: no layer is prepared for QAT; call prepare_qat_(model, scheme) first "
            "(or quantize_ for post-training quantization)"
        )
    for name, m in prepared.items():
        foreign = foreign_parametrizations(m, (WeightMask, WeightFakeQuant))
        if foreign:
            raise UsageError(
                f"convert_: layer {name!r} has parametrizations {foreign} on its weight that "
                "convert_ cannot fold; remove them first"
            )
    for name, m in prepared.items():
        if get_scheme(qat_scheme(m)).static and not bool(getattr(m, AMAX_BUFFER).item() > 0):
            raise UsageError(
                f"convert_: layer {name!r} ({qat_scheme(m)}) has no activation range yet: it "
                "saw no training batch; run training steps or pass calibration= to prepare_qat_"
            )
    schemes = sorted({qat_scheme(m) for m in prepared.values()})
    report = QuantReport(",".join(schemes))
    for name, m in prepared.items():
        scheme = get_scheme(qat_scheme(m))
        input_scale = None
        if scheme.static:
            input_scale = absmax_scale(m._buffers.pop(AMAX_BUFFER), scheme.activation)
        if parametrize.is_parametrized(m, "weight"):
            # Zero the pruned entries of the float weight and drop the chain: the quantized
            # layer quantizes that weight bit for bit as the fake quantization did.
            zero_pruned(m)
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        for key, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, ActivationFakeQuant):
                del m._forward_pre_hooks[key]
        delattr(m, QAT_ATTR)
        set_module(model, name, quantized_module(m, scheme, input_scale=input_scale))
        report.layers.append(QuantLayer(name, kind(m), "quantized"))
    after_swap(model)
    return report
