"""One compression run, stage by stage, driven by a :class:`~sparsekit.run.config.Config`.

The stages (:data:`STAGES`, each a short ``stage_<name>(ctx)`` over one :class:`RunContext`):
setup -> dense model (trained and cached by config hash, or loaded; evaluated) -> sensitivity
-> channel pruning -> QAT preparation -> shard (FSDP2) -> prune (the Pruner, the optimizer,
resume) -> fine-tune under the pruner -> finalize -> quantize -> evaluate -> benchmark dense vs
compressed -> accelerate (GPU) -> a causal LM's generation speed (GPU) -> save -> HF export ->
summarize. Everything is logged to TensorBoard under ``<run_dir>/tb`` and summarized in
``summary.json`` / ``summary.md``.

What happens during training is callbacks (:class:`Callback`): :class:`Logging`,
:class:`Evaluation` and :class:`Checkpointing` are built in; ``run(..., callbacks=[...])`` and
:func:`register_callback` (for runs started through the command line in this process) add more.

The command line (``sparsekit.run.cli``) is a thin Hydra front end over :func:`run`; Python users
can call it with a plain ``Config``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_model
from torch import nn

import sparsekit as sk
from sparsekit.run import distributed as D
from sparsekit.io.files import atomic_write, move_aside
from sparsekit.run.bench import benchmark, generation_speeds
from sparsekit.run.loading import (
    build_run_data,
    check_input_paths,
    check_model_takes_data,
    export_hf,
    load_dense,
    load_hf,
    load_safetensors,
)
from sparsekit.prune.channels import channel_criterion
from sparsekit.prune.criteria import needs_calibration
from sparsekit.run import figures
from sparsekit.run.config import Config, choices, joint_gptq, validate
from sparsekit.run.resources import recipes_dir
from sparsekit.run.context import (  # noqa: F401  (CHECKPOINT, Callback: public here too)
    CHECKPOINT,
    Callback,
    RunContext,
    default_callbacks,
    register_callback,
    save_finetune_checkpoint,
)
from sparsekit.errors import (
    FileFormatError,
    RunPaused,
    StorageError,
    storage_errors,
)
from sparsekit.data import DataBundle
from sparsekit.io.cache import cache_root
from sparsekit.models import build_model
from sparsekit.progress import FILE_LOG, LOG, format_seconds, is_quiet
from sparsekit.io.runstate import (
    load_latest_checkpoint,
    previous_path,
    restore,
    set_rng_state,
    write_run_state,
)
from sparsekit.prune.sensitivity import SensitivityTable
from sparsekit.quant.formats import INT4_GROUP_SCHEMES, get_scheme
from sparsekit.quant.layers import check_layer_groups
from sparsekit.run.tracking import Tracker, read_overrides, recipe_of, run_logdir, utc_now, versions
from sparsekit.run.train import eval_batches, fit, get_batch, make_optimizer, task_loss


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available; use auto or cpu")
    return torch.device(name)


def baseline_key(cfg: Config) -> str:
    """Hash of everything that determines the trained dense baseline (model, data, training)."""
    t = cfg.train
    spec = {
        "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "checkpoint"},
        # what the training sees: not the evaluation settings, which need no retraining
        "data": [cfg.data.name, cfg.data._target_, cfg.data.kwargs, cfg.data.batch_size],
        "train": [t.dense_steps, t.dense_lr, t.optimizer, t.weight_decay, t.lr_schedule,
                  t.warmup_steps, t.grad_clip, t.seed],
        "torch": torch.__version__.split("+")[0],
        "v": 1,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_file(path: str | os.PathLike, write: Any) -> Path:
    """``atomic_write`` whose failures (permissions, a full disk) are StorageError naming
    ``path``."""
    with storage_errors(path):
        return atomic_write(path, write)


def save_weights(model: nn.Module, path: str | os.PathLike) -> Path:
    """``sk.save`` (portable, compressed; it writes atomically itself); StorageError naming
    ``path`` when it cannot be written."""
    with storage_errors(path):
        sk.save(model, path)
    return Path(path)


def file_size(model: nn.Module) -> int:
    """Bytes of the file :func:`save_weights` writes for ``model``."""
    with tempfile.TemporaryDirectory() as d:
        return save_weights(model, Path(d) / "m.safetensors").stat().st_size


def dense_model(cfg: Config, data: DataBundle, device: torch.device, tracker: Tracker,
                hf_model: nn.Module | None = None) -> tuple:
    """The dense model outside a run (tools): ``hf_model`` (model=hf, never trained here),
    loaded from ``model.checkpoint``, from the baseline cache, or trained here and cached.
    Returns ``(model, source)``."""
    ctx = RunContext(cfg, Path.cwd(), callbacks=default_callbacks(), device=device,
                     tracker=tracker, data=data, hf_model=hf_model)
    return _dense_model(ctx)


def check_quant_groups(model: nn.Module, cfg: Config) -> None:
    """An int4 ``quant.scheme``'s groups (``quant.group_size``) fit every selected layer: the
    one line naming a layer that does not fit, before the dense model is trained or
    evaluated (not with channel pruning, which changes the layers' input sizes first)."""
    q = cfg.quant
    if q.scheme == "none" or cfg.prune.channel.ratio > 0:
        return
    check_layer_groups(model, get_scheme(q.scheme), q.group_size, list(q.include),
                       list(q.exclude))


def _dense_model(ctx: RunContext) -> tuple[nn.Module, str]:
    cfg, device = ctx.cfg, ctx.device
    if ctx.hf_model is not None:
        m = cfg.model
        what = f"hf {m.path}" if m.path else "hf model.config (random weights)"
        check_quant_groups(ctx.hf_model, cfg)
        return ctx.hf_model.to(device), what
    torch.manual_seed(cfg.train.seed)  # the initial weights too: same config, same baseline
    model = build_model(cfg.model.name, cfg.model._target_, cfg.model.kwargs).to(device)
    check_model_takes_data(model, ctx.data, cfg)
    check_quant_groups(model, cfg)
    if cfg.model.checkpoint:
        load_dense(model, cfg.model.checkpoint)
        return model, f"checkpoint {cfg.model.checkpoint}"
    path = cache_root(cfg.cache_dir) / "baselines" / f"{baseline_key(cfg)}.safetensors"
    if path.exists():
        try:
            load_safetensors(model, path)
            return model, f"cached {path}"
        except FileFormatError as e:  # a damaged cache entry: keep it for inspection, rebuild
            _discard(path, e)
    return model, train_dense(ctx, model, path)


def train_dense(ctx: RunContext, model: nn.Module, path: Path) -> str:
    """Train the dense baseline and write it to the cache entry ``path``; returns how it
    came about. A killed dense training continues from its last checkpoint, next to the cache
    entry (a damaged one is moved aside with a warning, and training starts over)."""
    t = ctx.cfg.train
    ctx.model = model
    ctx.optimizer = make_optimizer(model.parameters(), t.optimizer, t.dense_lr, t.weight_decay)
    ctx.dense_partial = partial = path.with_name(path.stem + ".partial.pt")
    state = load_latest_checkpoint(partial, discard=True)
    start = 0 if state is None else restore(state, model, ctx.optimizer)
    fit(model, ctx.data.train, ctx.optimizer, steps=t.dense_steps, lr=t.dense_lr,
        batch_size=ctx.cfg.data.batch_size, seed=t.seed, start_step=start,
        warmup=t.warmup_steps, lr_schedule=t.lr_schedule, grad_clip=t.grad_clip,
        on_step=ctx.step_hook("dense"), log_every=t.log_every, quiet=is_quiet(t.quiet),
        desc="dense training")
    if D.is_main():  # every rank trained the same model; one writes the cache
        write_file(path, lambda tmp: save_model(model, tmp))
        partial.unlink(missing_ok=True)
        previous_path(partial).unlink(missing_ok=True)
    how = f"resumed at step {start}, " if start else ""
    return f"trained ({how}{t.dense_steps} steps), cached {path}"


def _discard(path: Path, err: Exception) -> None:
    """Move a damaged cache entry aside (``<name>.corrupt-<time>``) with a warning naming it."""
    if D.is_main():
        try:
            moved = move_aside(path).name
        except FileNotFoundError:  # another process moved it first
            moved = "(already moved)"
        warnings.warn(f"cache entry {path} is damaged and will be rebuilt; moved it to "
                      f"{moved}: {err}", stacklevel=2)


def taylor_loss(dataset: Any, cfg: Config) -> Any:
    """Taylor channel importance needs gradients: the task loss on a few training batches."""
    idx = torch.arange(min(len(dataset), cfg.data.batch_size * cfg.prune.calibration_batches))
    x, y = get_batch(dataset, idx)

    def loss_fn(model: nn.Module) -> torch.Tensor:
        device = next(model.parameters()).device
        return task_loss(model(x.to(device)), y.to(device))

    return loss_fn


def scan_sensitivity(
    cfg: Config, model: nn.Module, eval_model: Any, calibration: list, tracker: Tracker,
    run_dir: Path,
) -> dict[str, float] | None:
    """``sensitivity.enabled``: each selected layer of the dense model pruned alone at each level
    (``sk.sensitivity``), written to sensitivity.json/.md and one TensorBoard chart per layer.
    Returns the per-layer levels ``sk.allocate`` picks for ``sensitivity.target``, or the
    per-layer patterns (``"dense"`` for the layers to keep) for ``sensitivity.dense_layers`` /
    ``dense_params``; None without a target. A resumed run reads its sensitivity.json instead
    of measuring again."""
    s, p, metric = cfg.sensitivity, cfg.prune, _metric(cfg.data.task)
    path = run_dir / "sensitivity.json"
    if path.exists():
        table = SensitivityTable.from_dict(json.loads(path.read_text())["table"])
    else:
        table = sk.sensitivity(
            model, lambda m: eval_model(m)[metric],
            sparsities=list(s.sparsities) if p.pattern == "unstructured" else None,
            pattern=p.pattern, criterion=p.criterion, include=list(p.include),
            exclude=list(p.exclude),
            calibration=calibration if needs_calibration(p.criterion) else None,
            higher_is_better=metric in ("accuracy", "cosine"),
            criterion_options=p.options.given(),
        )
        if tracker.writer is not None:
            table.log(tracker.writer)
        tracker.text("sensitivity", f"{metric}, one layer pruned at a time:\n\n```\n{table}\n```")
    if s.dense_layers is not None or s.dense_params is not None:
        levels = sk.allocate(table, dense_layers=s.dense_layers, dense_params=s.dense_params)
    else:
        levels = None if s.target is None else sk.allocate(table, s.target)
    out = {"metric": metric, "table": table.to_dict(), "allocation": levels}
    write_file(path, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=2) + "\n"))
    write_file(run_dir / "sensitivity.md",
                 lambda tmp: Path(tmp).write_text(f"{metric}:\n\n```\n{table}\n```\n"))
    return levels


