"""sparsekit: pruning, N:M sparsity and quantization for PyTorch models."""

from sparsekit.accel import AccelReport, accelerate, log_accel_report
from sparsekit.prune.channels import (
    ChannelPruner,
    ChannelReport,
    apply_channel_plan,
    channel_plan,
    prune_channels_,
)
from sparsekit.prune.pruner import Pruner, prune_
from sparsekit.quant import QuantReport, convert_, prepare_qat_, quantize_
from sparsekit.prune.report import SparsityReport, sparsity_report
from sparsekit.prune.schedules import Cubic, Linear, OneShot, Schedule
from sparsekit.io.checkpoint import load, save
from sparsekit.models.registry import register_model, registered_models
from sparsekit.prune.sensitivity import SensitivityTable, allocate, sensitivity

__all__ = [
    "AccelReport",
    "accelerate",
    "load",
    "log_accel_report",
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
    "channel_plan",
    "convert_",
    "prepare_qat_",
    "prune_",
    "prune_channels_",
    "quantize_",
    "register_model",
    "registered_models",
    "sensitivity",
    "sparsity_report",
]
__version__ = "0.1.0"
