"""Where a Pruner's masks live: one of three mask stores, picked once when the Pruner is made.

The Pruner computes masks (scores, thresholds, N:M groups); a store keeps them and makes the
weights obey them:

- :class:`ParametrizedMasks` (one process, or replicated weights outside a DDP wrapper): each
  mask a ``masks.WeightMask`` parametrization, so forward and gradients only see masked
  weights.
- :class:`HeldMasks` (weights inside a DistributedDataParallel wrapper): parametrizing them
  would reset the gradient accumulators DDP hooked, so the masks are plain tensors held here;
  pruned gradients are masked by a hook and pruned weights zeroed again after every optimizer
  step (:meth:`~HeldMasks.enforce`).
- :class:`ShardedMasks` (FSDP2 ``fully_shard`` weights, DTensors): FSDP2 owns the Parameters,
  so each rank holds its shard of every mask, sharded like the weight; counts and threshold
  searches run over all ranks.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import nn

from sparsekit.errors import UsageError
from sparsekit.nn import shards as D
from sparsekit.prune import masks as M
from sparsekit.prune.checksums import verify_masks
from sparsekit.prune.report import SparsityReport, build_report


class MaskStore(Protocol):
    """What a Pruner asks of the place its masks live. Names are qualified layer names."""

    #: ranks a mask search spans (sharded weights), None when every tensor is whole here
    search_comm: D.ShardComm | None
    #: whether a solver (SparseGPT) may update whole weights in place
    whole_weights: bool

    def keep(self, name: str) -> torch.Tensor:
        """This rank's part of a layer's keep-mask (all of it for whole weights); live."""

    def masks(self) -> dict[str, torch.Tensor]:
        """Every keep-mask as users see it (live tensors; DTensors for sharded weights)."""

    def set(self, name: str, mask: torch.Tensor) -> None:
        """Install ``mask`` (this rank's part) and zero the weights it prunes."""

    def enforce(self) -> None:
        """Undo what an optimizer step did to pruned weights (no-op where masks act in the
        forward pass)."""

    def verify(self) -> None:
        """Check that replicated masks agree over the ranks (RuntimeError naming layers)."""

    def allsum(self, counts: list[int]) -> list[int]:
        """``counts`` summed over the ranks when they are per-shard, else as given."""

    def report(
        self, modules: Mapping[str, nn.Module], pattern: str | None, skipped: Mapping[str, str]
    ) -> SparsityReport:
        """The sparsity of ``modules`` (whole layers, shards summed over ranks)."""

    def saved(self) -> dict[str, torch.Tensor]:
        """Copies of the masks for a state dict (CPU, or DTensor shards where they are)."""

    def load(self, name: str, mask: torch.Tensor) -> None:
        """Install a saved mask (a whole one, or a DTensor) for ``name``."""

    def release(self) -> None:
        """Plain weights a solver may update (the masks are all ones when it is called)."""

    def reattach(self, keeps: Mapping[str, torch.Tensor]) -> None:
        """Undo :meth:`release` after a failed solve, with the masks ``keeps``."""

    def finalize(self) -> None:
        """Fold the masks into the weights for good and let go of every layer."""

    def remove(self) -> None:
        """Take the masks off without applying them (roll back a failed construction)."""


def pick_store(owner: Any, modules: Mapping[str, nn.Module], wrapped: bool,
               comm: D.ShardComm | None) -> MaskStore:
    """The store for these layers: sharded when their weights are DTensors (all or none may
    be), held when the model sits in a DDP wrapper (``wrapped``), parametrized otherwise.
    ``owner`` is the Pruner (a mask owned by another one is refused)."""
    sharded = [D.is_sharded(M.original_weight(m)) for m in modules.values()]
    if any(sharded) and not all(sharded):
        raise UsageError(
            "some selected weights are sharded (FSDP2) and some are not: shard "
            "all selected layers or none"
        )
    if any(sharded):
        return ShardedMasks(owner, modules, comm)
    if wrapped:
        return HeldMasks(owner, modules, comm)
    return ParametrizedMasks(owner, modules, comm)


def _taken(name: str) -> UsageError:
    # a second Pruner would share (and overwrite) the first one's mask
    return UsageError(
        f"layer {name!r} already has a pruning mask (another Pruner's): finalize "
        "that Pruner first, or exclude the layer from one of them"
    )


class _WholeMasks:
    """What the unsharded stores share: whole masks on every rank, so checks, counts, reports
    and saved masks need no communication beyond the checksum."""

    comm: D.ShardComm | None

    def verify(self) -> None:
        verify_masks(self.masks(), self.comm)

    def allsum(self, counts: list[int]) -> list[int]:
        return counts

    def report(self, modules, pattern, skipped) -> SparsityReport:
        return build_report(modules, pattern, skipped)

    def saved(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().cpu().clone() for n, m in self.masks().items()}

    def load(self, name: str, mask: torch.Tensor) -> None:
        self.set(name, mask.to(self.keep(name).device))


class ParametrizedMasks(_WholeMasks):
    """Masks as weight parametrizations (``masks.WeightMask``) owned by one Pruner. An all-ones
    mask that ``prepare_qat_`` attached is taken over rather than stacked."""

    search_comm = None
    whole_weights = True

    def __init__(self, owner: Any, modules: Mapping[str, nn.Module], comm: D.ShardComm | None):
        self.owner = weakref.ref(owner)
        self.modules = dict(modules)
        self.comm = comm
        for name, module in self.modules.items():
            wm = M.find_mask(module)
            if wm is not None and wm.owner is not None and wm.owner() is not None:
                raise _taken(name)
        self.attached: list[nn.Module] = []  # masks attached here (not prepare_qat_'s)
        for module in self.modules.values():
            fresh = M.find_mask(module) is None
            try:
                M.attach_mask(module).owner = self.owner
            except Exception:
                self.remove()
                raise
            if fresh:
                self.attached.append(module)

    def keep(self, name: str) -> torch.Tensor:
        return M.find_mask(self.modules[name]).mask

    def masks(self) -> dict[str, torch.Tensor]:
        return {name: M.find_mask(m).mask for name, m in self.modules.items()}

    def set(self, name: str, mask: torch.Tensor) -> None:
        module = self.modules[name]
        M.attach_mask(module, mask).owner = self.owner
        M.zero_pruned(module)

    def enforce(self) -> None:
        pass  # the parametrization masks every forward pass and every gradient

    def release(self) -> None:
        for module in self.modules.values():
            M.fold_mask(module)

    def reattach(self, keeps: Mapping[str, torch.Tensor]) -> None:
        for name, module in self.modules.items():
            M.attach_mask(module, keeps[name]).owner = self.owner

    def finalize(self) -> None:
        for module in self.modules.values():
            M.fold_mask(module)
        self.modules, self.attached = {}, []

    def remove(self) -> None:
        for module in self.attached:
            M.remove_mask(module)
        for module in self.modules.values():
            wm = M.find_mask(module)
            if wm is not None:  # prepare_qat_'s all-ones mask: free for another Pruner again
                wm.owner = None
        self.modules, self.attached = {}, []


class HeldMasks(_WholeMasks):
    """Masks held here as bool tensors for weights DDP already wraps: a gradient hook masks
    pruned gradients, :meth:`enforce` zeroes pruned weights after each optimizer step."""

    search_comm = None
    whole_weights = True

    def __init__(self, owner: Any, modules: Mapping[str, nn.Module], comm: D.ShardComm | None):
        self.modules = dict(modules)
        self.comm = comm
        for name, module in self.modules.items():
            if M.find_mask(module) is not None:
                raise _taken(name)
        self.local = {
            name: torch.ones_like(D.local(m.weight), dtype=torch.bool)
            for name, m in self.modules.items()
        }
        self.hooks = self._hook()

    def _hook(self) -> list[Any]:
        return [
            m.weight.register_hook(lambda g, mask=self.local[name]: g * mask)
            for name, m in self.modules.items()
        ]

    def keep(self, name: str) -> torch.Tensor:
        return self.local[name]

    def masks(self) -> dict[str, torch.Tensor]:
        return dict(self.local)

    def set(self, name: str, mask: torch.Tensor) -> None:
        self.local[name].copy_(mask)
        D.local(self.modules[name].weight).detach().masked_fill_(~self.local[name], 0)

    @torch.no_grad()
    def enforce(self) -> None:
        for name, module in self.modules.items():
            D.local(module.weight).masked_fill_(~self.local[name], 0)

    def release(self) -> None:
        pass  # the weights are plain Parameters already

    def reattach(self, keeps: Mapping[str, torch.Tensor]) -> None:
        pass  # release() changed nothing

    def finalize(self) -> None:
        for name, mask in self.local.items():
            self.set(name, mask)
        self.remove()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.modules, self.local, self.hooks = {}, {}, []


class ShardedMasks(HeldMasks):
    """Held masks for FSDP2-sharded weights: each rank keeps the shard of every mask that
    matches its weight shard; counts and threshold searches are summed over the ranks."""

    whole_weights = False

    def __init__(self, owner: Any, modules: Mapping[str, nn.Module], comm: D.ShardComm | None):
        super().__init__(owner, modules, comm)
        self.search_comm = comm
        self.model = owner.model

    def _hook(self) -> list[Any]:
        return []  # FSDP2 reduce-scatters gradients into the shards: enforce() zeroes weights

    def masks(self) -> dict[str, torch.Tensor]:
        D.reshard(self.model)
        return {n: D.like(self.local[n], m.weight) for n, m in self.modules.items()}

    def enforce(self) -> None:
        D.reshard(self.model)  # the sharded weights, and no stale gathered copies
        super().enforce()

    def verify(self) -> None:
        pass  # shards differ by design; thresholds were searched over all of them

    def allsum(self, counts: list[int]) -> list[int]:
        if self.comm is None:
            return counts
        return self.comm.all_reduce_sum(torch.tensor(counts, dtype=torch.int64)).tolist()

    def report(self, modules, pattern, skipped) -> SparsityReport:
        D.reshard(self.model)
        # count this rank's shards (whole rows), then sum over the ranks
        shards = {n: SimpleNamespace(weight=D.local(m.weight)) for n, m in modules.items()}
        report = build_report(shards, pattern, skipped)
        layers = list(report.layers.values())
        k = len(layers)
        counts = self.allsum(
            [s.numel for s in layers]
            + [s.zeros for s in layers]
            + [s.nm_ok is False for s in layers]
        )
        for i, s in enumerate(layers):
            s.numel, s.zeros = counts[i], counts[k + i]
            if s.nm_ok is not None:
                s.nm_ok = counts[2 * k + i] == 0
        return report

    def saved(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.masks().items()}

    def load(self, name: str, mask: torch.Tensor) -> None:
        mask = D.local_part(mask, self.modules[name].weight)
        self.set(name, mask.to(self.keep(name).device))
