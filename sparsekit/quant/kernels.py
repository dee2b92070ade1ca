"""8-bit matrix products, exact on every device, with the dense GPU kernels where they apply.

``int8_mm`` returns the exact int32 product. ``torch._int_mm`` is used where its constraints
hold (those of its CUDA kernel: M > 16, K and N multiples of 8), on CPU and GPU alike; where they
do not, CPU falls back to an int32 matmul and CUDA zero-pads to the constraints. Both are exact:
zeros add nothing to an integer sum, so every path returns the same integers.

``fp8_mm`` returns the float32 product of float8 e4m3fn operands. On a GPU with fp8 tensor cores
(compute capability >= 8.9) it calls ``torch._scaled_mm`` with unit scales and float32 output,
zero-padding M, K and N to multiples of 16; elsewhere it casts to float32 and multiplies (products
of two e4m3 values are exact in float32, so the paths differ only in summation order). Scales
are applied after the product, as an outer product of row and channel scales, in both cases.

>>> a = torch.randint(-127, 128, (3, 5), dtype=torch.int8)
>>> w = torch.randint(-127, 128, (4, 5), dtype=torch.int8)
>>> torch.equal(int8_mm(a, w), (a.long() @ w.long().t()).int())
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekit import _compat

_INT_MM_MIN_M = 17  # torch._int_mm needs more than 16 rows
_INT_MM_MULTIPLE = 8  # ... and K, N multiples of 8
_SCALED_MM_MULTIPLE = 16  # torch._scaled_mm needs K, N multiples of 16 (M padded too: cheap)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the end to (rows, cols); no copy when already that size."""
    if t.shape == (rows, cols):
        return t
    # F.pad has no int8/float8 kernels on every device: pad through a zero buffer instead.
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def int_mm_applies(m: int, k: int, n: int) -> bool:
    """Whether ``torch._int_mm`` takes an (m, k) x (k, n) product as it is."""
    return m >= _INT_MM_MIN_M and k % _INT_MM_MULTIPLE == 0 and n % _INT_MM_MULTIPLE == 0


def int8_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ w.T`` for int8 ``a`` (M, K) and ``w`` (N, K): int32 (M, N)."""
    m, k = a.shape
    n = w.shape[0]
    if int_mm_applies(m, k, n):
        return _compat.int_mm(a.contiguous(), w.contiguous().t())
    if a.device.type == "cpu":
        return a.int() @ w.int().t()
    mp, kp, np_ = (
        max(m, _INT_MM_MIN_M),
        _round_up(k, _INT_MM_MULTIPLE),
        _round_up(n, _INT_MM_MULTIPLE),
    )
    out = _compat.int_mm(_pad2d(a, mp, kp), _pad2d(w, np_, kp).t())
    return out[:m, :n]


def fp8_kernel_available(device: torch.device) -> bool:
    """True on CUDA devices with fp8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_fp8(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` for float8 ``a`` (M, K), ``w`` (N, K) through ``torch._scaled_mm`` with unit
    scales: float32 (M, N). M, K and N are zero-padded to multiples of 16."""
    m, k = a.shape
    n = w.shape[0]
    mp, kp, np_ = (_round_up(d, _SCALED_MM_MULTIPLE) for d in (m, k, n))
    one = torch.ones((), dtype=torch.float32, device=a.device)
    out = _compat.scaled_mm(
        _pad2d(a, mp, kp).contiguous(),
        _pad2d(w, np_, kp).contiguous().t(),  # column-major, as the kernel requires
        scale_a=one,
        scale_b=one,
        out_dtype=torch.float32,
    )
    return out[:m, :n]


def fp8_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` for float8 e4m3fn ``a`` (M, K) and ``w`` (N, K): float32 (M, N)."""
    if fp8_kernel_available(a.device):
        return scaled_mm_fp8(a, w)
    return F.linear(a.float(), w.float())


def scaled_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The W8A8 linear: ``(xq @ wq.T) * x_scale * w_scale + bias`` in float32, returned in
    ``out_dtype``. ``xq`` (M, K) and ``wq`` (N, K) share a dtype (int8 or float8 e4m3fn);
    ``x_scale`` is (M, 1) and ``w_scale`` is (N,), both float32."""
    if xq.dtype == torch.int8:
        acc = int8_mm(xq, wq).float()
    else:
        acc = fp8_mm(xq, wq)
    y = acc * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
