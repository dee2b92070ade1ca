"""Progress bars (tqdm) that a run can silence: ``quiet=True`` or the environment variable
SPARSEKIT_QUIET=1 (which CI sets). They are drawn only on a terminal: when stderr goes to a
file or a pipe (a log, CI, ``nohup``) nothing is written, so logs hold no carriage returns or
escape codes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def is_quiet(quiet: bool = False) -> bool:
    return quiet or os.environ.get("SPARSEKIT_QUIET", "") not in ("", "0")


def progress(iterable: Iterable[T], quiet: bool = False, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable, **kwargs)`` on a terminal, else the iterable itself."""
    if is_quiet(quiet) or not _is_terminal(kwargs.get("file", sys.stderr)):
        return iterable
    return tqdm(iterable, dynamic_ncols=True, **kwargs)


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
