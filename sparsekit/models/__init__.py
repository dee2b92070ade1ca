"""Built-in models, torchvision models by name, and any importable factory.

Every model built here carries ``model._sparsekit_spec = {"_target_": "<factory>", **kwargs}``
so that a saved checkpoint can rebuild its architecture without unpickling code.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sparsekit.data import import_object
from sparsekit.models.cnn1d import mnist1d_cnn
from sparsekit.models.lm import tiny_lm

BUILTIN_MODELS = {"mnist1d_cnn": mnist1d_cnn, "tiny_lm": tiny_lm}


def _torchvision_names() -> list[str]:
    try:
        import torchvision
    except ImportError:
        return []
    return list(torchvision.models.list_models())


def check_model_name(name: str, target: str | None = None) -> None:
    """Raise ValueError naming ``model.name`` and the allowed values for an unknown model."""
    if target is not None or name in BUILTIN_MODELS or name == "hf":
        return
    if name.removeprefix("torchvision.") not in _torchvision_names():
        raise ValueError(
            f"model.name={name!r} is not allowed; choose one of: {', '.join(BUILTIN_MODELS)}, hf, "
            "a torchvision model name (e.g. resnet18), or set model._target_ to a factory"
        )


def build_model(name: str, target: str | None = None, kwargs: dict[str, Any] | None = None):
    """``target`` (an importable ``"pkg.mod.factory"``) called with ``kwargs``; else built-in
    model ``name``; else the torchvision model ``name`` (optionally prefixed "torchvision.")."""
    kwargs = dict(kwargs or {})
    if target is not None:
        factory, target_path = import_object(target, "model._target_"), target
    elif name in BUILTIN_MODELS:
        factory = BUILTIN_MODELS[name]
        target_path = f"{factory.__module__}.{factory.__name__}"
    else:
        check_model_name(name)
        import torchvision

        tv_name = name.removeprefix("torchvision.")
        kwargs = {"name": tv_name, **kwargs}
        factory, target_path = torchvision.models.get_model, "torchvision.models.get_model"
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        raise TypeError(f"model factory {target_path} returned {kind}, not nn.Module")
    model._sparsekit_spec = {"_target_": target_path, **kwargs}
    return model
