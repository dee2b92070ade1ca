"""Modules that expose GEMMs hidden inside other layers as plain ``nn.Linear`` children.

- ``nn.MultiheadAttention`` (torchvision ViT) runs the fused ``_native_multi_head_attention``
  in eval mode, which a sparse weight cannot serve. :class:`SplitMultiheadAttention` computes
  the same function with ``in_proj`` / ``out_proj`` Linears and ``scaled_dot_product_attention``.
- A convolution whose kernel equals its stride (no padding, dilation or groups) is a GEMM over
  non-overlapping patches: a 1x1 conv (a GEMM over channels) and a ViT's patch embedding
  (16x16, stride 16), :class:`ConvAsLinear`. cuDNN runs the latter as a strided implicit GEMM
  plus two layout conversions, about 2 ms of a ViT-B/16 at batch 256 on the H200; as a patch
  gather and a GEMM it is a tenth of that (journal/gpu.md).
Each ``*_skip_reason`` returns None when the module can be converted, else why not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def mha_skip_reason(mha: nn.MultiheadAttention) -> str | None:
    if not mha._qkv_same_embed_dim or mha.in_proj_weight is None:
        return "MultiheadAttention with separate q/k/v sizes (kdim/vdim) is not converted"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "MultiheadAttention with add_bias_kv/add_zero_attn is not converted"
    return None


class SplitMultiheadAttention(nn.Module):
    """Self-attention equal to an ``nn.MultiheadAttention`` in eval mode, with the packed q/k/v
    projection as ``in_proj`` (Linear E -> 3E) and ``out_proj`` (Linear E -> E).

    Called like the original with ``query is key is value`` and ``need_weights=False``; returns
    ``(output, None)``. Masks are not supported (ViT and BERT-style encoders pass none)."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        reason = mha_skip_reason(mha)
        if reason:
            raise ValueError(reason)
        e = mha.embed_dim
        self.embed_dim, self.num_heads, self.batch_first = e, mha.num_heads, mha.batch_first
        self.in_proj = nn.Linear(e, 3 * e, bias=mha.in_proj_bias is not None,
                                 device=mha.in_proj_weight.device,
                                 dtype=mha.in_proj_weight.dtype)
        with torch.no_grad():
            self.in_proj.weight.copy_(mha.in_proj_weight)
            if mha.in_proj_bias is not None:
                self.in_proj.bias.copy_(mha.in_proj_bias)
        self.out_proj = mha.out_proj

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if not (query is key and key is value):
            raise NotImplementedError("SplitMultiheadAttention serves self-attention only "
                                      "(query is key is value)")
        if attn_mask is not None or key_padding_mask is not None:
            raise NotImplementedError("SplitMultiheadAttention takes no attn_mask or "
                                      "key_padding_mask (use is_causal=True for causal masks)")
        if need_weights:
            raise NotImplementedError("SplitMultiheadAttention does not return attention "
                                      "weights; call it with need_weights=False")
        x = query if self.batch_first else query.transpose(0, 1)
        b, t, e = x.shape
        h = self.num_heads
        qkv = self.in_proj(x).reshape(b, t, 3, h, e // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(b, t, e))
        return (out if self.batch_first else out.transpose(0, 1)), None


def conv_skip_reason(conv: nn.Module) -> str | None:
    if not isinstance(conv, nn.Conv2d):
        return (f"{type(conv).__name__} is not converted (only Conv2d whose kernel equals its "
                f"stride runs as a GEMM)")
    if tuple(conv.kernel_size) != tuple(conv.stride):
        return (f"conv kernel {tuple(conv.kernel_size)} differs from its stride "
                f"{tuple(conv.stride)} (only convs over non-overlapping patches run as GEMMs)")
    if conv.padding not in ((0, 0), "valid") or conv.groups != 1 \
            or conv.dilation != (1, 1) or conv.padding_mode != "zeros":
        return "conv with padding, dilation or groups is not converted"
    return None


class ConvAsLinear(nn.Module):
    """A Conv2d whose kernel equals its stride (1x1 convs, patch embeddings) as a Linear over
    each patch's ``C * kh * kw`` values: (B, C, H, W) -> (B, N, H // kh, W // kw), the rows and
    columns a strided conv leaves out dropped as it drops them."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        reason = conv_skip_reason(conv)
        if reason:
            raise ValueError(reason)
        self.kernel = tuple(conv.kernel_size)
        fan_in = conv.in_channels * self.kernel[0] * self.kernel[1]
        self.linear = nn.Linear(fan_in, conv.out_channels, bias=conv.bias is not None,
                                device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():  # (N, C, kh, kw) flattens in the patch order of forward()
            self.linear.weight.copy_(conv.weight.reshape(conv.out_channels, fan_in))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        kh, kw = self.kernel
        h, w = height // kh, width // kw
        if (h * kh, w * kw) != (height, width):
            x = x[:, :, :h * kh, :w * kw]
        patches = (x.reshape(b, c, h, kh, w, kw).permute(0, 2, 4, 1, 3, 5)
                   .reshape(b, h, w, c * kh * kw))
        return self.linear(patches).permute(0, 3, 1, 2)


def split_attention_(model: nn.Module,
                     keep: Callable[[str], bool] = lambda name: True) -> dict[str, str]:
    """Replace every ``nn.MultiheadAttention`` named by ``keep`` by its
    :class:`SplitMultiheadAttention`, in place; ``{name: why not}`` for those left as they are."""
    skipped = {}
    for name, module in list(model.named_modules()):
        if name and keep(name) and isinstance(module, nn.MultiheadAttention):
            reason = mha_skip_reason(module)
            if reason:
                skipped[name] = reason
            else:
                model.set_submodule(name, SplitMultiheadAttention(module))
    return skipped
