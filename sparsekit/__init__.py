"""sparsekit: pruning, N:M sparsity and quantization for PyTorch models.

The public API, loaded lazily: ``import sparsekit`` imports no submodule (nor torch-pruning,
safetensors, triton, Hydra or transformers); ``sparsekit.Pruner`` imports the module that
defines it on first use.

What is exported: the verbs (``prune_``, ``quantize_``, ``accelerate``, ...), the pruners and
schedules, the five report types (each with ``to_dict()``, ``to_markdown()`` and
``log(writer, step)``: :mod:`sparsekit.reporting`), the two JSON plans a checkpoint stores
(``channel_plan``/``apply_channel_plan``, ``quant_plan``/``apply_quant_plan``), ``save``/``load``
and the model registry.

What sparsekit writes on your modules (nothing else; the process environment is never changed
by a library call):

- ``Pruner``: a ``WeightMask`` parametrization on each selected layer's ``weight``
  (``torch.nn.utils.parametrize``); ``finalize()``/``prune_`` fold it, leaving a plain
  ``weight`` Parameter in its original place in the state_dict.
- ``prepare_qat_``: a ``WeightFakeQuant`` parametrization, for W8A8 schemes a forward pre-hook,
  and the attribute ``sparsekit_qat_scheme`` (the scheme name) on each prepared layer;
  ``convert_`` removes all three and swaps in the quantized layer.
- ``quantize_``, ``convert_``, ``accelerate``: replace selected submodules (QuantLinear,
  QuantConv, the accel layers); ``accelerate`` also moves the model to its device in bf16.
- ``prune_channels_``/``ChannelPruner``/``apply_channel_plan``: replace pruned tensors and update
  the width attributes the modules already have (``out_features``, ``in_channels``,
  ``num_heads``, ``num_attention_heads``, ``all_head_size``, ``attention_head_size``,
  ``hidden_dim``, ...) so that their forward matches the new shapes.
- Models built by :mod:`sparsekit.models` builders (and ``model=hf``) carry
  ``_sparsekit_spec`` (builder name and keyword arguments), read by ``save`` to rebuild them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AccelReport": "sparsekit.accel",
    "accelerate": "sparsekit.accel",
    "CompileOptions": "sparsekit.accel",
    "PlanOptions": "sparsekit.accel",
    "ChannelPruner": "sparsekit.prune.channels",
    "ChannelReport": "sparsekit.prune.channels",
    "apply_channel_plan": "sparsekit.prune.channels",
    "channel_plan": "sparsekit.prune.channels",
    "prune_channels_": "sparsekit.prune.channels",
    "register_channel_criterion": "sparsekit.prune.channels",
    "Distiller": "sparsekit.prune.distill",
    "distill_": "sparsekit.prune.distill",
    "Pruner": "sparsekit.prune.pruner",
    "prune_": "sparsekit.prune.pruner",
    "GPTQ": "sparsekit.quant",
    "QuantReport": "sparsekit.quant",
    "apply_quant_plan": "sparsekit.quant",
    "quant_plan": "sparsekit.quant",
    "convert_": "sparsekit.quant",
    "prepare_qat_": "sparsekit.quant",
    "quantize_": "sparsekit.quant",
    "register_scheme": "sparsekit.quant",
    "SparsityReport": "sparsekit.prune.report",
    "sparsity_report": "sparsekit.prune.report",
    "Cubic": "sparsekit.prune.schedules",
    "Linear": "sparsekit.prune.schedules",
    "OneShot": "sparsekit.prune.schedules",
    "Schedule": "sparsekit.prune.schedules",
    "load": "sparsekit.io.checkpoint",
    "save": "sparsekit.io.checkpoint",
    "register_criterion": "sparsekit.prune.criteria",
    "register_model": "sparsekit.models.registry",
    "registered_models": "sparsekit.models.registry",
    "SensitivityTable": "sparsekit.prune.sensitivity",
    "allocate": "sparsekit.prune.sensitivity",
    "sensitivity": "sparsekit.prune.sensitivity",
    "teacher_samples": "sparsekit.data.teacher",
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