def make_schedule(cfg: Config) -> sk.Schedule:
    s = cfg.schedule
    if not cfg.prune.fine_tune or s.kind == "oneshot":
        return sk.OneShot(step=s.start if cfg.prune.fine_tune else 0)
    cls = {"linear": sk.Linear, "cubic": sk.Cubic}[s.kind]
    return cls(start=s.start, end=s.end, every=s.every)


def _metric(task: str) -> str:
    return {"lm": "perplexity", "embedding": "cosine"}.get(task, "accuracy")


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if metric == "accuracy" else f"{value:.4f}" if metric == "cosine" \
        else f"{value:.3f}"


#: the speed figures of a run: summary key, table row, number format
SPEEDS = (("latency_ms", "latency b=1 (ms)", ".3f"),
          ("throughput", "throughput (samples/s)", ",.0f"),
          ("tokens_per_s", "generation (tokens/s, b=1)", ",.1f"))


#: what a CPU run says instead of a speedup
CPU_SPEED = ("speedup not measured on CPU: a pruned model runs dense kernels there (sparse "
             "tensor cores are a GPU's), so the speed rows are CPU time, not a speedup")


def speed_notes(speed: dict[str, dict[str, float]], device: str) -> list[str]:
    """What the speed figures mean: on a CPU, :data:`CPU_SPEED`; and every figure where the
    compressed model is slower than dense beyond the noise (p10-p90 ranges apart), as a
    slowdown.

    >>> speed_notes({"dense": {"latency_ms": 1.0}, "compressed": {"latency_ms": 5.0}}, "cpu")[1]
    'slowdown: compressed is 5.0x slower than dense (latency b=1, CPU time)'
    """
    d, c = speed.get("dense", {}), speed.get("compressed", {})
    measured = [(key, label) for key, label, _ in SPEEDS if d.get(key) and c.get(key)]
    notes = [CPU_SPEED] if device == "cpu" and measured else []
    for key, label in measured:
        slower = c[key] / d[key] if key == "latency_ms" else d[key] / c[key]
        apart = (c.get(key + "_p10", c[key]) > d.get(key + "_p90", d[key]) if key == "latency_ms"
                 else c.get(key + "_p90", c[key]) < d.get(key + "_p10", d[key]))
        if slower > 1 and apart:
            what = label.split(" (")[0]
            notes.append(f"slowdown: compressed is {slower:.1f}x slower than dense ({what}"
                         f"{', CPU time' if device == 'cpu' else ''})")
    return notes


