"""One compression run, stage by stage, driven by a :class:`~sparsekit.run.config.Config`.

dense model (trained and cached by config hash, or loaded) -> evaluate -> channel pruning ->
QAT preparation -> fine-tune under the pruner (checkpointed, resumable) -> finalize -> quantize
-> evaluate -> benchmark dense vs compressed -> accelerate (GPU) -> save; everything is logged to
TensorBoard under ``<run_dir>/tb`` and summarized in ``summary.json`` / ``summary.md``.

The command line (``sparsekit.run.cli``) is a thin Hydra front end over :func:`run`; Python users
can call it with a plain ``Config``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file as safetensors_load_file
from safetensors.torch import save_model
from torch import nn

import sparsekit as sk
from sparsekit.run import distributed as D
from sparsekit.io.files import atomic_torch_save, atomic_write, move_aside, safe_torch_load
from sparsekit.run.bench import benchmark
from sparsekit.prune.calibration import call_model, eval_mode
from sparsekit.io.checkpoint import is_sparsekit_file, load_state_dict
from sparsekit.run.config import Config, validate
from sparsekit.errors import (
    FileFormatError,
    ModelCallError,
    SparsekitError,
    StorageError,
    UnsafeFileError,
    UsageError,
    storage_errors,
)
from sparsekit.data import DataBundle, build_data
from sparsekit.io.cache import cache_root
from sparsekit.models import build_model
from sparsekit.progress import is_quiet
from sparsekit.io.runstate import VERSION as RUNSTATE_VERSION
from sparsekit.io.runstate import (
    load_latest_checkpoint,
    previous_path,
    restore,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_run_state,
)
from sparsekit.prune.sensitivity import SensitivityTable
from sparsekit.run.tracking import Tracker, read_overrides, recipe_of, run_logdir, utc_now, versions
from sparsekit.run.train import eval_batches, evaluate, fit, get_batch, make_optimizer, task_loss

CHECKPOINT = Path("checkpoints") / "last.pt"
# test hook: SIGKILL this process right after writing the checkpoint of this fine-tuning step
KILL_ENV = "SPARSEKIT_TEST_KILL_AT_STEP"
# the same for the dense baseline's training (its checkpoints sit beside the baseline cache)
KILL_DENSE_ENV = "SPARSEKIT_TEST_KILL_AT_DENSE_STEP"


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


def load_safetensors(model: nn.Module, path: str | os.PathLike, what: str = "") -> None:
    """Weights from a safetensors file: one ``sk.save`` wrote (compressed tensors expanded), or
    a plain state dict. FileFormatError naming the file when it is truncated or corrupt, or
    naming ``what`` (default: the file) when its keys or shapes are another architecture's."""
    what = what or f"file {os.fspath(path)!r}"
    try:
        if is_sparsekit_file(path):
            state = load_state_dict(path)
        else:  # a plain safetensors state dict
            state = safetensors_load_file(os.fspath(path))
    except (SafetensorError, FileFormatError) as e:
        reason = str(e).removeprefix(f"{path}: ").removeprefix(f"{path} ")
        raise FileFormatError(f"{what} is not a readable checkpoint: {reason}") from None
    _load_matching(model, state, what)


def load_dense(model: nn.Module, path: str) -> None:
    """Dense weights from a user file: safetensors, or a torch state dict (``weights_only``).
    FileFormatError (UnsafeFileError for a pickle of code) naming the file when it is not a
    readable checkpoint of this model."""
    option = f"model.checkpoint={path!r}"
    if not Path(path).is_file():
        raise UsageError(f"{option} does not exist or is not a file")
    try:
        if str(path).endswith(".safetensors"):
            load_safetensors(model, path, option)
            return
        state = safe_torch_load(path)
    except UnsafeFileError as e:
        if option in str(e):
            raise
        raise UnsafeFileError(f"{option}: refused to load: {e}") from None
    except FileFormatError as e:
        if option in str(e):
            raise
        raise FileFormatError(f"{option} is not a readable checkpoint: {e}") from None
    except SparsekitError:
        raise
    except Exception as e:
        detail = _pickle_detail(e) if isinstance(e, pickle.UnpicklingError) else None
        if detail is not None and "GLOBAL" in detail:  # weights_only refused to import code
            raise UnsafeFileError(
                f"{option}: refused to load, the file pickles Python objects beyond tensors and "
                f"plain data ({detail}); save a state_dict, or use sk.save"
            ) from e
        raise FileFormatError(
            f"{option} is not a readable checkpoint (safetensors, or a torch.save of a "
            f"state_dict): {type(e).__name__}: {detail or _first_line(e)}"
        ) from e
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise FileFormatError(
            f"{option} holds a {type(state).__name__}, not a state_dict (a dict of tensors)"
        )
    _load_matching(model, state, option)


