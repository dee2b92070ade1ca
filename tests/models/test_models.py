"""Built-in models, torchvision by name, ``_target_`` factories, the registry and the rebuild
spec."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.models import build_model, build_registered, check_model_name
from sparsekit.prune.patterns import nm_incompatibility


def test_mnist1d_cnn_shapes_and_24_compatibility():
    model = build_model("mnist1d_cnn")
    assert model(torch.randn(3, 1, 40)).shape == (3, 10)
    assert model._sparsekit_spec == {"builder": "mnist1d_cnn", "kwargs": {}}
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
    assert model._sparsekit_spec["builder"] == "tiny_lm"
    assert model._sparsekit_spec["kwargs"]["d_model"] == 32
    report = sk.prune_(model, pattern="2:4", exclude=["lm_head"])
    assert report.skipped == {} and report.global_sparsity > 0.4


def small_mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_target_factory_builds_without_a_spec():
    """A factory the user typed (model._target_) builds, but records no spec: a file never
    names it, so loading its checkpoint takes model= or a registered builder."""
    model = build_model("ignored", target=f"{__name__}.small_mlp", kwargs={"width": 12})
    assert model[0].out_features == 12
    assert not hasattr(model, "_sparsekit_spec")


def test_registered_builder_validates_kwargs_and_records_spec(tmp_path):
    sk.register_model("test_small_mlp", small_mlp, doc="a 2-layer MLP")
    assert "test_small_mlp" in sk.registered_models()
    assert {"mnist1d_cnn", "tiny_lm", "torchvision", "hf"} <= set(sk.registered_models())
    model = build_registered("test_small_mlp", {"width": 6})
    assert model[0].out_features == 6
    assert model._sparsekit_spec == {"builder": "test_small_mlp", "kwargs": {"width": 6}}
    with pytest.raises(UsageError, match="takes no argument 'depth'; it takes: width"):
        build_registered("test_small_mlp", {"depth": 3})
    with pytest.raises(ConfigTypeError, match=r"kwargs.width is a Tensor"):
        build_registered("test_small_mlp", {"width": torch.tensor(3)})
    with pytest.raises(UsageError, match="'nope' is not registered"):
        build_registered("nope", {})
    # the spec round-trips through a file: sk.load rebuilds it by name
    sk.save(model, tmp_path / "m.safetensors")
    back = sk.load(tmp_path / "m.safetensors")
    assert back[0].out_features == 6 and torch.equal(back[0].weight, model[0].weight)


def test_torchvision_by_name():
    model = build_model("squeezenet1_1", kwargs={"num_classes": 3})
    assert model.classifier[1].out_channels == 3
    assert model._sparsekit_spec == {
        "builder": "torchvision", "kwargs": {"name": "squeezenet1_1", "num_classes": 3}
    }


def test_torchvision_never_downloads():
    with pytest.raises(UsageError, match="would download"):
        build_registered("torchvision", {"name": "resnet18", "weights": "DEFAULT"})
    with pytest.raises(UsageError, match="list_models"):
        build_registered("torchvision", {"name": "_api"})
    # a detection model whose backbone weights default to a download builds offline
    model = build_registered("torchvision", {"name": "fasterrcnn_mobilenet_v3_large_fpn",
                                             "num_classes": 3})
    assert model._sparsekit_spec["kwargs"]["num_classes"] == 3


def test_unknown_names():
    with pytest.raises(ValueError, match="model.name='nope'.*mnist1d_cnn, tiny_lm"):
        check_model_name("nope")
    with pytest.raises(ValueError, match="model._target_"):
        build_model("x", target="sparsekit.models.no_such_factory")
    with pytest.raises(TypeError, match="not nn.Module"):
        build_model("x", target="builtins.dict")
