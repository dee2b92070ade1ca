"""A small decoder-only transformer language model (GPT-style, pre-norm), all projections
``nn.Linear`` so every one of them can be pruned."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Input token ids (B, T) int64 with T <= seq_len; output logits (B, T, vocab_size)."""

    def __init__(
        self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
        seq_len: int = 128,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def tiny_lm(
    vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
    seq_len: int = 128,
) -> TinyLM:
    """Factory for :class:`TinyLM` (byte vocabulary by default).

    >>> tiny_lm(d_model=16, n_layers=1, n_heads=2, seq_len=8)(torch.zeros(2, 8).long()).shape
    torch.Size([2, 8, 256])
    """
    return TinyLM(vocab_size, d_model, n_layers, n_heads, seq_len)