def _pickle_detail(err: BaseException) -> str:
    """The line of torch's weights_only refusal that says what it met (a GLOBAL it would have
    to import, or a corrupt opcode), not the paragraph around it."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    hits = [ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln or "load key" in ln]
    return (hits or lines or [type(err).__name__])[0][:300]


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def _load_matching(model: nn.Module, state: dict, option: str) -> None:
    """``model.load_state_dict(state)``; FileFormatError naming the file when the keys or
    shapes are those of another architecture."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{len(missing)} missing key(s) (e.g. {missing[0]})" if missing else "",
            f"{len(unexpected)} unexpected key(s) (e.g. {unexpected[0]})" if unexpected else "",
            f"{len(shapes)} shape mismatch(es) (e.g. {shapes[0]})" if shapes else "",
        ]
        raise FileFormatError(
            f"{option} is a checkpoint of another architecture than {type(model).__name__}: "
            f"{'; '.join(p for p in parts if p)}; check model= and model.kwargs"
        )
    try:
        model.load_state_dict(state)
    except Exception as e:
        raise FileFormatError(f"{option}: cannot load it into the model: {_first_line(e)}") from e


def check_model_takes_data(model: nn.Module, data: DataBundle, cfg: Config) -> None:
    """One forward pass on two training inputs, as training calls the model (``model(x)``):
    ModelCallError naming the model, the data and the layer that fails (an image model on 1-D
    data, say) before anything is trained or loaded."""
    n = min(2, len(data.train))
    if n == 0:
        raise UsageError(f"data={cfg.data.name} has no training samples")
    x = get_batch(data.train, torch.arange(n))[0]
    device = next(model.parameters(), torch.zeros(0)).device
    x = x.to(device) if isinstance(x, torch.Tensor) else x
    try:
        with eval_mode(model):
            call_model(model, x, calibration_fn=lambda m, b: m(b))
    except ModelCallError as e:
        name = cfg.model.name or cfg.model._target_
        raise ModelCallError(
            f"model {name!r} cannot take the inputs of data={cfg.data.name}: {e}; pick a model "
            "and data that fit (model.name, model.kwargs, data=)"
        ) from e


def load_hf(cfg: Config) -> tuple[nn.Module, Any]:
    """``model=hf``: the transformers model of ``model.path`` (a local directory) or built
    from ``model.config`` (random weights), and its tokenizer (from ``data.tokenizer``, else
    ``model.path``; None when there is none and ``data=text`` does not need one)."""
    from sparsekit.models import hf

    m = cfg.model
    if (m.path is None) == (m.config is None):
        raise UsageError("model=hf needs exactly one of model.path=DIR (a local transformers "
                         "directory) or model.config=CONFIG (a dict or config.json; random "
                         "weights)")
    torch.manual_seed(cfg.train.seed)  # model.config: the same random weights every run
    if m.path is not None:
        model = hf.load_pretrained(m.path, m.task, quiet=is_quiet(cfg.train.quiet))
    else:
        model = hf.build_from_config(m.config, m.task)
    source = cfg.data.tokenizer or m.path
    if source is None:
        if cfg.data.name == "text":
            raise UsageError("data=text with model.config needs data.tokenizer=DIR (a directory "
                             "holding tokenizer files)")
        return model, None
    option = "data.tokenizer" if cfg.data.tokenizer else "model.path"
    try:
        return model, hf.load_tokenizer(source, option)
    except FileFormatError:
        if cfg.data.name == "text":
            raise
        return model, None  # exported without tokenizer files


