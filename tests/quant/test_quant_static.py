"""Static activation scales (``int8_static``, ``fp8_static``, ``fp8_static_tensor``): calibrated
by quantize_, tracked by QAT and frozen by convert_, saved and loaded, run by accel unchanged;
checked against the formula they stand for (one absmax over the calibration inputs, values
beyond it saturating). ``fp8_static_tensor``'s one weight scale per tensor, likewise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.quant import QuantConv, QuantLinear
from sparsekit.quant.formats import FP8, get_scheme
from sparsekit.quant.numerics import channel_scales, dequantize, fake_quantize, quantize
from sparsekit.quant.qat import AMAX_BUFFER, AMAX_MOMENTUM

STATIC = ["int8_static", "fp8_static", "fp8_static_tensor"]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _batches(n=3, rows=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 16, generator=g) * (i + 1) for i in range(n)]


def _reference(lin: nn.Linear, x: torch.Tensor, scale: float, scheme: str) -> torch.Tensor:
    """float64: the input quantized with one scale (saturating), times the dequantized weight
    (its stored per-channel scales; all equal for a per-tensor scheme), plus bias."""
    fmt = get_scheme(scheme).activation
    t = x.double() / scale
    t = t.round().clamp(-fmt.qmax, fmt.qmax) if fmt.name == "int8" else \
        t.clamp(-fmt.qmax, fmt.qmax).float().to(fmt.dtype).double()
    w = lin.weight.double() * lin.weight_scale.double()[:, None]
    return (t * scale) @ w.t() + lin.bias.double()


@pytest.mark.parametrize("scheme", STATIC)
def test_quantize_calibrates_one_scale_per_layer(scheme):
    model, cal = _mlp(), _batches()
    float_model = copy.deepcopy(model)
    report = sk.quantize_(model, scheme, calibration=cal)
    assert report.quantized == ["0", "2"]
    qmax = get_scheme(scheme).activation.qmax
    # layer 0 sees the calibration batches themselves; layer 2 the float ReLU outputs
    want0 = max(float(b.abs().max()) for b in cal) / qmax
    with torch.no_grad():
        want2 = max(float(float_model[1](float_model[0](b)).abs().max()) for b in cal) / qmax
    torch.testing.assert_close(model[0].input_scale, torch.tensor([want0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(model[2].input_scale, torch.tensor([want2]), rtol=1e-6, atol=0)
    # the forward is the formula, including inputs far beyond the calibrated range (saturate)
    x = torch.randn(5, 16) * 3
    x[0, 0] = 50 * want0 * qmax
    got = model[0](x)
    ref = _reference(model[0], x, float(model[0].input_scale), scheme)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    q = quantize(x, model[0].input_scale, get_scheme(scheme).activation)
    assert float(q[0, 0].float()) == qmax  # saturated, not wrapped or NaN
    # one fixed scale: a sample's output does not depend on the rest of its batch
    torch.testing.assert_close(model(x)[:2], model(x[:2]), rtol=0, atol=0)


def test_static_needs_calibration_and_skips_layers_it_never_saw():
    with pytest.raises(UsageError, match="calibration="):
        sk.quantize_(_mlp(), "fp8_static")

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.unused = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            return self.a(x)

    model = TwoHeads()
    report = sk.quantize_(model, "int8_static", calibration=_batches())
    assert report.quantized == ["a"] and isinstance(model.a, QuantLinear)
    (skipped,) = [ly for ly in report.layers if ly.name == "unused"]
    assert skipped.status == "skipped" and "not called" in skipped.reason
    with pytest.raises(UsageError, match="unused"):
        sk.quantize_(TwoHeads(), "int8_static", calibration=_batches(), strict=True)


def test_static_conv_uses_the_one_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding=1))
    cal = [torch.randn(2, 4, 10) for _ in range(2)]
    sk.quantize_(model, "int8_static", calibration=cal)
    conv = model[0]
    assert isinstance(conv, QuantConv)
    s = float(conv.input_scale)
    assert s == pytest.approx(max(float(b.abs().max()) for b in cal) / 127, rel=1e-6)
    x = torch.randn(3, 4, 10)
    xq = (x.double() / s).round().clamp(-127, 127) * s
    w = conv.weight.double() * conv.weight_scale.double()[:, None, None]
    ref = F.conv1d(xq, w, conv.bias.double(), padding=1)
    torch.testing.assert_close(conv(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", STATIC)
def test_save_and_load_keep_the_scales(scheme, tmp_path):
    model = _mlp()
    sk.quantize_(model, scheme, calibration=_batches())
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors", model=_mlp())
    assert torch.equal(back[0].input_scale, model[0].input_scale)
    x = torch.randn(4, 16)
    assert torch.equal(back(x), model(x))


def test_fake_quantize_with_a_static_scale_cuts_the_gradient_where_it_saturates():
    fmt = get_scheme("int8_static").activation
    x = torch.tensor([0.5, -1.0, 3.0, -7.0], requires_grad=True)
    scale = torch.tensor([2.0 / 127])  # range [-2, 2]: 3 and -7 saturate
    y = fake_quantize(x, scale, fmt, clips=True)
    torch.testing.assert_close(y.detach(), torch.tensor([0.5, -1.0, 2.0, -2.0]),
                               rtol=0, atol=float(scale) / 2)
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("scheme", STATIC)
def test_qat_tracks_the_range_and_convert_freezes_it(scheme):
    model, cal = _mlp(), _batches()
    sk.prepare_qat_(model, scheme, calibration=cal)
    amax0 = getattr(model[0], AMAX_BUFFER).clone()
    assert float(amax0) == pytest.approx(max(float(b.abs().max()) for b in cal))
    # a training step moves the range towards the batch's absmax by AMAX_MOMENTUM
    x = torch.randn(8, 16) * 10
    model.train()
    loss = model(x).pow(2).mean()
    expected = amax0 + AMAX_MOMENTUM * (x.abs().max() - amax0)
    torch.testing.assert_close(getattr(model[0], AMAX_BUFFER), expected.reshape(1))
    loss.backward()
    assert model[0].parametrizations.weight.original.grad.abs().sum() > 0
    # eval mode reads the range without moving it
    model.eval()
    before = getattr(model[0], AMAX_BUFFER).clone()
    with torch.no_grad():
        fake = model(x)
    assert torch.equal(getattr(model[0], AMAX_BUFFER), before)
    qmax = get_scheme(scheme).activation.qmax
    sk.convert_(model)
    assert isinstance(model[0], QuantLinear) and not hasattr(model[0], AMAX_BUFFER)
    torch.testing.assert_close(model[0].input_scale, before / qmax)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fake, rtol=1e-5, atol=1e-5)


def test_qat_without_calibration_starts_from_the_first_batch_and_convert_needs_a_range():
    model = _mlp()
    sk.prepare_qat_(model, "fp8_static")
    assert float(getattr(model[0], AMAX_BUFFER)) == 0  # unset
    with pytest.raises(UsageError, match="no activation range"):
        sk.convert_(copy.deepcopy(model))
    x = torch.randn(4, 16)
    model.train()
    model(x)
    assert float(getattr(model[0], AMAX_BUFFER)) == pytest.approx(float(x.abs().max()))
    sk.convert_(model)
    assert float(model[0].input_scale) == pytest.approx(float(x.abs().max()) / 448)


def _one_tensor_scale_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 weight on the per-tensor grid, written out: (dequantized weight, the scale)."""
    scale = w.detach().abs().max().float() / 448
    return dequantize(quantize(w, scale, FP8), scale), scale


