"""Per layer: which variants a linear layer may run (:func:`layer_plan`), the pure choice among
their timings at one GEMM shape (:func:`choose`), and how one candidate is timed as it will
run (:func:`time_module`: compiled with inductor, so its activation quantization and scale
epilogue are fused as inside the model, timed under CUDA-graph replay; wall clock on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel.layers import scheme_precision, variant_name
from sparsekit.accel.report import BASELINE, LayerDecision, decide
from sparsekit.nn.timing import graph_time_us, time_ms
from sparsekit.quant.modules import QuantLinear

DECODE_TOKENS = 64  # M at or below this is decode-sized: 2:4 often loses there (docs/gpu.md)
DECODE_MARGIN = 1.05  # ... so there a 2:4 variant must beat the best dense one by 5%
_ALIGN = 32  # in/out features the 8-bit and 2:4 kernels take (cuSPARSELt, _scaled_mm, _int_mm)


def choose(timings_us: dict[str, float], tokens: int, min_speedup: float = 1.0
           ) -> tuple[str, str]:
    """(variant, why) from one GEMM shape's timings (us). The fastest variant that beats bf16
    dense by ``min_speedup``; bf16 dense otherwise. At decode sizes (``tokens`` <= 64) a 2:4
    variant must also beat the best dense variant (bf16 or fp8/int8 dense) by
    ``DECODE_MARGIN``, else that dense one is kept: small GEMMs time noisily, and there 2:4
    gains least and (for 8-bit) adds the most error."""
    variant, speedup = decide(timings_us, min_speedup)
    if variant == BASELINE:
        return BASELINE, "no variant beat bf16 dense" + (
            f" by {min_speedup}x" if min_speedup != 1.0 else "")
    why = f"fastest measured ({speedup:.2f}x bf16 dense at M={tokens})"
    if tokens <= DECODE_TOKENS and variant.endswith("2:4"):
        dense = {v: t for v, t in timings_us.items() if v.endswith("dense")}
        best_dense = min(dense, key=dense.get)
        if timings_us[variant] * DECODE_MARGIN > dense[best_dense]:
            if best_dense != BASELINE and dense[BASELINE] / dense[best_dense] < min_speedup:
                best_dense = BASELINE
            return best_dense, (f"decode-sized (M={tokens}): 2:4 not {DECODE_MARGIN}x faster "
                                f"than {best_dense}")
    return variant, why



def time_module(module: nn.Module, x: torch.Tensor, backend: str = "inductor",
                inductor: dict | None = None) -> float:
    """Microseconds per call of ``module(x)`` as it will run: compiled with ``backend`` and
    extra ``inductor`` options (no CUDA graphs of its own) and timed under CUDA-graph replay on
    CUDA; wall clock on CPU."""
    fn = _compat.compile_module(module, dynamic=False, backend=backend, options=inductor)
    # every candidate class shares AccelLinear.forward's code object: without a higher limit
    # dynamo stops recompiling it after 8 candidates and the rest would be timed eagerly
    with torch.no_grad(), _compat.recompile_limit(1 << 16):
        if x.is_cuda:
            return graph_time_us(lambda: fn(x))
        return time_ms(lambda: fn(x), "cpu", warmup=1, repeats=5) * 1e3



def own_precision(layer: nn.Module) -> str | None:
    """The accel precision that keeps a ``QuantLinear``'s numerics: a W8A8 layer's activation
    format ("fp8" for fp8 and fp8_static, "int8" for int8 and int8_static), "fp8w" for
    fp8_weight_only; None for other layers."""
    return scheme_precision(layer.scheme) if isinstance(layer, QuantLinear) else None


def layer_plan(has_2to4: bool, precision: str, sparsity: str, in_features: int,
               out_features: int, dense_precision: str = "bf16") -> tuple[list[str], str]:
    """Candidate variants for one linear (bf16 dense always first; the last one is what
    sparsity "2:4"/"dense" installs) and why the list is what it is. Pure."""
    if in_features % _ALIGN or out_features % _ALIGN:
        return [BASELINE], (f"in/out features {in_features}/{out_features} not multiples of "
                            f"{_ALIGN}: stays bf16 dense")
    if sparsity == "dense":
        return list(dict.fromkeys([BASELINE, variant_name(precision, False)])), "sparsity=dense"
    if not has_2to4:
        return (list(dict.fromkeys([BASELINE, variant_name(dense_precision, False)])),
                f"weight holds no 2:4 pattern: {dense_precision} dense")
    if sparsity == "2:4":
        return [BASELINE, variant_name(precision, True)], "2:4 pattern"
    cands = [BASELINE, variant_name(precision, False), "bf16_2:4", variant_name(precision, True)]
    return list(dict.fromkeys(cands)), "auto: fastest measured"


@dataclass
class PlannedLayer:
    """A layer ``accelerate`` may replace: the original ``layer``, the ``tokens`` (M) it is
    called with on the example inputs, its ``candidates`` (variants, bf16 dense first; with
    ``sparsity="auto"`` those that ran at its shape) and its ``decision`` (the report's entry;
    ``decision.variant`` is what gets installed)."""

    layer: nn.Module
    tokens: int
    candidates: list[str]
    decision: LayerDecision



__all__ = ["DECODE_MARGIN", "DECODE_TOKENS", "PlannedLayer", "choose", "layer_plan",
           "own_precision", "time_module"]
