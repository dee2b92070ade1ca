"""Decode attention over a static KV cache: one query token per sequence, grouped-query heads
read once, masked cache positions never loaded.

In a decode step with Hugging Face's static cache and ``torch.compile``, HF's SDPA path gets a
boolean mask and so repeats every key and value head for each of its query heads
(``repeat_kv``: for Llama-3-8B four copies of the whole cache, written and read each layer) and
attends over all the cache's positions, filled or not. :func:`decode_attention` reads each kv
head's keys and values once for all the query heads of its group, and only at the positions
the mask lets take part; it splits the positions over programs (flash-decoding) so that a
batch of one still fills the GPU (:mod:`sparsekit.accel.kernels.attention.kernel`).

``decode_attention(q, k, v, mask, scale)``: q (B, H, 1, D), k and v (B, KVH, L, D) of q's dtype
(bfloat16 or float16) with H a multiple of KVH (query head h uses kv head h // (H / KVH), as
HF's ``repeat_kv``), mask None or bool (B or 1, L) (True: the position takes part); returns
``softmax(q k^T * scale) v`` as (B, 1, H, D) in q's dtype, softmax in float32. A sequence with
no position to attend gets zeros. :func:`reference` is the same in plain torch (float32).

HF models use it through the attention implementation :data:`NAME`
(:func:`attention_forward`, registered by :func:`register`): single-token queries that it
takes run here, everything else (prefill, sliding windows, soft-capping, position biases,
float masks, dropout) goes to HF's own SDPA function unchanged.
:class:`sparsekit.accel.generate.Generator` turns it on for the generate calls of a model on
CUDA; ``PlanOptions(decode_attention=False)`` keeps HF's SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sparsekit.accel.kernels import switches

NAME = "sparsekit_sdpa"
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_N = 64      # cache positions a program loads a step
G_PAD = 16        # query heads of a group padded to tl.dot's smallest tile


def enabled() -> bool:
    """Whether generate uses this attention (``PlanOptions.decode_attention``, default on)."""
    return switches.current().decode_attention


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None) -> str | None:
    """None when :func:`decode_attention` takes these inputs, else why not."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return (f"q must be (B, H, 1, D), k and v (B, KVH, L, D) alike; got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, t, d = q.shape
    kb, kvh, _, kd = k.shape
    if t != 1:
        return f"one query token per sequence, got {t}"
    if kb != b or kd != d or kvh < 1 or h % kvh:
        return (f"k and v must be (B={b}, KVH, L, D={d}) with H={h} a multiple of KVH; got "
                f"{tuple(k.shape)}")
    if h // kvh > G_PAD:
        return f"at most {G_PAD} query heads per kv head, got {h // kvh}"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"q, k and v must share one of {[str(x) for x in DTYPES]}; got {q.dtype}, "
                f"{k.dtype}, {v.dtype}")
    if d not in HEAD_DIMS:
        return f"head dim must be one of {HEAD_DIMS}, got {d}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "q, k and v must be contiguous along the head dim"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2
                             or mask.shape[0] not in (1, b) or mask.shape[1] != k.shape[2]
                             or mask.stride(1) != 1):
        return (f"mask must be None or bool (1 or B={b}, L={k.shape[2]}) contiguous along L, "
                f"got {mask.dtype} {tuple(mask.shape)}")
    return None


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """:func:`decode_attention` in plain torch, float32."""
    b, h, _, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, kvh, h // kvh, d)
    scores = torch.einsum("bkgd,bkld->bkgl", qf, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, length), float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)  # no position to attend: zeros
    out = torch.einsum("bkgl,bkld->bkgd", p, v.float())
    return out.reshape(b, 1, h, d).to(q.dtype)


@functools.lru_cache(maxsize=None)
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(batch_heads: int, length: int, sms: int) -> int:
    """How many programs share one kv head's positions: enough for about two programs per SM,
    at most one per block of BLOCK_N positions."""
    blocks = -(-length // BLOCK_N)
    want = -(-2 * sms // max(1, batch_heads))
    return max(1, min(blocks, want))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Run the Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    from sparsekit.accel.kernels.attention import kernel as kernels

    why = check(q, k, v, mask)
    if why is not None:
        raise ValueError(f"decode_attention: {why}")
    b, h, _, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    sms = _sm_count(str(q.device)) if q.is_cuda else 4
    n_split = splits(b * kvh, length, sms)
    blocks = -(-length // BLOCK_N)
    per_split = BLOCK_N * -(-blocks // n_split)
    n_split = -(-length // per_split)
    acc = torch.empty((b * h * n_split, d), dtype=torch.float32, device=q.device)
    stat = torch.empty((b * h * n_split, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, 1, h, d), dtype=q.dtype, device=q.device)
    m = mask if mask is not None else q
    kernels.partial[(b * kvh, n_split)](
        q, k, v, m, acc, stat, length, kvh, float(scale), q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        0 if mask is None or mask.shape[0] == 1 else mask.stride(0), SPLIT=per_split,
        GROUP=h // kvh, G_PAD=G_PAD, D=d, BLOCK_N=BLOCK_N, HAS_MASK=mask is not None,
        DOT_F32=not q.is_cuda, num_warps=4)
    kernels.combine[(b * h,)](acc, stat, out, SPLITS=n_split,
                              S_PAD=max(2, 1 << (n_split - 1).bit_length()), D=d, num_warps=4)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The custom op ``sparsekit::decode_attention`` (CUDA: the Triton kernels; CPU:
    :func:`reference`), registered by :mod:`sparsekit.accel.ops` (which ``sparsekit.accel``
    imports)."""
    return torch.ops.sparsekit.decode_attention(q, k, v, mask, float(scale))


def _mask_2d(mask: torch.Tensor | None, b: int, length: int) -> torch.Tensor | None | bool:
    """HF's 4-D boolean decode mask (B or 1, 1, 1, L) as (B or 1, L); False when it is another
    kind of mask (a float bias, per-head)."""
    if mask is None:
        return None
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
            or mask.shape[0] not in (1, b) or mask.shape[3] != length):
        return False
    return mask[:, 0, 0, :]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An HF attention function (``AttentionInterface``): single-token queries on
    :func:`decode_attention`, anything else on HF's ``sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = _mask_2d(attention_mask, query.shape[0], key.shape[2])
    plain = (kwargs.get("dropout", 0.0) == 0.0 and kwargs.get("softcap") is None
             and kwargs.get("sliding_window") is None and kwargs.get("position_bias") is None
             and not kwargs.get("output_attentions", False))
    if plain and mask is not False and check(query, key, value, mask) is None:
        scale = kwargs.get("scaling")
        if scale is None:
            scale = query.shape[-1] ** -0.5
        return decode_attention(query, key, value, mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.lru_cache(maxsize=None)
def register() -> str:
    """Register :func:`attention_forward` (with HF's SDPA mask) as the attention implementation
    :data:`NAME`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


__all__ = ["NAME", "attention_forward", "check", "decode_attention", "enabled", "launch",
           "reference", "register", "splits"]
