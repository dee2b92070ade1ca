"""8-bit matmuls against exact references, on every path (kernel, fallback, GPU)."""

import pytest
import torch

from sparsekit.quant import kernels
from sparsekit.quant.kernels import fp8_mm, int8_mm, int_mm_applies, scaled_matmul

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _int8(*shape, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8).to(device)


def _fp8(*shape, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    )


# (M, K, N): kernel shapes and shapes that need the fallback (small M, odd K or N)
SHAPES = [(32, 64, 16), (17, 8, 8), (3, 5, 7), (16, 64, 16), (40, 12, 24), (20, 16, 9)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_mm_is_exact(m, k, n):
    a, w = _int8(m, k, seed=1), _int8(n, k, seed=2)
    out = int8_mm(a, w)
    assert out.dtype == torch.int32 and out.shape == (m, n)
    assert torch.equal(out.long(), a.long() @ w.long().t())


def test_int8_mm_uses_int_mm_only_where_its_constraints_hold(monkeypatch):
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    int8_mm(_int8(32, 64), _int8(16, 64))
    int8_mm(_int8(3, 5), _int8(7, 5))
    assert calls == [(32, 64)]
    assert int_mm_applies(17, 8, 8) and not int_mm_applies(16, 8, 8)
    assert not int_mm_applies(32, 12, 8) and not int_mm_applies(32, 8, 12)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_fp8_mm_matches_float64(m, k, n):
    a, w = _fp8(m, k, seed=3), _fp8(n, k, seed=4)
    ref = a.double() @ w.double().t()
    torch.testing.assert_close(fp8_mm(a, w).double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max())


def _cpu_scaled_mm_works() -> bool:
    try:
        kernels.scaled_mm_fp8(_fp8(2, 16), _fp8(16, 16))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm_works(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gpu_fp8_code_path_pads_correctly_on_cpu(m, k, n):
    # the padding and layout logic of the GPU path, run through torch's CPU _scaled_mm
    a, w = _fp8(m, k, seed=5), _fp8(n, k, seed=6)
    torch.testing.assert_close(kernels.scaled_mm_fp8(a, w), fp8_mm(a, w), rtol=1e-6, atol=1e-3)


def test_scaled_matmul_applies_row_and_channel_scales():
    a, w = _int8(20, 16, seed=7), _int8(8, 16, seed=8)
    sx, sw, bias = torch.rand(20, 1) + 0.1, torch.rand(8) + 0.1, torch.randn(8)
    ref = (a.double() @ w.double().t()) * sx.double() * sw.double() + bias.double()
    out = scaled_matmul(a, sx, w, sw, bias, torch.float32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    assert scaled_matmul(a, sx, w, sw, None, torch.bfloat16).dtype == torch.bfloat16


@cuda
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gpu_int8_mm_matches_cpu(m, k, n):
    a, w = _int8(m, k, seed=9), _int8(n, k, seed=10)
    assert torch.equal(int8_mm(a.cuda(), w.cuda()).cpu(), int8_mm(a, w))


@cuda
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gpu_fp8_mm_matches_cpu(m, k, n):
    a, w = _fp8(m, k, seed=11), _fp8(n, k, seed=12)
    ref = fp8_mm(a, w)
    # fp32 accumulation on both sides; only the summation order differs
    torch.testing.assert_close(
        fp8_mm(a.cuda(), w.cuda()).cpu(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max()
    )
