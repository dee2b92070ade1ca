"""Quantized Linear and Conv modules: 8-bit weights with per-output-channel float32 scales.

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

>>> layer = QuantLinear.from_float(nn.Linear(16, 4), "int8")
>>> layer.weight.dtype, layer.weight_scale.shape, tuple(layer(torch.randn(2, 16)).shape)
(torch.int8, torch.Size([4]), (2, 4))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit import _compat
from sparsekit.errors import UsageError
from sparsekit.prune.calibration import conv_pads, im2col
from sparsekit.quant.formats import Format, Scheme, get_scheme
from sparsekit.quant.kernels import scaled_matmul
from sparsekit.quant.numerics import (
    dequantize,
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


_compat.check_module_apply()  # _QuantWeight overrides nn.Module._apply(fn, recurse)


class _QuantWeight(nn.Module):
    """Shared storage of an 8-bit weight, its scales and the float bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme):
        super().__init__()
        self.scheme = scheme.name
        fmt = scheme.weight
        kw = {"device": weight.device}
        self.register_buffer("weight", torch.zeros(weight.shape, dtype=fmt.dtype, **kw))
        self.register_buffer("weight_scale", torch.ones(weight.shape[0], **kw))
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

    @torch.no_grad()
    def _fill(self, weight: torch.Tensor) -> None:
        scheme = get_scheme(self.scheme)
        fmt = scheme.weight
        scale = weight_scales(weight, fmt, scheme.weight_granularity)
        self.weight.copy_(quantize(weight, scale.reshape((-1,) + (1,) * (weight.dim() - 1)), fmt))
        self.weight_scale.copy_(scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``weight * weight_scale`` (per output channel) in ``dtype``."""
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