def build_run_data(cfg: Config, hf_model: nn.Module | None, tokenizer: Any) -> DataBundle:
    """The run's data; ``data=text`` is tokenized with the model's tokenizer."""
    if cfg.data.name != "text" or cfg.data._target_ is not None:
        return build_data(cfg.data.name, cfg.data._target_, cfg.data.kwargs, cfg.cache_dir)
    from sparsekit.data.hf_text import text_data
    from sparsekit.errors import UsageError

    if not cfg.data.path:
        raise UsageError("data=text needs data.path=FILE|DIR|GLOB (local .txt/.jsonl files)")
    if tokenizer is None:
        if not cfg.data.tokenizer:
            raise UsageError("data=text needs a tokenizer: model=hf model.path=DIR, or "
                             "data.tokenizer=DIR")
        from sparsekit.models.hf import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer, "data.tokenizer")
    task = "causal_lm" if hf_model is None else hf_model._sparsekit_spec["kwargs"]["task"]
    return text_data(cfg.data.path, tokenizer, cfg.data.seq_len,
                     cache_root(cfg.cache_dir) / "data", task=task, **cfg.data.kwargs)


def export_hf(model: nn.Module, tokenizer: Any, run_dir: Path, model_path: Path,
              quiet: bool = False) -> dict:
    """``<run>/hf/``: what ``AutoModelFor*.from_pretrained`` and ``AutoTokenizer`` load (the
    compressed weights), plus the sparsekit file (``sparsekit.safetensors``, for ``sk.load``);
    ``<run>/hf-compressed-tensors/`` when compressed-tensors can write the model (the summary
    says what was written, or why not)."""
    from sparsekit.quant.compressed_tensors import CT_DIR, export_compressed_tensors
    from sparsekit.models.hf import export_pretrained

    out = export_pretrained(model, run_dir / "hf", tokenizer, quiet)
    target = out / "sparsekit.safetensors"
    target.unlink(missing_ok=True)
    try:
        os.link(model_path, target)
    except OSError:  # another file system: copy
        shutil.copyfile(model_path, target)
    return {"dir": str(out), **export_compressed_tensors(model, run_dir / CT_DIR, tokenizer, quiet)}


def dense_model(cfg: Config, data: DataBundle, device: torch.device, tracker: Tracker,
                hf_model: nn.Module | None = None) -> tuple:
    """The dense model: ``hf_model`` (model=hf, never trained here), loaded from
    ``model.checkpoint``, from the baseline cache, or trained here and cached. Returns
    ``(model, source)``."""
    if hf_model is not None:
        m = cfg.model
        what = f"hf {m.path}" if m.path else "hf model.config (random weights)"
        return hf_model.to(device), what
    torch.manual_seed(cfg.train.seed)  # the initial weights too: same config, same baseline
    model = build_model(cfg.model.name, cfg.model._target_, cfg.model.kwargs).to(device)
    check_model_takes_data(model, data, cfg)
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
    t = cfg.train
    optimizer = make_optimizer(model.parameters(), t.optimizer, t.dense_lr, t.weight_decay)
    # a killed dense training continues from its last checkpoint, next to the cache entry
    # (a damaged one is moved aside with a warning, and training starts over)
    partial = path.with_name(path.stem + ".partial.pt")
    state = load_latest_checkpoint(partial, discard=True)
    start = 0 if state is None else restore(state, model, optimizer)
    kill_at = int(os.environ.get(KILL_DENSE_ENV, "-1"))

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if metrics:  # fit fills them on logging steps
            tracker.scalars({f"dense_{k}": v for k, v in metrics.items()}, step)
        if (step + 1) % t.checkpoint_every == 0 and step != t.dense_steps - 1:
            if D.is_main():
                with storage_errors(partial):
                    save_checkpoint(partial, step=step, model=model, optimizer=optimizer)
            D.barrier()
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    fit(model, data.train, optimizer, steps=t.dense_steps, lr=t.dense_lr,
        batch_size=cfg.data.batch_size, seed=t.seed, start_step=start, warmup=t.warmup_steps,
        lr_schedule=t.lr_schedule, grad_clip=t.grad_clip, on_step=on_step, log_every=t.log_every,
        quiet=is_quiet(t.quiet), desc="dense training")
    if D.is_main():  # every rank trained the same model; one writes the cache
        write_file(path, lambda tmp: save_model(model, tmp))
        partial.unlink(missing_ok=True)
        previous_path(partial).unlink(missing_ok=True)
    how = f"resumed at step {start}, " if start else ""
    return model, f"trained ({how}{t.dense_steps} steps), cached {path}"


