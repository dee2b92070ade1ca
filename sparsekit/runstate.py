"""Resume checkpoints for the fine-tuning stage of a run.

A checkpoint holds everything the rest of the run depends on: model weights (with their mask
parametrizations), optimizer state, pruner state (masks and schedule position), the step, and
the RNG states of torch, CUDA, numpy and Python. It is plain data, written atomically (temp
file + rename) and read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparsekit._io import atomic_torch_save, safe_torch_load

VERSION = 1


def rng_state() -> dict[str, Any]:
    """The global RNG states as tensors, ints and lists (no numpy objects, no pickles)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pruner: Any = None,
    done: bool = False,
) -> Path:
    """Write the state after fine-tuning step ``step`` (``done``: the loop has finished)."""
    return atomic_torch_save(
        {
            "version": VERSION,
            "step": step,
            "done": done,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "pruner": None if pruner is None else pruner.state_dict(),
            "rng": rng_state(),
        },
        path,
    )


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (no code is unpickled)."""
    state = safe_torch_load(path)
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"{path} is not a sparsekit resume checkpoint of version {VERSION}")
    return state


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pruner: Any = None,
) -> int:
    """Load ``state`` into freshly built objects (the pruner already attached, so the model's
    parametrized keys exist). Returns the next step to run."""
    if pruner is not None and state["pruner"] is not None:
        pruner.load_state_dict(state["pruner"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["step"]) + 1
