"""int4 weight-only schemes: group scales and rounding against float64, saturation at [-8, 7],
the layer contract (int8 storage, (out, in // group) scales, dequantization), QAT with the same
numerics, odd groups refused naming the layer, and save/load."""

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.quant.formats import INT4, Scheme, get_scheme
from sparsekit.quant.modules import QuantLinear
from sparsekit.quant.numerics import expand_groups, fake_quantize, group_scales, quantize


def _weight(rows=6, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    # group magnitudes spread over three decades: a shared scale would crush the small groups
    spread = torch.logspace(-2, 1, cols // 32).repeat_interleave(32)
    return torch.randn(rows, cols, generator=g) * spread


def _reference(w, group):
    """float64 quantize/dequantize, written from the definition."""
    w = w.double()
    rows, cols = w.shape
    scale = w.abs().reshape(rows, cols // group, group).amax(dim=2) / 7
    full = scale.repeat_interleave(group, dim=1)
    q = torch.clamp(torch.round(w / full), -8, 7)
    return q, scale, q * full


@pytest.mark.parametrize("group", [32, 128, 256])
def test_group_scales_and_rounding_match_float64(group):
    w = _weight()
    q_ref, s_ref, deq_ref = _reference(w, group)
    s = group_scales(w, INT4, group)
    assert s.dtype == torch.float32 and s.shape == (6, 256 // group)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-7, atol=0)
    q = quantize(w, expand_groups(s, group), INT4)
    assert q.dtype == torch.int8 and torch.equal(q.double(), q_ref)
    # each group's absmax lands on +-7 exactly; error at most half a step of its own group
    sevens = torch.full_like(s, 7, dtype=torch.int8)
    assert torch.equal(q.abs().reshape(6, -1, group).amax(2), sevens)
    err = (q.double() * expand_groups(s, group).double() - w.double()).abs()
    assert (err <= 0.5 * expand_groups(s_ref, group) * (1 + 1e-6)).all()
    torch.testing.assert_close(q.double() * expand_groups(s, group).double(), deq_ref,
                               rtol=1e-6, atol=0)


def test_group_edges_each_group_its_own_scale():
    w = torch.zeros(1, 256)
    w[0, 127], w[0, 128] = 7.0, 0.07  # last of group 0, first of group 1
    w[0, 0], w[0, 255] = 1.0, 0.01
    s = group_scales(w, INT4, 128)
    torch.testing.assert_close(s, torch.tensor([[1.0, 0.01]]))
    q = quantize(w, expand_groups(s, 128), INT4)
    assert (q[0, 0], q[0, 127], q[0, 128], q[0, 255]) == (1, 7, 7, 1)


def test_saturation_clamps_to_minus_8_and_7():
    scale = torch.tensor([[1.0]])
    x = torch.tensor([[-100.0, -8.4, -7.6, 7.4, 7.6, 100.0, 0.5, -0.5]])
    q = quantize(x, scale, INT4)
    assert q.tolist() == [[-8, -8, -8, 7, 7, 7, 0, 0]]  # half to even: 0.5 -> 0


def test_zero_groups_stay_zero():
    w = torch.zeros(2, 128)
    w[1, 5] = 3.0
    layer = QuantLinear.from_float(_linear(w), "int4_weight")
    assert torch.equal(layer.dequantized_weight(), w.where(w != 0, torch.zeros(())) * 1.0)
    assert (layer.weight[0] == 0).all()


def _linear(w, bias=True):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


@pytest.mark.parametrize(("scheme", "group"), [("int4_weight", 128), ("int4_weight_channel", 256)])
def test_layer_contract_and_forward(scheme, group):
    w = _weight()
    lin = _linear(w)
    layer = QuantLinear.from_float(lin, scheme)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (6, 256)
    assert layer.weight_scale.dtype == torch.float32
    assert layer.weight_scale.shape == (6, 256 // group) and layer.group_size == group
    assert -8 <= int(layer.weight.min()) and int(layer.weight.max()) <= 7
    want = layer.weight.float() * layer.weight_scale.repeat_interleave(group, dim=1)
    assert torch.equal(layer.dequantized_weight(), want)
    _, _, deq_ref = _reference(w, group)
    torch.testing.assert_close(want.double(), deq_ref, rtol=1e-6, atol=0)
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(layer(x), x @ want.t() + lin.bias, rtol=1e-5, atol=1e-5)
    layer.to(torch.bfloat16)  # the bias follows; int4 values and float32 scales stay
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_odd_groups_refused_naming_the_layer():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))
    for verb in (sk.quantize_, sk.prepare_qat_):
        with pytest.raises(UsageError, match=r"layer '2': in_features=64 is not a multiple of "
                                             r"int4_weight's group size 128"):
            verb(model, "int4_weight")
    assert type(model[0]) is nn.Linear  # nothing was changed
    report = sk.quantize_(model, "int4_weight", exclude="2")
    assert report.quantized == ["0"]
    with pytest.raises(UsageError, match="no whole groups"):
        QuantLinear.from_float(nn.Linear(100, 4), "int4_weight")


def test_int4_takes_linear_only_and_is_weight_only():
    report = sk.quantize_(nn.Sequential(nn.Conv1d(128, 4, 1)), "int4_weight_channel")
    assert report.skipped == {
        "0": "int4_weight_channel (int4 weight-only) takes Linear layers only"}
    with pytest.raises(UsageError, match="weight-only"):
        Scheme("bad", INT4, INT4)
    assert get_scheme("int4_weight").activation is None


def test_qat_fake_quant_matches_the_converted_layer_with_straight_through_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 16))
    sk.prepare_qat_(model, "int4_weight")
    x = torch.randn(4, 256)
    y = model(x)
    raw = model[0].parametrizations.weight.original
    fq = model[0].weight
    _, _, deq_ref = _reference(raw.detach(), 128)
    torch.testing.assert_close(fq.double(), deq_ref, rtol=1e-6, atol=0)
    y.sum().backward()
    # straight through: d(sum y)/dW = sum over the batch of x, for every output row
    torch.testing.assert_close(raw.grad, x.sum(0).expand(16, 256), rtol=1e-5, atol=1e-5)
    sk.convert_(model)
    assert isinstance(model[0], QuantLinear) and model[0].weight_scale.shape == (16, 2)
    torch.testing.assert_close(model(x), y.detach(), rtol=1e-5, atol=1e-5)


def test_fake_quantize_int4_equals_quantize_dequantize():
    w = _weight()
    s = expand_groups(group_scales(w, INT4, 64), 64)
    assert torch.equal(fake_quantize(w, s, INT4), quantize(w, s, INT4).float() * s)


def test_save_load_round_trip_keeps_int4_values_and_2_4_zeros(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 4))
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["2"])
    sk.quantize_(model, "int4_weight", exclude=["2"])
    sk.quantize_(model, "int4_weight_channel", include=["2"])
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors",
                   model=nn.Sequential(nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 4)))
    for i in (0, 2):
        assert torch.equal(back[i].weight, model[i].weight)
        assert torch.equal(back[i].weight_scale, model[i].weight_scale)
        assert back[i].group_size == model[i].group_size
    x = torch.randn(3, 256)
    assert torch.equal(back(x), model(x))


def test_accel_takes_int4_layers_dequantized_not_as_int8_values():
    from sparsekit.accel.layers import _weights
    from sparsekit.quant.formats import INT8

    layer = QuantLinear.from_float(_linear(_weight()), "int4_weight")
    w, scale = _weights(layer, INT8)  # an int8 kernel gets the int4 weight requantized
    assert scale.shape == (6,)
    torch.testing.assert_close(w.float() * scale[:, None], layer.dequantized_weight(),
                               rtol=0, atol=float(scale.max()) / 2)
    int8 = QuantLinear.from_float(_linear(_weight()), "int8")
    assert _weights(int8, INT8)[0] is not None and torch.equal(_weights(int8, INT8)[0],
                                                               int8.weight)
