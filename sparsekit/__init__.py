"""sparsekit: pruning, N:M sparsity and quantization for PyTorch models.

What is exported here: the verbs (``prune_``, ``quantize_``, ``accelerate``, ...), the pruners
and schedules, the five report types (each with ``to_dict()``, ``to_markdown()`` and
``log(writer, step)``: :mod:`sparsekit.reporting`), the two JSON plans a checkpoint stores
(``channel_plan``/``apply_channel_plan``, ``quant_plan``/``apply_quant_plan``), ``save``/``load``
and the model registry.
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
