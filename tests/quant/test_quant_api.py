"""quantize_: selection, the report, skip reasons, strict mode and every bad input."""

import math

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.quant import SCHEMES, QuantConv, QuantLinear, Scheme
from sparsekit.quant.formats import Format


def _model():
    return nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv1d(8, 8, 3, padding=1, groups=2),
        nn.Flatten(),
        nn.Linear(8 * 16, 10),
    )


def test_quantize_replaces_selected_layers_and_reports_the_rest():
    model = _model()
    report = sk.quantize_(model, "int8", exclude="0")
    assert isinstance(model[0], nn.Conv1d) and isinstance(model[4], QuantLinear)
    assert isinstance(model[2], nn.Conv1d)  # grouped conv: skipped, still float
    assert report.quantized == ["4"]
    assert "grouped" in report.skipped["2"] and "groups=2" in report.skipped["2"]
    statuses = {ly.name: ly.status for ly in report.layers}
    assert statuses == {"0": "excluded", "2": "skipped", "4": "quantized"}
    table = str(report)
    assert "int8" in table and "excluded" in table and "groups=2" in table
    assert report.to_dict()["layers"][2]["status"] == "quantized"
    assert model(torch.randn(2, 4, 16)).shape == (2, 10)


def test_weight_only_takes_what_w8a8_skips():
    model = nn.Sequential(nn.Conv1d(4, 8, 3, groups=2), nn.Conv3d(2, 2, 1))
    assert sk.quantize_(model, "int8_weight_only").skipped == {}
    assert isinstance(model[0], QuantConv) and isinstance(model[1], QuantConv)
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Conv3d(2, 2, 1))
    assert "Conv3d" in sk.quantize_(model, "fp8").skipped["1"]


def test_layer_of_unsupported_dtype_is_skipped_and_strict_raises():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4).double())
    with pytest.raises(ValueError, match=r"strict=True.*'1'.*float64"):
        sk.quantize_(model, "fp8", strict=True)
    assert isinstance(model[0], nn.Linear)  # strict failure leaves the model untouched
    report = sk.quantize_(model, "fp8")
    assert "torch.float64" in report.skipped["1"] and report.quantized == ["0"]


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4'"):
        sk.quantize_(_model(), "int4")
    with pytest.raises(ValueError, match="matches no selectable layer"):
        sk.quantize_(_model(), "int8", include="fc_typo")
    model = _model()
    sk.quantize_(model, "int8_weight_only")
    with pytest.raises(ValueError, match="'0' is already quantized"):
        sk.quantize_(model, "fp8")
    with pytest.raises(ValueError, match="'0' is already quantized"):
        sk.prepare_qat_(model, "fp8")
    model = _model()
    sk.quantize_(model, "int8", exclude="4")
    sk.quantize_(model, "fp8", include="4")  # mixed precision: each layer quantized once
    assert model[4].weight.dtype == torch.float8_e4m3fn and model[0].weight.dtype == torch.int8
    model = _model()
    sk.prepare_qat_(model, "int8", include="4")
    with pytest.raises(ValueError, match="'4' is already prepared for QAT"):
        sk.quantize_(model, "int8")
    with pytest.raises(ValueError, match="'4' is already prepared for QAT"):
        sk.prepare_qat_(model, "fp8")
    with pytest.raises(ValueError, match="no layer is prepared for QAT"):
        sk.convert_(_model())


def test_quantize_under_a_live_pruner_asks_to_finalize():
    model = _model()
    pruner = sk.Pruner(model, pattern="2:4", include="4")
    pruner.step(0)
    with pytest.raises(ValueError, match=r"'4' has parametrizations \['WeightMask'\].*finalize"):
        sk.quantize_(model, "int8")
    pruner.finalize()
    sk.quantize_(model, "int8", include="4")


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int8", "fp8"])
def test_pruned_zeros_stay_exactly_zero(scheme):
    model = _model()
    sk.prune_(model, pattern="2:4", include=["0", "4"])
    zeros = {n: model.get_submodule(n).weight == 0 for n in ("0", "4")}
    x = torch.randn(3, 4, 16)
    before = model(x)
    sk.quantize_(model, scheme)
    for name, z in zeros.items():
        q = model.get_submodule(name).weight
        assert bool((q.float()[z] == 0).all())
        assert int((q.float() == 0).reshape(-1, 4).sum(1).min()) >= 2  # 2:4 still holds
    rel = (model(x) - before).norm() / before.norm()
    assert rel < 0.1


