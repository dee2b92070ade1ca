"""Pruning across ranks (``torchrun``): process-group queries, DDP/FSDP2 awareness, and the
sums that make every rank's masks agree.

Everything here is a no-op, or the identity, in a single process (no process group, or a world
of one), so library code calls it unconditionally.

How masks agree across ranks (see docs/distributed.md):

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch builds without distributed support
    DTensor = None


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def is_distributed() -> bool:
    """True when more than one rank takes part."""
    return world_size() > 1


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (so qualified names carry no
    ``module.`` prefix); any other module is returned as is (FSDP2 shards in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def ddp_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is already the ``.module`` of a DistributedDataParallel wrapper
    (``sk.Pruner(ddp.module)``): its parameters must not be parametrized any more, since that
    resets the gradient accumulators DDP hooked. DDP marks nothing on the module, so this looks
    among live objects for a wrapper holding it (only while a process group is initialized,
    which DDP needs)."""
    import gc

    if not is_initialized():
        return False
    ddp = nn.parallel.DistributedDataParallel
    return any(isinstance(o, ddp) and o.module is module for o in gc.get_objects())


def reshard(model: nn.Module) -> None:
    """Drop the gathered copies FSDP2 keeps after a forward pass without backward (the root
    module keeps its parameters unsharded after forward; calibration and evaluation leave them
    so), so that ``module.weight`` is the sharded DTensor again and the next forward gathers
    the current shards. No-op for modules without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor (an FSDP2 parameter)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage); a plain tensor as is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def like(local_tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``local_tensor`` as this rank's shard, sharded like DTensor ``reference``
    (same global shape); shares ``local_tensor``'s storage."""
    return DTensor.from_local(
        local_tensor,
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )


def local_part(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` for a weight sharded like DTensor ``reference``:
    ``tensor`` may be a DTensor, the local shard, or the full tensor (dim-0 sharding on a 1-D
    mesh, as ``fully_shard`` does: ``torch.chunk`` over the ranks)."""
    shard = reference.to_local()
    if is_sharded(tensor):
        tensor = tensor.to_local()
    elif tuple(tensor.shape) == tuple(reference.shape) != tuple(shard.shape):
        mesh, placements = reference.device_mesh, reference.placements
        if mesh.ndim != 1 or len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
            raise ValueError(f"cannot slice a full tensor for placements {placements}")
        chunks = torch.chunk(tensor, mesh.size(), dim=0)
        pos = mesh.get_local_rank()
        tensor = chunks[pos] if pos < len(chunks) else tensor[:0]
    if tuple(tensor.shape) != tuple(shard.shape):
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} is neither the full {tuple(reference.shape)} "
            f"nor this rank's shard {tuple(shard.shape)}"
        )
    return tensor


@dataclass(frozen=True)
class ShardComm:
    """Sums and maxima over the ranks of a process group (selections over sharded tensors,
    calibrated ranges).

    ``device`` is where the collective runs (CUDA for an NCCL-only group, CPU for gloo), or None
    for a group with both (each tensor stays where it is); tensors travel there and back.
    """

    group: Any = None
    device: torch.device | None = torch.device("cpu")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``tensor`` over all ranks, on ``tensor``'s device."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``tensor`` over all ranks, on ``tensor``'s device."""
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        buf = tensor.to(self.device or tensor.device, copy=True)
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(tensor.device)


def comm(group: Any = None) -> ShardComm | None:
    """A :class:`ShardComm` over ``group`` (default: the world), or None in a single process."""
    if not is_initialized() or dist.get_world_size(group) == 1:
        return None
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return ShardComm(group, torch.device("cuda", torch.cuda.current_device()))
    return ShardComm(group, None if "nccl" in backend else torch.device("cpu"))


def all_reduce_dict(tensors: Mapping[str, torch.Tensor], c: ShardComm | None) -> dict[str, Any]:
    """Sum every tensor of ``tensors`` over ranks in one collective (same names and shapes on
    every rank; summed in float64 for float inputs). Identity when ``c`` is None."""
    if c is None or not tensors:
        return dict(tensors)
    names = sorted(tensors)
    flat = torch.cat([tensors[n].reshape(-1).double() for n in names])
    summed = c.all_reduce_sum(flat).split([tensors[n].numel() for n in names])
    return {n: s.reshape(tensors[n].shape).to(tensors[n].dtype) for n, s in zip(names, summed)}


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
