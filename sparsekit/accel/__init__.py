"""GPU runtime: 2:4 sparse and fp8/int8 linear layers on tensor cores, cuSPARSELt algorithm
search, CUDA graphs per input-shape bucket, and the speed-aware planner (``accelerate``)."""

from sparsekit.accel.api import AcceleratedModel, accelerate, layer_plan
from sparsekit.accel.report import AccelReport, LayerDecision, decide
from sparsekit.io import checkpoint

checkpoint.register_accelerator(accelerate)

__all__ = [
    "AccelReport",
    "AcceleratedModel",
    "LayerDecision",
    "accelerate",
    "decide",
    "layer_plan",
]
