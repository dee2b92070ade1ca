"""Quantized Linear/Conv layers against float64 references computed from the formulas."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import sparsekit as sk
from sparsekit.quant import QuantConv, QuantLinear, apply_quant_plan, quant_plan, quantize_
from sparsekit.quant.modules import quantized_module

QMAX = {"int8": 127.0, "fp8": 448.0}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def ref_fake_quant(t: torch.Tensor, amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 dequantize(quantize(t)) for symmetric absmax scales (broadcast ``amax``)."""
    s = amax.double() / QMAX[fmt]
    v = t.double() / s
    if fmt == "int8":
        return v.round().clamp(-127, 127) * s
    return v.clamp(-448, 448).to(torch.float8_e4m3fn).double() * s


def ref_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = w.abs().flatten(1).amax(1).reshape((-1,) + (1,) * (w.dim() - 1))
    return ref_fake_quant(w, amax, fmt)


def ref_layer(layer: nn.Module, x: torch.Tensor, scheme: str) -> torch.Tensor:
    """The float layer run in float64 on fake-quantized weight and (for W8A8) input: per-token
    scales for Linear, per-sample for Conv."""
    fmt = "int8" if scheme.startswith("int8") else "fp8"
    ref = copy.deepcopy(layer).double()
    with torch.no_grad():
        ref.weight.copy_(ref_weight(layer.weight, fmt))
    x = x.double()
    if scheme != "int8_weight_only":
        if isinstance(layer, nn.Linear):
            amax = x.abs().amax(-1, keepdim=True)
        else:
            amax = x.abs().flatten(1).amax(1).reshape((-1,) + (1,) * (x.dim() - 1))
        x = ref_fake_quant(x, amax, fmt)
    with torch.no_grad():
        return ref(x)


def _close(out, ref):
    # float32 vs float64: a rare tie in w/s may round one step differently
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


SCHEMES = ["int8_weight_only", "int8", "fp8"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_linear_matches_reference(scheme):
    lin = nn.Linear(24, 12)
    x = torch.randn(3, 5, 24) * torch.logspace(-2, 1, 5)[:, None]  # tokens of varied size
    q = QuantLinear.from_float(lin, scheme)
    out = q(x)
    assert out.shape == (3, 5, 12)
    _close(out, ref_layer(lin, x, scheme))
    # and close to the float layer: 8-bit error only
    rel = (out - lin(x)).norm() / lin(x).norm()
    assert rel < {"int8_weight_only": 0.01, "int8": 0.03, "fp8": 0.08}[scheme]


CONVS = [
    lambda: nn.Conv1d(4, 8, 5, padding=2),
    lambda: nn.Conv1d(3, 6, 4, stride=2, dilation=2),
    lambda: nn.Conv1d(4, 8, 4, padding="same", dilation=2, bias=False),
    lambda: nn.Conv1d(4, 8, 3, padding=1, padding_mode="reflect"),
    lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1),
    lambda: nn.Conv2d(2, 4, (3, 2), padding="same", padding_mode="circular"),
]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("make", CONVS)
def test_conv_matches_reference(make, scheme):
    conv = make()
    x = torch.randn(3, conv.in_channels, *([9] * (conv.weight.dim() - 2)))
    x[1] *= 20  # per-sample scales: one large sample must not change the others
    q = QuantConv.from_float(conv, scheme)
    out = q(x)
    assert out.shape == conv(x).shape
    _close(out, ref_layer(conv, x, scheme))
    if scheme != "int8_weight_only":
        torch.testing.assert_close(q(x[:1]), out[:1], rtol=1e-6, atol=1e-6)  # batch-independent
    _close(q(x[0]), ref_layer(conv, x[:1], scheme)[0])  # unbatched input


