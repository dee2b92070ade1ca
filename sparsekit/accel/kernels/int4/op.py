"""The W4A16 kernels as custom ops: ``int4_24_mm(x, values, meta, scales, bias)`` and
``int4_mm(x, values, scales, bias)``, bf16 ``x @ (q * scale).T + bias`` for int4 weights with
group scales, 2:4 or dense, in sparsekit's packed formats (:mod:`.format`), on its Triton
kernels (tuned for M <= 32; they take any M); ``int4_24_widen`` the 2:4 weight dequantized to
dense bf16 in one pass (the prefill's). The CPU references dequantize the weight.
"""

from typing import Optional

import torch

from sparsekit.accel.kernels.int4 import format as w4a16

# --- int4_24_mm / int4_mm (W4A16, small M; sparsekit's formats) ----------------------------

@torch.library.custom_op("sparsekit::int4_24_mm", mutates_args=(), device_types="cuda")
def int4_24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    return w4a16.launch_24(x, values, meta, scales, bias)


@int4_24_mm.register_kernel("cpu")
def _int4_24_mm_ref(x, values, meta, scales, bias):
    return w4a16.reference_24(x, values, meta, scales, bias)


@int4_24_mm.register_fake
def _int4_24_mm_fake(x, values, meta, scales, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::int4_24_widen", mutates_args=(), device_types="cuda")
def int4_24_widen(values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor
                  ) -> torch.Tensor:
    return w4a16.widen_24(values, meta, scales)


@int4_24_widen.register_kernel("cpu")
def _int4_24_widen_ref(values, meta, scales):
    return w4a16.dequantize_packed_24(values, meta, scales, torch.bfloat16)


@int4_24_widen.register_fake
def _int4_24_widen_fake(values, meta, scales):
    return values.new_empty((values.shape[0], 4 * values.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::int4_mm", mutates_args=(), device_types="cuda")
def int4_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    return w4a16.launch(x, values, scales, bias)


@int4_mm.register_kernel("cpu")
def _int4_mm_ref(x, values, scales, bias):
    return w4a16.reference(x, values, scales, bias)


@int4_mm.register_fake
def _int4_mm_fake(x, values, scales, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


__all__ = ["int4_24_mm", "int4_24_widen", "int4_mm"]
