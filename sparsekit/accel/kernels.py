"""GPU linear layers: bf16 / fp8 / int8, dense or 2:4 on cuSPARSELt, as drop-in modules.

Each class is built from an ``nn.Linear`` (weights already holding zeros in a 2:4 pattern for
the sparse ones) and computes ``x @ W.T + b`` for x (..., K) -> (..., N) in bfloat16.
``VARIANTS`` maps the variant names used in reports and configs to their classes.

cuSPARSELt computes ``W (N, K, compressed) @ x.T``; with ``transpose_result=True`` it writes
the row-major (M, N) result directly. Its plan is rebuilt on every call (0.5-0.9 ms of host
time on the H200), which is why these modules are meant to run under CUDA-graph replay
(:mod:`sparsekit.accel.graphs`), where that host work is gone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.accel import actquant

_ROW_ALIGN = 16  # cuSPARSELt / int8 GEMMs want the token count padded to this
_MIN_ROWS = 32  # torch._int_mm needs more than 16 rows


def _pad_rows(x2d: torch.Tensor, align: int) -> torch.Tensor:
    m = x2d.shape[0]
    pad = max(-(-m // align) * align, _MIN_ROWS) - m
    return F.pad(x2d, (0, 0, 0, pad)) if pad else x2d


def weight_scales(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of w (N, K): (wq (N, K) ``dtype``, scale (N,)
    float32) with w ~= wq * scale[:, None]. Zeros stay zeros, so a 2:4 pattern survives."""
    return actquant.quant_rows_ref(w, dtype)


class _AccelLinear(nn.Module):
    """Shared shape handling: flatten leading dims, pad rows, call ``_mm``, restore."""

    variant = ""
    sparse = False
    uses_alg = False

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(torch.bfloat16)
        m = x2d.shape[0]
        y = self._mm(_pad_rows(x2d, _ROW_ALIGN).contiguous())
        return y[:m].reshape(*lead, self.out_features)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        alg = f", alg_id={self.alg_id}" if self.uses_alg else ""
        return f"{self.in_features}, {self.out_features}, variant={self.variant}{alg}"


class DenseBF16(_AccelLinear):
    """cuBLAS bf16 (``F.linear``): the baseline every other variant is timed against."""

    variant = "bf16_dense"

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())

    def _mm(self, x2d):
        return F.linear(x2d, self.weight, self.bias)


class Sparse24BF16(_AccelLinear):
    """bf16 2:4 on sparse tensor cores (cuSPARSELt), bias fused in the GEMM."""

    variant = "bf16_2:4"
    sparse = True
    uses_alg = True

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        self.alg_id = alg_id
        w = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.register_buffer("packed", torch._cslt_compress(w))

    def _mm(self, x2d):
        return torch._cslt_sparse_mm(self.packed, x2d.t(), self.bias, transpose_result=True,
                                     alg_id=self.alg_id)


class FP8Dense(_AccelLinear):
    """W8A8 float8 e4m3 dense (``torch._scaled_mm``, row-wise scales in its epilogue);
    activations quantized per token by one Triton pass."""

    variant = "fp8_dense"

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        wq, sw = weight_scales(linear.weight.detach().float(), torch.float8_e4m3fn)
        self.register_buffer("wq", wq.contiguous())
        self.register_buffer("w_scale", sw.reshape(1, -1).contiguous())

    def _mm(self, x2d):
        q, sx = actquant.quant_rows(x2d, torch.float8_e4m3fn)
        return torch._scaled_mm(q, self.wq.t(), scale_a=sx.reshape(-1, 1), scale_b=self.w_scale,
                                bias=self.bias, out_dtype=torch.bfloat16)


@functools.cache
def fp8_alpha_vector_supported(device_index: int) -> bool:
    """Whether this cuSPARSELt applies a per-output-channel alpha vector to an fp8 e4m3 GEMM
    with bf16 output: tried once per device on a tiny problem and checked against the unscaled
    result (some versions refuse it: CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING)."""
    dev = torch.device("cuda", device_index)
    w = torch.zeros(32, 64, device=dev)
    w[:, 0::4] = torch.randn(32, 16, device=dev).clamp(-2, 2)
    packed = torch._cslt_compress(w.to(torch.float8_e4m3fn))
    x = torch.randn(16, 64, device=dev).clamp(-2, 2).to(torch.float8_e4m3fn)
    alpha = torch.rand(32, device=dev) + 0.5
    try:
        y = torch._cslt_sparse_mm(packed, x.t(), None, alpha, out_dtype=torch.bfloat16,
                                  transpose_result=True)
        plain = torch._cslt_sparse_mm(packed, x.t(), out_dtype=torch.bfloat16,
                                      transpose_result=True)
    except RuntimeError:
        return False
    return bool(torch.allclose(y.float(), plain.float() * alpha, rtol=2e-2, atol=1e-2))


