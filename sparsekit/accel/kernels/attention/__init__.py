"""Decode attention over a static KV cache (:mod:`.decode`, :mod:`.kernel`): one query token
per sequence, grouped-query heads read once, masked positions never loaded
(``sparsekit::decode_attention``; the CPU reference is plain float32 torch). Used by
generate's decode steps through HF's attention interface, not by the linear layers."""

from __future__ import annotations

from sparsekit.accel.kernels import Kernel, register
from sparsekit.accel.kernels.attention import decode, op


def _run(layer, q, kv, config):
    k, v, mask, scale = kv
    return op.decode_attention(q, k, v, mask, scale)


register(Kernel("decode_attention", "attention", "attention", ("bf16", "f16"), None, (1, 1),
                None, _run, ops=("decode_attention",), order=60,
                check=lambda layer, w: None if decode.enabled() else
                "turned off (PlanOptions(decode_attention=False))"))
