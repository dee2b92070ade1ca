"""Pure mask builders: unstructured lowest-k (per layer or global), per-row, and N:M.

Every function takes scores (higher = more important) and returns boolean keep-masks
(True = kept). Weights are viewed in GEMM form, ``(out_features, in_features)``, where a conv
weight ``(out, in, *kernel)`` flattens to ``(out, in * prod(kernel))``: N:M groups run along
that reduction dimension, as sparse tensor cores want.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sparsekit.errors import UsageError
from sparsekit.names import parse_pattern  # noqa: F401 - torch-free, re-exported here

if TYPE_CHECKING:
    from sparsekit.nn.shards import ShardComm

_CHUNK = 1 << 24  # elements per pass of the global selection: bounds temporary memory
_EXCLUDED = torch.iinfo(torch.int32).max


def gemm_view(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a 2-D ``(out, in * prod(kernel))`` view (no copy for contiguous weights)."""
    return weight.reshape(weight.shape[0], -1)


def nm_incompatibility(weight_shape: Sequence[int], m: int) -> str | None:
    """Why a weight of this shape cannot take an N:M pattern along its input dimension, or None."""
    if len(weight_shape) < 2:
        return f"weight has {len(weight_shape)} dimension(s); N:M needs (out, in, ...)"
    k = 1
    for d in weight_shape[1:]:
        k *= int(d)
    if k % m:
        return f"input dimension {k} (in * kernel) is not a multiple of M={m}"
    return None


