"""Where sparsekit caches what it can rebuild: datasets, trained baselines, accel's timing plans
and cuSPARSELt algorithm ids. One variable, ``SPARSEKIT_CACHE``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` when given, else ``$SPARSEKIT_CACHE``, else ``~/.cache/sparsekit``.
    ``$SPARSEKIT_CACHE_DIR`` (the accel cache's old variable) is still read when
    ``SPARSEKIT_CACHE`` is unset, with a DeprecationWarning."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    root = os.environ.get("SPARSEKIT_CACHE")
    if not root and os.environ.get("SPARSEKIT_CACHE_DIR"):
        warnings.warn("SPARSEKIT_CACHE_DIR is deprecated; set SPARSEKIT_CACHE (one cache for "
                      "data, baselines and accel plans)", DeprecationWarning, stacklevel=2)
        root = os.environ["SPARSEKIT_CACHE_DIR"]
    return Path(root or "~/.cache/sparsekit").expanduser()
