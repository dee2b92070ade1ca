"""The mma.sp kernels as custom ops (CUDA: the library, :mod:`.launch`; CPU: references that
expand the weight; fakes).

- ``sk24_mma_mm(x, values, meta, x_scale, w_scale, bias, config=None)``: bf16
  ``(x @ W.T) * x_scale * w_scale + bias`` for M <= 32 on the sparse tensor cores (the
  fragment-ordered format, bf16 or fp8 e4m3 values; ``config`` the kernel configuration, by
  default per shape), x (M, K) bf16 (an fp8 layer's quantized activations widened, exactly) or
  fp8 for the "e4m3" layout.
- ``sk24_mma_int4_mm(x, values, meta, scales, bias, config=None)``: bf16
  ``x @ (q * scale).T + bias`` for an int4 2:4 weight in the kernel's int4 format
  (:func:`.launch.compress_int4`), M <= 32 (nibbles widened to bf16 in registers, group
  scales applied in float32).
"""

from typing import Optional

import torch

from sparsekit.accel.kernels.mma_sp import launch as sk24_mma

# --- sk24_mma_mm (small-M 2:4 on the sparse tensor cores, the fragment-ordered format) ------

@torch.library.custom_op("sparsekit::sk24_mma_mm", mutates_args=(), device_types="cuda")
def sk24_mma_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                x_scale: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], config: Optional[list[int]] = None
                ) -> torch.Tensor:
    return sk24_mma.launch(x, values, meta, x_scale, w_scale, bias,
                           None if config is None else tuple(config))


@sk24_mma_mm.register_kernel("cpu")
def _sk24_mma_mm_ref(x, values, meta, x_scale, w_scale, bias, config=None):
    return sk24_mma.reference(x, values, meta, x_scale, w_scale, bias)


@sk24_mma_mm.register_fake
def _sk24_mma_mm_fake(x, values, meta, x_scale, w_scale, bias, config=None):
    return x.new_empty((x.shape[0], 16 * values.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("sparsekit::sk24_mma_int4_mm", mutates_args=(), device_types="cuda")
def sk24_mma_int4_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                     scales: torch.Tensor, bias: Optional[torch.Tensor],
                     config: Optional[list[int]] = None) -> torch.Tensor:
    return sk24_mma.launch_int4(x, values, meta, scales, bias,
                                None if config is None else tuple(config))


@sk24_mma_int4_mm.register_kernel("cpu")
def _sk24_mma_int4_mm_ref(x, values, meta, scales, bias, config=None):
    return sk24_mma.reference_int4(x, values, meta, scales, bias)


@sk24_mma_int4_mm.register_fake
def _sk24_mma_int4_mm_fake(x, values, meta, scales, bias, config=None):
    return x.new_empty((x.shape[0], 16 * values.shape[0]), dtype=torch.bfloat16)


__all__ = ["sk24_mma_int4_mm", "sk24_mma_mm"]