def is_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when every group of ``m`` consecutive inputs of every row has at most ``n`` nonzeros."""
    w = gemm_view(weight)
    if w.shape[1] % m:
        return False
    return bool(((w.reshape(w.shape[0], -1, m) != 0).sum(-1) <= n).all())


def nm_mask(scores: torch.Tensor, n: int, m: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the ``n`` highest-scoring entries of every group of ``m`` along the input dimension.

    ``scores`` has the weight's shape; ``keep`` (optional, same shape) is the current mask:
    entries it already prunes stay pruned. Returns a bool mask of ``scores``' shape.
    """
    s = gemm_view(scores).float()
    if keep is not None:
        s = s.masked_fill(~gemm_view(keep), float("-inf"))
    groups = s.reshape(s.shape[0], -1, m)
    idx = groups.topk(n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    if keep is not None:
        mask &= gemm_view(keep).reshape(mask.shape)
    return mask.reshape(scores.shape)


def nm_group_cost(scores: torch.Tensor, m: int, n: int, keep: torch.Tensor) -> torch.Tensor:
    """Score lost by enforcing N:M on each group: the sum of its ``m - n`` lowest scores among
    entries still kept (already-pruned entries cost nothing). Shape ``(out, in // m)``."""
    s = gemm_view(scores).float().masked_fill(~gemm_view(keep), 0.0)
    groups = s.reshape(s.shape[0], -1, m)
    return groups.sort(dim=-1).values[..., : m - n].sum(-1)


def nm_partial_mask(
    scores: torch.Tensor, n: int, m: int, keep: torch.Tensor, enforce: torch.Tensor
) -> torch.Tensor:
    """The N:M mask on the groups flagged by ``enforce`` (bool, ``(out, in // m)``) and the
    current ``keep`` mask elsewhere."""
    full = gemm_view(nm_mask(scores, n, m, keep))
    cur = gemm_view(keep)
    rows = enforce.repeat_interleave(m, dim=1)
    return torch.where(rows, full, cur).reshape(scores.shape)


def row_mask(
    scores: torch.Tensor, sparsity: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Prune ``round(sparsity * in)`` lowest-scoring entries in every output row (Wanda's
    comparison group). Entries ``keep`` already prunes stay pruned."""
    s = gemm_view(scores).float()
    if keep is not None:
        s = s.masked_fill(~gemm_view(keep), float("-inf"))
    k = prune_count(s.shape[1], sparsity)
    mask = torch.ones_like(s, dtype=torch.bool)
    if k:
        mask.scatter_(1, s.topk(k, dim=1, largest=False).indices, False)
    return mask.reshape(scores.shape)


def prune_count(numel: int, sparsity: float) -> int:
    """How many of ``numel`` entries a sparsity level prunes: ``round(sparsity * numel)``, halves
    rounded up, so the count is exact and reproducible."""
    return int(sparsity * numel + 0.5)


def _sort_key(scores: torch.Tensor) -> torch.Tensor:
    """int32 keys that order like the (non-negative, float32) scores."""
    s = scores.detach().float().reshape(-1)
    if bool((s < 0).any()) or bool(torch.isnan(s).any()):
        raise UsageError("scores must be non-negative and not NaN for threshold selection")
    return s.view(torch.int32)


def lowest_k_masks(
    scores: Sequence[torch.Tensor],
    k: int,
    keep: Sequence[torch.Tensor] | None = None,
    comm: ShardComm | None = None,
) -> list[torch.Tensor]:
    """Prune exactly ``k`` entries in total over all tensors: those already pruned by ``keep``
    first, then the lowest-scoring kept ones (ties broken by position, tensors in order).

    Selection is a two-pass radix select over 16-bit digits of the float32 scores' bit patterns,
    processed in chunks: no tensor holding all scores is ever built, so memory stays at one
    chunk's worth above the masks, whatever the total size.

    ``comm`` (see :class:`sparsekit.nn.shards.ShardComm`) selects over tensors sharded across
    ranks: every rank passes its local shards of the same tensors in the same order, ``k``
    counts entries of all ranks, the two histograms are summed over ranks, and ties are broken
    as if each tensor's shards were concatenated in rank order. The result on every rank equals
    the single-process result on the concatenated shards, and no rank sees another's scores.
    """
    keep = (
        list(keep) if keep is not None else [torch.ones_like(s, dtype=torch.bool) for s in scores]
    )
    total = sum(s.numel() for s in scores)
    already = sum(int((~m).sum()) for m in keep)
    if comm is not None:
        total, already = comm.all_reduce_sum(torch.tensor([total, already])).tolist()
    if not 0 <= k <= total:
        raise UsageError(f"cannot prune {k} of {total} entries")
    need = k - already
    if need < 0:
        raise UsageError(f"{already} entries are already pruned; cannot lower the count to {k}")
    if need == 0:
        return [m.clone() for m in keep]

    threshold, ties = _radix_threshold(scores, keep, need, comm)
    take = _tie_quota(scores, keep, threshold, ties, comm) if comm is not None else None
    return _prune_below(scores, keep, threshold, ties, take)


def _radix_threshold(
    scores: Sequence[torch.Tensor],
    keep: Sequence[torch.Tensor],
    need: int,
    comm: ShardComm | None,
) -> tuple[int, int]:
    """The sort key (:func:`_sort_key`) of the ``need``-th lowest kept score over all tensors
    (and ranks), and how many kept entries equal to it are to be pruned: a two-pass radix select
    over the keys' high, then low 16 bits, chunk by chunk."""

    def keys():
        for s, m in zip(scores, keep):
            flat_s, flat_m = s.reshape(-1), m.reshape(-1)
            for lo in range(0, flat_s.numel(), _CHUNK):
                key = _sort_key(flat_s[lo : lo + _CHUNK])
                yield key.masked_fill(~flat_m[lo : lo + _CHUNK], _EXCLUDED)

    def histogram(digits) -> torch.Tensor:
        hist = torch.zeros(1 << 16, dtype=torch.int64, device=device)
        for d in digits:
            hist += torch.bincount(d, minlength=1 << 16)
        if comm is not None:
            hist = comm.all_reduce_sum(hist)
        return hist.cumsum(0).cpu()

    device = scores[0].device if scores else torch.device("cpu")
    # pass 1: high 16 bits; pass 2: low 16 bits inside the chosen high bucket
    cum = histogram(key >> 16 for key in keys())
    hi = int(torch.searchsorted(cum, torch.tensor(need), right=False))
    below = int(cum[hi - 1]) if hi else 0
    cum = histogram(key[(key >> 16) == hi] & 0xFFFF for key in keys())
    lo = int(torch.searchsorted(cum, torch.tensor(need - below), right=False))
    threshold = (hi << 16) | lo
    ties = need - below - (int(cum[lo - 1]) if lo else 0)  # entries equal to threshold to prune
    return threshold, ties


def _prune_below(
    scores: Sequence[torch.Tensor],
    keep: Sequence[torch.Tensor],
    threshold: int,
    ties: int,
    take: list[int] | None,
) -> list[torch.Tensor]:
    """``keep`` with every kept entry whose key is below ``threshold`` pruned, and the first
    ``ties`` kept entries equal to it (``take[i]`` of tensor ``i`` when given: sharded)."""
    out = []
    for i, (s, m) in enumerate(zip(scores, keep)):
        if take is not None:
            ties = take[i]
        flat_m = m.reshape(-1)
        mask = flat_m.clone()
        for start in range(0, s.numel(), _CHUNK):
            key = _sort_key(s.reshape(-1)[start : start + _CHUNK])
            live = flat_m[start : start + _CHUNK]
            chunk = mask[start : start + _CHUNK]
            chunk &= ~((key < threshold) & live)
            if ties:
                eq = ((key == threshold) & live).nonzero().flatten()[:ties]
                chunk[eq] = False
                ties -= eq.numel()
        out.append(mask.reshape(m.shape))
    return out


def _tie_quota(
    scores: Sequence[torch.Tensor],
    keep: Sequence[torch.Tensor],
    threshold: int,
    ties: int,
    comm: ShardComm,
) -> list[int]:
    """How many of its entries equal to ``threshold`` each local tensor prunes, so that the
    ``ties`` pruned over all ranks are the first in (tensor, rank, position) order."""
    counts = torch.zeros(comm.world, len(scores), dtype=torch.int64)
    for i, (s, m) in enumerate(zip(scores, keep)):
        flat_s, flat_m = s.reshape(-1), m.reshape(-1)
        for lo in range(0, flat_s.numel(), _CHUNK):
            eq = (_sort_key(flat_s[lo : lo + _CHUNK]) == threshold) & flat_m[lo : lo + _CHUNK]
            counts[comm.rank, i] += int(eq.sum())
    counts = comm.all_reduce_sum(counts)
    # ties that come before this rank's shard of tensor i: all earlier tensors, lower ranks of i
    before = counts.sum(0).cumsum(0) - counts.sum(0) + counts[: comm.rank].sum(0)
    return (ties - before).clamp(min=0).minimum(counts[comm.rank]).tolist()
