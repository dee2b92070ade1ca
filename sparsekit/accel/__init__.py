"""GPU runtime: 2:4 sparse and fp8/int8 linear layers on tensor cores, cuSPARSELt algorithm
search, CUDA graphs per input-shape bucket, and the speed-aware planner (``accelerate``)."""

from sparsekit.accel.api import accelerate
from sparsekit.accel.model import AcceleratedModel
from sparsekit.accel.options import CompileOptions, PlanOptions
from sparsekit.accel.planner import layer_plan
from sparsekit.accel.report import AccelReport, LayerDecision, decide
from sparsekit.io import checkpoint

checkpoint.register_accelerator(accelerate)

__all__ = [
    "AccelReport",
    "AcceleratedModel",
    "CompileOptions",
    "LayerDecision",
    "PlanOptions",
    "accelerate",
    "decide",
    "layer_plan",
]
