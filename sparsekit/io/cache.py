"""Where sparsekit caches what it can rebuild: datasets, trained baselines, accel's timing plans
and cuSPARSELt algorithm ids. One variable, ``SPARSEKIT_CACHE``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` when given, else ``$SPARSEKIT_CACHE``, else ``~/.cache/sparsekit``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    root = os.environ.get("SPARSEKIT_CACHE")
    return Path(root or "~/.cache/sparsekit").expanduser()
