"""How pruning masks agree across ranks (``torchrun``; see docs/distributed.md): position-sensitive
mask checksums and the check that every rank holds the same masks.

- Replicated weights (DDP, or no wrapper): every rank holds the same weights, so every rank
  computes the masks itself from identical data (Wanda input norms are summed over ranks first),
  and after each mask update :func:`verify_masks` all-reduces one checksum per layer and raises
  if any rank disagrees. Nothing of the size of a mask crosses the network.
- Sharded weights (FSDP2, ``fully_shard``: parameters are DTensors): each rank scores and masks
  only its local shard. Thresholds that span a whole tensor (or, for ``scope="global"``, every
  selected tensor) come from :func:`sparsekit.prune.patterns.lowest_k_masks` with a
  :class:`ShardComm`: the radix-select histograms are summed over ranks, so every rank uses the
  same threshold and no rank ever holds another's weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sparsekit.nn.shards import ShardComm, comm, is_sharded, local


# Checksum weights: a pseudo-random value below 2**31 per position (two rounds of squaring mod
# the prime 2**31 - 1, so the weights are not linear in the position: moving kept entries while
# keeping their count and position sum still changes the checksum); a sum over up to 2**32
# entries fits in int64 exactly.
_A, _B, _P = 1_103_515_245, 12_345, (1 << 31) - 1
_CHUNK = 1 << 22


def mask_checksum(mask: torch.Tensor, offset: int = 0) -> int:
    """A position-sensitive checksum of a bool mask (equal masks give equal checksums).
    ``offset``: flat position of the first entry (the checksum is a sum over positions, so the
    checksums of the shards of a tensor, at their offsets, add up to the whole tensor's)."""
    flat = local(mask).reshape(-1)
    total = 0
    for lo in range(0, flat.numel(), _CHUNK):
        chunk = flat[lo : lo + _CHUNK]
        start = offset + lo
        x = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        x = (x % _P * _A + _B) % _P
        for _ in range(2):
            x = (x * x + _B) % _P
        total += int((x * chunk).sum())
    return total


def verify_masks(masks: Mapping[str, torch.Tensor], c: ShardComm | None) -> None:
    """Check that every rank holds the same masks (replicated weights): one checksum per layer
    is gathered from every rank. Raises RuntimeError naming the layers that differ."""
    if c is None or not masks:
        return
    names = list(masks)
    table = torch.zeros(c.world, len(names), dtype=torch.int64)
    table[c.rank] = torch.tensor([mask_checksum(masks[n]) for n in names], dtype=torch.int64)
    table = c.all_reduce_sum(table)
    differ = [n for i, n in enumerate(names) if bool((table[:, i] != table[0, i]).any())]
    if differ:
        raise RuntimeError(
            f"masks differ across ranks for layer(s) {differ[:8]}: the ranks' weights or "
            "calibration statistics diverged (wrap the model in DDP or FSDP2 so weights stay "
            "in sync, and feed each rank its share of the calibration data)"
        )


def global_mask_checksum(mask: torch.Tensor, c: ShardComm | None = None) -> int:
    """:func:`mask_checksum` of the whole mask: for a DTensor sharded on dim 0 (FSDP2), the
    shards' checksums at their offsets summed over ranks, without gathering the mask; equals
    the checksum of the same mask held whole by one process."""
    c = comm() if c is None else c
    if not is_sharded(mask) or c is None:  # whole, or all shards on this one rank
        return mask_checksum(mask)
    shard = mask.to_local()
    row = shard[0].numel() if shard.dim() and shard.shape[0] else 0
    rows = torch.tensor([shard.shape[0] if shard.dim() else 0], dtype=torch.int64)
    table = torch.zeros(c.world, dtype=torch.int64)
    table[c.rank] = rows[0]
    start = int(c.all_reduce_sum(table)[: c.rank].sum()) * row
    return int(c.all_reduce_sum(torch.tensor([mask_checksum(shard, start)]))[0])
