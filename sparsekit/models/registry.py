"""Model builders by exact name: the only way a file (a checkpoint header, a run directory) can
say how to build a model.

A spec read from a file is ``{"builder": NAME, "kwargs": {...}}``: ``NAME`` must be registered
here (the built-ins, or your own factory registered in code with :func:`register_model`) and
``kwargs`` may hold only JSON values whose names the builder accepts. Nothing from a file is
ever passed to an import.

>>> from torch import nn
>>> register_model("doc_mlp", lambda width=8: nn.Sequential(nn.Linear(4, width)))
>>> model = build_registered("doc_mlp", {"width": 16})
>>> model._sparsekit_spec
{'builder': 'doc_mlp', 'kwargs': {'width': 16}}
>>> build_registered("doc_mlp", {"depth": 2})
Traceback (most recent call last):
...
sparsekit.errors.UsageError: model builder 'doc_mlp' takes no argument 'depth'; it takes: width
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.imports import load_internal
from sparsekit.registry import Registry

MODELS: Registry[Callable[..., nn.Module]] = Registry("model builder")
_DOCS: dict[str, str] = {}
# built-in names whose module registers them on import (keys of sparsekit.imports.INTERNAL)
_LAZY = ("hf",)
# torchvision builder arguments that download weights: never taken from a spec
_DOWNLOADS = ("weights", "progress")


def register_model(name: str, builder: Callable[..., nn.Module], *, doc: str = "") -> None:
    """Make ``builder`` (called with keyword arguments, returning an ``nn.Module``) buildable
    by ``name`` from model specs, for example the header of a file :func:`sparsekit.save`
    wrote. Registering a name again replaces its builder."""
    if not callable(builder):
        raise ConfigTypeError(f"register_model({name!r}): builder must be callable")
    MODELS.register(name, builder)
    _DOCS[name] = doc or (inspect.getdoc(builder) or "").split("\n")[0]


def registered_models() -> list[str]:
    """The names :func:`build_registered` accepts (lazily registered built-ins included)."""
    return sorted(set(MODELS.names()) | set(_LAZY))


def _builder(name: str) -> Callable[..., nn.Module]:
    if name not in MODELS and name in _LAZY:
        try:
            load_internal(name)
        except ImportError as e:
            raise UsageError(f"model builder {name!r} is not available here: {e}") from None
    if name not in MODELS:
        raise UsageError(
            f"model builder {name!r} is not registered; registered: "
            f"{', '.join(registered_models())} (register your own with "
            "sparsekit.register_model, or build the model yourself)"
        )
    return MODELS[name]


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigTypeError(f"{where}: key {k!r} is not a string")
            _check_json(v, f"{where}.{k}")
        return
    raise ConfigTypeError(
        f"{where} is a {type(value).__name__}; model arguments are JSON values only "
        "(str, int, float, bool, None, list, dict)"
    )


def _check_names(name: str, builder: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # no introspectable signature: JSON values only
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    allowed = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for key in kwargs:
        if key not in allowed:
            raise UsageError(
                f"model builder {name!r} takes no argument {key!r}; it takes: "
                f"{', '.join(allowed) or 'no arguments'}"
            )


def build_registered(name: str, kwargs: dict) -> nn.Module:
    """Build the model registered as ``name`` with ``kwargs`` (JSON values, names checked
    against the builder's signature). The model records ``model._sparsekit_spec =
    {"builder": name, "kwargs": kwargs}``, which :func:`sparsekit.save` stores."""
    if not isinstance(name, str):
        raise ConfigTypeError(f"model builder name must be a string, got {name!r}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ConfigTypeError(f"model builder {name!r}: kwargs must be a dict, got {kwargs!r}")
    _check_json(kwargs, f"model builder {name!r} kwargs")
    builder = _builder(name)
    _check_names(name, builder, kwargs)
    model = builder(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(
            f"model builder {name!r} returned {type(model).__name__}, not an nn.Module"
        )
    model._sparsekit_spec = {"builder": name, "kwargs": dict(kwargs)}
    return model


def torchvision_model(name: str, **kwargs: Any) -> nn.Module:
    """The torchvision model ``name`` (one of ``torchvision.models.list_models()``), built with
    random weights: arguments that download (``weights*``, ``progress``) are refused."""
    import torchvision

    names = torchvision.models.list_models()
    if name not in names:
        raise UsageError(
            f"torchvision model name={name!r} is not one of torchvision.models.list_models() "
            f"(e.g. {', '.join(names[:5])}, ...)"
        )
    bad = [k for k in kwargs if k.startswith(_DOWNLOADS)]
    if bad:
        raise UsageError(
            f"torchvision model {name!r}: {', '.join(bad)} would download weights; load "
            "trained weights with model.checkpoint=... (or sk.load) instead"
        )
    builder = torchvision.models.get_model_builder(name)
    params = inspect.signature(builder).parameters
    no_download = {k: None for k in params if k.startswith("weights")}  # e.g. weights_backbone
    return builder(**no_download, **kwargs)


def _register_builtins() -> None:
    from sparsekit.models.cnn1d import mnist1d_cnn
    from sparsekit.models.lm import tiny_lm

    register_model("mnist1d_cnn", mnist1d_cnn)
    register_model("tiny_lm", tiny_lm)
    register_model("torchvision", torchvision_model)


_register_builtins()
