"""Built-in models, torchvision by name, ``_target_`` factories, and the rebuild spec."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.models import build_model, check_model_name
from sparsekit.patterns import nm_incompatibility


def test_mnist1d_cnn_shapes_and_24_compatibility():
    model = build_model("mnist1d_cnn")
    assert model(torch.randn(3, 1, 40)).shape == (3, 10)
    assert model._sparsekit_spec == {"_target_": "sparsekit.models.cnn1d.mnist1d_cnn"}
    # every layer but the 1-channel input conv can take 2:4
    bad = {n for n, m in model.named_modules() if isinstance(m, (nn.Conv1d, nn.Linear))
           and nm_incompatibility(m.weight.shape, 4)}
    assert bad == {"conv1"}


def test_tiny_lm_is_causal():
    model = build_model("tiny_lm", kwargs={"d_model": 32, "n_layers": 2, "n_heads": 2,
                                           "seq_len": 16}).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = 0  # changing later tokens must not change earlier logits
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
    assert model(x).shape == (2, 16, 256)
    assert model._sparsekit_spec["_target_"] == "sparsekit.models.lm.tiny_lm"
    assert model._sparsekit_spec["d_model"] == 32
    report = sk.prune_(model, pattern="2:4", exclude=["lm_head"])
    assert report.skipped == {} and report.global_sparsity > 0.4


def small_mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_target_factory_and_spec_rebuilds():
    model = build_model("ignored", target=f"{__name__}.small_mlp", kwargs={"width": 12})
    assert model[0].out_features == 12
    spec = dict(model._sparsekit_spec)
    target = spec.pop("_target_")
    rebuilt = build_model("ignored", target=target, kwargs=spec)
    assert rebuilt[0].weight.shape == model[0].weight.shape


def test_torchvision_by_name():
    model = build_model("squeezenet1_1", kwargs={"num_classes": 3})
    assert model.classifier[1].out_channels == 3
    assert model._sparsekit_spec == {
        "_target_": "torchvision.models.get_model", "name": "squeezenet1_1", "num_classes": 3
    }


def test_unknown_names():
    with pytest.raises(ValueError, match="model.name='nope'.*mnist1d_cnn, tiny_lm"):
        check_model_name("nope")
    with pytest.raises(ValueError, match="model._target_"):
        build_model("x", target="sparsekit.models.no_such_factory")
    with pytest.raises(TypeError, match="not nn.Module"):
        build_model("x", target="builtins.dict")
