"""sparsekit: pruning, N:M sparsity and quantization for PyTorch models.

What is exported here: the verbs (``prune_``, ``quantize_``, ``accelerate``, ...), the pruners
and schedules, the five report types (each with ``to_dict()``, ``to_markdown()`` and
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

import warnings as _warnings

from sparsekit.accel import AccelReport, accelerate
from sparsekit.prune.channels import (
    ChannelPruner,
    ChannelReport,
    apply_channel_plan,
    channel_plan,
    prune_channels_,
)
from sparsekit.prune.pruner import Pruner, prune_
from sparsekit.quant import (
    QuantReport,
    apply_quant_plan,
    convert_,
    prepare_qat_,
    quant_plan,
    quantize_,
)
from sparsekit.prune.report import SparsityReport, sparsity_report
from sparsekit.prune.schedules import Cubic, Linear, OneShot, Schedule
from sparsekit.io.checkpoint import load, save
from sparsekit.models.registry import register_model, registered_models
from sparsekit.prune.sensitivity import SensitivityTable, allocate, sensitivity

__all__ = [
    "AccelReport",
    "accelerate",
    "load",
    "save",
    "ChannelPruner",
    "ChannelReport",
    "Cubic",
    "Linear",
    "OneShot",
    "Pruner",
    "QuantReport",
    "Schedule",
    "SensitivityTable",
    "SparsityReport",
    "allocate",
    "apply_channel_plan",
    "apply_quant_plan",
    "channel_plan",
    "convert_",
    "prepare_qat_",
    "prune_",
    "prune_channels_",
    "quant_plan",
    "quantize_",
    "register_model",
    "registered_models",
    "sensitivity",
    "sparsity_report",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "log_accel_report":  # before the report protocol: report.log(writer, step)
        _warnings.warn("sk.log_accel_report is deprecated; use report.log(writer, step)",
                       DeprecationWarning, stacklevel=2)
        from sparsekit.accel.report import log_accel_report

        return log_accel_report
    raise AttributeError(f"module 'sparsekit' has no attribute {name!r}")