def with_spread(side: dict[str, Any], key: str, fmt: str) -> str:
    """``median (p10-p90)`` of a speed figure in a summary's dense/compressed entry; ``-``
    when it was not measured.

    >>> with_spread({"latency_ms": 0.058, "latency_ms_p10": 0.055, "latency_ms_p90": 0.061},
    ...             "latency_ms", ".3f")
    '0.058 (0.055-0.061)'
    """
    if side.get(key) is None:
        return "-"
    text = format(side[key], fmt)
    if side.get(f"{key}_p10") is not None:
        text += f" ({format(side[f'{key}_p10'], fmt)}-{format(side[f'{key}_p90'], fmt)})"
    return text


def summary_table(s: dict[str, Any]) -> str:
    """The end-of-run table (markdown) from a run summary: the metric, sparsity, size and the
    speed figures measured (median, with p10-p90 over the repeats in brackets); a causal LM's
    generation speed has a row even when it was skipped (with the reason below)."""
    m, d, c = s["metric"], s["dense"], s["compressed"]
    size = lambda x: "-" if x is None else f"{x:,}"  # noqa: E731
    rows = [
        (m, _fmt(m, d[m]), _fmt(m, c[m])),
        ("sparsity (pruned layers)", "0.00%", f"{s['sparsity']:.2%}"),
        ("size (bytes)", size(d["size_bytes"]), size(c["size_bytes"])),
    ]
    generation = s.get("generation") or {}
    cpu = s.get("device") == "cpu"
    for key, label, fmt in SPEEDS:
        if key in d or key in c or (key == "tokens_per_s" and generation):
            if cpu and (key in d or key in c):  # measured on a CPU: no speed to speak of
                label = label.replace(")", ", CPU time)", 1)
            rows.append((label, with_spread(d, key, fmt), with_spread(c, key, fmt)))
    lines = ["| | dense | compressed |", "| --- | ---: | ---: |"]
    lines += [f"| {a} | {b} | {c_} |" for a, b, c_ in rows]
    lines.append("")
    if any(k in d for k, _, _ in SPEEDS):
        lines.append("Speed: median over bench.repeats calls (p10-p90 in brackets); ranges that "
                     "overlap are within noise.")
    lines += [f"{note[0].upper()}{note[1:]}." for note in s.get("speed_notes") or ()]
    if generation.get("skipped"):
        lines.append(f"Generation speed skipped: {generation['skipped']}.")
    elif generation.get("dense_way"):
        ways = ", ".join(f"{DENSE_GENERATES[n]} {v:,.1f}" for n, v in
                         generation["dense_ways"].items())
        lines.append(f"Generation: dense is the faster dense way, "
                     f"{DENSE_GENERATES[generation['dense_way']]} (tokens/s: {ways}); every way "
                     "timed in alternating rounds.")
    hf = s.get("hf") or {}
    if "max_abs_diff" in hf:
        lines.append(f"hf/ holds {hf['holds']}: its outputs differ from the measured model's by "
                     f"up to {hf['max_abs_diff']:.3g} (max abs, on one evaluation batch row).")
    if "compressed_tensors_max_abs_diff" in hf:
        lines.append(f"hf-compressed-tensors/: its outputs differ by up to "
                     f"{hf['compressed_tensors_max_abs_diff']:.3g} (max abs).")
    lines.append(f"TensorBoard logdir: {s['tensorboard_logdir']}")
    return "\n".join(lines)


def stage_setup(ctx: RunContext) -> None:
    """Cache and run directories, the resolved config, device and distributed mode, the
    resume checkpoint and the TensorBoard tracker."""
    cfg, t = ctx.cfg, ctx.cfg.train
    ctx.t0, ctx.started = time.perf_counter(), utc_now()
    cache = cache_root(cfg.cache_dir)
    with storage_errors(cache, "create the cache directory (cache_dir)"):
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK | os.X_OK):
            raise StorageError(f"cache_dir={str(cache)!r} is not writable: pass a writable "
                               "cache_dir= or set SPARSEKIT_CACHE")
    ctx.resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    if D.is_main():  # under torchrun only rank 0 writes files and TensorBoard logs
        write_file(ctx.run_dir / "config.yaml", lambda tmp: Path(tmp).write_text(ctx.resolved))
    device = pick_device(t.device)
    if device.type == "cpu" and t.cpu_threads > 0:
        # tiny models lose more to thread synchronization than they gain from a second thread
        torch.set_num_threads(t.cpu_threads)
    ctx.mode = D.resolve_mode(t.distributed)  # none | ddp | fsdp2 (see docs/distributed.md)
    if ctx.mode == "fsdp2" and cfg.quant.qat:
        raise ValueError("train.distributed=fsdp2 cannot fine-tune with quant.qat=true; use ddp")
    if ctx.mode != "none":
        device = D.init(device=device.type)  # this rank's GPU under torchrun
        D.split_batch(cfg.data.batch_size, what="data.batch_size")  # fail before any work
    ctx.device, ctx.metric = device, _metric(cfg.data.task)
    ctx.state = load_latest_checkpoint(ctx.run_dir / CHECKPOINT) if ctx.resume else None
    tb = cfg.tracker
    ctx.tracker = Tracker(run_logdir(ctx.run_dir, resume=ctx.state is not None),
                          tb.kind == "tensorboard" and D.is_main(), tb.flush_secs,
                          tb.histogram_every, tb.histograms,
                          purge_step=None if ctx.state is None else ctx.state["step"] + 1)
    ctx.tracker.text("config", f"```yaml\n{ctx.resolved}\n```")


