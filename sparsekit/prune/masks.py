"""Masks as weight parametrizations (torch.nn.utils.parametrize), folding, masks from zeros.

While a mask is attached, ``module.weight`` is computed as ``original * mask`` on every access,
so the forward pass only ever sees masked weights and pruned entries get zero gradient. The
mask is a buffer updated in place: its identity never changes, so optimizers, hooks and
compiled graphs holding it stay valid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.errors import UsageError


class WeightMask(nn.Module):
    """Parametrization ``w -> w * mask``; ``mask`` is a bool buffer of the weight's shape."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool).clone())
        self.owner: Any = None  # weakref to the Pruner that moves this mask, if any

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) of a masked model belongs to no Pruner
        return {**super().__getstate__(), "owner": None}


def find_mask(module: nn.Module) -> WeightMask | None:
    """The WeightMask parametrizing ``module.weight``, or None."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    for p in module.parametrizations.weight:
        if isinstance(p, WeightMask):
            return p
    return None


def original_weight(module: nn.Module, name: str | None = None) -> torch.Tensor:
    """The unmasked weight Parameter (the parametrization's original, or the plain weight).
    UsageError for a weight parametrized from several tensors (``weight_norm``'s ``original0``
    and ``original1``): there is no one weight to mask."""
    if parametrize.is_parametrized(module, "weight"):
        plist = module.parametrizations.weight
        if not hasattr(plist, "original"):
            kinds = ", ".join(type(p).__name__ for p in plist)
            raise UsageError(
                f"layer {name or type(module).__name__!r}: its weight is computed by a "
                f"parametrization ({kinds}) from several tensors; sparsekit prunes one weight "
                "tensor: fold it "
                "first (torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight'))")
        return plist.original
    return module.weight


def attach_mask(module: nn.Module, mask: torch.Tensor | None = None) -> WeightMask:
    """Attach (or update in place) a mask on ``module.weight``; all-ones when ``mask`` is None.

    The mask goes first in the parametrization chain, so later parametrizations (for example
    fake quantization) see the masked weight.
    """
    existing = find_mask(module)
    if mask is None:
        mask = torch.ones_like(original_weight(module), dtype=torch.bool)
    if existing is not None:
        existing.mask.copy_(mask)
        return existing
    if parametrize.is_parametrized(module, "weight"):
        raise UsageError(
            f"{type(module).__name__}.weight already has parametrizations "
            f"{[type(p).__name__ for p in module.parametrizations.weight]}: attach the pruning "
            "mask before other parametrizations (create the Pruner before prepare_qat_)"
        )
    wm = WeightMask(mask.to(original_weight(module).device))
    wm.param_order = list(module._parameters)  # restored by fold_mask: same state_dict order
    parametrize.register_parametrization(module, "weight", wm)
    return wm


@torch.no_grad()
def zero_pruned(module: nn.Module) -> None:
    """Zero the original weight where the mask prunes, so optimizer state and weight decay act
    on zeros and a folded or exported weight needs no mask."""
    wm = find_mask(module)
    if wm is not None:
        original_weight(module).masked_fill_(~wm.mask, 0)


@torch.no_grad()
def fold_mask(module: nn.Module) -> None:
    """Remove the mask for good: ``module.weight`` becomes a plain Parameter with zeros where
    pruned (same Parameter object as before the mask, same state_dict keys as an unpruned
    module). Other parametrizations on the weight are folded too."""
    wm = find_mask(module)
    if wm is None:
        return
    zero_pruned(module)
    parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    params = module._parameters
    order = [k for k in wm.param_order if k in params] + [
        k for k in params if k not in wm.param_order
    ]
    module._parameters = {k: params[k] for k in order}


@torch.no_grad()
def remove_mask(module: nn.Module) -> None:
    """Remove the mask without applying it: ``module.weight`` becomes the original Parameter
    again, with its current values and its place in the state_dict."""
    wm = find_mask(module)
    if wm is None:
        return
    parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    params = module._parameters
    order = [k for k in wm.param_order if k in params] + [
        k for k in params if k not in wm.param_order
    ]
    module._parameters = {k: params[k] for k in order}

