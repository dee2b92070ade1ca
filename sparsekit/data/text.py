"""A byte-level text corpus that is on every machine: the Python standard library's source.

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (sorted, tests excluded) are
concatenated up to ``max_bytes``; the first ``1 - eval_fraction`` is for training, the rest for
evaluation. Samples are non-overlapping windows: input bytes ``[i, i + seq_len)`` and the
next-byte targets ``[i + 1, i + seq_len + 1)``, both int64 of shape (seq_len,).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from sparsekit.data.bundle import DataBundle
from sparsekit.io.files import atomic_write


def read_stdlib_source(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of standard-library Python source, in a fixed file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages") for p in rel):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteWindows(Dataset):
    """Non-overlapping next-byte prediction windows over a uint8 tensor."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if len(data) <= seq_len:
            raise ValueError(f"data.kwargs.seq_len={seq_len} is longer than the text ({len(data)})")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_text(
    cache_dir: str | os.PathLike,
    seq_len: int = 128,
    max_bytes: int = 2_000_000,
    eval_fraction: float = 0.1,
):
    """The corpus as a :class:`~sparsekit.data.bundle.DataBundle` of :class:`ByteWindows`
    (vocabulary 256: raw bytes)."""
    spec = {"max_bytes": max_bytes, "python": sys.version.split()[0], "v": 1}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"stdlib_text_{key}.npy"
    if path.exists():
        arr = np.load(path, allow_pickle=False)
    else:
        arr = np.frombuffer(read_stdlib_source(max_bytes), dtype=np.uint8).copy()

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.save(f, arr)

        atomic_write(path, write)
    data = torch.from_numpy(arr)
    split = int(len(data) * (1 - eval_fraction))
    return DataBundle(
        train=ByteWindows(data[:split], seq_len),
        eval=ByteWindows(data[split:], seq_len),
        info={"vocab_size": 256, "seq_len": seq_len},
    )
