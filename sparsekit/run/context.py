"""The context the stages of a run share, and the callbacks that act while it trains.

:class:`RunContext` is filled stage by stage (see ``sparsekit.run.pipeline.STAGES``).
:class:`Callback` hooks are called before each stage, after each training step and after each
checkpoint; :class:`Logging` (TensorBoard), :class:`Evaluation` (every ``train.eval_every``
steps) and :class:`Checkpointing` (every ``train.checkpoint_every`` steps) are the built-in
ones. ``run(..., callbacks=[...])`` adds callbacks to one run, :func:`register_callback` to
every run of this process (those the command line starts included): the kill-and-resume tests
use it to SIGKILL the process right after a checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit.data import DataBundle
from sparsekit.errors import storage_errors
from sparsekit.io.files import atomic_torch_save
from sparsekit.io.runstate import VERSION as RUNSTATE_VERSION
from sparsekit.io.runstate import rng_state, save_checkpoint
from sparsekit.progress import is_quiet
from sparsekit.prune.report import sparsity_report
from sparsekit.prune.scheduled import ScheduledPruner
from sparsekit.run import distributed as D
from sparsekit.run.config import Config
from sparsekit.run.tracking import Tracker
from sparsekit.run.train import evaluate

#: the fine-tuning checkpoint, relative to the run directory
CHECKPOINT = Path("checkpoints") / "last.pt"


@dataclasses.dataclass(eq=False)
class RunContext:
    """What the stages of one run share (``sparsekit.run.pipeline.STAGES``): made by ``run``,
    filled in stage by stage (the comments name the stages that set each group of fields),
    read by the callbacks."""

    cfg: Config
    run_dir: Path
    resume: bool = False
    callbacks: list[Callback] = dataclasses.field(default_factory=list)
    # setup
    started: str = ""
    t0: float = 0.0
    resolved: str = ""  # the resolved config, YAML
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    mode: str = "none"  # none | ddp | fsdp2
    metric: str = "accuracy"
    state: dict | None = None  # the fine-tuning checkpoint a resumed run continues from
    tracker: Tracker | None = None
    # dense
    hf_model: nn.Module | None = None
    tokenizer: Any = None
    data: DataBundle | None = None
    model: nn.Module | None = None  # the model being compressed (trained, in dense training)
    optimizer: torch.optim.Optimizer | None = None  # of the phase being trained
    dense_partial: Path | None = None  # the dense training's checkpoint, beside the cache
    dense_source: str = ""
    dense_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    dense_size: int = 0
    dense: nn.Module | None = None  # a copy: distillation teacher and speed reference
    keep_dense: list[str] = dataclasses.field(default_factory=list)  # sensitivity: left dense
    example: Any = None
    calibration: list = dataclasses.field(default_factory=list)
    sparsity: Any = None  # the prune.sparsity, or the per-layer levels of the sensitivity scan
    # channels, shard, prune, fine_tune, finalize
    channels: Any = None  # a ChannelPruner interleaved with fine-tuning
    channel_report: Any = None
    unsharded: nn.Module | None = None  # FSDP2: the container for the gathered weights
    masks: Any = None  # the Pruner
    steps: int = 0  # fine-tuning steps
    start: int = 0  # the first fine-tuning step this process runs
    report: Any = None  # the SparsityReport of the compressed model
    # quantize, evaluate, benchmark, accelerate, save, export_hf, summarize
    quant_report: Any = None
    # quant.compare: the evaluation metric of each model variant (dense, pruned, + rtn, + gptq)
    variants: dict[str, float] = dataclasses.field(default_factory=dict)
    comp_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    speed: dict[str, dict[str, float]] = dataclasses.field(
        default_factory=lambda: {"dense": {}, "compressed": {}})
    accel: dict[str, Any] = dataclasses.field(default_factory=dict)
    fast: Any = None  # the AcceleratedModel (accel.enabled, on CUDA)
    # fine-tuning's cost: tokens/s and peak memory as last logged, steps done in this process
    finetune: dict[str, Any] = dataclasses.field(default_factory=dict)
    generation: dict[str, Any] = dataclasses.field(default_factory=dict)  # a causal LM's
    model_path: Path | None = None
    hf_export: dict | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def pruner(self) -> ScheduledPruner | None:
        """What fine-tuning steps: the mask Pruner, else the ChannelPruner (or None)."""
        return self.masks if self.masks is not None else self.channels

    @property
    def quiet(self) -> bool:
        return is_quiet(self.cfg.train.quiet)

    @property
    def final_step(self) -> int:
        """The step the end-of-run values are logged at."""
        return max(self.steps, 1)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        d = self.cfg.data
        return evaluate(model, self.data.eval, d.task, d.eval_batch_size, d.eval_batches,
                        self.quiet, reference=self.dense)

    def emit(self, hook: str, *args: Any) -> None:
        """Call ``hook`` of every callback, in order, with this context first."""
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def step_hook(self, phase: str) -> Any:
        """``fit``'s ``on_step`` for ``phase``: the callbacks' :meth:`Callback.on_step`."""
        return lambda step, metrics: self.emit("on_step", phase, step, metrics)


class Callback:
    """A hook into :func:`run`; override what you need (each method does nothing here).

    ``phase`` is ``"dense"`` (training the dense baseline) or ``"finetune"``; ``ctx`` is the
    run's :class:`RunContext`, whose ``model``, ``optimizer`` and ``pruner`` are the phase's.
    Built in: :class:`Logging`, :class:`Evaluation`, :class:`Checkpointing` (in that order);
    more come from :func:`run`'s ``callbacks`` and :func:`register_callback`."""

    def on_stage(self, ctx: RunContext, stage: str) -> None:
        """Before the stage named ``stage`` (see :data:`STAGES`) runs."""

    def on_step(self, ctx: RunContext, phase: str, step: int, metrics: dict[str, float]) -> None:
        """After training step ``step`` and the pruner's step; ``metrics`` (``train/loss``,
        ``train/lr``) on logging steps, empty otherwise."""

    def on_checkpoint(self, ctx: RunContext, phase: str, step: int) -> None:
        """After every rank has written (its part of) the checkpoint of ``step``: a run killed
        from here on resumes at ``step + 1``."""


