"""The one allow-list for unpickling: the plain data classes a pickle sparsekit reads may name.

sparsekit writes no pickles of its own (checkpoints are safetensors; resume state is read with
``torch.load(weights_only=True)``, torch's own allow-list of tensors and plain containers). The
one pickle it must read with its own unpickler is the ``.metadata`` index of a
torch.distributed.checkpoint (FSDP2 resume state), which DCP itself unpickles with no
restriction. :func:`restricted_load` admits exactly the classes listed in :data:`PLAIN_CLASSES`
(DCP's metadata dataclasses, torch sizes, dtypes and layouts, paths): nothing else, not even a
class that happens to be importable from a DCP module (such as a ``TCPStore``, whose
construction opens a socket).

>>> import io, pickle, torch
>>> restricted_load(io.BytesIO(pickle.dumps(torch.Size([2, 3]))), "size.pkl")
torch.Size([2, 3])
>>> restricted_load(io.BytesIO(pickle.dumps(print)), "evil.pkl")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
sparsekit.errors.UnsafeFileError: evil.pkl names builtins.print, which is not plain data ...
"""

from __future__ import annotations

import pickle
from typing import IO, Any


from sparsekit.errors import FileFormatError, UnsafeFileError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
           "float8_e4m3fnuz", "float8_e5m2fnuz", "int64", "int32", "int16", "int8", "uint8",
           "uint16", "uint32", "uint64", "bool", "complex64", "complex128")

#: (module, name) of every global an admitted pickle may name
PLAIN_CLASSES: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "StorageMeta",
                                    "TensorProperties", "TensorStorageMetadata",
                                    "BytesStorageMetadata", "ChunkStorageMetadata",
                                    "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # "torch.strided" -> the layout object
    *(("torch", d) for d in _DTYPES),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _Restricted(pickle.Unpickler):
    def __init__(self, file: IO[bytes], where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PLAIN_CLASSES:
            raise UnsafeFileError(
                f"{self.where} names {module}.{name}, which is not plain data that file ever "
                "holds; refused, and nothing in it was run"
            )
        return super().find_class(module, name)


def restricted_load(file: IO[bytes], where: str) -> Any:
    """Unpickle ``file`` (named ``where`` in errors) admitting only :data:`PLAIN_CLASSES`;
    UnsafeFileError for any other global, FileFormatError for a pickle that is not readable."""
    try:
        return _Restricted(file, where).load()
    except UnsafeFileError:
        raise
    except Exception as e:  # truncated, not a pickle, a listed class given bad arguments
        raise FileFormatError(f"{where} is not readable: {type(e).__name__}: {e}") from None


__all__ = ["PLAIN_CLASSES", "restricted_load"]
