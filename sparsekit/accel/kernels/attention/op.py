"""Decode attention as a custom op: ``decode_attention(q, k, v, mask, scale)``, one query token
per sequence over a static KV cache, grouped-query heads read once, masked positions never
loaded (:mod:`.decode`); the CPU reference is plain float32 torch.
"""

from typing import Optional

import torch

from sparsekit.accel.kernels.attention import decode as attention

# --- decode_attention (one query token over a static KV cache) -------------------------------

@torch.library.custom_op("sparsekit::decode_attention", mutates_args=(), device_types="cuda")
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return attention.launch(q, k, v, mask, scale)


@decode_attention.register_kernel("cpu")
def _decode_attention_ref(q, k, v, mask, scale):
    return attention.reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, mask, scale):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


__all__ = ["decode_attention"]
