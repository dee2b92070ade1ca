"""Symmetric absmax quantization: scales, quantize/dequantize, fake quantization with a
straight-through estimator.

Every scale is ``max(|x|) / qmax`` over its group, in float32, so the largest magnitude of each
group lands exactly on the format's largest value and nothing is clipped. A zero stays exactly
zero (``0 / s = 0`` rounds and casts to 0), which keeps pruning masks intact.

>>> w = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.25, -0.125]])
>>> channel_scales(w, INT8) * 127
tensor([1., 2.])
>>> quantize(w, channel_scales(w, INT8)[:, None], INT8)
tensor([[  64, -127,    0],
        [ 127,   16,   -8]], dtype=torch.int8)
>>> weight_scales(w, INT8, "tensor") * 127
tensor([2., 2.])

int4 weights have one scale per group of consecutive input channels (2-D scales):

>>> w4 = torch.tensor([[0.7, -0.35, 0.07, 1.4]])
>>> s4 = group_scales(w4, INT4, 2)
>>> s4 * 7
tensor([[0.7000, 1.4000]])
>>> quantize(w4, expand_groups(s4, 2), INT4)
tensor([[ 7, -4,  0,  7]], dtype=torch.int8)
"""

from __future__ import annotations

import torch

from sparsekit.errors import UsageError
# INT4 and INT8 are imported for the doctests
from sparsekit.quant.formats import INT4, INT8, WEIGHT_GRANULARITIES, Format  # noqa: F401

# Smallest absmax a scale is built from: an all-zero group (a fully pruned channel, a row of
# ReLU zeros) gets a tiny positive scale instead of 0/0, and its values quantize to 0.
MIN_ABSMAX = 1e-12


def absmax_scale(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``max(amax, MIN_ABSMAX) / fmt.qmax`` in float32 (same shape as ``amax``)."""
    return amax.detach().float().clamp_min(MIN_ABSMAX) / fmt.qmax


def channel_scales(weight: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Per-output-channel scales of a weight of shape (out, in, *kernel): shape (out,), float32,
    ``scale[c] = max |weight[c]| / qmax``."""
    return absmax_scale(weight.detach().abs().flatten(1).amax(dim=1), fmt)


def weight_scales(weight: torch.Tensor, fmt: Format,
                  granularity: str = "channel") -> torch.Tensor:
    """A weight's scales at a scheme's ``weight_granularity``, shape (out,), float32:
    ``"channel"`` gives :func:`channel_scales`; ``"tensor"`` one scale ``max |weight| / qmax``
    over the whole weight, repeated for every output channel (so layers store (out,) scales
    whatever the granularity)."""
    if granularity == "channel":
        return channel_scales(weight, fmt)
    if granularity == "tensor":
        return absmax_scale(weight.detach().abs().amax(), fmt).expand(weight.shape[0]).clone()
    raise UsageError(f"unknown weight granularity {granularity!r}; allowed: "
                     f"{', '.join(map(repr, WEIGHT_GRANULARITIES))}")


def group_scales(weight: torch.Tensor, fmt: Format, group_size: int) -> torch.Tensor:
    """Scales of a 2-D weight (out, in) with one scale per ``group_size`` consecutive input
    channels: shape (out, in // group_size), float32, ``max |group| / qmax``. ValueError when
    ``in`` is not a multiple of ``group_size``."""
    rows, cols = weight.shape
    if group_size <= 0 or cols % group_size:
        raise UsageError(f"input dimension {cols} is not a multiple of the group size "
                         f"{group_size}")
    amax = weight.detach().abs().reshape(rows, cols // group_size, group_size).amax(dim=2)
    return absmax_scale(amax, fmt)


def expand_groups(scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group scales (out, groups) repeated to one per weight entry (out, groups * group_size):
    ``scale.repeat_interleave(group_size, dim=1)``."""
    return scale.repeat_interleave(group_size, dim=1)


def row_scales(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Per-row (per-token) scales of a 2-D activation (rows, features): shape (rows, 1)."""
    return absmax_scale(x.detach().abs().amax(dim=1, keepdim=True), fmt)


def sample_scales(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Per-sample scales of a batched feature map (batch, channels, *spatial): one scale over each
    sample's channels and positions, shape (batch, 1, ..., 1) to broadcast against ``x``."""
    amax = x.detach().abs().flatten(1).amax(dim=1)
    return absmax_scale(amax, fmt).reshape((-1,) + (1,) * (x.dim() - 1))


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x / scale`` in ``fmt.dtype``, as the format's :meth:`~Format.cast` stores it: integer
    formats round half to even and clamp to [qmin, qmax] (int8 [-127, 127], int4 [-8, 7] held
    in int8); fp8 clamps to [-448, 448] then casts (round to nearest even). ``scale``
    broadcasts."""
    return fmt.cast(x.detach().float() / scale)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` computed in float32, returned in ``dtype``."""
    return (q.float() * scale).to(dtype)


class _FakeQuantize(torch.autograd.Function):
    """Forward: the dequantized value exactly; backward: the straight-through estimator. Absmax
    scales never clip; a fixed (static) scale may, and there the gradient is zero (the output
    does not move with a saturated input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, fmt: Format,
                clips: bool) -> torch.Tensor:
        if clips:
            ctx.save_for_backward((x.detach().float() / scale).abs() <= fmt.qmax)
        ctx.clips = clips
        return dequantize(quantize(x, scale, fmt), scale, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.clips:
            (inside,) = ctx.saved_tensors
            grad = grad * inside
        return grad, None, None, None


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Format,
                  clips: bool = False) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype with a straight-through gradient to ``x``.
    ``scale`` is treated as a constant (computed from detached values). ``clips``: the scale
    may be below ``max |x| / qmax`` (a static scale), so the gradient of saturated entries is
    cut to zero."""
    return _FakeQuantize.apply(x, scale.detach(), fmt, clips)
