"""sparsekit's exception types: every error a user can cause has one of these, with a message
that names the option, layer or file and what is allowed.

They subclass the built-in types the public API has always raised (ValueError, TypeError,
OSError), so ``except ValueError`` in user code keeps working. The command line maps them to
exit codes: :class:`UsageError` (a bad option or value, found before the run starts) exits 2;
any other :class:`SparsekitError` (found while running: a corrupt file, a checkpoint of another
architecture, a full disk) exits 1 with one line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class SparsekitError(Exception):
    """Base of every error sparsekit raises on purpose (bad input, bad file, refused action)."""


class UsageError(SparsekitError, ValueError):
    """A bad option, argument or value: names it and the allowed values."""


class ConfigTypeError(SparsekitError, TypeError):
    """An argument of the wrong type: names it and the accepted types."""


class FileFormatError(SparsekitError, ValueError):
    """A file that is not what it should be (truncated, corrupt, another format or
    architecture): names the file and what is wrong."""


class UnsafeFileError(FileFormatError):
    """A file asks for something sparsekit never does when loading (an import, a pickle)."""


class StorageError(SparsekitError, OSError):
    """A file or directory that cannot be written or read (permissions, full disk): names it."""


class ModelCallError(SparsekitError, ValueError):
    """The model cannot be called with the batches given (calibration, channels, accel): names
    the layer or the batch and says how to pass ``calibration_fn``."""


class RunPaused(SparsekitError):
    """A run stopped on purpose at its time budget (``train.max_minutes``) after writing its
    resume checkpoint: ``resume=true`` continues it. Not a failure."""


class NumericsError(SparsekitError, ValueError):
    """Non-finite weights, activations or statistics where a finite value is needed: names the
    layer."""


_WRITE_FAILED = ("PytorchStreamWriter", "inline_container", "unexpected pos", "file write failed",
                 "IoError", "StorageFull", "No space left")


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike, what: str = "write") -> Iterator[None]:
    """Turn a failed write of ``path`` into :class:`StorageError` naming it: an OSError
    (permissions, a full disk, a file where a directory should be), or the RuntimeError that
    ``torch.save`` raises on a full disk (``[enforce fail at inline_container.cc] unexpected
    pos``) and safetensors' error of the same kind."""
    try:
        yield
    except SparsekitError:
        raise
    except OSError as e:
        where = e.filename if e.filename is not None else path
        reason = e.strerror or str(e) or type(e).__name__
        raise StorageError(f"cannot {what} {os.fspath(where)}: {reason}") from e
    except Exception as e:  # torch.save / safetensors wrap the OSError in their own types
        text = str(e)
        if not any(s in text for s in _WRITE_FAILED):
            raise
        first = (text.strip().splitlines() or [""])[0]
        raise StorageError(
            f"cannot {what} {os.fspath(path)}: the write failed (is the disk full?): {first}"
        ) from e


def file_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a reader whose first argument is a path: any error it meets that is not already
    a :class:`SparsekitError` (a KeyError from a malformed header, safetensors' or JSON's parse
    errors, a state_dict of another architecture) becomes :class:`FileFormatError` naming the
    file; OSError becomes :class:`StorageError`."""

    @functools.wraps(fn)
    def wrapper(path: str | os.PathLike, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(path, *args, **kwargs)
        except SparsekitError as e:  # about this file's content: say which file
            if os.fspath(path) in str(e):
                raise
            cls = type(e) if isinstance(e, (FileFormatError, StorageError)) else FileFormatError
            raise cls(f"{os.fspath(path)}: {e}") from e
        except OSError as e:
            raise StorageError(f"cannot read {os.fspath(path)}: {e.strerror or e}") from e
        except Exception as e:
            text = (str(e).strip().splitlines() or [""])[0][:300]
            name = os.fspath(path)
            detail = text if name in text else f"{name}: {type(e).__name__}: {text}"
            raise FileFormatError(f"{detail} (not a valid sparsekit checkpoint)") from e

    return wrapper
