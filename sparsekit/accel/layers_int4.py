"""int4 weight-only (W4A16) accelerated linear layers, dense and 2:4: ``int4_dense`` and
``int4_2:4`` in :data:`sparsekit.accel.layers.VARIANTS`.

Each computes ``x @ (q * scale).T + b`` in bfloat16 for x (..., K) -> (..., N), from int4 values
``q`` in [-8, 7] with one float32 scale per ``group_size`` input columns of each output row,
kept in sparsekit's packed formats (:mod:`sparsekit.accel.kernels.int4.format`). A layer is
built from:
- an int4 :class:`~sparsekit.quant.QuantLinear` (schemes ``int4_weight``,
  ``int4_weight_channel``: ``weight`` int8 (N, K) in [-8, 7], ``weight_scale`` float32
  (N, K / group_size), the int attribute ``group_size``), whose values and scales it takes as
  they are;
- a float ``nn.Linear`` or a QuantLinear of another scheme, whose (dequantized) weight is
  quantized here by round to nearest: symmetric, ``scale = max |group| / 7``, half to even,
  group ``group_size`` (128, or K when K is smaller; for a K that is no multiple of 128 the
  largest of 64 and 32 dividing it, else K: one scale per output row).
A 2:4 layer's weight must hold at most 2 nonzeros in every group of 4 along K (rounding keeps
zeros at zero). K must be a multiple of 64 and of the group size (ValueError naming the shape).

The kernels come from the registry (:mod:`sparsekit.accel.kernels`), as the layer's plan says.
Token counts up to 32 (decode) run sparsekit's Triton kernels (``sparsekit::int4_mm``,
``sparsekit::int4_24_mm``), which read the packed weight once; a 2:4 layer on CUDA whose
shape and group the sparse tensor cores' int4 format takes
(:func:`sparsekit.accel.kernels.mma_sp.launch.check_int4`: group a multiple of 128) decodes
there instead
(``sparsekit::sk24_mma_int4_mm``, ``path`` "mma"; it keeps that format beside the packed one:
0.39 more bytes per weight). Larger token counts (prefill) are
compute-bound and run on tensor cores in bf16, chosen at construction by ``prefill``:
- ``"dequant"`` (the default): the layer dequantizes its weight into a bf16 (N, K) tensor on each
  call and multiplies with ``F.linear`` (cuBLAS, dense even for a 2:4 weight). It keeps only
  the int4 weight (0.41 bytes per weight for 2:4, 0.53 dense, at group 128) and pays per call
  one pass over the int4 weight plus a write and a read of 2 bytes per weight;
- ``"bf16_2:4"`` (2:4 layers): the layer also keeps the dequantized weight packed for
  cuSPARSELt (``sparsekit::sparse24_mm``, 1.125 bytes per weight on top: 3.7x the int4
  layer's memory) and runs prefill at bf16 2:4 speed with no per-call dequantization.
On CPU every op runs its plain-torch reference.

>>> import torch
>>> from torch import nn
>>> lin = nn.Linear(128, 32)
>>> layer = Int4Dense(lin)
>>> w = layer.weights(layer.plan.kernels()[0])  # the packed int4 weight its kernels read
>>> w.values.shape, w.values.dtype, w.scales.shape, layer.group_size
(torch.Size([32, 64]), torch.uint8, torch.Size([32, 1]), 128)
>>> tuple(layer(torch.randn(2, 3, 128)).shape)
(2, 3, 32)
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekit.accel.kernels.int4 import format as w4a16
from sparsekit.accel.linear import AccelLinear
from sparsekit.names import INT4_GROUP_SIZES

PREFILLS = ("dequant", "bf16_2:4")


def rtn_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of a float weight (N, K): (q (N, K) int8 in [-8, 7], scales
    (N, K / group_size) float32), ``scale = max(max |group|, 1e-12) / 7``, ``q =
    clamp(round_half_even(w / scale), -8, 7)`` (quant/'s symmetric absmax numerics)."""
    n, k = weight.shape
    reason = w4a16.check_shape(n, k, group_size)
    if reason:
        raise ValueError(f"int4 quantization: {reason}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scales = w.abs().amax(dim=2).clamp_min(1e-12) / w4a16.QMAX
    q = (w / scales[..., None]).round_().clamp_(w4a16.QMIN, w4a16.QMAX)
    return q.to(torch.int8).reshape(n, k), scales


def int4_weights(layer: nn.Module, group_size: int = w4a16.GROUP_SIZE
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(q (N, K) int8, scales (N, K / g) float32, g) of ``layer``: an int4 QuantLinear's own
    values, else round to nearest of its float (or dequantized) weight with group
    ``min(group_size, K)`` or, where that does not divide K, the largest of the int4 schemes'
    smaller groups (64, 32) that does, else K (per output row)."""
    w, scale = layer.weight.detach(), getattr(layer, "weight_scale", None)
    if w.dtype == torch.int8 and scale is not None and scale.dim() == 2 \
            and hasattr(layer, "group_size"):
        return w, scale.detach().float(), int(layer.group_size)
    if hasattr(layer, "dequantized_weight"):
        w = layer.dequantized_weight(torch.float32)
    k = w.shape[1]
    group = min(group_size, k)
    if k % group:
        group = next((g for g in INT4_GROUP_SIZES if g < group and k % g == 0), k)
    q, scales = rtn_int4(w, group)
    return q, scales, group


class _Int4Linear(AccelLinear):
    precision = "int4"

    def __init__(self, linear: nn.Module, alg_id: int = 0, fused_quant: bool = True,
                 prefill: str = "dequant"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.alg_id = int(alg_id)
        self.fused_quant = fused_quant  # the 8-bit layers' option; int4 quantizes no activation
        allowed = PREFILLS if self.sparse else PREFILLS[:1]
        if prefill not in allowed:
            raise ValueError(f"{self.variant}: prefill must be one of {allowed}, got {prefill!r}")
        self.prefill = prefill
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16).contiguous())
        try:  # a shape or a weight the format cannot take: the error names this layer
            q, scales, self.group_size = int4_weights(linear)
            reason = w4a16.check_shape(self.out_features, self.in_features, self.group_size)
            if reason:
                raise ValueError(reason)
            source = (q, scales)
            self.start(source)
            # "bf16_2:4": the alternative kernel for large M (a bf16 2:4 copy beside the int4
            # one) instead of the dequantizing one
            if prefill == "bf16_2:4":
                self.start(source, large=self.choices["large"][0])
        except ValueError as e:
            raise ValueError(f"{self.variant} layer ({self.out_features}x{self.in_features}): "
                             f"{e}") from None

    def shape_text(self) -> str:
        return f"{super().shape_text()} g{self.group_size}"

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features).to(torch.bfloat16)

    def gemm_weight(self, source: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The weight a bf16 GEMM of this layer takes: ``q * scale`` in bf16."""
        return w4a16.dequantize(*source, torch.bfloat16)

    def int_weight(self) -> torch.Tensor:
        """The int4 values (N, K) int8, dense (a 2:4 layer's zeros in place)."""
        return self.source()[0]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` (N, K) in ``dtype`` (computed in float32; elementwise ops)."""
        return w4a16.dequantize(*self.source(), dtype)

    @property
    def path(self) -> str:
        """The small-M kernel (part of the algorithm cache's key)."""
        return self.plan.routes[0].kernel

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, prefill={self.prefill}"


class Int4Dense(_Int4Linear):
    """W4A16 dense: ``values`` (N, K/2) uint8, ``scales`` (N, K / group_size) float32."""

    variant = "int4_dense"


class Int4Sparse24(_Int4Linear):
    """W4A16 2:4: ``values`` (N, K/4) uint8 (the kept entries), ``meta`` (N, K/32) int32,
    ``scales`` (N, K / group_size) float32; on CUDA where the sparse tensor cores' int4 format
    takes it, that format for decode instead."""

    variant = "int4_2:4"
    sparse = True


__all__ = ["PREFILLS", "Int4Dense", "Int4Sparse24", "int4_weights", "rtn_int4"]
