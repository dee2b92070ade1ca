"""Progress bars (tqdm) that a run can silence: ``quiet=True`` or the environment variable
SPARSEKIT_QUIET=1 (which CI sets)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def is_quiet(quiet: bool = False) -> bool:
    return quiet or os.environ.get("SPARSEKIT_QUIET", "") not in ("", "0")


def progress(iterable: Iterable[T], quiet: bool = False, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable, **kwargs)``, or the iterable itself when quiet."""
    if is_quiet(quiet):
        return iterable
    return tqdm(iterable, dynamic_ncols=True, **kwargs)
