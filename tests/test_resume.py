"""A run SIGKILLed during fine-tuning and resumed ends exactly like an uninterrupted run.

The killed runs are processes of their own; the uninterrupted and resumed runs run in the test's
process (tests/kill_after_checkpoint.py: run_here), which costs no interpreter start-up."""

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

from kill_after_checkpoint import command as kill_command, run_here  # tests/ is on sys.path
from sparsekit.run.pipeline import CHECKPOINT
from sparsekit.io.runstate import load_checkpoint

TINY = [
    "data.kwargs.num_samples=300", "train.dense_steps=30", "train.finetune_steps=20",
    "train.log_every=5", "train.eval_every=5", "train.checkpoint_every=5",
    "schedule.end=10", "schedule.every=5", "bench=off", "train.quiet=true",
    "train.device=cpu",  # bit-exact comparisons: GPU kernels are not deterministic run to run
]


def sparsekit(args: list[str], cwd: Path, kill: tuple[str, int]) -> subprocess.Popen:
    """The command line ``sparsekit ARGS`` in a process of its own, SIGKILLed right after
    writing the checkpoint ``kill=(phase, step)`` (tests/kill_after_checkpoint.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPARSEKIT_QUIET": "1"}
    return subprocess.Popen([sys.executable, *kill_command(*kill), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# channel pruning in two increments at steps 5 and 10, interleaved with fine-tuning: the kill
# at step 9 falls between them, so the resumed run must rebuild the pruned widths first
CHANNELS = ["prune=channel", "prune.channel.ratio=0.5", "prune.channel.steps=2",
            "prune.channel.round_to=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run that two tests compare with, made once (in this process): its directory."""
    root = tmp_path_factory.mktemp("uninterrupted")
    run_here([*TINY, f"cache_dir={root / 'cache_full'}", "hydra.run.dir=full"], root)
    return root / "full"


# masks: the default run's kill-and-resume test; channels and the dense-training kill: slow
@pytest.mark.parametrize("extra", [[], pytest.param(CHANNELS, marks=pytest.mark.slow)],
                         ids=["masks", "channels"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, extra, uninterrupted):
    killed = sparsekit([*TINY, *extra, f"cache_dir={tmp_path / 'cache'}",
                        "hydra.run.dir=runs/killed"], tmp_path,
                       kill=("finetune", 9))
    full_dir = uninterrupted
    if extra:  # made here while the killed run trains (a cache each: two writers of one
        # dense checkpoint file would race, one removing it as the other replaces it)
        run_here([*TINY, *extra, f"cache_dir={tmp_path / 'cache_full'}", "hydra.run.dir=full"],
                 tmp_path)
        full_dir = tmp_path / "full"
    assert killed.wait(timeout=300) == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "killed"
    assert not (run_dir / "summary.json").exists()
    assert load_checkpoint(run_dir / CHECKPOINT)["step"] == 9
    assert not list((run_dir / CHECKPOINT.parent).glob(".*.tmp"))  # atomic: no leftovers

    out = run_here(["resume=true"], tmp_path)  # the latest run under runs/
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
    full_dir = uninterrupted
    cache = tmp_path / "cache"
    killed = sparsekit([*TINY, f"cache_dir={cache}", "hydra.run.dir=runs/killed"], tmp_path,
                       kill=("dense", 19))
    assert killed.wait(timeout=300) == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "killed"
    assert not (run_dir / CHECKPOINT).exists()  # fine-tuning never started
    (partial,) = (cache / "baselines").glob("*.partial.pt")
    assert load_checkpoint(partial)["step"] == 19
    assert not list((cache / "baselines").glob("*.safetensors"))

    run_here(["resume=true"], tmp_path)  # finds the run killed before fine-tuning
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
