"""Activation quantization for the 8-bit layers, with the numerics of
:mod:`sparsekit.quant.numerics` (absmax scales per token, int8 rounds half to even).

- :func:`act_quant_rows`: plain torch ops, what the layers call so that inductor fuses them into
  the op that produces the activation;
- ``quant_rows(x, dtype)``: the same as an opaque custom op (``sparsekit::quant_rows``), kept
  to measure what the fusion gains (``PlanOptions(fused_quant=False)``).

The GEMM kernels' ops live in their families' folders (``sparsekit.accel.kernels.<family>.op``).
"""

import torch

from sparsekit.quant.formats import FP8, INT8, Format
from sparsekit.quant.numerics import quantize, row_scales

_FORMATS = {torch.int8: INT8, torch.float8_e4m3fn: FP8}


def fmt_of(dtype: torch.dtype) -> Format:
    """The quant :class:`Format` stored as ``dtype`` (int8 or float8 e4m3fn)."""
    if dtype not in _FORMATS:
        raise ValueError(f"quantized dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return _FORMATS[dtype]


def act_quant_rows(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of x (M, K): (q (M, K) in ``fmt.dtype``, scale (M, 1) float32),
    exactly what :class:`~sparsekit.quant.QuantLinear` does to its input. Plain torch ops."""
    scale = row_scales(x, fmt)
    return quantize(x, scale, fmt), scale


@torch.library.custom_op("sparsekit::quant_rows", mutates_args=())
def quant_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = act_quant_rows(x, fmt_of(dtype))
    return q, s


@quant_rows.register_fake
def _quant_rows_fake(x, dtype):
    fmt_of(dtype)
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


__all__ = ["act_quant_rows", "fmt_of", "quant_rows"]
