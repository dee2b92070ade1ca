"""The W4A16 Triton kernels (:mod:`.format`, :mod:`.kernel`): int4 values with float32 scales
per group of input columns, bf16 activations. Small M (decode, M <= 32): ``int4_triton``
(``sparsekit::int4_mm``, dense) and ``int4_24_triton`` (``sparsekit::int4_24_mm``, 2:4) read
the packed weight once. Larger M (prefill, compute-bound): the weight dequantized to bf16 on
each call, then ``F.linear`` (``int4_dequant``; a 2:4 weight in one pass,
``sparsekit::int4_24_widen``). On CPU the ops run their references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekit.accel.kernels import UNBOUNDED, Format, Kernel, register
from sparsekit.accel.kernels.int4 import format as w4a16
from sparsekit.accel.kernels.int4 import op


def _pack(layer, source) -> dict[str, torch.Tensor]:
    values, scales = w4a16.pack(*source)
    return {"values": values, "scales": scales}


def _pack_24(layer, source) -> dict[str, torch.Tensor]:
    values, meta, scales = w4a16.pack_24(*source)
    return {"values": values, "meta": meta, "scales": scales}


# bytes per weight at group 128: dense 0.5 + 4/128, 2:4 0.25 + 0.125 (positions) + 4/128
INT4 = Format("int4", _pack, lambda dtype: 0.5 + 4 / w4a16.GROUP_SIZE,
              unpack=lambda layer, t: (w4a16.unpack(t["values"]), t["scales"]))
INT4_24 = Format("int4_24", _pack_24, lambda dtype: 0.375 + 4 / w4a16.GROUP_SIZE,
                 unpack=lambda layer, t: (w4a16.unpack_24(t["values"], t["meta"]),
                                          t["scales"]))


def _run(layer, x2d, w, config):
    return op.int4_mm(x2d, w.values, w.scales, layer.bias)


def _run_24(layer, x2d, w, config):
    return op.int4_24_mm(x2d, w.values, w.meta, w.scales, layer.bias)


def _run_dequant(layer, x2d, w, config):
    return F.linear(x2d, w4a16.dequantize_packed(w.values, w.scales, torch.bfloat16),
                    layer.bias)


def _run_dequant_24(layer, x2d, w, config):
    # one op (one pass on CUDA): a compiler traces one call, not the dequantization's
    # elementwise ops a layer (the first generate's compile time)
    return F.linear(x2d, op.int4_24_widen(w.values, w.meta, w.scales), layer.bias)


register(Kernel("int4_triton", "int4", "linear", ("int4",), False, (1, w4a16.MAX_M), INT4,
                _run, ops=("int4_mm",), order=50))
register(Kernel("int4_24_triton", "int4", "linear", ("int4",), True, (1, w4a16.MAX_M),
                INT4_24, _run_24, ops=("int4_24_mm",), order=50))
register(Kernel("int4_dequant", "int4", "linear", ("int4",), False, (1, UNBOUNDED), INT4,
                _run_dequant, order=55))
register(Kernel("int4_24_dequant", "int4", "linear", ("int4",), True, (1, UNBOUNDED), INT4_24,
                _run_dequant_24, ops=("int4_24_widen",), order=55))
