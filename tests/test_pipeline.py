"""The run as stages over a RunContext, with callbacks for logging, evaluation, checkpoints
and whatever a caller adds (the kill-and-resume tests kill the process from one)."""

from __future__ import annotations

import pytest

from sparsekit.run.config import Config
from sparsekit.run.context import (
    CHECKPOINT,
    Callback,
    Checkpointing,
    Evaluation,
    Logging,
    default_callbacks,
    register_callback,
)
from sparsekit.run.pipeline import STAGES, run
from sparsekit.prune.pruner import Pruner
from sparsekit.io.runstate import load_checkpoint


class Recorder(Callback):
    """Everything the run tells its callbacks, with what was on disk at each checkpoint."""

    def __init__(self) -> None:
        self.stages: list[str] = []
        self.steps: dict[str, list[int]] = {"dense": [], "finetune": []}
        self.checkpoints: dict[str, list[int]] = {"dense": [], "finetune": []}
        self.on_disk: list[int] = []
        self.pruners: set[type] = set()

    def on_stage(self, ctx, stage):
        self.stages.append(stage)

    def on_step(self, ctx, phase, step, metrics):
        self.steps[phase].append(step)
        if phase == "finetune":
            self.pruners.add(type(ctx.pruner))

    def on_checkpoint(self, ctx, phase, step):
        self.checkpoints[phase].append(step)
        path = ctx.dense_partial if phase == "dense" else ctx.run_dir / CHECKPOINT
        self.on_disk.append(load_checkpoint(path)["step"])


def test_stages_in_order_and_callbacks_after_each_step_and_checkpoint(tmp_path):
    cfg = Config(cache_dir=str(tmp_path / "cache"))
    cfg.data.kwargs = {"num_samples": 200}
    cfg.train.dense_steps, cfg.train.finetune_steps = 12, 10
    cfg.train.log_every = cfg.train.eval_every = 5
    cfg.train.checkpoint_every = 4
    cfg.schedule.end, cfg.schedule.every = 6, 3
    cfg.bench.enabled, cfg.train.quiet, cfg.train.device = False, True, "cpu"
    rec = Recorder()
    summary = run(cfg, tmp_path / "run", callbacks=[rec])

    assert rec.stages == [name for name, _ in STAGES]
    assert rec.steps == {"dense": list(range(12)), "finetune": list(range(10))}
    # dense: every 4th step but the last (the cache entry follows); fine-tuning: and the last
    assert rec.checkpoints == {"dense": [3, 7], "finetune": [3, 7, 9]}
    assert rec.on_disk == [3, 7, 3, 7, 9]  # each callback ran after its checkpoint was written
    assert rec.pruners == {Pruner}
    assert summary["finetune_steps"] == 10 and summary["sparsity"] > 0


def test_built_in_callbacks_come_first_and_registration_checks_the_type():
    kinds = [type(c) for c in default_callbacks()[:3]]
    assert kinds == [Logging, Evaluation, Checkpointing]
    with pytest.raises(TypeError, match="Callback"):
        register_callback(lambda ctx: None)


def test_accel_stage_hands_the_config_to_accelerate_as_the_option_objects(monkeypatch):
    """accel.capture goes into CompileOptions, accel.min_speedup and accel.siblings into
    PlanOptions (the stage runs only on CUDA: the device and accelerate stand in here)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import sparsekit as sk
    from sparsekit.run import pipeline

    class Called(Exception):
        pass

    seen = {}

    def accelerate(model, example_inputs, **kwargs):
        seen.update(kwargs, example=example_inputs)
        raise Called

    cfg = Config()
    cfg.accel.enabled, cfg.accel.precision, cfg.accel.sparsity = True, "fp8", "auto"
    cfg.accel.min_speedup, cfg.accel.siblings, cfg.accel.capture = 1.05, True, False
    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cuda"), model=nn.Linear(4, 4),
                          example=torch.randn(3, 4))
    monkeypatch.setattr(sk, "accelerate", accelerate)
    with pytest.raises(Called):
        pipeline.stage_accelerate(ctx)
    assert seen["precision"] == "fp8" and seen["sparsity"] == "auto"
    assert seen["compile"] == sk.CompileOptions(capture=False)
    assert seen["plan"] == sk.PlanOptions(min_speedup=1.05, siblings=True)
    assert seen["example"].shape == (1, 4)
