"""``python tests/kill_after_checkpoint.py PHASE STEP [sparsekit args...]``: the sparsekit
command line, SIGKILLed right after it wrote the ``PHASE`` checkpoint (``dense``: the baseline's
training; ``finetune``) of ``STEP``, on every rank. The kill-and-resume tests start it (also
under torchrun) through :func:`command`; the kill lives here, sparsekit only calls the hook.
The runs they compare it with (uninterrupted, resumed) go through :func:`run_here`."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from pathlib import Path

from sparsekit.run.context import Callback, RunContext, register_callback


def command(phase: str, step: int) -> list[str]:
    """What replaces ``-m sparsekit`` on a command line to kill that run at ``step``."""
    return [str(Path(__file__).resolve()), phase, str(step)]


def run_here(argv: list[str], cwd: Path) -> str:
    """The sparsekit command line ``argv`` in this process, from ``cwd``; what it printed.
    The same code as ``python -m sparsekit`` (one intra-op thread, as in the processes the
    tests start: tests/conftest.py), without the seconds of interpreter start-up and imports
    each process costs; a failure raises (SystemExit from a usage or runtime error)."""
    from sparsekit.run.cli import main

    old, out = os.getcwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    finally:
        os.chdir(old)
    return out.getvalue()


class KillAfterCheckpoint(Callback):
    def __init__(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step

    def on_checkpoint(self, ctx: RunContext, phase: str, step: int) -> None:
        if (phase, step) == (self.phase, self.step):
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from sparsekit.run.cli import main

    phase, step, *argv = sys.argv[1:]
    register_callback(KillAfterCheckpoint(phase, int(step)))
    main(argv)
