"""The dense W8A8 GEMM as a custom op: ``scaled_mm(xq, wq, x_scale, w_scale, bias, out_dtype)``,
``(xq @ wq.T) * x_scale * w_scale + bias`` (x_scale (M, 1), w_scale (N,), float32) on
``torch._scaled_mm`` (fp8, row-wise scales and bias in cuBLAS's epilogue) or ``torch._int_mm``
(int8); the CPU reference is quant's :func:`~sparsekit.quant.kernels.scaled_matmul`.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from sparsekit import _compat
from sparsekit.accel.kernels import M_MULTIPLE, pad_rows
from sparsekit.quant.kernels import scaled_matmul

# --- scaled_mm (dense W8A8) ------------------------------------------------------------------

@torch.library.custom_op("sparsekit::scaled_mm", mutates_args=(), device_types="cuda")
def scaled_mm(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    m = xq.shape[0]
    if xq.dtype == torch.int8:
        acc = _compat.int_mm(pad_rows(xq, 32), wq.t())[:m]
        y = acc.float() * x_scale * w_scale
        return (y if bias is None else y + bias.float()).to(out_dtype)
    xp = pad_rows(xq, M_MULTIPLE)
    sp = pad_rows(x_scale, M_MULTIPLE) if xp.shape[0] != m else x_scale.contiguous()
    sw = w_scale.reshape(1, -1)
    try:  # row-wise scales and bias in cuBLAS's epilogue
        y = _compat.scaled_mm(xp, wq.t(), scale_a=sp, scale_b=sw, bias=bias, out_dtype=out_dtype)
    except RuntimeError:  # a cuBLAS without bias for row-wise scaling: add it after
        y = _compat.scaled_mm(xp, wq.t(), scale_a=sp, scale_b=sw, out_dtype=out_dtype)
        y = y if bias is None else y + bias
    return y[:m] if xp.shape[0] != m else y


@scaled_mm.register_kernel("cpu")
def _scaled_mm_ref(xq, wq, x_scale, w_scale, bias, out_dtype):
    return scaled_matmul(xq, x_scale, wq, w_scale, bias, out_dtype)


@scaled_mm.register_fake
def _scaled_mm_fake(xq, wq, x_scale, w_scale, bias, out_dtype):
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


def widened_mm(x2d: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A weight-only fp8 layer's large-M product: bf16 x times the e4m3 values widened to bf16
    (exact), then the per-channel scales and the bias in float32, as the decode kernels apply
    them (after the sums, never folded into the weight, which would round it a second time)."""
    acc = F.linear(x2d.to(torch.bfloat16), q.to(torch.bfloat16))
    y = acc.float() * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


__all__ = ["scaled_mm", "widened_mm"]
