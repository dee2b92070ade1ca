"""A run SIGKILLed during fine-tuning and resumed ends exactly like an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kill_after_checkpoint import command as kill_command  # tests/ is on sys.path
from sparsekit.run.pipeline import CHECKPOINT
from sparsekit.io.runstate import load_checkpoint

TINY = [
    "data.kwargs.num_samples=300", "train.dense_steps=30", "train.finetune_steps=20",
    "train.log_every=5", "train.eval_every=5", "train.checkpoint_every=5",
    "schedule.end=10", "schedule.every=5", "bench=off", "train.quiet=true",
    "train.device=cpu",  # bit-exact comparisons: GPU kernels are not deterministic run to run
]


def sparsekit(args: list[str], cwd: Path, kill: tuple[str, int] | None = None) -> subprocess.Popen:
    """``python -m sparsekit ARGS``; ``kill=(phase, step)``: SIGKILLed right after writing that
    checkpoint (tests/kill_after_checkpoint.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPARSEKIT_QUIET": "1"}
    entry = ["-m", "sparsekit"] if kill is None else kill_command(*kill)
    return subprocess.Popen([sys.executable, *entry, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# channel pruning in two increments at steps 5 and 10, interleaved with fine-tuning: the kill
# at step 9 falls between them, so the resumed run must rebuild the pruned widths first
CHANNELS = ["prune=channel", "prune.channel.ratio=0.5", "prune.channel.steps=2",
            "prune.channel.round_to=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that two tests compare with, started once in the background (each test starts
    its killed run beside it): ``(process, directory)``; wait for the process before reading.
    A cache of its own: two processes training one baseline at once would race on its file."""
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = sparsekit([*TINY, f"cache_dir={root / 'cache_full'}", "hydra.run.dir=full"], root)
    yield proc, root / "full"
    proc.kill()


def _started(extra: list[str], tmp_path: Path, uninterrupted) -> tuple[subprocess.Popen, Path]:
    if not extra:
        return uninterrupted
    # a cache each: both processes train the same baseline at once, and two writers of one
    # dense checkpoint file race (one removes it as the other replaces it)
    full = sparsekit([*TINY, *extra, f"cache_dir={tmp_path / 'cache_full'}",
                      "hydra.run.dir=full"], tmp_path)
    return full, tmp_path / "full"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], CHANNELS], ids=["masks", "channels"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, extra, uninterrupted):
    full, full_dir = _started(extra, tmp_path, uninterrupted)
    killed = sparsekit([*TINY, *extra, f"cache_dir={tmp_path / 'cache'}",
                        "hydra.run.dir=runs/killed"], tmp_path,
                       kill=("finetune", 9))
    assert full.wait(timeout=300) == 0, full.stderr.read()
    assert killed.wait(timeout=300) == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "killed"
    assert not (run_dir / "summary.json").exists()
    assert load_checkpoint(run_dir / CHECKPOINT)["step"] == 9
    assert not list((run_dir / CHECKPOINT.parent).glob(".*.tmp"))  # atomic: no leftovers

    resumed = sparsekit(["resume=true"], tmp_path)  # the latest run under runs/
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "TensorBoard logdir" in out

    a = json.loads((full_dir / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    for key in ("accuracy", "loss", "size_bytes"):
        assert a["compressed"][key] == b["compressed"][key], key
    assert a["sparsity"] == b["sparsity"]
    if extra:  # both increments happened: half of every prunable layer's channels are gone
        assert a["channels"] == b["channels"]
        assert a["channels"]["channels_removed"] == pytest.approx(0.5, abs=0.05)
    wa = load_file(full_dir / "model.safetensors")
    wb = load_file(run_dir / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k  # same masks (zeros) and same kept weights
    assert load_checkpoint(run_dir / CHECKPOINT)["done"]
    # the resumed run kept the original run's configuration
    assert "finetune_steps: 20" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_sigkill_during_dense_training_then_resume(tmp_path, uninterrupted):
    """Killed while training the dense baseline: the baseline's checkpoint (beside its cache
    entry) carries the run on, and the result equals an uninterrupted run's, bit for bit."""
    full, full_dir = uninterrupted
    cache = tmp_path / "cache"
    killed = sparsekit([*TINY, f"cache_dir={cache}", "hydra.run.dir=runs/killed"], tmp_path,
                       kill=("dense", 19))
    assert full.wait(timeout=300) == 0, full.stderr.read()
    assert killed.wait(timeout=300) == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "killed"
    assert not (run_dir / CHECKPOINT).exists()  # fine-tuning never started
    (partial,) = (cache / "baselines").glob("*.partial.pt")
    assert load_checkpoint(partial)["step"] == 19
    assert not list((cache / "baselines").glob("*.safetensors"))

    resumed = sparsekit(["resume=true"], tmp_path)  # finds the run killed before fine-tuning
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    b = json.loads((run_dir / "summary.json").read_text())
    assert b["dense_source"].startswith("trained (resumed at step 20, 30 steps)")
    assert not partial.exists()  # replaced by the finished baseline
    a = json.loads((full_dir / "summary.json").read_text())
    for key in ("accuracy", "loss"):
        assert a["dense"][key] == b["dense"][key], key
        assert a["compressed"][key] == b["compressed"][key], key
    wa = load_file(full_dir / "model.safetensors")
    wb = load_file(run_dir / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
