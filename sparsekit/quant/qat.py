"""Quantization-aware training: fake quantization with a straight-through estimator, and the
conversion to real 8-bit layers.

``prepare_qat_`` appends a :class:`WeightFakeQuant` parametrization to each selected layer's
weight and, for W8A8 schemes, a forward pre-hook that fake-quantizes the layer's input with the
same per-token / per-sample scales the quantized layer uses. Under a pruner the mask comes first
in the parametrization chain, so the fake quantization sees the masked weight and the pruner
keeps updating its masks in the same loop. Order: create the Pruner, then ``prepare_qat_``;
train; ``pruner.finalize()``; ``convert_``.

>>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
>>> _ = prepare_qat_(model, "fp8")
>>> model(torch.randn(3, 8)).shape
torch.Size([3, 2])
>>> convert_(model).quantized
['0', '2']
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.quant.formats import Scheme, get_scheme
from sparsekit.quant.layers import (
    QAT_ATTR,
    all_layers,
    foreign_parametrizations,
    kind,
    qat_scheme,
    select_float_layers,
    set_module,
)
from sparsekit.quant.modules import quantized_module, unsupported_reason
from sparsekit.quant.numerics import channel_scales, fake_quantize, row_scales, sample_scales
from sparsekit.quant.report import QuantLayer, QuantReport


class WeightFakeQuant(nn.Module):
    """Parametrization ``w -> dequantize(quantize(w))`` with per-output-channel scales and a
    straight-through gradient. No state: scales follow the weight as it trains."""

    def __init__(self, scheme: str):
        super().__init__()
        self.scheme = scheme

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        fmt = get_scheme(self.scheme).weight
        scale = channel_scales(weight, fmt).reshape((-1,) + (1,) * (weight.dim() - 1))
        return fake_quantize(weight, scale, fmt)

    def extra_repr(self) -> str:
        return f"scheme={self.scheme}"


class ActivationFakeQuant:
    """Forward pre-hook fake-quantizing a layer's input: per token (row of the input flattened
    to (tokens, features)) for Linear, per sample for ConvNd -- as the quantized layers do."""

    def __init__(self, scheme: str, conv_dims: int | None):
        self.scheme = scheme
        self.conv_dims = conv_dims

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        fmt = get_scheme(self.scheme).activation
        if self.conv_dims is None:
            scale = row_scales(x.reshape(-1, x.shape[-1]), fmt).reshape(*x.shape[:-1], 1)
        elif x.dim() == self.conv_dims + 2:
            scale = sample_scales(x, fmt)
        else:  # unbatched (channels, *spatial): one sample
            scale = sample_scales(x.unsqueeze(0), fmt).squeeze(0)
        return (fake_quantize(x, scale, fmt), *rest)


def prepare_qat_(
    model: nn.Module,
    scheme: str | Scheme,
    include: str | Sequence[str] = ("*",),
    exclude: str | Sequence[str] = (),
    strict: bool = False,
) -> QuantReport:
    """Insert fake quantization into the selected Linear/ConvNd layers, in place.

    Parameters stay float and keep training (gradients pass straight through the rounding);
    the forward pass computes what the quantized model will. Layers under a pruning mask keep
    it (create the Pruner first). A layer the scheme cannot take is skipped with the reason in
    the report; ``strict=True`` raises instead. ValueError for an unknown scheme or a layer
    already quantized or prepared."""
    scheme = get_scheme(scheme)
    chosen = select_float_layers(model, include, exclude, "prepare_qat_")
    report = QuantReport(scheme.name)
    todo: list[nn.Module] = []
    for name, m in all_layers(model).items():
        layer = QuantLayer(name, kind(m), "qat")
        if name not in chosen:
            layer.status, layer.reason = "excluded", "not selected by include/exclude"
        elif (reason := unsupported_reason(m, scheme)) is not None:
            layer.status, layer.reason = "skipped", reason
        else:
            todo.append(m)
        report.layers.append(layer)
    if strict and report.skipped:
        raise ValueError(
            f"prepare_qat_({scheme.name!r}, strict=True) cannot take: {report.skipped}"
        )
    for m in todo:
        parametrize.register_parametrization(m, "weight", WeightFakeQuant(scheme.name))
        if scheme.activation is not None:
            conv_dims = None if isinstance(m, nn.Linear) else m.weight.dim() - 2
            m.register_forward_pre_hook(ActivationFakeQuant(scheme.name, conv_dims))
        setattr(m, QAT_ATTR, scheme.name)
    return report


def convert_(model: nn.Module) -> QuantReport:
    """Replace every layer prepared by :func:`prepare_qat_` with its quantized layer, in place,
    quantizing the trained weight (masked zeros stay exactly zero). The converted model computes
    what the fake-quantized one did, up to float32 rounding. ValueError when no layer is
    prepared, or a layer still carries a pruning mask (call ``pruner.finalize()`` first)."""
    prepared = {n: m for n, m in model.named_modules() if qat_scheme(m) is not None}
    if not prepared:
        raise ValueError(
            "convert_: no layer is prepared for QAT; call prepare_qat_(model, scheme) first "
            "(or quantize_ for post-training quantization)"
        )
    for name, m in prepared.items():
        foreign = foreign_parametrizations(m, (WeightFakeQuant,))
        if foreign:
            raise ValueError(
                f"convert_: layer {name!r} still has parametrizations {foreign} on its weight: "
                "call pruner.finalize() before convert_"
            )
    schemes = sorted({qat_scheme(m) for m in prepared.values()})
    report = QuantReport(",".join(schemes))
    for name, m in prepared.items():
        scheme = qat_scheme(m)
        if parametrize.is_parametrized(m, "weight"):
            # The quantized layer re-quantizes the float weight itself, bit for bit as the
            # fake quantization did.
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
        for key, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, ActivationFakeQuant):
                del m._forward_pre_hooks[key]
        delattr(m, QAT_ATTR)
        set_module(model, name, quantized_module(m, scheme))
        report.layers.append(QuantLayer(name, kind(m), "quantized"))
    return report