def stage_dense(ctx: RunContext) -> None:
    """The data and the dense model (see :func:`dense_model`), evaluated and sized; a copy
    kept when something reads it later; the example batch and the calibration batches."""
    cfg = ctx.cfg
    if cfg.model.name == "hf":
        ctx.hf_model, ctx.tokenizer = load_hf(cfg)
        embedding_run(ctx)
    ctx.data = build_run_data(cfg, ctx.hf_model, ctx.tokenizer, ctx.device)
    ctx.model, ctx.dense_source = _dense_model(ctx)
    # a copy of the dense model only when something reads it: the distillation teacher, the
    # speed references (forward, generation) and the embedding reference (an LLM one-shot run
    # would otherwise hold its weights twice)
    keep_dense = ((cfg.train.distill.alpha > 0 and cfg.prune.fine_tune) or cfg.bench.enabled
                  or cfg.data.task == "embedding"
                  or (cfg.accel.enabled and ctx.device.type == "cuda"
                      and is_causal_lm(ctx.model)))
    ctx.dense = copy.deepcopy(ctx.model).eval() if keep_dense else None
    ctx.dense_eval = ctx.evaluate(ctx.model)
    ctx.dense_size = file_size(ctx.model)
    ctx.tracker.dense({f"eval/{ctx.metric}": ctx.dense_eval[ctx.metric]}, 0)
    example = next(eval_batches(ctx.data.eval, cfg.bench.batch_size, 1))[0]
    ctx.example = example.to(ctx.device) if isinstance(example, torch.Tensor) else example
    data = ctx.data
    calibration_set = data.train if data.calibration is None else data.calibration
    ctx.calibration = [
        b[0]
        for b in eval_batches(calibration_set, cfg.data.batch_size, cfg.prune.calibration_batches)
    ]
    ctx.sparsity = cfg.prune.sparsity


def embedding_run(ctx: RunContext) -> None:
    """``data=text`` for an encoder whose task (given, or read from its config) is
    ``feature_extraction``: the run measures embedding agreement with the dense model
    (``data.task=embedding``) and fine-tunes by distillation alone."""
    cfg = ctx.cfg
    task = ctx.hf_model._sparsekit_spec["kwargs"]["task"]
    if task == "feature_extraction" and cfg.data.name == "text" and cfg.data.task == "lm":
        cfg.data.task = "embedding"
        validate(cfg)
    ctx.metric = _metric(cfg.data.task)


def stage_sensitivity(ctx: RunContext) -> None:
    """``sensitivity.enabled``: the scan (:func:`scan_sensitivity`); with ``sensitivity.target``
    its per-layer levels replace ``prune.sparsity``."""
    if ctx.cfg.sensitivity.enabled:
        levels = scan_sensitivity(ctx.cfg, ctx.model, ctx.evaluate, ctx.calibration,
                                  ctx.tracker, ctx.run_dir)
        if levels is not None and any(isinstance(v, str) for v in levels.values()):
            ctx.keep_dense = [n for n, v in levels.items() if v == "dense"]
        elif levels is not None:
            ctx.sparsity = levels


