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
>>> layer.values.shape, layer.values.dtype, layer.scales.shape, layer.group_size
(torch.Size([32, 64]), torch.uint8, torch.Size([32, 1]), 128)
>>> tuple(layer(torch.randn(2, 3, 128)).shape)
(2, 3, 32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel.kernels.cusparselt import op as cslt_op
from sparsekit.accel.kernels.int4 import op as int4_op
from sparsekit.accel.kernels.mma_sp import op as mma_op
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel.kernels.int4 import format as w4a16
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


class _Int4Linear(nn.Module):
    variant = ""
    sparse = False
    uses_alg = False
    fmt = None
    path = "triton"  # the decode route (part of the algorithm cache's key)
    # on the mma.sp kernel (int4 2:4): its configuration per M bucket (sk24_mma.BUCKETS), as
    # the decode plan chose it (Planner.plan_decode); None: the kernel's defaults
    dconfig: tuple[tuple[int, ...], ...] | None = None

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
        try:  # a shape or a weight the format cannot take: the error names this layer
            q, scales, self.group_size = int4_weights(linear)
            self._pack(q, scales)
        except ValueError as e:
            raise ValueError(f"{self.variant} layer ({self.out_features}x{self.in_features}): "
                             f"{e}") from None
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16).contiguous())
        if prefill == "bf16_2:4":
            self.register_buffer("packed", cslt_op.pack_24(self.dequantized_weight(torch.bfloat16)))

    def _pack(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        raise NotImplementedError

    def int_weight(self) -> torch.Tensor:
        """The int4 values (N, K) int8, dense (a 2:4 layer's zeros in place)."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` (N, K) in ``dtype`` (computed in float32; elementwise ops)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2d.shape[0] <= w4a16.MAX_M:
            y = self._decode(x2d)
        elif self.prefill == "bf16_2:4":
            y = cslt_op.sparse24_mm(x2d, self.packed, self.bias, self.out_features, self.alg_id,
                                torch.bfloat16)
        else:
            y = F.linear(x2d, self._prefill_weight(), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _prefill_weight(self) -> torch.Tensor:
        """The bf16 weight a "dequant" prefill multiplies with (made on each call)."""
        return self.dequantized_weight(torch.bfloat16)

    def _decode(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, variant={self.variant}, "
                f"group_size={self.group_size}, prefill={self.prefill}, decode={self.path}"
                + (f" {sk24_mma.config_text(self.dconfig)}" if self.dconfig else ""))


class Int4Dense(_Int4Linear):
    """W4A16 dense: ``values`` (N, K/2) uint8, ``scales`` (N, K / group_size) float32."""

    variant = "int4_dense"

    def _pack(self, q, scales):
        values, scales = w4a16.pack(q, scales)
        self.register_buffer("values", values)
        self.register_buffer("scales", scales)

    def int_weight(self):
        return w4a16.unpack(self.values)

    def dequantized_weight(self, dtype=torch.float32):
        return w4a16.dequantize_packed(self.values, self.scales, dtype)

    def _decode(self, x2d):
        return int4_op.int4_mm(x2d, self.values, self.scales, self.bias)


class Int4Sparse24(_Int4Linear):
    """W4A16 2:4: ``values`` (N, K/4) uint8 (the kept entries), ``meta`` (N, K/32) int32,
    ``scales`` (N, K / group_size) float32."""

    variant = "int4_2:4"
    sparse = True

    def _pack(self, q, scales):
        values, meta, packed_scales = w4a16.pack_24(q, scales)
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        self.register_buffer("scales", packed_scales)
        # the sparse tensor cores' int4 format (sk24_mma) where it is built and fits
        mma = sk24_mma.usable_int4(q, self.group_size)
        formatted = sk24_mma.compress_int4(q, scales) if mma else (None, None, None)
        for name, t in zip(("mvalues", "mmeta", "mscales"), formatted):
            self.register_buffer(name, t, persistent=False)
        self.path = "mma" if mma else "triton"

    def int_weight(self):
        return w4a16.unpack_24(self.values, self.meta)

    def dequantized_weight(self, dtype=torch.float32):
        return w4a16.dequantize_packed_24(self.values, self.meta, self.scales, dtype)

    def _prefill_weight(self):
        # one op (one pass on CUDA): a compiler traces one call, not the dequantization's
        # elementwise ops a layer (the first generate's compile time)
        return int4_op.int4_24_widen(self.values, self.meta, self.scales)

    def _decode(self, x2d):
        if self.mvalues is not None:
            cfg = None if self.dconfig is None else [v for c in self.dconfig for v in c]
            return mma_op.sk24_mma_int4_mm(x2d, self.mvalues, self.mmeta, self.mscales, self.bias,
                                        cfg)
        return int4_op.int4_24_mm(x2d, self.values, self.meta, self.scales, self.bias)


__all__ = ["PREFILLS", "Int4Dense", "Int4Sparse24", "int4_weights", "rtn_int4"]
