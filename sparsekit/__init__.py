"""sparsekit: pruning, N:M sparsity and quantization for PyTorch models.

The public API, loaded lazily: ``import sparsekit`` imports no submodule (nor torch-pruning,
safetensors, triton, Hydra or transformers); ``sparsekit.Pruner`` imports the module that
defines it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AccelReport": "sparsekit.accel",
    "accelerate": "sparsekit.accel",
    "log_accel_report": "sparsekit.accel",
    "ChannelPruner": "sparsekit.prune.channels",
    "ChannelReport": "sparsekit.prune.channels",
    "apply_channel_plan": "sparsekit.prune.channels",
    "channel_plan": "sparsekit.prune.channels",
    "prune_channels_": "sparsekit.prune.channels",
    "Pruner": "sparsekit.prune.pruner",
    "prune_": "sparsekit.prune.pruner",
    "QuantReport": "sparsekit.quant",
    "convert_": "sparsekit.quant",
    "prepare_qat_": "sparsekit.quant",
    "quantize_": "sparsekit.quant",
    "SparsityReport": "sparsekit.prune.report",
    "sparsity_report": "sparsekit.prune.report",
    "Cubic": "sparsekit.prune.schedules",
    "Linear": "sparsekit.prune.schedules",
    "OneShot": "sparsekit.prune.schedules",
    "Schedule": "sparsekit.prune.schedules",
    "load": "sparsekit.io.checkpoint",
    "save": "sparsekit.io.checkpoint",
    "register_model": "sparsekit.models.registry",
    "registered_models": "sparsekit.models.registry",
    "SensitivityTable": "sparsekit.prune.sensitivity",
    "allocate": "sparsekit.prune.sensitivity",
    "sensitivity": "sparsekit.prune.sensitivity",
}
# sk.save / sk.load store and rebuild channel-pruned and quantized models and accelerate them:
# the modules that own those register their handlers with the checkpoint when imported
_CHECKPOINT_HANDLERS = ("sparsekit.prune.channels", "sparsekit.quant", "sparsekit.accel")

# ``sparsekit.quant.quantize_`` after a plain ``import sparsekit`` works as it did when the
# package imported its subpackages eagerly
_SUBPACKAGES = ("accel", "data", "io", "models", "prune", "quant", "run")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"sparsekit.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparsekit' has no attribute {name!r}")
    if name in ("save", "load"):
        for module in _CHECKPOINT_HANDLERS:
            importlib.import_module(module)
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