def test_calibration_measures_each_layers_output_error():
    lin = nn.Linear(16, 8)
    model = nn.Sequential(lin)
    batches = [torch.randn(4, 16) for _ in range(3)]
    report = sk.quantize_(model, "int8", calibration=batches)
    x = torch.cat(batches)
    expected = ((model(x) - lin(x)).norm() / lin(x).norm()).item()
    assert report.layers[0].rel_error == pytest.approx(expected, rel=1e-4)
    assert 0 < report.layers[0].rel_error < 0.05 and not math.isnan(expected)


class _Block(nn.Module):
    """An encoder block as torchvision's ViT writes it: MultiheadAttention, then an MLP."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("scheme", ["fp8", "int8_static"])
def test_layers_read_by_their_parent_are_skipped_and_the_model_still_runs(scheme):
    """nn.MultiheadAttention reads out_proj.weight itself (and nn.TransformerEncoderLayer's
    eval fast path its linear1/linear2): quantizing them in place would hand float8/int8
    tensors to those kernels. They are skipped with the reason, and the models run."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    block = _Block().eval()
    report = sk.quantize_(block, scheme, calibration=[x])
    status = {ly.name: (ly.status, ly.reason) for ly in report.layers}
    assert status["attn.out_proj"][0] == "skipped"
    assert "MultiheadAttention" in status["attn.out_proj"][1]
    assert report.quantized == ["mlp.0", "mlp.2"]
    with torch.no_grad():
        assert torch.isfinite(block(x)).all()
    assert sk.prepare_qat_(_Block(), scheme, calibration=[x]).quantized == ["mlp.0", "mlp.2"]
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    report = sk.quantize_(layer, scheme, calibration=[x])
    assert report.quantized == [] and len(report.skipped) == 3
    with torch.no_grad():
        assert torch.isfinite(layer(x)).all()


class _Int4(Format):
    """int8 storage, [-7, 7], halves rounded away from zero (int8's own handler rounds them to
    even): a format that only its handler can produce."""

    def cast(self, t):
        return (t.sign() * (t.abs() + 0.5).floor()).clamp_(-7, 7).to(torch.int8)


@pytest.fixture
def int4_schemes():
    fmt = _Int4("int4", torch.int8, 7.0)
    schemes = [Scheme("test_int4_weight_only", fmt, None), Scheme("test_int4", fmt, fmt)]
    for s in schemes:
        sk.register_scheme(s)
    yield fmt
    for s in schemes:
        SCHEMES.unregister(s.name)


def test_a_scheme_brings_its_own_format_handler(int4_schemes, tmp_path):
    # one row whose values over its scale (7 / 7 = 1) sit on halves: 2.5 -> 3, -3.5 -> -4,
    # 0.5 -> 1 away from zero (half to even would give 2, -4, 0)
    row = torch.tensor([7.0, 2.5, -3.5, 0.5])
    model = nn.Sequential(nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.stack([row, row * 2]))
    assert sk.quantize_(model, "test_int4_weight_only").quantized == ["0"]
    expected = torch.tensor([7, 3, -4, 1], dtype=torch.int8)
    assert torch.equal(model[0].weight, torch.stack([expected, expected]))
    # the checkpoint stores the scheme's name; loading rebuilds the layer with its format
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors", model=nn.Sequential(nn.Linear(4, 2, bias=False)))
    assert torch.equal(back[0].weight, model[0].weight)
    # W8A8 with the custom format: the input is cast by the handler too
    x = torch.tensor([[1.0, 0.25, -0.75, 0.0]])  # over its scale 1/7: 7, 1.75, -5.25, 0
    w8a8 = nn.Sequential(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        w8a8[0].weight.copy_(torch.tensor([[7.0, 7.0, 7.0, 7.0]]))
    sk.quantize_(w8a8, "test_int4")
    xq = torch.tensor([7.0, 2.0, -5.0, 0.0]) / 7  # 1.75 -> 2, -5.25 -> -5
    torch.testing.assert_close(w8a8(x), (xq * 7).sum().reshape(1, 1), rtol=0, atol=1e-6)
    # QAT's fake quantization goes through the same handler
    qat = nn.Sequential(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        qat[0].weight.copy_(row[None])
    sk.prepare_qat_(qat, "test_int4_weight_only")
    torch.testing.assert_close(qat[0].weight, expected[None].float())