def stage_channels(ctx: RunContext) -> None:
    """Channel pruning. Channel-only runs with steps > 1 remove channels in increments on the
    schedule while fine-tuning (one process: ``ctx.channels`` is what fine-tuning steps);
    otherwise all increments happen here, before fine-tuning."""
    cfg = ctx.cfg
    p, c = cfg.prune, cfg.prune.channel
    if c.ratio <= 0:
        return
    options = dict(
        ratio=c.ratio, criterion=c.criterion, scope=c.scope, round_to=c.round_to,
        exclude=list(c.exclude),
        loss_fn=(taylor_loss(ctx.data.train, cfg)
                 if channel_criterion(c.criterion).needs_loss else None),
    )
    if c.steps > 1 and p.fine_tune and p.pattern == "none" and ctx.mode == "none":
        s = cfg.schedule
        every = max(1, -(-(s.end - s.start) // c.steps))  # ceil: exactly `steps` updates
        ctx.channels = sk.ChannelPruner(
            ctx.model, ctx.example[:1], schedule=sk.Linear(s.start, s.end, every), **options
        )
    else:
        ctx.channel_report = sk.prune_channels_(ctx.model, ctx.example[:1], steps=c.steps,
                                                **options)


def stage_qat_prep(ctx: RunContext) -> None:
    """``quant.qat``: fake-quantized layers to fine-tune (converted in the quantize stage)."""
    q = ctx.cfg.quant
    if q.scheme != "none" and q.qat:
        # a static scheme's activation ranges start from the calibration batches
        sk.prepare_qat_(ctx.model, q.scheme, include=list(q.include), exclude=list(q.exclude),
                        calibration=ctx.calibration, group_size=q.group_size)


def stage_shard(ctx: RunContext) -> None:
    """FSDP2: shard before the Pruner, whose masks then become shards like the weights."""
    if ctx.mode == "fsdp2":
        ctx.unsharded = copy.deepcopy(ctx.model)  # a container for the full weights later
        D.shard_model(ctx.model)


def stage_prune(ctx: RunContext) -> None:
    """The Pruner (``prune.pattern``), the fine-tuning optimizer, and, resuming, the state of
    the last checkpoint loaded into both (and into the model)."""
    cfg, p, t = ctx.cfg, ctx.cfg.prune, ctx.cfg.train
    if p.pattern != "none" and not joint_gptq(cfg):  # a joint sweep prunes in stage_quantize
        # the layers the sensitivity scan keeps dense are excluded, by their exact names
        dense = [f"re:{re.escape(n)}" for n in ctx.keep_dense]
        ctx.masks = sk.Pruner(
            ctx.model, sparsity=ctx.sparsity, pattern=p.pattern, criterion=p.criterion,
            scope=p.scope, schedule=make_schedule(cfg), include=list(p.include),
            exclude=list(p.exclude) + dense,
            calibration=ctx.calibration if needs_calibration(p.criterion) else None,
            strict=p.strict, criterion_options=p.options.given(),
        )
    ctx.steps = t.finetune_steps if p.fine_tune else 0
    ctx.optimizer = make_optimizer(ctx.model.parameters(), t.optimizer, t.finetune_lr,
                                   t.weight_decay)
    ctx.start = resume_finetune(ctx)


def resume_finetune(ctx: RunContext) -> int:
    """Load the resume checkpoint (FSDP2: torch.distributed.checkpoint shards) into the model,
    optimizer and pruner; returns the first step to run (0 without one, seeding the RNG)."""
    state, path = ctx.state, ctx.run_dir / CHECKPOINT
    if state is None:
        torch.manual_seed(ctx.cfg.train.seed + 1)
        return 0
    if not state.get("sharded"):
        return restore(state, ctx.model, ctx.optimizer, ctx.pruner)
    if state["sharded"] != CHECKPOINT.with_suffix(".dcp").name:  # a name, never a path
        raise FileFormatError(f"{path}: unexpected sharded checkpoint {state['sharded']!r}")
    loaded = D.load_training_state(path.parent / state["sharded"], ctx.model, ctx.optimizer,
                                   ctx.pruner, step=-1)
    set_rng_state(state["rng"])
    return int(loaded["step"]) + 1


def stage_fine_tune(ctx: RunContext) -> None:
    """Fine-tuning under the pruner (which ``fit`` steps), with distillation from the dense
    copy when ``train.distill.alpha`` > 0; DDP averages gradients over ranks, each training on
    its slice of every global batch. Without fine-tuning, the pruner's one shot."""
    cfg, t = ctx.cfg, ctx.cfg.train
    if ctx.pruner is not None and not cfg.prune.fine_tune:
        ctx.pruner.step(0)
    if ctx.steps <= ctx.start:
        return
    train_model = D.wrap_ddp(ctx.model, ctx.device) if ctx.mode == "ddp" else ctx.model
    hook = ctx.step_hook("finetune")

    def on_step(step: int, metrics: dict[str, float]) -> None:
        ctx.finetune.update({k.split("/")[1]: round(v, 3) for k, v in metrics.items()
                             if k in ("train/tokens_per_s", "train/peak_memory_gb")})
        hook(step, metrics)

    start = time.perf_counter()
    done = fit(train_model, ctx.data.train, ctx.optimizer, steps=ctx.steps, lr=t.finetune_lr,
               batch_size=cfg.data.batch_size, seed=t.seed + 1, start_step=ctx.start,
               warmup=t.finetune_warmup, lr_schedule=t.lr_schedule, grad_clip=t.grad_clip,
               dropout=t.finetune_dropout, pruner=ctx.pruner,
               distiller=distiller(ctx), distill_alpha=t.distill.alpha,
               on_step=on_step, quiet=ctx.quiet, desc="fine-tuning",
               shard=ctx.mode != "none", log_every=t.log_every, precision=str(t.precision),
               max_seconds=t.max_minutes * 60 if t.max_minutes > 0 else None)
    ctx.finetune.update(steps_this_process=done - ctx.start, precision=str(t.precision),
                        seconds_this_process=round(time.perf_counter() - start, 1))
    if done < ctx.steps:
        if done > ctx.start:
            D.barrier()
            save_finetune_checkpoint(ctx, done - 1)
            D.barrier()
        raise RunPaused(f"train.max_minutes={t.max_minutes:g} reached at fine-tuning step "
                        f"{done} of {ctx.steps}; the checkpoint is written: continue with "
                        f"sparsekit resume={ctx.run_dir}")


def distiller(ctx: RunContext) -> sk.Distiller | None:
    """The fine-tuning's :class:`~sparsekit.Distiller` from ``train.distill`` (None at alpha
    0): its defaults follow the data's task (pooled embeddings for ``embedding``)."""
    d = ctx.cfg.train.distill
    if d.alpha <= 0 or ctx.dense is None:
        return None
    task = "feature_extraction" if ctx.cfg.data.task == "embedding" else "classification"
    return sk.Distiller(ctx.dense, task=task, target=str(d.target), loss=str(d.loss),
                        temperature=d.temperature, feature_weight=d.feature_weight,
                        feature_loss=str(d.feature_loss))


def stage_finalize(ctx: RunContext) -> None:
    """The pruner's full target (even after few steps), its report, then ``finalize``: plain
    modules from here on. FSDP2: every rank gathers the full weights; the rest runs
    unsharded."""
    pruner = ctx.pruner
    if pruner is not None:
        pruner.step(max(ctx.steps, ctx.cfg.schedule.end))
        final = pruner.report()
        if pruner is ctx.channels:
            ctx.channel_report = final
        else:
            ctx.report = final
            if ctx.mode != "fsdp2":
                ctx.tracker.weight_histograms(ctx.model, ctx.steps, force=True)
        pruner.finalize()
    if ctx.channel_report is not None:
        ctx.tracker.text("channels", f"```\n{ctx.channel_report}\n```", ctx.steps)
    if ctx.report is None:
        ctx.report = sk.sparsity_report(ctx.model)
    if ctx.mode == "fsdp2":
        ctx.model = D.gather_full(ctx.model, ctx.unsharded)
        ctx.tracker.weight_histograms(ctx.model, ctx.steps, force=True)


def stage_quantize(ctx: RunContext) -> None:
    """``quant.scheme``: QAT layers converted, or post-training quantization on the
    calibration batches (``quant.method``: round to nearest or GPTQ; with SparseGPT N:M in
    one shot, GPTQ prunes in the same sweep). ``quant.compare``: the variants first."""
    cfg, q, p = ctx.cfg, ctx.cfg.quant, ctx.cfg.prune
    if q.scheme == "none":
        return
    joint = joint_gptq(cfg)
    selection = {"include": list(q.include), "exclude": list(q.exclude),
                 "group_size": q.group_size}
    if q.qat:
        ctx.quant_report = sk.convert_(ctx.model)
    elif q.method == "gptq":
        if q.compare:
            compare_variants(ctx, joint)
        gptq = sk.GPTQ(pattern=str(p.pattern) if joint else None, act_order=q.act_order)
        ctx.quant_report = sk.quantize_(ctx.model, q.scheme, calibration=ctx.calibration,
                                        method=gptq, **selection)
        if joint:  # what the sweep pruned
            ctx.report = sk.sparsity_report(ctx.model, include=list(p.include),
                                            exclude=list(p.exclude), pattern=str(p.pattern))
    else:
        ctx.quant_report = sk.quantize_(ctx.model, q.scheme, calibration=ctx.calibration,
                                        **selection)
    ctx.tracker.text("quantization", f"```\n{ctx.quant_report}\n```", 0)


def quant_label(q: Any) -> str:
    """The quantization a run applies, as its variants name it: ``quant.scheme``, or with
    ``quant.group_size`` the int4 scheme of that group (``int4_weight_g64``; ``auto``:
    ``int4_weight_auto``, each layer's own group)."""
    if q.group_size is None:
        return q.scheme
    if q.group_size == "auto":
        return f"{q.scheme}_auto"
    return INT4_GROUP_SCHEMES[q.group_size]


def compare_variants(ctx: RunContext, joint: bool) -> None:
    """``quant.compare``: the metric of the dense model, the pruned model before quantization
    (a joint sweep's is SparseGPT alone, on a copy) and the pruned model quantized by rounding
    to nearest (a copy), into ``ctx.variants``; :func:`stage_evaluate` adds the GPTQ model."""
    q, p = ctx.cfg.quant, ctx.cfg.prune
    metric = ctx.metric
    pruned_name = "dense" if p.pattern == "none" else str(p.pattern)
    ctx.variants["dense"] = ctx.dense_eval[metric]
    ref = copy.deepcopy(ctx.model)
    if joint:
        sk.prune_(ref, pattern=str(p.pattern), criterion="sparsegpt",
                  calibration=ctx.calibration, include=list(p.include), exclude=list(p.exclude))
    ctx.variants[pruned_name] = ctx.evaluate(ref)[metric]
    sk.quantize_(ref, q.scheme, include=list(q.include), exclude=list(q.exclude),
                 group_size=q.group_size)
    ctx.variants[f"{pruned_name}+{quant_label(q)}/rtn"] = ctx.evaluate(ref)[metric]
    del ref


def stage_evaluate(ctx: RunContext) -> None:
    """The compressed model on the evaluation set, beside the dense one; its sparsity."""
    ctx.comp_eval = ctx.evaluate(ctx.model)
    m, step, tracker = ctx.metric, ctx.final_step, ctx.tracker
    tracker.scalars({f"eval/{m}": ctx.comp_eval[m]}, step)
    tracker.dense({f"eval/{m}": ctx.dense_eval[m]}, step)
    tracker.scalars(ctx.report.scalars(), step)
    tracker.layer_sparsity(ctx.report.to_dict()["layers"], step)
    if ctx.variants:
        q, p = ctx.cfg.quant, ctx.cfg.prune
        pruned = "dense" if p.pattern == "none" else str(p.pattern)
        ctx.variants[f"{pruned}+{quant_label(q)}/{q.method}"] = ctx.comp_eval[m]
        tracker.scalars({f"variants/{m}/{name}": v for name, v in ctx.variants.items()}, step)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` generates text (a Hugging Face model whose ``can_generate()``)."""
    can = getattr(model, "can_generate", None)
    return bool(callable(can) and can())


def stage_benchmark(ctx: RunContext) -> None:
    """Latency and throughput of the dense and the compressed model (rank 0), with their
    spread. A causal LM's speed is its generation's instead (:func:`stage_generate`)."""
    b = ctx.cfg.bench
    if (b.enabled and isinstance(ctx.example, torch.Tensor) and D.is_main()
            and not is_causal_lm(ctx.model)):
        for name, m in (("dense", ctx.dense), ("compressed", ctx.model)):
            ctx.speed[name] = benchmark(m, ctx.example, b.batch_size, b.warmup, b.repeats, name,
                                        ctx.quiet)


def stage_accelerate(ctx: RunContext) -> None:
    """``accel.enabled`` (rank 0): ``sk.accelerate`` on a copy (kept as ``ctx.fast``), its
    per-layer report logged to TensorBoard, and a benchmark of its result (a causal LM's:
    :func:`stage_generate`); skipped (with the reason) without CUDA."""
    a, b = ctx.cfg.accel, ctx.cfg.bench
    ctx.accel = {"enabled": a.enabled}
    if not a.enabled or not D.is_main():
        return
    if ctx.device.type != "cuda":
        print("accel skipped: CUDA is not available")
        ctx.accel["skipped"] = "CUDA is not available"
        return
    fast = ctx.fast = sk.accelerate(
        copy.deepcopy(ctx.model), ctx.example[:1], precision=a.precision, sparsity=a.sparsity,
        compile=sk.CompileOptions(capture=a.capture),
        plan=sk.PlanOptions(min_speedup=a.min_speedup, siblings=a.siblings,
                            decode_dense=a.decode_dense))
    report = fast.sparsekit_report
    if ctx.tracker.writer is not None:
        report.log(ctx.tracker.writer)
    ctx.accel["report"] = report.to_dict()
    if b.enabled and not is_causal_lm(ctx.model):
        ctx.accel["speed"] = benchmark(fast, ctx.example, b.batch_size, b.warmup, b.repeats,
                                       "accel", ctx.quiet)


def generation_skipped(ctx: RunContext) -> str | None:
    """Why a causal LM's generation speed cannot be measured in this run, or None."""
    if ctx.device.type != "cuda":
        return "needs a CUDA GPU (accel=gpu); this run is on " + ctx.device.type
    if ctx.fast is None:
        return "needs accel=gpu"
    if not callable(getattr(ctx.fast, "generate", None)):
        return "this sparsekit's AcceleratedModel has no generate()"
    return None


# the dense ways a causal LM's generation is timed in (:func:`dense_generates`)
DENSE_GENERATES = {"hf_static_cache": "Hugging Face's static-cache generate",
                   "sparsekit": "sparsekit's dense generate"}


def dense_generates(ctx: RunContext, options: dict) -> dict[str, Any]:
    """The dense model's ways to generate, at accel's width (bf16), by :data:`DENSE_GENERATES`
    name: Hugging Face's (its static KV cache, whose decoding step ``generate`` compiles) and
    sparsekit's (``sk.accelerate(..., sparsity="dense")``: its compiled prefill and decode
    graphs and decode attention, no sparse kernel). Both run ``ctx.dense`` itself (accelerate
    leaves a dense bf16 model's modules and weights as they are): no second copy."""
    a = ctx.cfg.accel
    dense = ctx.dense.to(torch.bfloat16)  # its last use: the speed reference
    fast = sk.accelerate(dense, ctx.example[:1], precision="bf16", sparsity="dense",
                         device=ctx.device,
                         compile=sk.CompileOptions(capture=a.capture, warmup=False),
                         plan=sk.PlanOptions(siblings=a.siblings))
    return {"hf_static_cache": lambda x: dense.generate(x, cache_implementation="static",
                                                        **options),
            "sparsekit": lambda x: fast.generate(x, **options)}


def stage_generate(ctx: RunContext) -> None:
    """A causal LM with ``accel.enabled`` (rank 0): generation speed of the dense and the
    compressed model, ``bench.new_tokens`` new tokens after a prompt of ``bench.prompt_tokens``
    tokens of the evaluation text, batch 1, greedy. Every way (the dense ones of
    :func:`dense_generates`, and ``AcceleratedModel.generate`` of the compressed model) is
    called ``bench.warmup`` times, then once a round for ``bench.repeats`` rounds in
    alternating order (:func:`~sparsekit.run.bench.generation_speeds`); the dense figure is the
    faster dense way's (``generation.dense_way``, every way's in ``generation.dense_ways``).
    Tokens/s (median, p10, p90) go to ``ctx.speed[...]["tokens_per_s"...]``. Off CUDA (or
    without accel) it is skipped, and the run says why."""
    a, b = ctx.cfg.accel, ctx.cfg.bench
    if not (a.enabled and D.is_main() and is_causal_lm(ctx.model)):
        return
    why = generation_skipped(ctx)
    if why is not None:
        print(f"generation speed skipped: {why}")
        ctx.generation = {"skipped": why}
        return
    ids = ctx.example[:1, : b.prompt_tokens]
    pad = getattr(ctx.tokenizer, "pad_token_id", None)
    pad = getattr(ctx.tokenizer, "eos_token_id", None) if pad is None else pad
    options = dict(max_new_tokens=b.new_tokens, min_new_tokens=b.new_tokens, do_sample=False,
                   pad_token_id=pad)
    fast = ctx.fast
    calls = {**dense_generates(ctx, options), "compressed": lambda x: fast.generate(x, **options)}
    speeds = generation_speeds(calls, ids, b.new_tokens, b.repeats, b.warmup, "generate",
                               ctx.quiet)
    way = max(DENSE_GENERATES, key=lambda name: speeds[name]["median"])
    for side, s in (("dense", speeds[way]), ("compressed", speeds["compressed"])):
        ctx.speed[side].update(tokens_per_s=s["median"], tokens_per_s_p10=s["p10"],
                               tokens_per_s_p90=s["p90"])
    ctx.generation = {"prompt_tokens": int(ids.shape[-1]), "new_tokens": b.new_tokens,
                      "batch_size": 1, "dense_way": way,
                      "dense_ways": {name: speeds[name]["median"] for name in DENSE_GENERATES}}


def stage_save(ctx: RunContext) -> None:
    """``<run_dir>/model.safetensors``, portable and compressed (rank 0)."""
    ctx.model_path = ctx.run_dir / "model.safetensors"
    if D.is_main():
        save_weights(ctx.model, ctx.model_path)


def stage_export_hf(ctx: RunContext) -> None:
    """``model=hf``: ``<run_dir>/hf/`` for ``from_pretrained`` (rank 0); see :func:`export_hf`."""
    if ctx.hf_model is not None and D.is_main():
        example = ctx.example[:1] if isinstance(ctx.example, torch.Tensor) else ctx.example
        cfg = ctx.cfg
        embedding = ({"source": cfg.model.path, "max_seq_length": cfg.data.seq_len}
                     if cfg.data.task == "embedding" else None)
        ctx.hf_export = export_hf(ctx.model, ctx.tokenizer, ctx.run_dir, ctx.model_path,
                                  ctx.quiet, example, cfg.model.task, embedding)


def stage_summarize(ctx: RunContext) -> None:
    """``summary.json`` / ``summary.md`` and the final TensorBoard values (speed, size,
    hparams, the summary text), once rank 0's files are written."""
    D.barrier()
    s = ctx.summary = run_summary(ctx)
    step, tracker, m = ctx.final_step, ctx.tracker, ctx.metric
    for name, log in (("dense", tracker.dense), ("compressed", tracker.scalars)):
        log({f"speed/{key}{end}": value for key, _, _ in SPEEDS
             for end in ("", "_p10", "_p90")
             if (value := ctx.speed[name].get(key + end)) is not None}, step)
        log({"size/bytes": s[name]["size_bytes"]}, step)
    if s["speedup"] is not None:
        tracker.scalars({"speed/speedup": s["speedup"]}, step)
    if ctx.speed["dense"] or ctx.speed["compressed"]:
        tracker.figure("speed/spread", figures.speed_spread(ctx.speed, ctx.device.type == "cpu"),
                       step)
    # compressed first, the dense reference once, at the end: hparams' columns in this order
    final = {f"final/{m}/compressed": ctx.comp_eval[m],
             "final/sparsity": ctx.report.global_sparsity,
             "final/size_bytes": s["compressed"]["size_bytes"]}
    if s["speedup"] is not None:
        final["final/speedup"] = s["speedup"]
    final[f"final/{m}/dense"] = ctx.dense_eval[m]
    hparams = OmegaConf.to_container(OmegaConf.structured(ctx.cfg), enum_to_str=True)
    tracker.hparams(hparams, final, step, s["overrides"], domains=hparam_domains())
    table = summary_table(s)
    markdown = f"# sparsekit run\n\n{table}\n\nSparsity by layer:\n\n```\n{ctx.report}\n```\n"
    tracker.text("summary", markdown, step)
    tracker.close()
    s["ended_utc"] = utc_now()
    s["seconds"] = round(time.perf_counter() - ctx.t0, 1)  # the whole run, figures included
    if D.is_main():
        write_file(ctx.run_dir / "summary.json",
                   lambda tmp: Path(tmp).write_text(json.dumps(s, indent=2) + "\n"))
        write_file(ctx.run_dir / "summary.md", lambda tmp: Path(tmp).write_text(markdown))
    s["table"] = f"{table}\n\nSparsity by layer:\n{ctx.report}"


def speedup(speed: dict[str, dict[str, float]]) -> float | None:
    """Dense over compressed latency at batch 1, or for a causal LM compressed over dense
    generation tokens/s (medians); None when neither was measured."""
    d, c = speed["dense"], speed["compressed"]
    if d.get("latency_ms") and c.get("latency_ms"):
        return d["latency_ms"] / c["latency_ms"]
    if d.get("tokens_per_s") and c.get("tokens_per_s"):
        return c["tokens_per_s"] / d["tokens_per_s"]
    return None


def hparam_domains() -> dict[str, list[str]]:
    """Every value a string hparam of the config can take, where the set is fixed: the
    schema's and registries' choices, the recipes, the registered models and data sets (the
    hparams dashboard needs them to filter; strings without one are left to the config text)."""
    from sparsekit.data import BUILTIN_DATA, TOKENIZED_DATA
    from sparsekit.models import registered_models

    domains = {key: list(values) for key, values in choices().items()}
    domains["recipe"] = ["default", *sorted(p.stem for p in recipes_dir().glob("*.yaml"))]
    domains["model.name"] = sorted(registered_models())
    domains["data.name"] = [*BUILTIN_DATA, *TOKENIZED_DATA]
    domains["prune.pattern"] = ["unstructured", "none", "2:4", "1:4", "4:8"]
    return domains


def run_summary(ctx: RunContext) -> dict[str, Any]:
    """The run summary (the keys of ``summary.json``) from what the stages left in ``ctx``."""
    speed, report = ctx.speed, ctx.report
    overrides = read_overrides(ctx.run_dir)
    return {
        "recipe": recipe_of(overrides),
        "overrides": overrides,
        "versions": versions(),
        "started_utc": ctx.started,
        "metric": ctx.metric,
        "dense": {**ctx.dense_eval, **speed["dense"], "size_bytes": ctx.dense_size},
        "compressed": {**ctx.comp_eval, **speed["compressed"],
                       "size_bytes": ctx.model_path.stat().st_size},
        "sparsity": report.global_sparsity,
        "skipped_layers": report.skipped,
        "channels": None if ctx.channel_report is None else ctx.channel_report.to_dict(),
        "quant": None if ctx.quant_report is None else ctx.quant_report.to_dict(),
        "variants": ctx.variants or None,
        "speedup": None if ctx.device.type == "cpu" else speedup(speed),
        "speed_notes": speed_notes(speed, ctx.device.type),
        "generation": ctx.generation or None,
        "accel": ctx.accel,
        "dense_source": ctx.dense_source,
        "teacher_samples": ctx.data.info.get("teacher"),
        "device": str(ctx.device),
        "finetune_steps": ctx.steps,
        "finetune": ctx.finetune or None,
        "model_path": str(ctx.model_path),
        "hf": ctx.hf_export,
        "run_dir": str(ctx.run_dir),
        "tensorboard_logdir": str(ctx.tracker.logdir),
        "seconds": round(time.perf_counter() - ctx.t0, 1),
    }


#: stages that may take minutes: a line on the ``sparsekit`` logger (stderr and the run's
#: sparsekit.log under the CLI) when they start
LONG_STAGES = ("dense", "sensitivity", "prune", "fine_tune", "quantize", "evaluate", "benchmark",
               "accelerate", "generate", "export_hf")


def timed_stage(name: str, stage: Any, ctx: RunContext) -> None:
    """Run ``stage(ctx)`` with a line when a long one starts (:data:`LONG_STAGES`) and one
    with its time when any stage took a second or more: on stderr and in sparsekit.log, or
    only in sparsekit.log (:data:`FILE_LOG`) when the run is quiet."""
    log = FILE_LOG if ctx.quiet else LOG
    if name in LONG_STAGES:
        log.info(f"stage {name} ...")
    started = time.perf_counter()
    stage(ctx)
    took = time.perf_counter() - started
    if took >= 1:
        log.info(f"stage {name}: done in {format_seconds(took)}")


#: the stages of a run, in order; each reads and fills the :class:`RunContext`
STAGES: tuple[tuple[str, Any], ...] = (
    ("setup", stage_setup),
    ("dense", stage_dense),
    ("sensitivity", stage_sensitivity),
    ("channels", stage_channels),
    ("qat_prep", stage_qat_prep),
    ("shard", stage_shard),
    ("prune", stage_prune),
    ("fine_tune", stage_fine_tune),
    ("finalize", stage_finalize),
    ("quantize", stage_quantize),
    ("evaluate", stage_evaluate),
    ("benchmark", stage_benchmark),
    ("accelerate", stage_accelerate),
    ("generate", stage_generate),
    ("save", stage_save),
    ("export_hf", stage_export_hf),
    ("summarize", stage_summarize),
)


def run(cfg: Config, run_dir: str | os.PathLike, resume: bool = False,
        callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Run every stage of ``cfg`` (:data:`STAGES`) with outputs under ``run_dir``; ``resume``
    continues from ``run_dir/checkpoints/last.pt`` when it exists (from the previous
    checkpoint, with a warning, when that one is damaged). ``callbacks`` join the built-in ones
    (:class:`Callback`). Returns the summary (also written to ``summary.json`` and
    ``summary.md``). ``run_dir/run_state.json`` records ``running``, then ``failed`` (with the
    error) or ``finished``."""
    validate(cfg)
    check_input_paths(cfg)  # before any model is built or trained
    run_dir = Path(run_dir).resolve()
    with storage_errors(run_dir, "create the run directory (hydra.run.dir)"):
        run_dir.mkdir(parents=True, exist_ok=True)
        if D.is_main():
            write_run_state(run_dir, "running")
    ctx = RunContext(cfg, run_dir, resume, [*default_callbacks(), *callbacks])
    try:
        for name, stage in STAGES:
            ctx.emit("on_stage", name)
            timed_stage(name, stage, ctx)
    except RunPaused as e:
        if D.is_main():
            write_run_state(run_dir, "paused", str(e))
        raise
    except BaseException as e:
        if D.is_main() and not isinstance(e, KeyboardInterrupt):  # Ctrl-C: can continue
            try:
                write_run_state(run_dir, "failed", f"{type(e).__name__}: {e}"[:2000])
            except OSError:  # an unwritable or full disk: the original error says more
                pass
        raise
    if D.is_main():
        write_run_state(run_dir, "finished")
    return ctx.summary
