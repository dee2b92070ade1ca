"""Where a tensor's zeros are, and whether they form the 2:4 pattern: what the checkpoint
compresses, what the sparsity report counts and what the 2:4 kernels accept."""

from __future__ import annotations

import torch

COMPRESSIBLE = {
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
}


def mask_from_zeros(weight: torch.Tensor) -> torch.Tensor:
    """Bool keep-mask of the nonzero entries of ``weight`` (int8 / float8 weights, which support
    few ops, are compared in float32)."""
    w = weight.detach()
    return (w.float() if w.element_size() == 1 else w) != 0


def is_2to4(t: torch.Tensor) -> bool:
    """True when every group of 4 consecutive entries of each row of ``t`` (flattened to
    (shape[0], rest)) has at most 2 non-zeros."""
    if t.dim() < 2 or t.dtype not in COMPRESSIBLE or t.numel() == 0:
        return False
    cols = t.numel() // t.shape[0]
    if cols % 4:
        return False
    nz = t.detach().reshape(t.shape[0], cols // 4, 4).float().ne(0)
    return bool(nz.sum(-1).le(2).all())
