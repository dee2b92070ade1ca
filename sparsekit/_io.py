"""Atomic file writes: readers never see a half-written file; a killed writer keeps the old."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` (same directory,
    so the rename is atomic on POSIX). Returns the final path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_torch_save(obj: object, path: str | os.PathLike) -> Path:
    """``torch.save`` through :func:`atomic_write`. Save only plain data (tensors, numbers,
    strings, lists, dicts) so that ``torch.load(path, weights_only=True)`` reads it back."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def safe_torch_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> object:
    """Load a file written by :func:`atomic_torch_save` without executing pickled code."""
    return torch.load(path, map_location=map_location, weights_only=True)
