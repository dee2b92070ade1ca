"""The plan cache: timings and choices on disk, ``$SPARSEKIT_CACHE/plans.json`` (default
``~/.cache/sparsekit``), keyed by device name, torch version, what was timed (a variant and its
numerics, a layer's decode plan, a whole model's signature), weight shape (N, K), tokens M and
input dtype, so a second ``accelerate`` of the same shapes times nothing. A damaged file is
re-measured, not fatal; entries are merged in with an atomic write."""

from __future__ import annotations

import json
from pathlib import Path

from sparsekit.io.cache import cache_root
from sparsekit.io.files import atomic_write


def cache_path() -> Path:
    return cache_root() / "plans.json"


def plan_key(device_name: str, torch_version: str, variant: str, out_features: int,
             in_features: int, tokens: int, dtype: str = "bfloat16",
             inductor: dict | None = None) -> str:
    """One cache entry's key: everything a variant's time depends on (extra ``inductor``
    options of the compile included)."""
    return (f"{device_name}|torch={torch_version}|{variant}|N={out_features}|K={in_features}|"
            f"M={tokens}|{dtype}" + (f"|inductor={sorted(inductor.items())}" if inductor else ""))


def load(path: Path | None = None) -> dict[str, dict]:
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a damaged cache is re-measured, not fatal
        return {}


def store(entries: dict[str, dict], path: Path | None = None) -> None:
    """Merge ``entries`` into the cache file (atomic write)."""
    path = path or cache_path()
    data = load(path)
    data.update(entries)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1,
                                                                   sort_keys=True)))



def model_key(device_name: str, torch_version: str, signature: str) -> str:
    """The cache key of one whole-model decision (``signature``: a hash of layer shapes, tokens,
    candidates, per-layer choices, input shapes and accelerate's options)."""
    return f"model|{device_name}|torch={torch_version}|{signature}"



__all__ = ["cache_path", "load", "model_key", "plan_key", "store"]