def test_weight_only_takes_grouped_and_3d_convs():
    for conv in (nn.Conv1d(4, 8, 3, groups=2), nn.Conv3d(2, 4, 3, padding=1)):
        x = torch.randn(2, conv.in_channels, *([5] * (conv.weight.dim() - 2)))
        out = QuantConv.from_float(conv, "int8_weight_only")(x)
        _close(out, ref_layer(conv, x, "int8_weight_only"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_storage_is_8_bit_and_survives_dtype_casts(scheme):
    q = QuantLinear.from_float(nn.Linear(16, 8), scheme)
    dtype = torch.int8 if scheme.startswith("int8") else torch.float8_e4m3fn
    sd = q.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert sd["weight"].dtype == dtype and sd["weight_scale"].dtype == torch.float32
    before = q.weight.clone()
    q.to(torch.bfloat16)
    assert q.weight.dtype == dtype and q.weight_scale.dtype == torch.float32
    assert torch.equal(q.weight.float(), before.float())
    assert q.bias.dtype == torch.bfloat16
    assert q(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _model():
    return nn.Sequential(
        nn.Conv1d(1, 8, 5, padding=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12, 10)
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_save_load_round_trip_with_weights_only(tmp_path, scheme):
    model = _model()
    quantize_(model, scheme)
    x = torch.randn(4, 1, 12)
    torch.save(model.state_dict(), tmp_path / "q.pt")
    plan = quant_plan(model)
    fresh = _model()
    apply_quant_plan(fresh, plan)
    fresh.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert torch.equal(fresh(x), model(x))
    assert fresh[0].weight.dtype == model[0].weight.dtype
    save_file(model.state_dict(), tmp_path / "q.safetensors")
    fresh2 = _model()
    apply_quant_plan(fresh2, plan)
    fresh2.load_state_dict(load_file(tmp_path / "q.safetensors"))
    assert torch.equal(fresh2(x), model(x))


def test_plan_is_json_and_checks_the_model():
    import json

    model = _model()
    quantize_(model, "int8", exclude="3")
    plan = json.loads(json.dumps(quant_plan(model)))
    assert list(plan) == ["0"] and plan["0"]["type"] == "Conv1d"
    with pytest.raises(ValueError, match="'0' expects a float Conv1d"):
        apply_quant_plan(nn.Sequential(nn.Conv1d(1, 4, 5)), plan)
    with pytest.raises(ValueError, match="'9' is not in the model"):
        apply_quant_plan(_model(), {"9": plan["0"]})
    with pytest.raises(ValueError, match="version"):
        apply_quant_plan(_model(), {"0": {**plan["0"], "version": 99}})
    with pytest.raises(ValueError, match="names quantization scheme 'int4', which is not built in"):
        apply_quant_plan(_model(), {"0": {**plan["0"], "scheme": "int4"}})
    assert quant_plan(_model()) == {}


@cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("make", [lambda: nn.Linear(40, 24), CONVS[0], CONVS[4]])
def test_gpu_layer_matches_cpu_layer(make, scheme):
    layer = make()
    x = (
        torch.randn(20, 40)
        if isinstance(layer, nn.Linear)
        else torch.randn(20, layer.in_channels, *([9] * (layer.weight.dim() - 2)))
    )
    q = quantized_module(layer, scheme)
    ref = q(x)
    out = copy.deepcopy(q).cuda()(x.cuda()).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@cuda
def test_gpu_bf16_model_runs_w8a8():
    model = _model().cuda().to(torch.bfloat16)
    quantize_(model, "fp8")
    assert model[0].weight.dtype == torch.float8_e4m3fn
    x = torch.randn(32, 1, 12, device="cuda", dtype=torch.bfloat16)
    assert model(x).dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sk_save_stores_a_quarter_of_the_fp32_bytes_and_loads_back(tmp_path, scheme):
    def mlp():
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))

    model = mlp()
    sk.save(model, tmp_path / "fp32.safetensors")
    quantize_(model, scheme)
    sk.save(model, tmp_path / "q.safetensors")
    ratio = (tmp_path / "q.safetensors").stat().st_size / (
        tmp_path / "fp32.safetensors"
    ).stat().st_size
    assert 0.25 < ratio < 0.27  # 1 byte per weight, + float32 scales and biases (2 x 256 each)
    back = sk.load(tmp_path / "q.safetensors", model=mlp())
    assert back[0].weight.dtype == model[0].weight.dtype
    x = torch.randn(5, 256)
    assert torch.equal(back(x), model(x))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_model_keeps_bf16_activations(scheme):
    model = _model()
    x = torch.randn(4, 1, 12)
    ref = model(x)
    model.to(torch.bfloat16)
    quantize_(model, scheme)
    out = model(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert model[0].weight.dtype in (torch.int8, torch.float8_e4m3fn)
    assert (out.float() - ref).norm() / ref.norm() < 0.1
