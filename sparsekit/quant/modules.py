"""Quantized Linear and Conv modules: 8-bit weights with per-output-channel float32 scales,
and 4-bit weight-only Linear layers with per-group scales.

Both keep ``weight`` (int8 or float8 e4m3fn, the float layer's shape), ``weight_scale``
(float32, shape (out,); all equal for a scheme with one weight scale per tensor,
``fp8_static_tensor``) and ``bias`` (the float layer's, unchanged) in their state_dict.
``int8_weight_only`` dequantizes the weight into the input's dtype and runs the float op.
W8A8 schemes quantize activations on the fly with symmetric absmax scales:

- Linear: one scale per token, i.e. per row of the input flattened to (tokens, features).
- Conv: one scale per sample (over its channels and positions), applied before im2col.
- Static schemes (``int8_static``, ``fp8_static``, ``fp8_static_tensor``): one fixed scale per
  layer, the float32 buffer ``input_scale`` (shape (1,)), calibrated by ``quantize_`` or trained
  by QAT; inputs beyond ``qmax * input_scale`` saturate.

Why per token / per sample rather than per tensor: a sample's output then never depends on what
else is in its batch (evaluation gives the same answer at any batch size, and QAT learns the
numerics inference will use), and one outlier token or sample cannot crush the resolution of the
others. The scales enter as a row vector of the epilogue ``acc * x_scale * w_scale``, so the
dense kernels run unchanged. A conv uses one scale per sample, not per im2col row, so that each
input value is quantized once, before it is copied into the overlapping patches.

int4 schemes (``int4_weight``, ``int4_weight_channel``; Linear only, weight-only: W4A16) keep
``weight`` as int8 (out, in) holding values in [-8, 7] (unpacked, one per byte; checkpoints
store it that way, 2:4-compacted when it is 2:4), ``weight_scale`` float32 (out, in //
group_size) and the int attribute ``group_size`` (``in`` for the per-channel scheme, whose
scales are (out, 1)). The weight is ``weight.float() *
weight_scale.repeat_interleave(group_size, dim=1)``, cast to the input's dtype for the float
matmul. An input dimension that is not a multiple of the group size is refused.

>>> layer = QuantLinear.from_float(nn.Linear(16, 4), "int8")
>>> layer.weight.dtype, layer.weight_scale.shape, tuple(layer(torch.randn(2, 16)).shape)
(torch.int8, torch.Size([4]), (2, 4))
>>> layer4 = QuantLinear.from_float(nn.Linear(256, 4), "int4_weight")
>>> layer4.weight_scale.shape, layer4.group_size, int(layer4.weight.min()) >= -8
(torch.Size([4, 2]), 128, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit import _compat
from sparsekit.errors import UsageError
from sparsekit.nn.calibration import conv_pads, im2col
from sparsekit.quant.formats import Format, Scheme, fitting_group_sizes, get_scheme
from sparsekit.quant.kernels import scaled_matmul
from sparsekit.quant.numerics import (
    dequantize,
    expand_groups,
    group_scales,
    quantize,
    row_scales,
    sample_scales,
    weight_scales,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CONV_TYPES: dict[type[nn.Module], int] = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def unsupported_reason(module: nn.Module, scheme: str | Scheme) -> str | None:
    """Why ``scheme`` cannot quantize ``module`` (a Linear or ConvNd), or None when it can."""
    scheme = get_scheme(scheme)
    if not isinstance(module, (nn.Linear, *CONV_TYPES)):
        return f"{type(module).__name__} has no quantized counterpart (Linear, Conv1d/2d/3d)"
    if scheme.grouped and not isinstance(module, nn.Linear):
        return f"{scheme.name} (int4 weight-only) takes Linear layers only"
    dtype = module.weight.dtype
    if dtype not in FLOAT_DTYPES:
        return f"weight dtype {dtype} is not one of float32, float16, bfloat16"
    if module.weight.device.type == "meta":
        return "weight is on the meta device (no values to quantize)"
    if module.weight.numel() == 0:
        return f"zero-size weight {tuple(module.weight.shape)}: nothing to quantize"
    if scheme.activation is not None and isinstance(module, nn.Conv3d):
        return f"{scheme.name} (W8A8) has no Conv3d path; int8_weight_only can take it"
    if scheme.activation is not None and getattr(module, "groups", 1) != 1:
        return (
            f"{scheme.name} (W8A8) has no grouped-convolution path (groups={module.groups}); "
            "int8_weight_only can take it"
        )
    return None


def odd_group_reason(module: nn.Module, scheme: str | Scheme) -> str | None:
    """Why a grouped (int4) ``scheme`` refuses the Linear ``module``: its input dimension is
    not a multiple of the group size; None when it fits (or the scheme has no groups)."""
    scheme = get_scheme(scheme)
    if not (scheme.grouped and isinstance(module, nn.Linear)):
        return None
    k, g = module.in_features, scheme.layer_group_size(module.in_features)
    if k % g == 0:
        return None
    return (f"in_features={k} is not a multiple of {scheme.name}'s group size {g}; group sizes "
            f"that fit it: {', '.join(map(str, fitting_group_sizes(k)))} (group_size=...; "
            "auto: the largest that fits, per layer), or exclude the layer")


_compat.check_module_apply()  # _QuantWeight overrides nn.Module._apply(fn, recurse)


class _QuantWeight(nn.Module):
    """Shared storage of a quantized weight, its scales and the float bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme):
        super().__init__()
        self.scheme = scheme.name
        fmt = scheme.weight
        kw = {"device": weight.device}
        self.register_buffer("weight", torch.zeros(weight.shape, dtype=fmt.dtype, **kw))
        if scheme.grouped:
            k = weight.shape[1]
            self.group_size = scheme.layer_group_size(k)
            if weight.dim() != 2 or k % self.group_size:
                raise UsageError(f"{scheme.name}: a weight of shape {tuple(weight.shape)} has no "
                                 f"whole groups of {self.group_size} input channels")
            scale_shape = (weight.shape[0], k // self.group_size)
        else:
            scale_shape = (weight.shape[0],)
        self.register_buffer("weight_scale", torch.ones(scale_shape, **kw))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        if scheme.static:
            self.register_buffer("input_scale", torch.ones(1, **kw))

    @classmethod
    def from_float(cls, layer: nn.Module, scheme: str | Scheme,
                   input_scale: torch.Tensor | None = None) -> Any:
        """Quantize the float ``layer``'s current weight (per output channel, or per tensor as
        the scheme's ``weight_granularity`` says) into a new module of this class; a static
        scheme takes its activation scale ``input_scale`` (one value)."""
        q = cls(layer, scheme)
        q._fill(layer.weight)
        if get_scheme(scheme).static:
            if input_scale is None:
                raise UsageError(f"scheme {q.scheme!r} has a static activation scale: pass "
                                 "input_scale (quantize_ calibrates it)")
            q.input_scale.copy_(input_scale.detach().float().reshape(1))
        return q

    @classmethod
    def from_quantized(cls, layer: nn.Module, scheme: str | Scheme, weight: torch.Tensor,
                       weight_scale: torch.Tensor) -> Any:
        """A new module of this class holding given quantized values (from a solver such as
        GPTQ): ``weight`` in the scheme's storage dtype and range, ``weight_scale`` of the
        layer's scale shape; the bias is ``layer``'s. ValueError when they do not fit."""
        q = cls(layer, scheme)
        fmt = get_scheme(scheme).weight
        if (weight.shape != q.weight.shape or weight.dtype != q.weight.dtype
                or weight_scale.shape != q.weight_scale.shape):
            raise UsageError(
                f"{q.scheme}: expected weight {tuple(q.weight.shape)} {q.weight.dtype} and "
                f"weight_scale {tuple(q.weight_scale.shape)}, got {tuple(weight.shape)} "
                f"{weight.dtype} and {tuple(weight_scale.shape)}")
        if fmt.integer and weight.numel() and not (
                fmt.qmin <= int(weight.min()) and int(weight.max()) <= fmt.qmax):
            raise UsageError(f"{q.scheme}: weight values outside [{fmt.qmin:g}, {fmt.qmax:g}]")
        with torch.no_grad():
            q.weight.copy_(weight)
            q.weight_scale.copy_(weight_scale)
        return q

    @torch.no_grad()
    def _fill(self, weight: torch.Tensor) -> None:
        scheme = get_scheme(self.scheme)
        fmt = scheme.weight
        if scheme.grouped:
            scale = group_scales(weight, fmt, self.group_size)
            self.weight.copy_(quantize(weight, expand_groups(scale, self.group_size), fmt))
            self.weight_scale.copy_(scale)
            return
        scale = weight_scales(weight, fmt, scheme.weight_granularity)
        self.weight.copy_(quantize(weight, scale.reshape((-1,) + (1,) * (weight.dim() - 1)), fmt))
        self.weight_scale.copy_(scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``weight * weight_scale`` (per output channel, or per group of ``group_size``
        inputs) in ``dtype``."""
        if self.weight_scale.dim() == 2:
            return dequantize(self.weight, expand_groups(self.weight_scale, self.group_size),
                              dtype)
        scale = self.weight_scale.reshape((-1,) + (1,) * (self.weight.dim() - 1))
        return dequantize(self.weight, scale, dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # Module.to(dtype)/.half() convert every floating tensor, and float8 counts as floating:
        # the 8-bit weight and float32 scales must only follow device moves.
        kept = {name: self._buffers[name] for name in ("weight", "weight_scale", "input_scale")
                if name in self._buffers}
        super()._apply(fn, recurse)
        device = fn(torch.zeros(0, device=kept["weight"].device)).device
        for name, t in kept.items():
            self._buffers[name] = t.to(device)
        return self

    def _activation_format(self) -> Format | None:
        return get_scheme(self.scheme).activation

    def _input_scale(self, x: torch.Tensor, dynamic: Callable[[torch.Tensor, Format], torch.Tensor],
                     fmt: Format) -> torch.Tensor:
        """The activation scale of ``x``: the static ``input_scale`` shaped to broadcast, or
        ``dynamic(x, fmt)``."""
        if "input_scale" in self._buffers:
            return self.input_scale.reshape((1,) * x.dim())
        return dynamic(x, fmt)


class QuantLinear(_QuantWeight):
    """Quantized ``nn.Linear``: input (..., in_features) -> output (..., out_features) in the
    input's dtype."""

    def __init__(self, linear: nn.Linear, scheme: str | Scheme):
        super().__init__(linear.weight, linear.bias, get_scheme(scheme))
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self._activation_format()
        if fmt is None:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        rows = x.reshape(-1, self.in_features)
        x_scale = self._input_scale(rows, row_scales, fmt)
        xq = quantize(rows, x_scale, fmt)
        y = scaled_matmul(xq, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}"
        )


class QuantConv(_QuantWeight):
    """Quantized ``nn.Conv1d``/``Conv2d``/``Conv3d`` (W8A8 for 1-D and 2-D with groups=1):
    input (batch, in_channels, *spatial) or unbatched (in_channels, *spatial)."""

    def __init__(self, conv: nn.Module, scheme: str | Scheme):
        super().__init__(conv.weight, conv.bias, get_scheme(scheme))
        self.dims = CONV_TYPES[type(conv)]
        self.in_channels = conv.in_channels
        self.out_channels = conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride = tuple(conv.stride)
        self.dilation = tuple(conv.dilation)
        self.groups = conv.groups
        self.padding = conv.padding if isinstance(conv.padding, str) else tuple(conv.padding)
        self.padding_mode = conv.padding_mode
        self.pads = tuple(conv_pads(conv))

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        if not any(self.pads):
            return x
        mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
        return F.pad(x, self.pads, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batched = x.dim() == self.dims + 2
        x = self._pad(x if batched else x.unsqueeze(0))
        fmt = self._activation_format()
        if fmt is None:
            conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
            w = self.dequantized_weight(x.dtype)
            y = conv(x, w, self.bias, self.stride, 0, self.dilation, self.groups)
        else:
            y = self._w8a8(x, fmt)
        return y if batched else y.squeeze(0)

    def _w8a8(self, x: torch.Tensor, fmt: Format) -> torch.Tensor:
        """im2col + one 8-bit matmul; ``x`` is the padded batched input."""
        x_scale = self._input_scale(x, sample_scales, fmt)
        q = quantize(x, x_scale, fmt).float()  # exact: every int8/e4m3 value is a float32
        cols = im2col(q, self.kernel_size, self.stride, self.dilation)[0]  # (B * L, C*prod(k))
        batch = x.shape[0]
        positions = cols.shape[0] // batch
        cols = cols.to(fmt.dtype)
        rows_scale = x_scale.reshape(-1, 1).expand(batch, positions).reshape(-1, 1)
        w = self.weight.reshape(self.out_channels, -1)
        y = scaled_matmul(cols, rows_scale, w, self.weight_scale, self.bias, x.dtype)
        out_sizes = [
            (size - d * (k - 1) - 1) // s + 1
            for size, k, s, d in zip(
                x.shape[2:], self.kernel_size, self.stride, self.dilation, strict=True
            )
        ]
        return y.reshape(batch, positions, -1).transpose(1, 2).reshape(batch, -1, *out_sizes)

    def extra_repr(self) -> str:
        return (
            f"Conv{self.dims}d({self.in_channels}, {self.out_channels}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, groups={self.groups}), scheme={self.scheme}"
        )


def quantized_module(module: nn.Module, scheme: str | Scheme, fill: bool = True,
                     input_scale: torch.Tensor | None = None) -> nn.Module:
    """The quantized counterpart of a Linear or ConvNd: weights quantized from ``module`` (and
    a static scheme's ``input_scale``) when ``fill``, else zero-initialized storage of the right
    shapes and dtypes (to load into)."""
    cls = QuantLinear if isinstance(module, nn.Linear) else QuantConv
    return cls.from_float(module, scheme, input_scale) if fill else cls(module, scheme)