def test_fp8_static_tensor_quantizes_each_weight_with_one_scale():
    model, cal = _mlp(), _batches()
    with torch.no_grad():
        model[0].weight[:4] *= 1e-2  # small channels: per channel and per tensor grids differ
    float_model = copy.deepcopy(model)
    assert sk.quantize_(model, "fp8_static_tensor", calibration=cal).quantized == ["0", "2"]
    for i in (0, 2):
        lin, w = model[i], float_model[i].weight.detach()
        s = lin.weight_scale
        assert s.shape == (w.shape[0],) and bool((s == s[0]).all())
        assert float(s[0]) == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
        assert float(lin.weight.float().abs().max()) == 448.0
        want, _ = _one_tensor_scale_grid(w)
        assert torch.equal(lin.dequantized_weight(), want)
        # within half an e4m3 step of the float weight: relative 2^-4, subnormal step 2^-9
        err = (want.double() - w.double()).abs()
        bound = torch.maximum(w.double().abs() * 2**-4, s.double()[:, None] * 2**-10)
        assert bool((err <= bound * (1 + 1e-5)).all())
        # the forward is the formula on those values (inputs saturating beyond the range)
        x = torch.randn(5, w.shape[1]) * 3
        x[0, 0] = 50 * float(lin.input_scale) * 448
        ref = _reference(lin, x, float(lin.input_scale), "fp8_static_tensor")
        torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5)
    w0 = float_model[0].weight.detach()
    per_channel = channel_scales(w0, FP8)[:, None]
    assert not torch.equal(model[0].dequantized_weight(),
                           dequantize(quantize(w0, per_channel, FP8), per_channel))


def test_fp8_static_tensor_qat_trains_the_per_tensor_grid_and_convert_keeps_it():
    model, cal = _mlp(), _batches()
    sk.prepare_qat_(model, "fp8_static_tensor", calibration=cal)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for x in _batches(4, seed=2):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    wants = {}
    for i in (0, 2):
        w = model[i].parametrizations.weight.original.detach()
        wants[i], scale = _one_tensor_scale_grid(w)
        assert torch.equal(model[i].weight.detach(), wants[i])
        per_channel = channel_scales(w, FP8)[:, None]
        assert not torch.equal(wants[i], fake_quantize(w, per_channel, FP8))
    x = torch.randn(6, 16) * 2
    with torch.no_grad():
        fake = model(x)
    sk.convert_(model)
    for i in (0, 2):
        s = model[i].weight_scale
        assert isinstance(model[i], QuantLinear) and bool((s == s[0]).all())
        assert torch.equal(model[i].dequantized_weight(), wants[i])
    with torch.no_grad():
        torch.testing.assert_close(model(x), fake, rtol=1e-5, atol=1e-5)