_REGISTERED: list[Callback] = []


def register_callback(callback: Callback) -> None:
    """Add ``callback`` to every later :func:`run` in this process, the command line's runs
    included: how a script that calls ``sparsekit.cli.main`` hooks into its runs (the
    kill-and-resume tests kill the process right after a checkpoint this way)."""
    if not isinstance(callback, Callback):
        raise TypeError(f"callback must be a sparsekit.run.pipeline.Callback, got "
                        f"{type(callback).__name__}")
    _REGISTERED.append(callback)


def weights_report(ctx: RunContext) -> Any:
    """The sparsity logged while fine-tuning: the Pruner's report (its layers, FSDP2 shards
    summed over ranks), or the whole model's under channel pruning."""
    return ctx.masks.report() if ctx.masks is not None else sparsity_report(ctx.model)


class Logging(Callback):
    """TensorBoard while training: loss and learning rate on logging steps (``dense_`` prefixed
    for the baseline) with the weights' sparsity, and weight histograms and per-layer sparsity
    whenever the pruner moved (masks or channels; FSDP2 logs them once gathered)."""

    def __init__(self) -> None:
        self.seen: float | None = None

    def on_stage(self, ctx: RunContext, stage: str) -> None:
        if stage == "fine_tune":
            self.seen = None if ctx.pruner is None else ctx.pruner.progress

    def on_step(self, ctx: RunContext, phase: str, step: int, metrics: dict[str, float]) -> None:
        if phase == "dense":
            if metrics:
                ctx.tracker.scalars({f"dense_{k}": v for k, v in metrics.items()}, step)
            return
        pruner = ctx.pruner
        report = None  # one pass over the pruned weights per step at most
        if metrics:
            scalars = dict(metrics)
            if pruner is not None:
                report = weights_report(ctx)
                scalars["sparsity/global"] = report.global_sparsity
            ctx.tracker.scalars(scalars, step)
        if pruner is not None and pruner.progress != self.seen:  # masks or channels moved
            self.seen = pruner.progress
            if ctx.mode != "fsdp2":  # sharded weights get their histograms once gathered
                ctx.tracker.weight_histograms(ctx.model, step)
                report = report or weights_report(ctx)
                ctx.tracker.layer_sparsity(report.to_dict()["layers"], step)


class Evaluation(Callback):
    """Every ``train.eval_every`` fine-tuning steps (but the last: the evaluate stage does
    that one) the model on the evaluation set, beside the dense model's value."""

    def on_step(self, ctx: RunContext, phase: str, step: int, metrics: dict[str, float]) -> None:
        if phase != "finetune" or (step + 1) % ctx.cfg.train.eval_every or step == ctx.steps - 1:
            return
        m = ctx.metric
        ctx.tracker.scalars({f"eval/{m}": ctx.evaluate(ctx.model)[m]}, step)
        ctx.tracker.dense({f"eval/{m}": ctx.dense_eval[m]}, step)


class Checkpointing(Callback):
    """Resume checkpoints every ``train.checkpoint_every`` steps: the dense training's beside
    its cache entry (not after its last step: the cache entry follows), fine-tuning's in
    ``<run_dir>/checkpoints`` (and after its last step). Then :meth:`Callback.on_checkpoint`."""

    def on_step(self, ctx: RunContext, phase: str, step: int, metrics: dict[str, float]) -> None:
        t = ctx.cfg.train
        if phase == "dense":
            if (step + 1) % t.checkpoint_every or step == t.dense_steps - 1:
                return
            if D.is_main():
                with storage_errors(ctx.dense_partial):
                    save_checkpoint(ctx.dense_partial, step=step, model=ctx.model,
                                    optimizer=ctx.optimizer)
            D.barrier()
        else:
            if (step + 1) % t.checkpoint_every and step != ctx.steps - 1:
                return
            D.barrier()
            save_finetune_checkpoint(ctx, step)
            D.barrier()
        ctx.emit("on_checkpoint", phase, step)


def save_finetune_checkpoint(ctx: RunContext, step: int) -> None:
    """FSDP2: every rank writes its shards, then rank 0 the pointer to them; replicated state:
    rank 0's file serves every rank."""
    path, done = ctx.run_dir / CHECKPOINT, step == ctx.steps - 1
    if ctx.mode == "fsdp2":
        D.save_training_state(path.with_suffix(".dcp"), ctx.model, ctx.optimizer, ctx.pruner,
                              step=step)
        if D.is_main():
            atomic_torch_save({"version": RUNSTATE_VERSION, "step": step, "done": done,
                               "rng": rng_state(), "sharded": path.with_suffix(".dcp").name},
                              path)
    elif D.is_main():
        with storage_errors(path):
            save_checkpoint(path, step=step, model=ctx.model, optimizer=ctx.optimizer,
                            pruner=ctx.pruner, done=done)


def default_callbacks() -> list[Callback]:
    """Logging, periodic evaluation, checkpoints; then those of :func:`register_callback`."""
    return [Logging(), Evaluation(), Checkpointing(), *_REGISTERED]
