"""Atomic file writes: readers never see a half-written file; a killed writer keeps the old.

Written files follow the umask (as ``open`` would create them, not mkstemp's 0600, nor the
0600 that safetensors' ``save_file`` gives the files it writes), and the
temporary files of writers that were killed (``.NAME.*.tmp``, older than this process) are
removed the next time ``NAME`` is written.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from sparsekit.errors import FileFormatError, UnsafeFileError

_STARTED = time.time()  # temporary files older than this process are orphans of killed writers
_STALE_S = 300.0  # ... and untouched for this long (a live writer keeps touching its own)
_umask_lock = threading.Lock()


def _file_mode() -> int:
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def follow_umask(*paths: str | os.PathLike) -> None:
    """Give files written by a library that sets its own mode (safetensors' ``save_file``
    writes 0600, also through transformers' ``save_pretrained``) the umask's permissions, as
    ``open`` would have created them; a directory: every file under it."""
    mode = _file_mode()
    for path in map(Path, paths):
        for f in [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file()]:
            os.chmod(f, mode)


def _remove_orphans(path: Path) -> None:
    """Delete ``.NAME.*.tmp`` files left beside ``path`` by writers that were killed."""
    limit = min(_STARTED, time.time() - _STALE_S)
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if tmp.stat().st_mtime < limit:
                tmp.unlink()
        except OSError:  # another process removed or renamed it first
            pass


def atomic_write(
    path: str | os.PathLike, write: Callable[[str], None], *, previous: str | os.PathLike | None
    = None,
) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` (same directory,
    so the rename is atomic on POSIX). ``previous``: first move the existing ``path`` there,
    so the last good version survives a damaged new one. Returns the final path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _file_mode())  # after: a writer may replace the file (safetensors: 0600)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_torch_save(
    obj: object, path: str | os.PathLike, *, previous: str | os.PathLike | None = None
) -> Path:
    """``torch.save`` through :func:`atomic_write`. Save only plain data (tensors, numbers,
    strings, lists, dicts) so that ``torch.load(path, weights_only=True)`` reads it back."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp), previous=previous)


def safe_torch_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> object:
    """Load a file written by :func:`atomic_torch_save` without executing pickled code.

    A file that holds pickled code raises :class:`~sparsekit.errors.UnsafeFileError`; a
    truncated or corrupt one :class:`~sparsekit.errors.FileFormatError`; both name the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except pickle.UnpicklingError as e:
        what = re.search(r"(?:unsupported|Unsupported) (?:GLOBAL|global):? ?([\w.]+)", str(e))
        if what or _starts_like_pickle(path):  # weights_only refused a pickle of objects
            named = f" ({what.group(1)})" if what else ""
            raise UnsafeFileError(
                f"{path} holds pickled objects{named} other than tensors and plain data; "
                "sparsekit does not load those, and nothing in it was run"
            ) from None
        raise FileFormatError(f"{path} is not a readable torch file (corrupt?): {e}") from None
    except (EOFError, OSError, RuntimeError, ValueError, zipfile.BadZipFile) as e:
        raise FileFormatError(
            f"{path} is not a readable torch file (truncated or corrupt?): "
            f"{type(e).__name__}: {str(e)[:200]}"
        ) from None


def _starts_like_pickle(path: str | os.PathLike) -> bool:
    """Whether the file begins with a pickle protocol header (a bare pickle, not random
    bytes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def move_aside(path: str | os.PathLike) -> Path:
    """Rename a damaged ``path`` to ``<name>.corrupt-<UTC time>`` beside it; returns the new
    path."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, dest)
    return dest


def unique_dir(path: str | os.PathLike) -> Path:
    """Create the directory ``path`` (its parents as needed), or ``path_1``, ``path_2``, ... if
    it exists: ``os.mkdir`` is atomic, so two processes never get the same directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 0
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}_{n}")
