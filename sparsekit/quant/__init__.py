"""Quantization: int8 weight-only, int8 W8A8, fp8 (e4m3) W8A8 and int4 weight-only (W4A16)
layers; post-training quantization (``quantize_``: round to nearest, or GPTQ for int4, with
N:M pruning in the same sweep) and quantization-aware training (``prepare_qat_``/``convert_``),
both composing with pruning masks; the plan a checkpoint needs to rebuild quantized layers."""

from sparsekit.quant.formats import SCHEMES, Scheme, get_scheme, register_scheme
from sparsekit.quant.gptq import GPTQ
from sparsekit.quant.modules import QuantConv, QuantLinear
from sparsekit.quant.plan import apply_quant_plan, quant_plan
from sparsekit.quant.qat import convert_, prepare_qat_
from sparsekit.quant.quantize import quantize_
from sparsekit.quant.report import QuantLayer, QuantReport

__all__ = [
    "GPTQ",
    "SCHEMES",
    "QuantConv",
    "QuantLayer",
    "QuantLinear",
    "QuantReport",
    "Scheme",
    "apply_quant_plan",
    "convert_",
    "get_scheme",
    "register_scheme",
    "prepare_qat_",
    "quant_plan",
    "quantize_",
]
