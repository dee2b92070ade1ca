"""Dynamic activation quantization for W8A8 layers, fused into one or two Triton passes.

Two layouts, chosen by what the GEMM after them can absorb:
- per-token (``quant_rows``): one scale per row of ``x`` (M, K), one pass (the row is read twice
  from L2, once for its amax, once to quantize). Used where an epilogue pass applies
  ``scale_row[m] * scale_col[n]`` anyway (fp8 2:4: cuSPARSELt has no per-channel alpha for fp8).
- per-tensor (``quant_tensor``): one scale for all of ``x``, two passes (amax with an atomic max,
  then quantize). Used for int8 2:4, where the scalar folds into cuSPARSELt's per-output-channel
  alpha vector (``alpha[n] = scale_x * scale_w[n]``), so the GEMM writes the final output.

``*_ref`` functions are the plain torch definitions: the Triton kernels are tested against them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch references still work
    triton = None

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
_EPS = 1e-12


def qmax(dtype: torch.dtype) -> float:
    """Largest representable magnitude used for scaling into ``dtype`` (int8 or float8_e4m3fn)."""
    if dtype == torch.int8:
        return INT8_MAX
    if dtype == torch.float8_e4m3fn:
        return FP8_MAX
    raise ValueError(f"quantized dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        # round half away from zero, as the kernels do
        return (y.abs() + 0.5).floor().mul(y.sign()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return y.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def quant_rows_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) of ``dtype``, scale (M,) float32) with x ~= q * scale[:, None]."""
    amax = x.float().abs().amax(dim=1).clamp_min(_EPS)
    scale = amax / qmax(dtype)
    return _cast(x.float() / scale[:, None], dtype), scale


def quant_tensor_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) of ``dtype``, scale (1,) float32) with x ~= q * scale."""
    scale = (x.float().abs().amax().clamp_min(_EPS) / qmax(dtype)).reshape(1)
    return _cast(x.float() / scale, dtype), scale


def scale_epilogue_ref(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """acc (M, N) -> bf16 ``acc * row_scale[:, None] * col_scale[None, :] + bias``."""
    y = acc.float() * row_scale[:, None].float() * col_scale[None, :].float()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


if triton is not None:

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, QMAX: tl.constexpr,
                           IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
        inv = 1.0 / scale
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32) * inv
            v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
            if IS_INT8:
                q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32).to(tl.int8)
            else:
                q = v.to(tl.float8e4nv)
            tl.store(q_ptr + row * stride_q + offs, q, mask=offs < K)

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.abs(v), axis=0))

    @triton.jit
    def _quant_tensor_kernel(x_ptr, q_ptr, amax_ptr, s_ptr, n, QMAX: tl.constexpr,
                             IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        scale = tl.maximum(tl.load(amax_ptr), 1e-12) / QMAX
        if pid == 0:
            tl.store(s_ptr, scale)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32) / scale
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        if IS_INT8:
            q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32).to(tl.int8)
        else:
            q = v.to(tl.float8e4nv)
        tl.store(q_ptr + offs, q, mask=offs < n)

    @triton.jit
    def _epilogue_kernel(acc_ptr, y_ptr, rs_ptr, cs_ptr, b_ptr, M, N, stride_acc, stride_y,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.load(acc_ptr + rm[:, None] * stride_acc + rn[None, :], mask=mask, other=0)
        rs = tl.load(rs_ptr + rm, mask=rm < M, other=0.0)
        cs = tl.load(cs_ptr + rn, mask=rn < N, other=0.0)
        y = acc.to(tl.float32) * rs[:, None] * cs[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(tl.bfloat16), mask=mask)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def quant_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of x (M, K), one fused pass on CUDA; see
    :func:`quant_rows_ref` for the definition."""
    if not _use_triton(x):
        return quant_rows_ref(x, dtype)
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(k))
    _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), QMAX=qmax(dtype),
                             IS_INT8=dtype == torch.int8, BLOCK=block, num_warps=8)
    return q, s


def quant_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization of x (M, K), two passes on CUDA; see
    :func:`quant_tensor_ref` for the definition."""
    if not _use_triton(x):
        return quant_tensor_ref(x, dtype)
    x = x.contiguous()
    n = x.numel()
    amax = torch.zeros((1,), dtype=torch.float32, device=x.device)
    s = torch.empty((1,), dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = 8192
    grid = (triton.cdiv(n, block),)
    _amax_kernel[grid](x, amax, n, BLOCK=block, num_warps=8)
    _quant_tensor_kernel[grid](x, q, amax, s, n, QMAX=qmax(dtype), IS_INT8=dtype == torch.int8,
                               BLOCK=block, num_warps=8)
    return q, s


def scale_epilogue(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 ``acc * row_scale[:, None] * col_scale[None, :] + bias`` in one pass on CUDA
    (written in place when ``acc`` is bf16). acc (M, N) bf16 or int32."""
    if not _use_triton(acc):
        return scale_epilogue_ref(acc, row_scale, col_scale, bias)
    m, n = acc.shape
    y = acc if acc.dtype == torch.bfloat16 else torch.empty((m, n), dtype=torch.bfloat16,
                                                             device=acc.device)
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 128))
    _epilogue_kernel[grid](acc, y, row_scale, col_scale, bias if bias is not None else acc,
                           m, n, acc.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                           BLOCK_M=64, BLOCK_N=128, num_warps=8)
    return y
