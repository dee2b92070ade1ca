"""Pruning schedules: pure functions from a training step to progress in [0, 1].

Progress is the fraction of the final target in force: the Pruner multiplies a layer's target
sparsity by it (unstructured), or enforces that fraction of N:M groups. Progress only moves at
update steps ``start, start + every, ...`` and is 1 from ``end`` on, so calling ``step`` on
every batch, skipping steps, or resuming mid-run all give the same masks.

:func:`lr_at` is the learning-rate schedule of the fine-tuning and distillation loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparsekit.checks import check_int
from sparsekit.errors import UsageError


class Schedule:
    """Base class: ``progress(step)`` in [0, 1], non-decreasing in ``step``."""

    def progress(self, step: int) -> float:
        raise NotImplementedError

    def to_dict(self) -> dict[str, int | str]:
        """Plain description, e.g. for logging: ``{"kind": "cubic", "start": 0, ...}``."""
        return {"kind": type(self).__name__.lower(), **vars(self)}


@dataclass(frozen=True)
class OneShot(Schedule):
    """The full target at ``step`` (default 0) and after.

    >>> OneShot(step=10).progress(9), OneShot(step=10).progress(10)
    (0.0, 1.0)
    """

    step: int = 0

    def __post_init__(self) -> None:
        check_int("schedule step", self.step, 0)

    def progress(self, step: int) -> float:
        return 1.0 if step >= self.step else 0.0


@dataclass(frozen=True)
class _Ramp(Schedule):
    start: int = 0
    end: int = 1000
    every: int = 100

    def __post_init__(self) -> None:
        check_int("schedule start", self.start, 0)
        check_int("schedule end", self.end, 0)
        check_int("schedule every", self.every, 1)
        if self.end < self.start:
            raise UsageError(
                f"schedule end ({self.end}) is before its start ({self.start}); need end >= start"
            )

    def _fraction(self, step: int) -> float:
        """Elapsed fraction of [start, end] at the last update step at or before ``step``."""
        if step >= self.end:
            return 1.0
        if step < self.start:
            return 0.0
        last = self.start + (step - self.start) // self.every * self.every
        return (last - self.start) / (self.end - self.start)


@dataclass(frozen=True)
class Linear(_Ramp):
    """Progress rises linearly from 0 at ``start`` to 1 at ``end``, updated every ``every`` steps.

    >>> [Linear(start=0, end=100, every=25).progress(t) for t in (0, 30, 50, 100)]
    [0.0, 0.25, 0.5, 1.0]
    """

    def progress(self, step: int) -> float:
        return self._fraction(step)


@dataclass(frozen=True)
class Cubic(_Ramp):
    """Zhu & Gupta (2017): ``s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))**3`` with
    ``s_i = 0``, ``t0 = start``, ``n * dt = end - start``, ``dt = every``: prunes fast early,
    slowly near the end, and reaches the target at ``end``.

    >>> Cubic(start=0, end=100, every=50).progress(50)
    0.875
    """

    def progress(self, step: int) -> float:
        f = self._fraction(step)
        return 1.0 - math.pow(1.0 - f, 3)


SCHEDULES: dict[str, type[Schedule]] = {"oneshot": OneShot, "linear": Linear, "cubic": Cubic}


def lr_at(
    step: int, total: int, base_lr: float, warmup: int = 0, schedule: str = "cosine"
) -> float:
    """Learning rate at ``step`` of ``total``: linear warm-up over ``warmup`` steps, then
    constant or cosine decay to 10% of ``base_lr``.

    >>> lr_at(0, 100, 1.0), round(lr_at(100, 100, 1.0), 6)
    (1.0, 0.1)
    """
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base_lr
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))
