"""Scales, quantize/dequantize error bounds against float64, zeros, straight-through gradient."""

import pytest
import torch

from sparsekit.errors import UsageError
from sparsekit.quant.formats import FP8, INT8, Scheme, get_scheme
from sparsekit.quant.numerics import (
    MIN_ABSMAX,
    channel_scales,
    dequantize,
    fake_quantize,
    quantize,
    row_scales,
    sample_scales,
    weight_scales,
)


def _weight(seed=0, shape=(16, 8, 3)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None, None]


@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_channel_scales_follow_the_formula(fmt):
    w = _weight()
    ref = w.double().abs().reshape(w.shape[0], -1).max(dim=1).values / fmt.qmax
    s = channel_scales(w, fmt)
    assert s.dtype == torch.float32 and s.shape == (16,)
    torch.testing.assert_close(s.double(), ref, rtol=1e-7, atol=0)


@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_weight_scales_per_channel_or_one_per_tensor(fmt):
    w = _weight()  # channel absmaxes spread over four decades
    assert torch.equal(weight_scales(w, fmt), channel_scales(w, fmt))
    assert torch.equal(weight_scales(w, fmt, "channel"), channel_scales(w, fmt))
    s = weight_scales(w, fmt, "tensor")
    assert s.dtype == torch.float32 and s.shape == (16,)
    ref = w.double().abs().max() / fmt.qmax
    torch.testing.assert_close(s.double(), ref.expand(16), rtol=1e-7, atol=0)
    s[0] = 0  # a tensor of its own (not a broadcast view): a consumer may write to it
    assert bool((s[1:] > 0).all())
    with pytest.raises(UsageError, match="'channel', 'tensor'"):
        weight_scales(w, fmt, "row")


def test_row_and_sample_scales_follow_the_formula():
    x = torch.randn(4, 5, 6)
    torch.testing.assert_close(
        row_scales(x.reshape(-1, 6), INT8).squeeze(1),
        x.reshape(-1, 6).abs().amax(1) / 127,
    )
    s = sample_scales(x, FP8)
    assert s.shape == (4, 1, 1)
    torch.testing.assert_close(s.flatten(), x.abs().flatten(1).amax(1) / 448)


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = _weight(1)
    s = channel_scales(w, INT8)[:, None, None]
    q = quantize(w, s, INT8)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (dequantize(q, s).double() - w.double()).abs()
    # half a quantization step, plus float32 rounding of w/s
    assert bool((err <= s.double() * (0.5 + 1e-5)).all())
    # and it is really rounding to nearest: the float64 reference gives the same integers
    ref = torch.round(w.double() / s.double()).clamp(-127, 127)
    assert (q.double() - ref).abs().max() <= 1  # ties may differ by float32 division only
    assert (q.double() != ref).float().mean() < 1e-3


def test_fp8_round_trip_error_is_within_half_an_ulp():
    w = _weight(2)
    s = channel_scales(w, FP8)[:, None, None]
    q = quantize(w, s, FP8)
    assert q.dtype == torch.float8_e4m3fn
    assert float(q.float().abs().max()) == 448.0
    err = (dequantize(q, s).double() - w.double()).abs()
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4 for normals; subnormal step 2^-9
    bound = torch.maximum(w.double().abs() * 2**-4, s.double() * 2**-10) * (1 + 1e-5)
    assert bool((err <= bound).all())


@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_zeros_stay_exactly_zero_and_zero_rows_are_safe(fmt):
    w = _weight(3)
    w[::2] *= (torch.rand(w[::2].shape, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    w[1] = 0  # a fully pruned channel
    s = channel_scales(w, fmt)
    assert float(s[1]) == pytest.approx(MIN_ABSMAX / fmt.qmax)
    deq = dequantize(quantize(w, s[:, None, None], fmt), s[:, None, None])
    assert bool((deq[w == 0] == 0).all()) and int((w == 0).sum()) > w[1].numel()
    assert torch.isfinite(deq).all()


def test_fp8_clamps_out_of_range_values():
    q = quantize(torch.tensor([1000.0, -1000.0]), torch.tensor(1.0), FP8)
    assert q.float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_fake_quantize_is_exact_forward_and_identity_backward(fmt):
    x = torch.randn(6, 10, requires_grad=True)
    s = row_scales(x, fmt)
    y = fake_quantize(x, s, fmt)
    torch.testing.assert_close(y, dequantize(quantize(x, s, fmt), s), rtol=0, atol=0)
    g = torch.randn(6, 10)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_unknown_scheme_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'int8_weight_only', 'fp8_weight_only', 'int8', 'fp8'"):
        get_scheme("int4")


def test_scheme_with_an_unknown_weight_granularity_names_the_allowed_ones():
    with pytest.raises(UsageError, match="'fp8_row'.*'row'.*allowed: 'channel', 'tensor'"):
        Scheme("fp8_row", FP8, FP8, weight_granularity="row")
    assert get_scheme("fp8_static").weight_granularity == "channel"
    assert get_scheme("fp8_static_tensor") == Scheme("fp8_static_tensor", FP8, FP8, static=True,
                                                     weight_granularity="tensor")
