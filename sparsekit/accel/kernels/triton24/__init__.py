"""sparsekit's own 2:4 format (values and 2-bit positions, :mod:`.format`) and its small-M
Triton kernel (``sparsekit::sk24_mm``, M <= 32: decode), for bf16 and fp8 2:4 layers (fp8
weight-only too); plus the fp8 weight-only layers' large-M path, the format widened to bf16 in
one pass (``sparsekit::sk24_widen``) then ``F.linear``."""

from __future__ import annotations

import torch

from sparsekit.accel.kernels import UNBOUNDED, Format, Kernel, register
from sparsekit.accel.kernels.dense.op import widened_mm
from sparsekit.accel.kernels.triton24 import format as sk24
from sparsekit.accel.kernels.triton24 import op


def _pack(layer, w: torch.Tensor) -> dict[str, torch.Tensor]:
    values, meta = sk24.compress(w)
    return {"values": values, "meta": meta}


SK24 = Format("sk24", _pack, lambda dtype: 0.5 * dtype.itemsize + 0.125,
              unpack=lambda layer, t: sk24.decompress(t["values"], t["meta"]))


def _check(layer, w) -> str | None:
    return sk24.check_shape(layer.out_features, layer.in_features)


def _run(layer, x2d, w, config):
    # x as the kernel's position planes, made by torch ops that the compiler fuses into x's
    # producer (the custom op itself is opaque to it)
    if layer.fmt is None:
        return op.sk24_mm(sk24.planes(x2d), w.values, w.meta, None, None, layer.bias)
    q, sx = layer.quant(x2d)
    return op.sk24_mm(sk24.planes(q), w.values, w.meta, sx, layer.w_scale, layer.bias)


def _run_widened(layer, x2d, w, config):
    # exact widening behind one op: a compiler traces one call, not decompress's twenty-odd
    # elementwise ops a layer (the first generate's compile time)
    return widened_mm(x2d, op.sk24_widen(w.values, w.meta), layer.w_scale, layer.bias)


register(Kernel("sk24", "triton24", "linear", ("bf16", "fp8", "fp8w"), True, (1, sk24.MAX_M),
                SK24, _run, check=_check, ops=("sk24_mm",), order=40))
register(Kernel("sk24_widen", "triton24", "linear", ("fp8w",), True, (1, UNBOUNDED), SK24,
                _run_widened, check=_check, ops=("sk24_widen",), order=41))
