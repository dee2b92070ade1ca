"""Work across ranks (``torchrun``): process-group queries, DDP/FSDP2 awareness, and sums and
maxima over ranks (:class:`ShardComm`) for selections and statistics that span sharded tensors.

Everything here is a no-op, or the identity, in a single process (no process group, or a world
of one), so library code calls it unconditionally. How pruning masks agree across ranks:
:mod:`sparsekit.prune.checksums` and docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import functools
import sys

import torch
import torch.distributed as dist
from torch import nn


@functools.cache
def _dtensor() -> type | None:
    """``torch.distributed.tensor.DTensor`` (imported on first use: it takes about half a
    second), None on torch builds without distributed support."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


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
    if not dist.is_available() or "torch.distributed.tensor" not in sys.modules:
        return False  # no DTensor can exist before its module is imported
    dtensor = _dtensor()
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage); a plain tensor as is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def like(local_tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``local_tensor`` as this rank's shard, sharded like DTensor ``reference``
    (same global shape); shares ``local_tensor``'s storage."""
    return _dtensor().from_local(
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
