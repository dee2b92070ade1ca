"""HF ``generate``'s stop decision read a few steps late, so the host never waits on the GPU.

HF's decoding loop asks after every token whether all sequences are finished
(``StopCheck``: ``bool(unfinished.max() == 0)``), which blocks the host until the GPU has run
that step: the GPU then idles while the host prepares the next step (inputs, the graph's
input copies, its launch). :class:`LaggedStopCheck` copies each step's flag to pinned host
memory without blocking and reads it :data:`LAG` steps later, when the GPU has long finished
it, so the host queues the next steps meanwhile. When a flag it reads says every sequence
had finished, the loop stops and ``finish`` tells HF how many steps ran past that point;
HF's ``_undo_generation_steps`` drops their tokens (the same mechanism as HF's own
``DeferredStopCheck``, which HF enables on Apple GPUs only). At ``max_length`` it reads every
pending flag at once, so the loop never runs past the cache. The returned sequences are
those of the per-step check: the extra steps only append pad tokens (every sequence had
finished) that are then removed; with sampling, those steps still draw from the random
generator, so its state after the call is up to :data:`LAG` draws further on.

:func:`installed` puts it in place of HF's ``StopCheck`` for the calls it wraps, in this thread
only (another thread's ``generate`` keeps HF's); a call with a streamer keeps HF's (a
streamer needs each token on the host as it comes). ``SPARSEKIT_LAGGED_STOP=0`` keeps HF's
check everywhere.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator

import torch

LAG = 2  # steps between a flag's copy and its read
_local = threading.local()
_lock = threading.Lock()
_users = 0
_original = None  # HF's StopCheck while installed


def enabled() -> bool:
    """False when ``SPARSEKIT_LAGGED_STOP=0``."""
    return os.environ.get("SPARSEKIT_LAGGED_STOP", "1") != "0"


class LaggedStopCheck:
    """HF's ``StopCheck`` interface (``__call__(unfinished, tokens, length) -> bool``,
    ``finish() -> steps to undo``) with each step's flag read ``lag`` steps late."""

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
        """The steps HF must undo (its ``StopCheck.finish``)."""
        return self.undo


def _stop_check(streamer=None):
    """What HF's ``_sample`` builds as ``StopCheck(streamer)`` while installed."""
    max_length = getattr(_local, "max_length", None)
    if max_length is None or streamer is not None:
        return _original(streamer)
    return LaggedStopCheck(max_length)


@contextlib.contextmanager
def installed(max_length: int) -> Iterator[bool]:
    """HF generate calls in this thread, within the block, check for a stop :data:`LAG` steps
    late (the loop stops at ``max_length`` tokens, prompt included, at the latest). Yields
    whether it is in place: False when disabled or when this transformers has no
    ``StopCheck`` (its loop then checks every step, as before)."""
    global _users, _original
    try:
        from transformers.generation import utils as gen_utils
    except ImportError:
        gen_utils = None
    if not enabled() or gen_utils is None or not hasattr(gen_utils, "StopCheck") or \
            not hasattr(gen_utils, "_undo_generation_steps"):
        yield False
        return
    with _lock:
        if _users == 0:
            _original = gen_utils.StopCheck
            gen_utils.StopCheck = _stop_check
        _users += 1
    outer = getattr(_local, "max_length", None)
    _local.max_length = max_length
    try:
        yield True
    finally:
        _local.max_length = outer
        with _lock:
            _users -= 1
            if _users == 0:
                gen_utils.StopCheck = _original
                _original = None


__all__ = ["LAG", "LaggedStopCheck", "enabled", "installed"]