class FP8Sparse24(_AccelLinear):
    """W8A8 float8 e4m3 2:4 (cuSPARSELt). Where cuSPARSELt takes a per-channel alpha vector for
    fp8 (:func:`fp8_alpha_vector_supported`) this runs like :class:`Int8Sparse24` (per-tensor
    activation scale folded into alpha, bias fused, no epilogue); otherwise the GEMM writes
    unscaled bf16 and one Triton pass applies token x channel scales and bias."""

    variant = "fp8_2:4"
    sparse = True
    uses_alg = True

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        self.alg_id = alg_id
        wq, sw = weight_scales(linear.weight.detach().float(), torch.float8_e4m3fn)
        self.register_buffer("packed", torch._cslt_compress(wq.contiguous()))
        self.register_buffer("w_scale", sw.contiguous())
        self.alpha_vector = fp8_alpha_vector_supported(self.packed.device.index or 0)

    def _mm(self, x2d):
        if self.alpha_vector:
            q, sx = actquant.quant_tensor(x2d, torch.float8_e4m3fn)
            return torch._cslt_sparse_mm(self.packed, q.t(), self.bias, self.w_scale * sx,
                                         out_dtype=torch.bfloat16, transpose_result=True,
                                         alg_id=self.alg_id)
        q, sx = actquant.quant_rows(x2d, torch.float8_e4m3fn)
        acc = torch._cslt_sparse_mm(self.packed, q.t(), out_dtype=torch.bfloat16,
                                    transpose_result=True, alg_id=self.alg_id)
        return actquant.scale_epilogue(acc, sx, self.w_scale, self.bias)


class Int8Dense(_AccelLinear):
    """W8A8 int8 dense (``torch._int_mm``, int32 out), per-token activation scales, one Triton
    epilogue pass for scales and bias."""

    variant = "int8_dense"

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        wq, sw = weight_scales(linear.weight.detach().float(), torch.int8)
        self.register_buffer("wq", wq.contiguous())
        self.register_buffer("w_scale", sw.contiguous())

    def _mm(self, x2d):
        q, sx = actquant.quant_rows(x2d, torch.int8)
        acc = torch._int_mm(q, self.wq.t())
        return actquant.scale_epilogue(acc, sx, self.w_scale, self.bias)


class Int8Sparse24(_AccelLinear):
    """W8A8 int8 2:4 (cuSPARSELt): per-tensor activation scale folded with the per-channel
    weight scales into cuSPARSELt's alpha vector, bias fused: no epilogue pass."""

    variant = "int8_2:4"
    sparse = True
    uses_alg = True

    def __init__(self, linear: nn.Linear, alg_id: int = 0):
        super().__init__(linear)
        self.alg_id = alg_id
        wq, sw = weight_scales(linear.weight.detach().float(), torch.int8)
        self.register_buffer("packed", torch._cslt_compress(wq.contiguous()))
        self.register_buffer("w_scale", sw.contiguous())

    def _mm(self, x2d):
        q, sx = actquant.quant_tensor(x2d, torch.int8)
        alpha = self.w_scale * sx
        return torch._cslt_sparse_mm(self.packed, q.t(), self.bias, alpha,
                                     out_dtype=torch.bfloat16, transpose_result=True,
                                     alg_id=self.alg_id)


VARIANTS: dict[str, type[_AccelLinear]] = {
    cls.variant: cls
    for cls in (DenseBF16, Sparse24BF16, FP8Dense, FP8Sparse24, Int8Dense, Int8Sparse24)
}
PRECISIONS = ("bf16", "fp8", "int8")


def variant_name(precision: str, sparse: bool) -> str:
    """'bf16' + sparse -> 'bf16_2:4'; 'int8' dense -> 'int8_dense'."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return f"{precision}_{'2:4' if sparse else 'dense'}"
