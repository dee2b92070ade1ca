"""The protocol a run loop drives: mask pruning (:class:`~sparsekit.Pruner`) and channel
pruning (:class:`~sparsekit.ChannelPruner`) both follow a schedule through it.

    pruner.step(step)        # after optimizer.step(); True when the model changed
    pruner.done              # the schedule's end was reached: later steps change nothing
    pruner.report()          # what it did so far (a report with ``to_dict()``)
    pruner.state_dict()      # plain data for a resume checkpoint ...
    pruner.load_state_dict(state)   # ... restored into a freshly built pruner and model
    pruner.finalize()        # a plain module from here on; returns it

A step that returns True may replace the model's parameters (channel pruning makes new,
narrower ones): :func:`sparsekit.io.runstate.follow_parameters` points the optimizer at them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import nn


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
