"""Dense kernels on cuBLAS (any M): bf16 ``F.linear``, the W8A8 GEMM (``sparsekit::scaled_mm``:
fp8 ``torch._scaled_mm``, int8 ``torch._int_mm``) and the fp8 weight-only product (the e4m3
weight widened to bf16, exactly, then ``F.linear``). ``cublas`` also serves a 2:4 layer on a
bf16 copy of its effective weight where the planner finds dense faster at some token counts
(2 bytes per weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekit.accel.kernels import UNBOUNDED, Format, Kernel, register
from sparsekit.accel.kernels.dense import op
from sparsekit.accel.kernels.dense.op import widened_mm


def _effective_bf16(layer, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer's effective weight in bf16: the values times the weight scale (fp8)."""
    if layer.w_scale is not None:
        w = w.float() * layer.w_scale[:, None]
    return {"weight": w.to(torch.bfloat16).contiguous()}


BF16 = Format("bf16", _effective_bf16, lambda dtype: 2.0,
              unpack=lambda layer, t: t["weight"] if layer.w_scale is None else None)
# the quantized weight as it is (fp8 e4m3 or int8, one byte a weight)
QUANTIZED = Format("quantized", lambda layer, w: {"weight": w.contiguous()}, lambda dtype: 1.0,
                unpack=lambda layer, t: t["weight"])


def _run_bf16(layer, x2d, w, config):
    return F.linear(x2d, w.weight, layer.bias)


def _run_scaled(layer, x2d, w, config):
    q, sx = layer.quant(x2d)
    return op.scaled_mm(q, w.weight, sx, layer.w_scale, layer.bias, torch.bfloat16)


def _run_widened(layer, x2d, w, config):
    return widened_mm(x2d, w.weight, layer.w_scale, layer.bias)


register(Kernel(
    "cublas", "dense", "linear", ("bf16", "fp8", "fp8w"), None, (1, UNBOUNDED), BF16,
    _run_bf16, prefer=lambda layer, w: layer.precision == "bf16" and not layer.sparse,
    order=10))
register(Kernel("cublas_scaled", "dense", "linear", ("fp8", "int8"), False, (1, UNBOUNDED),
                QUANTIZED, _run_scaled, ops=("scaled_mm",), order=11))
register(Kernel("cublas_widen", "dense", "linear", ("fp8w",), False, (1, UNBOUNDED), QUANTIZED,
                _run_widened, order=12))
