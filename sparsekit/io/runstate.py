"""Resume checkpoints for the fine-tuning stage of a run.

A checkpoint holds everything the rest of the run depends on: model weights (with their mask
parametrizations), optimizer state, pruner state (masks and schedule position), the step, and
the RNG states of torch, CUDA, numpy and Python. It is plain data, written atomically (temp
file + rename, the previous one kept as ``<name>.prev.pt``) and read back with
``torch.load(weights_only=True)``; a damaged checkpoint falls back to the previous one.

A run directory also holds its state, ``run_state.json`` (:data:`STATE_FILE`): ``running``
while a process works on it (and after that process was killed), ``failed`` (with the error)
or ``finished``, with the process id and host; ``resume=true`` picks only runs that can
continue, never one whose process is still alive (:func:`still_running`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sparsekit.io.files import atomic_torch_save, atomic_write, move_aside, safe_torch_load
from sparsekit.errors import FileFormatError, UsageError

VERSION = 1
STATE_FILE = "run_state.json"
RUN_STATES = ("running", "paused", "failed", "finished")


def previous_path(path: str | os.PathLike) -> Path:
    """Where :func:`save_checkpoint` keeps the checkpoint before ``path``: ``last.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


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
    """Write the state after fine-tuning step ``step`` (``done``: the loop has finished); the
    checkpoint it replaces becomes :func:`previous_path`."""
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
        previous=previous_path(path),
    )


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (no code is unpickled); a damaged
    or foreign file raises :class:`~sparsekit.errors.FileFormatError` naming it."""
    state = safe_torch_load(path)
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise FileFormatError(f"{path} is not a sparsekit resume checkpoint of version {VERSION}")
    return state


def load_latest_checkpoint(path: str | os.PathLike, *, discard: bool = False) -> dict | None:
    """The checkpoint at ``path``, or (with a warning naming the damaged file, which is moved
    aside to ``<name>.corrupt-<time>``) the previous one; None when there is none.

    When no readable checkpoint is left: ``discard`` (a cache entry that can be rebuilt) warns,
    moves the damaged files aside and returns None; otherwise FileFormatError names the file."""
    path = Path(path)
    errors: list[str] = []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            continue
        try:
            state = load_checkpoint(candidate)
        except FileFormatError as e:
            errors.append(str(e))
            continue
        for bad in (path, previous_path(path))[: len(errors)]:
            if bad.exists():
                moved = move_aside(bad)
                warnings.warn(f"{bad} is damaged ({errors[0]}); moved it to {moved.name} and "
                              f"resumed from the previous checkpoint {candidate}", stacklevel=2)
        return state
    if not errors:
        return None
    if not discard:
        raise FileFormatError(f"cannot resume from {path}: {'; '.join(errors)}")
    for bad in (path, previous_path(path)):
        if bad.exists():
            moved = move_aside(bad)
            warnings.warn(f"{bad} is damaged; moved it to {moved.name} and starting over: "
                          f"{'; '.join(errors)}", stacklevel=2)
    return None


def write_run_state(run_dir: str | os.PathLike, state: str, error: str | None = None) -> None:
    """Record ``state`` (running | paused | failed | finished) of the run in ``run_dir``,
    atomically."""
    if state not in RUN_STATES:
        raise ValueError(f"run state {state!r}; allowed: {', '.join(RUN_STATES)}")
    info = {"state": state, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pid": os.getpid(), "host": socket.gethostname()}
    stat = _proc_stat(os.getpid())
    if stat is not None:  # with the pid, tells this process from a later one of the same id
        info["started"] = stat[1]
    if error is not None:
        info["error"] = error
    atomic_write(Path(run_dir) / STATE_FILE,
                 lambda tmp: Path(tmp).write_text(json.dumps(info, indent=2) + "\n"))


def read_run_state(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What :func:`write_run_state` recorded; None when nothing (or nothing readable) was."""
    try:
        info = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("state") not in RUN_STATES:
        return None
    return info


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, start time in clock ticks since boot, parent pid) of process ``pid``
    from Linux's /proc; None where there is no such file (no such process, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    try:
        return fields[0], int(fields[19]), int(fields[1])
    except (IndexError, ValueError):
        return None


def still_running(info: dict[str, Any] | None) -> int | None:
    """The process id when ``info`` (from :func:`read_run_state`) says ``running`` and that
    process is alive on this host (another process than this one, or than a rank of the same
    torchrun job: the ranks resolve ``resume=true`` each on its own); else None. A zombie (killed,
    not yet reaped: containers whose init never reaps) is not alive; a process id reused by a
    process that started at another time (Linux: /proc records when) is not the run's."""
    if not info or info.get("state") != "running" or info.get("host") != socket.gethostname():
        return None
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return None
    stat = _proc_stat(pid)
    if stat is not None:
        state, started, parent = stat
        if state in ("Z", "X") or info.get("started", started) != started:
            return None
        if os.environ.get("TORCHELASTIC_RUN_ID") and parent == os.getppid():
            return None  # rank 0 of this very torchrun job, already continuing the run
        return pid
    if Path("/proc/self/stat").exists():  # Linux, and no such process
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, owned by someone else
        return pid
    except OSError:
        return None
    return pid


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pruner: Any = None,
) -> int:
    """Load ``state`` into freshly built objects (the pruner already attached, so the model's
    parametrized keys exist). Returns the next step to run."""
    if pruner is not None and state["pruner"] is not None:
        pruner.load_state_dict(state["pruner"])  # channel pruning: reshapes the model
        follow_parameters(optimizer, model)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["step"]) + 1


def follow_parameters(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Point a one-group ``optimizer`` at ``model``'s parameters when pruning replaced them;
    the per-parameter state (momentum, Adam moments) of the old ones no longer fits and is
    dropped. No-op while the optimizer holds exactly the model's parameters."""
    params = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if len(held) == len(params) and all(a is b for a, b in zip(held, params)):
        return
    if len(optimizer.param_groups) != 1:
        raise UsageError(
            "pruning replaced the model's parameters and the optimizer has "
            f"{len(optimizer.param_groups)} parameter groups: rebuild the optimizer yourself"
        )
    optimizer.param_groups[0]["params"] = params
    optimizer.state.clear()
