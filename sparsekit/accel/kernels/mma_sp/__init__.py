"""The small-M 2:4 CUDA library on the sparse tensor cores (``mma.sp``, :mod:`.launch`,
``csrc/sk24_mma.cu``), M <= 32: bf16 weights, fp8 weights (widened in registers, or on the fp8
x fp8 kernel where it passed its self-check) and int4 weights (``mma_sp_int4``). Its
configurations (warps, steps ahead, row tiles, x mode) are chosen per token bucket
(:data:`.launch.BUCKETS`) by the planner where the library loads; on CPU the ops run their
references. A bf16 layer (and a weight-only fp8 one) takes it wherever it loads; a W8A8 fp8
layer takes it only when the planner timed it faster than the Triton kernel
(``PlanOptions(mma_sp="all")``: untimed)."""

from __future__ import annotations

import torch

from sparsekit.accel.kernels import Format, Kernel, register
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel.kernels.mma_sp import op


def _pack(layer, w: torch.Tensor) -> dict:
    layout = "paired" if layer.weight_only else sk24_mma.layout_for(w)
    values, meta = sk24_mma.compress(w, layout)
    # a W8A8 fp8 layer's quantized activations reach the kernel widened, exactly: to f16
    # where the library runs fp8 weights on the f16 sparse tensor cores, else to bf16 (a
    # weight-only layer's bf16 activations as they are)
    f16 = w.dtype == torch.float8_e4m3fn and not layer.weight_only and sk24_mma.fp8_f16_ok()
    return {"values": values, "meta": meta, "layout": layout,
            "wide": torch.float16 if f16 else torch.bfloat16}


MMA = Format("mma", _pack, lambda dtype: 0.5 * dtype.itemsize + 0.125,
             unpack=lambda layer, t: sk24_mma.decompress(t["values"], t["meta"]))


def _why_not(w: torch.Tensor) -> str | None:
    if not w.is_cuda:
        return "not on a CUDA device"
    shape = sk24_mma.check_shape(*w.shape)
    if shape:
        return shape
    if not sk24_mma.enabled():
        return "turned off (PlanOptions(mma_sp='off'))"
    return None if sk24_mma.load() is not None else (sk24_mma.reason() or "library not loaded")


def _check(layer, w: torch.Tensor) -> str | None:
    """bf16: where the library loads (:func:`.launch.usable`); fp8 weight-only: with bf16 x;
    W8A8 fp8: where it would run the layer untimed or the planner may time it."""
    if layer.weight_only:
        ok = sk24_mma.choosable(w, torch.bfloat16)
    elif layer.precision == "fp8":
        ok = sk24_mma.usable(w) or sk24_mma.choosable(w)
    else:
        ok = sk24_mma.usable(w)
    return None if ok else (_why_not(w) or "the library does not run this weight")


def _prefer(layer, w: torch.Tensor) -> bool:
    # a W8A8 fp8 layer only untimed under PlanOptions(mma_sp="all") (launch.dtypes)
    return layer.precision != "fp8" or sk24_mma.usable(w)


def _flat(config) -> list[int] | None:
    return None if config is None else [v for c in config for v in c]


def _run(layer, x2d, w, config):
    cfg = _flat(config)
    if w.layout == "e4m3":  # fp8 x fp8 on the fp8 sparse tensor cores
        q, sx = layer.quant(x2d)
        return op.sk24_mma_mm(q, w.values, w.meta, sx, layer.w_scale, layer.bias, cfg)
    if layer.fmt is None:
        return op.sk24_mma_mm(x2d.to(torch.bfloat16), w.values, w.meta, None, None, layer.bias,
                              cfg)
    # an fp8 layer's activations widened to f16 or bf16 (exact)
    q, sx = layer.quant(x2d)
    return op.sk24_mma_mm(q.to(w.wide), w.values, w.meta, sx, layer.w_scale, layer.bias, cfg)


def _pack_int4(layer, source) -> dict[str, torch.Tensor]:
    q, scales = source
    values, meta, packed = sk24_mma.compress_int4(q, scales)
    return {"values": values, "meta": meta, "scales": packed}


def _unpack_int4(layer, t) -> tuple[torch.Tensor, torch.Tensor]:
    q, per = sk24_mma.decompress_int4(t["values"], t["meta"], t["scales"])
    # the format keeps a scale per 128 columns: the layer's group is a multiple of 128
    return q, per[:, ::layer.group_size // sk24_mma.INT4_COLUMNS].contiguous()


MMA_INT4 = Format("mma_int4", _pack_int4, lambda dtype: 0.25 + 0.125 + 4 / 128,
                  unpack=_unpack_int4)


def _check_int4(layer, source) -> str | None:
    q, _ = source
    if sk24_mma.usable_int4(q, layer.group_size):
        return None
    return (_why_not(q) or sk24_mma.check_int4(*q.shape, layer.group_size)
            or "the library's int4 way failed its self-check")


def _run_int4(layer, x2d, w, config):
    return op.sk24_mma_int4_mm(x2d, w.values, w.meta, w.scales, layer.bias, _flat(config))


register(Kernel("mma_sp", "mma_sp", "linear", ("bf16", "fp8", "fp8w"), True,
                (1, sk24_mma.MAX_M), MMA, _run, check=_check, prefer=_prefer,
                configs=lambda layer, w: sk24_mma.candidates(w.values, w.wide),
                buckets=sk24_mma.BUCKETS, config_text=sk24_mma.config_text,
                ops=("sk24_mma_mm",), order=30))
register(Kernel("mma_sp_int4", "mma_sp", "linear", ("int4",), True, (1, sk24_mma.MAX_M),
                MMA_INT4, _run_int4, check=_check_int4,
                configs=lambda layer, w: sk24_mma.candidates(w.values),
                buckets=sk24_mma.BUCKETS, config_text=sk24_mma.config_text,
                ops=("sk24_mma_int4_mm",), order=31))
