"""The generate loop's stop decision read a few steps late, so the host never waits on the GPU.

A loop that asks after every token whether all sequences are finished
(``bool(unfinished.max() == 0)``) blocks the host until the GPU has run that step: the GPU
then idles while the host prepares the next step (inputs, the graph's input copies, its
launch). :class:`LaggedStopCheck` copies each step's flag to pinned host memory without
blocking and reads it :data:`LAG` steps later, when the GPU has long finished it, so the host
queues the next steps meanwhile. When a flag it reads says every sequence had finished, the
loop stops and :meth:`~LaggedStopCheck.finish` says how many steps ran past that point: the
loop drops their tokens (pad tokens: every sequence had finished). At ``max_length`` it reads
every pending flag at once, so the loop never runs past its cache. With sampling, the extra
steps still draw from the random generator, so its state after the call is up to :data:`LAG`
draws further on than after HF's per-step check. ``PlanOptions(lagged_stop=False)`` checks
every step (lag 0).
"""

from __future__ import annotations

import collections
import torch

from sparsekit.accel.kernels import switches

LAG = 2  # steps between a flag's copy and its read


def enabled() -> bool:
    """False under the current plan's ``PlanOptions(lagged_stop=False)``."""
    return switches.current().lagged_stop


class LaggedStopCheck:
    """``check(unfinished, tokens, length) -> stop?`` after each step (``unfinished``: a bool
    or 0/1 tensor per sequence, ``length``: the tokens so far, prompt included), with each
    step's flag read ``lag`` steps late; :meth:`finish`: the steps run after every sequence
    had finished."""

    def __init__(self, max_length: int, lag: int = LAG):
        if lag < 0:
            raise ValueError(f"lagged stop check: lag must be >= 0, got {lag}")
        self.max_length, self.lag = max_length, lag
        self.pending: collections.deque = collections.deque()  # (flag, event) not yet read
        self.slots: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # reused once read
        self.steps = 0
        self.undo = 0

    def __call__(self, unfinished: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
        done = unfinished.max() == 0
        if done.is_cuda:  # a pinned flag and its event per pending step, lag + 1 of them
            if not self.slots:
                self.slots = [(torch.zeros((), dtype=torch.bool, pin_memory=True),
                               torch.cuda.Event()) for _ in range(self.lag + 1)]
            flag, event = self.slots[self.steps % (self.lag + 1)]
            flag.copy_(done, non_blocking=True)
            event.record()
        else:
            flag, event = done, None
        self.steps += 1
        self.pending.append((flag, event))
        final = length >= self.max_length
        while self.pending and (final or len(self.pending) > self.lag):
            flag, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
            if bool(flag):
                self.undo = len(self.pending)  # the steps run after every sequence finished
                self.pending.clear()
                return True
        return final

    def finish(self) -> int:
        """The steps run after every sequence had finished (their tokens are dropped)."""
        return self.undo


__all__ = ["LAG", "LaggedStopCheck", "enabled"]
