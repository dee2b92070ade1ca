"""cuSPARSELt 2:4 GEMMs (any M; the large-M path of the bf16, fp8 and int8 2:4 layers, and the
optional bf16 prefill of an int4 2:4 layer): torch's binding (``sparsekit::sparse24_mm``) or,
for an fp8 layer with one activation and one weight scale, sparsekit's own
(``sparsekit::sparse24_mm_alpha``, :mod:`.ext`: scale, bias and GELU in the epilogue). Its
configurations are cuSPARSELt's algorithm ids, searched per shape by
:mod:`sparsekit.accel.algsearch` (the layer's ``alg_id``). On CPU the packed weight is the
dense weight and the ops run their references."""

from __future__ import annotations

import torch

from sparsekit.accel.kernels import UNBOUNDED, Format, Kernel, register
from sparsekit.accel.kernels.cusparselt import ext, op


def _pack(layer, w) -> dict:
    """The weight compressed for cuSPARSELt (CPU: as it is), with how this kernel runs the
    layer's numerics here: ``alpha`` (the layer's one scalar scale, applied in the GEMM's
    epilogue by sparsekit's binding where it loads; None: scales applied after the GEMM) and
    ``acc`` (the product's dtype: int32 for int8 where cuSPARSELt writes it exactly, else
    bf16)."""
    packed = op.pack_24(layer.gemm_weight(w))
    alpha = layer.scalar_scale if (layer.scalar_scale is not None
                                   and (not packed.is_cuda or op.alpha_path())) else None
    acc = torch.bfloat16
    if layer.precision == "int8":
        acc = op.int8_acc_dtype(packed.device.index or 0) if packed.is_cuda else torch.int32
    return {"packed": packed, "alpha": alpha, "acc": acc}


def _bytes(dtype: torch.dtype) -> float:
    # half the values plus 2 bits of position each (cuSPARSELt's metadata)
    return 0.5 * dtype.itemsize + 0.125


CSLT = Format("cslt", _pack, _bytes)


def _run(layer, x2d, w, config):
    if layer.fmt is None:  # bf16 (an int4 layer's bf16 prefill too)
        return op.sparse24_mm(x2d, w.packed, layer.bias, layer.out_features, layer.alg_id,
                              torch.bfloat16)
    q, sx = layer.quant(x2d)
    if w.alpha is not None:  # scale and bias inside the GEMM
        return op.sparse24_mm_alpha(q, w.packed, layer.bias, layer.out_features, layer.alg_id,
                                    w.alpha, False)
    acc = op.sparse24_mm(q, w.packed, None, layer.out_features, layer.alg_id, w.acc)
    return layer.epilogue(acc, sx)


def note(layers: list) -> str | None:
    """The report's line on where the fp8 2:4 layers among ``layers`` (those on this kernel)
    apply their scales: inside the GEMM (sparsekit's binding) or after it."""
    fp8 = [m for m in layers if m.precision == "fp8"]
    own = sum(m.alpha is not None for m in fp8)
    if own:
        return (f"epilogue: {own} fp8 2:4 layer(s) on sparsekit's cuSPARSELt binding (scale "
                f"and bias in the GEMM)")
    if any(not m.quantized for m in fp8):
        return ("epilogue: fp8 2:4 layers quantize activations per token, scales applied after "
                "the GEMM; a model quantized with quantize_(model, 'fp8_static_tensor', "
                "calibration=...) first runs scale and bias inside it (faster: docs/gpu.md)")
    if any(m.tensor_scale for m in fp8) and ext.reason():
        return (f"epilogue: sparsekit's cuSPARSELt binding unavailable ({ext.reason()}); "
                f"scales applied after torch's binding")
    return None


register(Kernel("cusparselt", "cusparselt", "linear", ("bf16", "fp8", "int8", "int4"), True,
                (1, UNBOUNDED), CSLT, _run,
                # an int4 layer keeps its int4 weight and dequantizes it (prefill="dequant")
                # unless asked to keep this bf16 copy too (prefill="bf16_2:4")
                prefer=lambda layer, w: layer.precision != "int4",
                ops=("sparse24_mm", "sparse24_mm_alpha"), note=note, order=20))
