"""MNIST-1D (Greydanus & Kalischek): 1-D digit signals of length 40, 10 classes.

Generated locally with ``mnist1d.data.make_dataset`` (never downloaded) and cached as ``.npz``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from sparsekit.data.bundle import DataBundle
from sparsekit.io.files import atomic_write


def generate(num_samples: int = 5000, seed: int = 42, train_split: float = 0.8) -> dict:
    """Arrays ``x`` (N, 40) float32, ``y`` (N,) int64 and their ``_test`` halves, from the
    reference generator with its default arguments except the three given."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed, args.train_split = num_samples, seed, train_split
    state = np.random.get_state()  # make_dataset reseeds numpy's global generator
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(state)
    return {
        "x": d["x"].astype(np.float32),
        "y": d["y"].astype(np.int64),
        "x_test": d["x_test"].astype(np.float32),
        "y_test": d["y_test"].astype(np.int64),
    }


def mnist1d(
    cache_dir: str | os.PathLike,
    num_samples: int = 5000,
    seed: int = 42,
    train_split: float = 0.8,
):
    """MNIST-1D as a :class:`~sparsekit.data.bundle.DataBundle` of TensorDatasets: inputs (N, 1, 40)
    float32 (one channel for Conv1d), labels (N,) int64. Default sizes give the paper's
    4000/1000 split."""
    spec = {"num_samples": num_samples, "seed": seed, "train_split": train_split, "v": 1}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"mnist1d_{key}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    else:
        arrays = generate(num_samples, seed, train_split)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        atomic_write(path, write)

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))

    return DataBundle(
        train=dataset(arrays["x"], arrays["y"]),
        eval=dataset(arrays["x_test"], arrays["y_test"]),
        info={"num_classes": 10, "in_len": int(arrays["x"].shape[-1])},
    )
