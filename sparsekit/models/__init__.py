"""Built-in models, torchvision models by name, and a user's factory typed on the command line.

Every model built from a registered builder (:mod:`sparsekit.models.registry`) carries
``model._sparsekit_spec = {"builder": NAME, "kwargs": {...}}`` so that a saved checkpoint can
rebuild its architecture without unpickling or importing anything. A model from a factory the
user named (``model._target_``) has no spec: loading its checkpoint takes ``model=`` (or a
builder registered in code with :func:`sparsekit.register_model`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sparsekit.imports import import_object
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.models.cnn1d import mnist1d_cnn
from sparsekit.models.lm import tiny_lm
from sparsekit.models.registry import build_registered, register_model, registered_models

BUILTIN_MODELS = {"mnist1d_cnn": mnist1d_cnn, "tiny_lm": tiny_lm}

__all__ = ["build_model", "build_registered", "check_model_name", "register_model",
           "registered_models"]


def _torchvision_names() -> list[str]:
    try:
        import torchvision
    except ImportError:
        return []
    return list(torchvision.models.list_models())


def check_model_name(name: str, target: str | None = None) -> None:
    """Raise UsageError naming ``model.name`` and the allowed values for an unknown model."""
    if target is not None or name in registered_models():
        return
    if name.removeprefix("torchvision.") not in _torchvision_names():
        raise UsageError(
            f"model.name={name!r} is not allowed; choose one of: {', '.join(BUILTIN_MODELS)}, "
            "a torchvision model name (e.g. resnet18), a name registered with "
            "sparsekit.register_model, or set model._target_ to a factory"
        )


def build_model(name: str, target: str | None = None, kwargs: dict[str, Any] | None = None):
    """``target`` (an importable ``"pkg.mod.factory"`` the user typed: never a value read from
    a file) called with ``kwargs``; else the registered builder ``name``; else the torchvision
    model ``name`` (optionally prefixed "torchvision.")."""
    kwargs = dict(kwargs or {})
    if target is not None:
        model = import_object(target, "model._target_")(**kwargs)
        if not isinstance(model, nn.Module):
            kind = type(model).__name__
            raise ConfigTypeError(f"model._target_={target!r} returned {kind}, not nn.Module")
        return model
    if name in registered_models() and name != "torchvision":
        return build_registered(name, kwargs)
    check_model_name(name)
    return build_registered("torchvision", {"name": name.removeprefix("torchvision."), **kwargs})
