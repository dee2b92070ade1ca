"""One API shape: include=/exclude= everywhere, criterion= for both pruners, keyword-only
arguments after the first two, one report protocol, consistent top-level exports."""

import json
import warnings

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.models import mnist1d_cnn
from sparsekit.reporting import Report


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def masks_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() == 0 for n, p in model.named_parameters() if n.endswith("weight")}


def widths(model: nn.Module) -> dict[str, int]:
    return {n: m.out_channels for n, m in model.named_modules() if isinstance(m, nn.Conv1d)}


def test_keyword_only_after_the_first_two_in_the_public_verbs():
    import inspect

    for fn in (sk.prune_, sk.Pruner, sk.prune_channels_, sk.ChannelPruner, sk.quantize_,
               sk.prepare_qat_, sk.accelerate, sk.sensitivity, sk.allocate, sk.sparsity_report):
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) <= 2, (fn.__name__, positional)
    with pytest.raises(TypeError, match="positional arguments"):
        sk.quantize_(mlp(), "int8", ["*"], [], None, None, False, "extra")
    with pytest.raises(TypeError, match="importance"):  # the old names are gone (pre-1.0)
        sk.ChannelPruner(mnist1d_cnn(), torch.randn(1, 1, 40), ratio=0.5, importance="lamp")


def test_channel_include_limits_pruning_like_exclude_of_the_rest():
    x = torch.randn(1, 1, 40)
    a, b = mnist1d_cnn(), mnist1d_cnn()
    b.load_state_dict(a.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings never warn
        sk.prune_channels_(a, x, ratio=0.5, include=["re:conv[23]"])
        sk.prune_channels_(b, x, ratio=0.5, exclude=["conv1"])
    base = widths(mnist1d_cnn())
    assert widths(a) == widths(b)
    assert widths(a)["conv1"] == base["conv1"] and widths(a)["conv2"] < base["conv2"]
    with pytest.raises(ValueError, match="include pattern 'nope' matches no module"):
        sk.prune_channels_(mnist1d_cnn(), x, ratio=0.5, include=["nope"])


def test_accelerate_selects_layers_like_the_pruner():

    def net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
        sk.prune_(m, pattern="2:4")
        return m

    x = torch.randn(2, 64)
    kw = dict(precision="bf16", device="cpu", compile=False, plan=sk.PlanOptions(cache=False))
    by_re = sk.accelerate(net(), x, exclude=["re:0|1"], **kw)
    by_include = sk.accelerate(net(), x, include=["2"], **kw)
    for fast in (by_re, by_include):
        variants = {d.name: d.variant for d in fast.report.layers}
        assert variants == {"2": "bf16_2:4"}
        assert type(fast.model[0]) is nn.Linear
    with pytest.raises(ValueError, match="exclude pattern 'fc9' matches no"):
        sk.accelerate(net(), x, exclude=["fc9"], **kw)
    with pytest.raises(TypeError, match="positional argument"):
        sk.accelerate(net(), x, "bf16", device="cpu", compile=False)


class _Writer:
    def __init__(self):
        self.scalars, self.texts = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[(tag, step)] = value

    def add_text(self, tag, text, step):
        self.texts[tag] = text


def _reports():
    model = mlp()
    sparsity = sk.prune_(model, pattern="2:4")
    quant = sk.quantize_(model, "int8", calibration=[torch.randn(4, 16)])
    channels = sk.prune_channels_(mnist1d_cnn(), torch.randn(1, 1, 40), ratio=0.5)
    table = sk.SensitivityTable([0.5], 1.0, {"fc": [1.5]}, {"fc": 8})
    accel = sk.AccelReport("bf16", "2:4", 1.0, "cpu")
    return {"sparsity": sparsity, "quant": quant, "channels": channels, "sensitivity": table,
            "accel": accel}


def test_every_report_follows_one_protocol():
    reports = _reports()
    assert len({type(r) for r in reports.values()}) == 5
    for tag, report in reports.items():
        assert isinstance(report, Report) and report.tag == tag
        json.dumps(report.to_dict())  # plain data
        md = report.to_markdown()
        assert "| --- |" in md, tag
        writer = _Writer()
        report.log(writer, step=7)
        assert f"{tag}/report" in writer.texts and writer.texts[f"{tag}/report"] == md
        for key, value in report.scalars().items():
            assert key.startswith(f"{tag}/") and (key, 7) in writer.scalars and value == \
                writer.scalars[(key, 7)]
    assert reports["sparsity"].scalars()["sparsity/global"] == pytest.approx(0.5)
    assert reports["quant"].scalars()["quant/quantized"] == 3


def test_exports_are_consistent():
    for name in ("channel_plan", "apply_channel_plan", "quant_plan", "apply_quant_plan",
                 "SparsityReport", "ChannelReport", "QuantReport", "SensitivityTable",
                 "AccelReport"):
        assert name in sk.__all__ and hasattr(sk, name)
    assert not [n for n in sk.__all__ if n.startswith("log_")]
    model = mlp()
    sk.quantize_(model, "int8")
    fresh = mlp()
    sk.apply_quant_plan(fresh, json.loads(json.dumps(sk.quant_plan(model))))
    assert type(fresh[0]) is type(model[0])