def _discard(path: Path, err: Exception) -> None:
    """Move a damaged cache entry aside (``<name>.corrupt-<time>``) with a warning naming it."""
    if D.is_main():
        try:
            moved = move_aside(path).name
        except FileNotFoundError:  # another process moved it first
            moved = "(already moved)"
        warnings.warn(f"cache entry {path} is damaged and will be rebuilt; moved it to "
                      f"{moved}: {err}", stacklevel=2)


class ChannelSteps:
    """Channel pruning interleaved with fine-tuning, in the Pruner's seat: ``fit`` steps it,
    checkpoints hold its plain state (the channel plan and progress), and restoring it reshapes
    a fresh model before its weights load. When widths change, the optimizer's parameters are
    replaced and its per-parameter state dropped (its shapes no longer match)."""

    def __init__(self, channel_pruner: Any, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.channel_pruner, self.model, self.optimizer = channel_pruner, model, optimizer
        self.progress = channel_pruner.progress

    def _rebind(self) -> None:
        self.optimizer.param_groups[0]["params"] = list(self.model.parameters())
        self.optimizer.state.clear()

    def step(self, step: int) -> bool:
        changed = self.channel_pruner.step(step)
        if changed:
            self._rebind()
            self.progress = self.channel_pruner.progress
        return changed

    def report(self) -> Any:
        return sk.sparsity_report(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {"plan": sk.channel_plan(self.model), "progress": self.channel_pruner.progress}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.channel_pruner.resume(state["plan"], state["progress"])
        self.progress = self.channel_pruner.progress
        self._rebind()


def taylor_loss(dataset: Any, cfg: Config) -> Any:
    """Taylor channel importance needs gradients: the task loss on a few training batches."""
    idx = torch.arange(min(len(dataset), cfg.data.batch_size * cfg.prune.calibration_batches))
    x, y = get_batch(dataset, idx)

    def loss_fn(model: nn.Module) -> torch.Tensor:
        device = next(model.parameters()).device
        return task_loss(model(x.to(device)), y.to(device))

    return loss_fn


def sensitivity_stage(
    cfg: Config, model: nn.Module, eval_model: Any, calibration: list, tracker: Tracker,
    run_dir: Path,
) -> dict[str, float] | None:
    """``sensitivity.enabled``: each selected layer of the dense model pruned alone at each level
    (``sk.sensitivity``), written to sensitivity.json/.md and one TensorBoard chart per layer.
    Returns the per-layer levels ``sk.allocate`` picks for ``sensitivity.target`` (None without
    one). A resumed run reads its sensitivity.json instead of measuring again."""
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
            calibration=None if p.criterion == "magnitude" else calibration,
            higher_is_better=metric == "accuracy",
        )
        if tracker.writer is not None:
            table.log(tracker.writer)
        tracker.text("sensitivity", f"{metric}, one layer pruned at a time:\n\n```\n{table}\n```")
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
    return "perplexity" if task == "lm" else "accuracy"


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if metric == "accuracy" else f"{value:.3f}"


def summary_table(s: dict[str, Any]) -> str:
    """The end-of-run table (markdown) from a run summary."""
    m, d, c = s["metric"], s["dense"], s["compressed"]

    def num(x: float | None, f: str) -> str:
        return "-" if x is None else format(x, f)

    rows = [
        (m, _fmt(m, d[m]), _fmt(m, c[m])),
        ("sparsity (pruned layers)", "0.00%", f"{s['sparsity']:.2%}"),
        ("size (bytes)", num(d["size_bytes"], ","), num(c["size_bytes"], ",")),
        ("latency b=1 (ms)", num(d.get("latency_ms"), ".3f"), num(c.get("latency_ms"), ".3f")),
        ("throughput (samples/s)", num(d.get("throughput"), ",.0f"),
         num(c.get("throughput"), ",.0f")),
    ]
    lines = ["| | dense | compressed |", "| --- | ---: | ---: |"]
    lines += [f"| {a} | {b} | {c_} |" for a, b, c_ in rows]
    lines.append("")
    lines.append(f"TensorBoard logdir: {s['tensorboard_logdir']}")
    return "\n".join(lines)


def run(cfg: Config, run_dir: str | os.PathLike, resume: bool = False) -> dict[str, Any]:
    """Run every stage of ``cfg`` with outputs under ``run_dir``; ``resume`` continues from
    ``run_dir/checkpoints/last.pt`` when it exists (from the previous checkpoint, with a
    warning, when that one is damaged). Returns the summary (also written to ``summary.json``
    and ``summary.md``). ``run_dir/run_state.json`` records ``running``, then ``failed`` (with
    the error) or ``finished``."""
    validate(cfg)
    run_dir = Path(run_dir).resolve()
    with storage_errors(run_dir, "create the run directory (hydra.run.dir)"):
        run_dir.mkdir(parents=True, exist_ok=True)
        if D.is_main():
            write_run_state(run_dir, "running")
    try:
        summary = _run(cfg, run_dir, resume)
    except BaseException as e:
        if D.is_main() and not isinstance(e, KeyboardInterrupt):  # Ctrl-C: can continue
            try:
                write_run_state(run_dir, "failed", f"{type(e).__name__}: {e}"[:2000])
            except OSError:  # an unwritable or full disk: the original error says more
                pass
        raise
    if D.is_main():
        write_run_state(run_dir, "finished")
    return summary


def _run(cfg: Config, run_dir: Path, resume: bool) -> dict[str, Any]:
    t0, started = time.perf_counter(), utc_now()
    cache = cache_root(cfg.cache_dir)
    with storage_errors(cache, "create the cache directory (cache_dir)"):
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK | os.X_OK):
            raise StorageError(f"cache_dir={str(cache)!r} is not writable: pass a writable "
                               "cache_dir= or set SPARSEKIT_CACHE")
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    if D.is_main():  # under torchrun only rank 0 writes files and TensorBoard logs
        write_file(run_dir / "config.yaml", lambda tmp: Path(tmp).write_text(resolved))
    t, quiet = cfg.train, is_quiet(cfg.train.quiet)
    device = pick_device(t.device)
    if device.type == "cpu" and t.cpu_threads > 0:
        # tiny models lose more to thread synchronization than they gain from a second thread
        torch.set_num_threads(t.cpu_threads)
    mode = D.resolve_mode(t.distributed)  # none | ddp | fsdp2 (see docs/distributed.md)
    if mode == "fsdp2" and cfg.quant.qat:
        raise ValueError("train.distributed=fsdp2 cannot fine-tune with quant.qat=true; use ddp")
    if mode != "none":
        device = D.init(device=device.type)  # this rank's GPU under torchrun
        D.split_batch(cfg.data.batch_size, what="data.batch_size")  # fail before any work
    metric = _metric(cfg.data.task)
    state = load_latest_checkpoint(run_dir / CHECKPOINT) if resume else None
    tb = cfg.tracker
    tracker = Tracker(run_logdir(run_dir, resume=state is not None),
                      tb.kind == "tensorboard" and D.is_main(), tb.flush_secs, tb.histogram_every,
                      tb.histograms, purge_step=None if state is None else state["step"] + 1)
    tracker.text("config", f"```yaml\n{resolved}\n```")

    hf_model = tokenizer = None
    if cfg.model.name == "hf":
        hf_model, tokenizer = load_hf(cfg)
    data = build_run_data(cfg, hf_model, tokenizer)
    model, dense_source = dense_model(cfg, data, device, tracker, hf_model)

    def eval_model(m: nn.Module) -> dict[str, float]:
        return evaluate(m, data.eval, cfg.data.task, cfg.data.eval_batch_size,
                        cfg.data.eval_batches, quiet)

    dense_eval = eval_model(model)
    dense_size = file_size(model)
    # a copy of the dense model only when something reads it: the distillation teacher and the
    # speed reference (an LLM one-shot run would otherwise hold its weights twice)
    keep_dense = (t.distill.alpha > 0 and cfg.prune.fine_tune) or cfg.bench.enabled
    dense = copy.deepcopy(model).eval() if keep_dense else None
    tracker.dense({f"eval/{metric}": dense_eval[metric]}, 0)
    example = next(eval_batches(data.eval, cfg.bench.batch_size, 1))[0]
    example = example.to(device) if isinstance(example, torch.Tensor) else example
    calibration_set = data.train if data.calibration is None else data.calibration
    calibration = [
        b[0]
        for b in eval_batches(calibration_set, cfg.data.batch_size, cfg.prune.calibration_batches)
    ]
    p, q = cfg.prune, cfg.quant
    sparsity = p.sparsity
    if cfg.sensitivity.enabled:  # per-layer levels from the scan when sensitivity.target is set
        levels = sensitivity_stage(cfg, model, eval_model, calibration, tracker, run_dir)
        sparsity = sparsity if levels is None else levels

    # Channel-only runs with steps > 1 remove channels in increments on the schedule while
    # fine-tuning (one process); otherwise all increments happen before fine-tuning.
    c = p.channel
    interleave = (c.ratio > 0 and c.steps > 1 and p.fine_tune and p.pattern == "none"
                  and mode == "none")
    channel_report = channel_pruner = None
    if c.ratio > 0:
        options = dict(
            ratio=c.ratio, criterion=c.importance, scope=c.scope, round_to=c.round_to,
            exclude=list(c.ignore),
            loss_fn=taylor_loss(data.train, cfg) if c.importance == "taylor" else None,
        )
        if interleave:
            s = cfg.schedule
            every = max(1, -(-(s.end - s.start) // c.steps))  # ceil: exactly `steps` updates
            channel_pruner = sk.ChannelPruner(
                model, example[:1], schedule=sk.Linear(s.start, s.end, every), **options
            )
        else:
            channel_report = sk.prune_channels_(model, example[:1], steps=c.steps, **options)
    quant_report = None
    if q.scheme != "none" and q.qat:
        sk.prepare_qat_(model, q.scheme, include=list(q.include), exclude=list(q.exclude))
    if mode == "fsdp2":  # shard before the Pruner: its masks become shards like the weights
        unsharded = copy.deepcopy(model)  # a container for the full weights after fine-tuning
        D.shard_model(model)

    pruner = None
    if p.pattern != "none":
        pruner = sk.Pruner(
            model, sparsity=sparsity, pattern=p.pattern, criterion=p.criterion, scope=p.scope,
            schedule=make_schedule(cfg), include=list(p.include), exclude=list(p.exclude),
            calibration=calibration if p.criterion != "magnitude" else None, strict=p.strict,
        )
    steps = t.finetune_steps if p.fine_tune else 0
    optimizer = make_optimizer(model.parameters(), t.optimizer, t.finetune_lr, t.weight_decay)
    if channel_pruner is not None:  # stepped, checkpointed and restored in the Pruner's place
        pruner = ChannelSteps(channel_pruner, model, optimizer)
    start = 0
    if state is not None and state.get("sharded"):  # FSDP2: torch.distributed.checkpoint
        if state["sharded"] != CHECKPOINT.with_suffix(".dcp").name:  # a name, never a path
            raise FileFormatError(f"{run_dir / CHECKPOINT}: unexpected sharded checkpoint "
                                  f"{state['sharded']!r}")
        loaded = D.load_training_state(run_dir / CHECKPOINT.parent / state["sharded"], model,
                                       optimizer, pruner, step=-1)
        set_rng_state(state["rng"])
        start = int(loaded["step"]) + 1
    elif state is not None:
        start = restore(state, model, optimizer, pruner)
    else:
        torch.manual_seed(t.seed + 1)
    ckpt_path = run_dir / CHECKPOINT
    kill_at = int(os.environ.get(KILL_ENV, "-1"))
    # DDP averages gradients over ranks, each training on its slice of every global batch
    train_model = D.wrap_ddp(model, device) if mode == "ddp" and steps > start else model

    seen_progress = [None if pruner is None else pruner.progress]

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if metrics:  # fit fills them on logging steps
            scalars = dict(metrics)
            if pruner is not None:
                scalars["sparsity/global"] = pruner.report().global_sparsity
            tracker.scalars(scalars, step)
        if pruner is not None and pruner.progress != seen_progress[0]:  # masks just moved
            seen_progress[0] = pruner.progress
            if mode != "fsdp2":  # sharded weights get their histograms once gathered
                tracker.weight_histograms(model, step)
                tracker.layer_sparsity(pruner.report().to_dict()["layers"], step)
        if (step + 1) % t.eval_every == 0 and step != steps - 1:  # dense: the reference line
            tracker.scalars({f"eval/{metric}": eval_model(model)[metric]}, step)
            tracker.dense({f"eval/{metric}": dense_eval[metric]}, step)
        if (step + 1) % t.checkpoint_every == 0 or step == steps - 1:
            D.barrier()
            if mode == "fsdp2":  # every rank writes its shards, then rank 0 the pointer to them
                D.save_training_state(ckpt_path.with_suffix(".dcp"), model, optimizer, pruner,
                                      step=step)
                if D.is_main():
                    atomic_torch_save({"version": RUNSTATE_VERSION, "step": step,
                                       "done": step == steps - 1, "rng": rng_state(),
                                       "sharded": ckpt_path.with_suffix(".dcp").name}, ckpt_path)
            elif D.is_main():  # replicated state: rank 0's file serves every rank
                with storage_errors(ckpt_path):
                    save_checkpoint(ckpt_path, step=step, model=model, optimizer=optimizer,
                                    pruner=pruner, done=step == steps - 1)
            D.barrier()
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    if pruner is not None and not p.fine_tune:
        pruner.step(0)
    if steps > start:
        teacher = dense if t.distill.alpha > 0 else None
        fit(train_model, data.train, optimizer, steps=steps, lr=t.finetune_lr,
            batch_size=cfg.data.batch_size, seed=t.seed + 1, start_step=start,
            warmup=0, lr_schedule=t.lr_schedule, grad_clip=t.grad_clip, pruner=pruner,
            teacher=teacher, distill_alpha=t.distill.alpha, temperature=t.distill.temperature,
            on_step=on_step, quiet=quiet, desc="fine-tuning", shard=mode != "none",
            log_every=t.log_every)
    if channel_pruner is not None:
        channel_pruner.step(max(steps, cfg.schedule.end))  # the full ratio, even with few steps
        channel_report = channel_pruner.report()
        pruner = None
    if channel_report is not None:
        tracker.text("channels", f"```\n{channel_report}\n```", steps)
    if pruner is not None:
        pruner.step(max(steps, cfg.schedule.end))  # the full target, even with few steps
        report = pruner.report()
        if mode != "fsdp2":
            tracker.weight_histograms(model, steps, force=True)
        pruner.finalize()
    else:
        report = sk.sparsity_report(model)
    if mode == "fsdp2":  # every rank gathers the full weights; the rest runs unsharded
        model = D.gather_full(model, unsharded)
        tracker.weight_histograms(model, steps, force=True)
    if q.scheme != "none":
        if q.qat:
            quant_report = sk.convert_(model)
        else:
            quant_report = sk.quantize_(model, q.scheme, calibration=calibration,
                                        include=list(q.include), exclude=list(q.exclude))
        tracker.text("quantization", f"```\n{quant_report}\n```", 0)

    comp_eval = eval_model(model)
    final_step = max(steps, 1)
    tracker.scalars({f"eval/{metric}": comp_eval[metric]}, final_step)
    tracker.dense({f"eval/{metric}": dense_eval[metric]}, final_step)
    tracker.scalars(report.scalars(), final_step)
    tracker.layer_sparsity(report.to_dict()["layers"], final_step)

    speed: dict[str, dict[str, float]] = {"dense": {}, "compressed": {}}
    if cfg.bench.enabled and isinstance(example, torch.Tensor) and D.is_main():
        b = cfg.bench
        for name, m in (("dense", dense), ("compressed", model)):
            speed[name] = benchmark(m, example, b.batch_size, b.warmup, b.repeats, name, quiet)
    accel_info: dict[str, Any] = {"enabled": cfg.accel.enabled}
    if cfg.accel.enabled and D.is_main():
        accel_info.update(accelerate(cfg, model, example, device, tracker, quiet))

    model_path = run_dir / "model.safetensors"
    hf_export = None
    if D.is_main():
        save_weights(model, model_path)
        if hf_model is not None:
            hf_export = export_hf(model, tokenizer, run_dir, model_path, quiet)
    D.barrier()
    sizes = {"dense": dense_size, "compressed": model_path.stat().st_size}
    overrides = read_overrides(run_dir)
    summary: dict[str, Any] = {
        "recipe": recipe_of(overrides),
        "overrides": overrides,
        "versions": versions(),
        "started_utc": started,
        "metric": metric,
        "dense": {**dense_eval, **speed["dense"], "size_bytes": sizes["dense"]},
        "compressed": {**comp_eval, **speed["compressed"], "size_bytes": sizes["compressed"]},
        "sparsity": report.global_sparsity,
        "skipped_layers": report.skipped,
        "channels": None if channel_report is None else channel_report.to_dict(),
        "quant": None if quant_report is None else quant_report.to_dict(),
        "speedup": (speed["dense"]["latency_ms"] / speed["compressed"]["latency_ms"]
                    if speed["compressed"] else None),
        "accel": accel_info,
        "dense_source": dense_source,
        "device": str(device),
        "finetune_steps": steps,
        "model_path": str(model_path),
        "hf": hf_export,
        "run_dir": str(run_dir),
        "tensorboard_logdir": str(tracker.logdir),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    for name, log in (("dense", tracker.dense), ("compressed", tracker.scalars)):
        if speed[name]:
            log({"speed/latency_ms": speed[name]["latency_ms"],
                 "speed/throughput": speed[name]["throughput"]}, final_step)
        log({"size/bytes": sizes[name]}, final_step)
    if summary["speedup"] is not None:
        tracker.scalars({"speed/speedup": summary["speedup"]}, final_step)
    final = {
        f"final/{metric}/dense": dense_eval[metric],
        f"final/{metric}/compressed": comp_eval[metric],
        "final/sparsity": report.global_sparsity,
        "final/size_bytes": sizes["compressed"],
    }
    if summary["speedup"] is not None:
        final["final/speedup"] = summary["speedup"]
    tracker.hparams(OmegaConf.to_container(OmegaConf.structured(cfg)), final, final_step,
                    overrides)
    table = summary_table(summary)
    markdown = f"# sparsekit run\n\n{table}\n\nSparsity by layer:\n\n```\n{report}\n```\n"
    tracker.text("summary", markdown, final_step)
    tracker.close()
    summary["ended_utc"] = utc_now()
    if D.is_main():
        write_file(run_dir / "summary.json",
                     lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2) + "\n"))
        write_file(run_dir / "summary.md", lambda tmp: Path(tmp).write_text(markdown))
    summary["table"] = f"{table}\n\nSparsity by layer:\n{report}"
    return summary


def accelerate(
    cfg: Config, model: nn.Module, example: Any, device: torch.device, tracker: Tracker,
    quiet: bool,
) -> dict[str, Any]:
    """The GPU stage: ``sk.accelerate``, its per-layer report logged to TensorBoard, and a
    benchmark of its result; skipped (with the reason recorded) without CUDA."""
    if device.type != "cuda":
        print("accel skipped: CUDA is not available")
        return {"skipped": "CUDA is not available"}
    a = cfg.accel
    fast = sk.accelerate(copy.deepcopy(model), example[:1], precision=a.precision,
                         sparsity=a.sparsity, min_speedup=a.min_speedup, fuse=a.fuse)
    report = fast.sparsekit_report
    if tracker.writer is not None:
        report.log(tracker.writer)
    info: dict[str, Any] = {"report": report.to_dict()}
    if cfg.bench.enabled:
        b = cfg.bench
        info["speed"] = benchmark(fast, example, b.batch_size, b.warmup, b.repeats, "accel", quiet)
    return info
