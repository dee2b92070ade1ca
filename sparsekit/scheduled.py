"""The protocol a run loop drives: mask pruning (:class:`~sparsekit.Pruner`) and channel
pruning (:class:`~sparsekit.ChannelPruner`) both follow a schedule through it.

    pruner.step(step)        # after optimizer.step(); True when the model changed
    pruner.done              # the schedule's end was reached: later steps change nothing
    pruner.report()          # what it did so far (a report with ``to_dict()``)
    pruner.state_dict()      # plain data for a resume checkpoint ...
    pruner.load_state_dict(state)   # ... restored into a freshly built pruner and model
    pruner.finalize()        # a plain module from here on; returns it

A step that returns True may replace the model's parameters (channel pruning makes new,
narrower ones): :func:`follow_parameters` points the optimizer at them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from sparsekit.errors import UsageError


@runtime_checkable
class ScheduledPruner(Protocol):
    #: how far along the schedule it is; changes exactly when :meth:`step` returns True
    progress: float

    def step(self, step: int) -> bool: ...

    @property
    def done(self) -> bool: ...

    def report(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def finalize(self) -> nn.Module: ...


def follow_parameters(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Point a one-group ``optimizer`` at ``model``'s parameters when pruning replaced them;
    the per-parameter state (momentum, Adam moments) of the old ones no longer fits and is
    dropped. No-op while the optimizer holds exactly the model's parameters."""
    params = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if len(held) == len(params) and all(a is b for a, b in zip(held, params)):
        return
    if len(optimizer.param_groups) != 1:
        raise UsageError(
            "pruning replaced the model's parameters and the optimizer has "
            f"{len(optimizer.param_groups)} parameter groups: rebuild the optimizer yourself"
        )
    optimizer.param_groups[0]["params"] = params
    optimizer.state.clear()
