"""Progress that a run can silence: ``quiet=True`` or the environment variable
SPARSEKIT_QUIET=1 (which CI sets). On a terminal, a tqdm bar. Elsewhere (a log file, CI, a pipe,
``nohup``), plain lines on the ``sparsekit`` logger, which the ``sparsekit`` command sends to
stderr and to the run's ``sparsekit.log``: one line per tenth of a loop (at least one a minute,
none in its first 5 s) with the count, the elapsed time and an ETA; no carriage returns or
escape codes. A library caller who configured no logging sees nothing."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
LOG = logging.getLogger("sparsekit")
#: the run's sparsekit.log alone (the CLI gives it only the file handler): what a quiet run
#: still records, and the end-of-run table that stdout prints
FILE_LOG = logging.getLogger("sparsekit.file")
LINE_EVERY_S = 60.0  # a line at least this often, however many items that is
QUIET_FIRST_S = 5.0  # no line before this: a loop that ends sooner logs nothing


def is_quiet(quiet: bool = False) -> bool:
    return quiet or os.environ.get("SPARSEKIT_QUIET", "") not in ("", "0")


def progress(iterable: Iterable[T], quiet: bool = False, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable, **kwargs)`` on a terminal; else :func:`progress_lines` when the
    ``sparsekit`` logger logs INFO; else the iterable itself. ``kwargs``: tqdm's (``desc``,
    ``total``, ``initial`` are read by the lines too)."""
    if is_quiet(quiet):
        return iterable
    if _is_terminal(kwargs.get("file", sys.stderr)):
        return tqdm(iterable, dynamic_ncols=True, **kwargs)
    if not LOG.isEnabledFor(logging.INFO):
        return iterable
    total = kwargs.get("total")
    if total is None and hasattr(iterable, "__len__"):
        total = kwargs.get("initial", 0) + len(iterable)  # type: ignore[arg-type]
    return progress_lines(iterable, kwargs.get("desc") or "progress", total,
                          kwargs.get("initial", 0))


def progress_lines(iterable: Iterable[T], desc: str, total: int | None = None,
                   initial: int = 0, every: int | None = None,
                   clock: Any = time.monotonic) -> Iterator[T]:
    """Yield ``iterable``'s items, logging ``"<desc>: <done>/<total> (<pct>%), <elapsed>
    elapsed, ETA <eta>"`` after every ``every``-th item (default: a tenth of ``total``), at
    least every :data:`LINE_EVERY_S` seconds, and after the last; none in the first
    :data:`QUIET_FIRST_S` seconds (a short loop, such as a quick evaluation, logs nothing).
    ``initial``: items done before (a resumed loop); the ETA is the rate of this run's items
    over what remains."""
    if every is None:
        every = max(1, math.ceil((total - initial) / 10)) if total else 10
    start = last = clock()
    done = initial
    for item in iterable:
        yield item
        done += 1
        now = clock()
        due = (done - initial) % every == 0 or now - last >= LINE_EVERY_S or done == total
        if due and now - start >= QUIET_FIRST_S:
            LOG.info(progress_line(desc, done, total, initial, now - start))
            last = now


def progress_line(desc: str, done: int, total: int | None, initial: int, elapsed: float) -> str:
    """One progress line.

    >>> progress_line("fine-tune", 250, 1000, 0, 30.0)
    'fine-tune: 250/1000 (25%), 30 s elapsed, ETA 1 min 30 s'
    >>> progress_line("eval", 7, None, 0, 2.5)
    'eval: 7, 2.5 s elapsed'
    """
    if not total:
        return f"{desc}: {done}, {format_seconds(elapsed)} elapsed"
    line = f"{desc}: {done}/{total} ({100 * done / total:.0f}%), {format_seconds(elapsed)} elapsed"
    if done < total and done > initial:
        line += f", ETA {format_seconds(elapsed / (done - initial) * (total - done))}"
    return line


def format_seconds(s: float) -> str:
    """``2.5 s``, ``30 s``, ``1 min 30 s``, ``2 h 5 min``.

    >>> [format_seconds(x) for x in (2.5, 30, 90, 7500)]
    ['2.5 s', '30 s', '1 min 30 s', '2 h 5 min']
    """
    if s < 10:
        return f"{s:.1f} s"
    s = round(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
