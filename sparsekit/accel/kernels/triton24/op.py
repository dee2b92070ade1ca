"""sparsekit's 2:4 Triton kernel as custom ops: ``sparsekit::sk24_mm`` (x (M, K) or its planes
(M, 4, K/4), :func:`.format.planes`: bf16 ``(x @ W.T) * x_scale * w_scale + bias`` for a 2:4
weight in sparsekit's own format, bf16 or float8 e4m3 ``x`` of the weight's dtype; tuned for
M <= 32, it takes any M) and ``sparsekit::sk24_widen`` (the format's weight widened to dense
bf16: the weight-only fp8 prefill). The CPU references expand the weight.
"""

from typing import Optional

import torch

from sparsekit.accel.kernels.triton24 import format as sk24

# --- sk24_mm (small-M 2:4, sparsekit's format) ---------------------------------------------

@torch.library.custom_op("sparsekit::sk24_mm", mutates_args=(), device_types="cuda")
def sk24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
            x_scale: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
            bias: Optional[torch.Tensor]) -> torch.Tensor:
    return sk24.launch(x, values, meta, x_scale, w_scale, bias)


@sk24_mm.register_kernel("cpu")
def _sk24_mm_ref(x, values, meta, x_scale, w_scale, bias):
    return sk24.reference(x, values, meta, x_scale, w_scale, bias)


@sk24_mm.register_fake
def _sk24_mm_fake(x, values, meta, x_scale, w_scale, bias):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=torch.bfloat16)


# --- sk24_widen (the format's weight widened to dense bf16: the weight-only fp8 prefill) -----

@torch.library.custom_op("sparsekit::sk24_widen", mutates_args=(), device_types="cuda")
def sk24_widen(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    return sk24.widen(values, meta)


@sk24_widen.register_kernel("cpu")
def _sk24_widen_ref(values, meta):
    return sk24.decompress(values, meta, dtype=torch.bfloat16)


@sk24_widen.register_fake
def _sk24_widen_fake(values, meta):
    return values.new_empty((values.shape[0], 2 * values.shape[1]), dtype=torch.bfloat16)


__all__ = ["sk24_mm", "sk24_widen"]
