"""Bringing a run's inputs in and its HF outputs out: dense weights from a user file
(safetensors or a weights-only torch state dict, checked against the model), the HF model and
tokenizer of ``model=hf``, the run's data (``data=text`` tokenized with the model's tokenizer),
a first forward pass that checks the model takes the data, and the ``<run>/hf/`` export."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as safetensors_load_file
from torch import nn

from sparsekit.data import DataBundle, build_data
from sparsekit.errors import (
    FileFormatError,
    ModelCallError,
    SparsekitError,
    UnsafeFileError,
    UsageError,
)
from sparsekit.io.cache import cache_root
from sparsekit.io.checkpoint import is_sparsekit_file, load_state_dict
from sparsekit.io.files import safe_torch_load
from sparsekit.progress import is_quiet
from sparsekit.nn.calibration import call_model, eval_mode
from sparsekit.run.config import Config
from sparsekit.run.train import get_batch


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
    except PermissionError as e:
        raise UsageError(f"{option} cannot be read: {e.strerror}") from None
    except Exception as e:  # a crafted file can trip torch.load in other ways; nothing ran
        raise FileFormatError(
            f"{option} is not a readable checkpoint (safetensors, or a torch.save of a "
            f"state_dict): {type(e).__name__}: {_first_line(e)}"
        ) from e
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise FileFormatError(
            f"{option} holds a {type(state).__name__}, not a state_dict (a dict of tensors)"
        )
    _load_matching(model, state, option)


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
    x, y = get_batch(data.train, torch.arange(n))[:2]
    device = next(model.parameters(), torch.zeros(0)).device
    x = x.to(device) if isinstance(x, torch.Tensor) else x
    name = cfg.model.name if cfg.model._target_ is None else cfg.model._target_
    try:
        with eval_mode(model):
            out = call_model(model, x, calibration_fn=lambda m, b: m(b))
    except ModelCallError as e:
        raise ModelCallError(
            f"model {name!r} cannot take the inputs of data={cfg.data.name}: {e}; pick a model "
            "and data that fit (model.name, model.kwargs, data=)"
        ) from e
    check_task_fits(out, y, cfg.data.task, f"model {name!r} on data={cfg.data.name}")


def check_task_fits(out: Any, target: Any, task: str, what: str) -> None:
    """``data.task`` against what the model gives: class logits (B, C) for targets (B,) under
    ``classification``, token logits (B, T, V) for targets (B, T) under ``lm``; a UsageError
    naming ``what`` otherwise (a perplexity of an image classifier means nothing)."""
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return
    shapes = {"classification": ((2, 1), "class logits (B, C) for targets (B,)"),
              "lm": ((3, 2), "token logits (B, T, V) for targets (B, T)")}
    want, needs = shapes[str(task)]
    if (logits.dim(), target.dim()) != want:
        other = "lm" if str(task) == "classification" else "classification"
        raise UsageError(
            f"data.task={task} needs {needs}, and {what} gives output {tuple(logits.shape)} for "
            f"targets {tuple(target.shape)}: "
            f"set data.task={other} or pick a model and data of that task"
        )


def check_input_paths(cfg: Config, *, complete: bool = True) -> None:
    """Every file or directory the run reads (model.path, model.config as a file,
    model.checkpoint, data.path, data.tokenizer) exists and is of the right kind: a one-line
    UsageError naming the option before any model is built, loaded or trained. ``complete``:
    also those the run cannot do without (data=text's data.path); False checks only the paths
    given (a config being composed may get the others later)."""
    from sparsekit.data.hf_text import text_files
    from sparsekit.models.hf import check_model_dir

    m, d = cfg.model, cfg.data
    if m.path is not None:
        check_model_dir(m.path)
    if isinstance(m.config, str) and not Path(m.config).expanduser().is_file():
        raise UsageError(f"model.config={m.config!r}: no such file (a config.json, or a dict)")
    if m.checkpoint and not Path(m.checkpoint).expanduser().is_file():
        raise UsageError(f"model.checkpoint={m.checkpoint!r} does not exist or is not a file")
    if complete and d.name == "text" and d._target_ is None:
        check_text_sources(cfg)
    if d.path is not None:
        text_files(d.path)
    if d.eval_path is not None:
        text_files(d.eval_path, "data.eval_path")
    tok = None if d.tokenizer is None else Path(d.tokenizer).expanduser()
    if tok is not None and not (tok.is_dir() or (tok.is_file() and tok.suffix.lower() == ".gguf")):
        raise UsageError(f"data.tokenizer={d.tokenizer!r}: no such directory (a directory "
                         "holding tokenizer files, or a .gguf file)")


def check_text_sources(cfg: Config) -> None:
    """data=text has text for every part of the run: data.path, or data-free teacher samples
    (``data.teacher_mix=1``) with held-out text in data.eval_path; one-line UsageError."""
    d = cfg.data
    if d.path:
        return
    if not d.teacher_samples or d.teacher_mix < 1:
        mix = (f" (data.teacher_mix={d.teacher_mix:g} mixes teacher samples with it; 1 is "
               "data-free)" if d.teacher_samples else "")
        raise UsageError("data=text needs data.path=FILE|DIR|GLOB (local .txt/.jsonl files)"
                         f"{mix}")
    if not d.eval_path:
        raise UsageError("data.teacher_mix=1 without data.path leaves nothing to evaluate on: "
                         "give data.eval_path=FILE|DIR|GLOB (held-out text, never teacher "
                         "samples)")


def load_hf(cfg: Config) -> tuple[nn.Module, Any]:
    """``model=hf``: the transformers model of ``model.path`` (a local directory, a ``.gguf``
    file or a directory holding one) or built from ``model.config`` (random weights), and its
    tokenizer (from ``data.tokenizer``, else ``model.path``; None when there is none and
    ``data=text`` does not need one)."""
    from sparsekit.models import hf

    m = cfg.model
    if (m.path is None) == (m.config is None):
        raise UsageError("model=hf needs exactly one of model.path=DIR (a local transformers "
                         "directory, or a .gguf file) or model.config=CONFIG (a dict or "
                         "config.json; random weights)")
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


def build_run_data(cfg: Config, hf_model: nn.Module | None, tokenizer: Any,
                   device: torch.device | None = None) -> DataBundle:
    """The run's data; ``data=text`` is tokenized with the model's tokenizer, evaluated on
    ``data.eval_path`` when given, and mixed with teacher samples (:func:`teacher_data`,
    sampled on ``device``) when ``data.teacher_samples`` > 0."""
    if cfg.data.name != "text" or cfg.data._target_ is not None:
        return build_data(cfg.data.name, cfg.data._target_, cfg.data.kwargs, cfg.cache_dir)
    from sparsekit.data.hf_text import held_out_text, text_data

    d = cfg.data
    check_text_sources(cfg)
    if tokenizer is None:
        if not d.tokenizer:
            raise UsageError("data=text needs a tokenizer: model=hf model.path=DIR, or "
                             "data.tokenizer=DIR")
        from sparsekit.models.hf import load_tokenizer

        tokenizer = load_tokenizer(d.tokenizer, "data.tokenizer")
    task = "causal_lm" if hf_model is None else hf_model._sparsekit_spec["kwargs"]["task"]
    cache = cache_root(cfg.cache_dir) / "data"
    text = None if not d.path else text_data(d.path, tokenizer, d.seq_len, cache, task=task,
                                             **d.kwargs)
    held_out = None
    if d.eval_path:
        keep = {k: v for k, v in d.kwargs.items()
                if k in ("text_field", "mlm_probability", "seed")}
        held_out = held_out_text(d.eval_path, tokenizer, d.seq_len, cache, task=task, **keep)
    if d.teacher_samples:
        return teacher_data(cfg, hf_model, task, text, held_out, device)
    if held_out is not None:
        text.eval = held_out
    return text


def teacher_data(cfg: Config, model: nn.Module | None, task: str, text: DataBundle | None,
                 held_out: Any, device: torch.device | None) -> DataBundle:
    """``data.teacher_samples`` sequences of ``data.seq_len + 1`` tokens written by the dense
    causal LM ``model`` (moved to ``device``; cached under the data cache), mixed into the
    training and calibration windows at ``data.teacher_mix``
    (:func:`sparsekit.data.teacher.mix_bundle`); ``data.teacher`` of the bundle's info says
    how they were made."""
    from sparsekit.data.teacher import mix_bundle, progress_callback, teacher_samples

    d = cfg.data
    if model is None or task != "causal_lm":
        raise UsageError(f"data.teacher_samples={d.teacher_samples} needs a causal LM teacher "
                         f"(model=hf with model.task=causal_lm); this model is {task}")
    if device is not None:
        model.to(device)
    options = dict(seed=d.teacher_seed, temperature=d.teacher_temperature,
                   top_p=d.teacher_top_p, first_tokens=d.teacher_first_tokens,
                   batch_size=d.teacher_batch_size)
    cache = cache_root(cfg.cache_dir) / "data"
    t0 = time.perf_counter()
    tokens = teacher_samples(model, d.teacher_samples, d.seq_len + 1, cache_dir=cache,
                             on_progress=progress_callback(d.teacher_samples, cfg.train.quiet),
                             **options)
    bundle = mix_bundle(text, tokens, d.teacher_mix, held_out)
    bundle.info["teacher"].update(options, seq_len=d.seq_len + 1,
                                  seconds=round(time.perf_counter() - t0, 2))
    return bundle


def export_holds(model: nn.Module) -> str:
    """What ``hf/`` holds of ``model``: its weights, or its quantized layers' dequantized
    values, and whether the measured model quantizes activations that ``hf/`` leaves in float
    (its outputs then differ: :func:`output_gap`)."""
    from sparsekit.quant.formats import get_scheme

    schemes = sorted({str(m.scheme) for m in model.modules()
                      if hasattr(m, "dequantized_weight") and hasattr(m, "scheme")})
    if not schemes:
        return "the measured weights"
    acts = any(get_scheme(s).activation is not None for s in schemes)
    return (f"dequantized {', '.join(schemes)} weights"
            + ("; no activation quantization (the measured model quantizes them)" if acts
               else ""))


def _output_tensor(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, name, None), torch.Tensor):
            return getattr(out, name)
    return out if isinstance(out, torch.Tensor) else out[0]


def output_gap(model: nn.Module, directory: Path, example: Any, task: str | None,
               cast: bool = True) -> float:
    """The largest absolute difference between the outputs (logits; an embedding model's
    hidden states) of ``model`` and of ``directory`` loaded back with ``from_pretrained``, on
    ``example``, in float32. ``cast``: the loaded model in ``model``'s dtype first."""
    from sparsekit.models.hf import load_pretrained

    param = next(model.parameters())
    back = load_pretrained(directory, task, quiet=True).to(param.device)
    if cast:
        back = back.to(model.get_input_embeddings().weight.dtype)
    with torch.no_grad(), eval_mode(model), eval_mode(back):
        want = _output_tensor(call_model(model, example)).float()
        got = _output_tensor(call_model(back, example)).float()
    return float((got - want).abs().max())


#: the sentence-transformers modules an exported embedding model may name (a source model's
#: modules.json naming any other is not copied: its types are imported when it loads)
ST_MODULES = ("Transformer", "Pooling", "Normalize")
ST_FILES = ("sentence_bert_config.json", "config_sentence_transformers.json")


def _source_modules(source: Path) -> list[dict] | None:
    """The source model's sentence-transformers modules (``modules.json``), when it has them
    and they are only :data:`ST_MODULES` in sub-directories of its own; else None."""
    try:
        entries = json.loads((source / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and ".." not in e["path"]
        and not Path(e["path"]).is_absolute()
        and e.get("type") in {f"sentence_transformers.models.{m}" for m in ST_MODULES}
        for e in entries)
    return entries if ok else None


def export_sentence_transformers(out: Path, source: str | None, dim: int,
                                 max_seq_length: int) -> str:
    """Make ``out`` (an exported encoder) a directory sentence-transformers loads as the model
    the run measured: the source model's modules (its pooling, its normalization) when its
    directory has them (:func:`_source_modules`), else the run's mean pooling over the
    attention mask (``pooled_embedding``). Returns what was written."""
    entries = _source_modules(Path(source).expanduser()) if source else None
    if entries is not None:
        src = Path(source).expanduser()
        for e in entries:
            if e["path"]:
                shutil.copytree(src / e["path"], out / e["path"], dirs_exist_ok=True)
        for name in ST_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        (out / "modules.json").write_text(json.dumps(entries, indent=2) + "\n")
        return "the source model's: " + ", ".join(e["type"].rsplit(".", 1)[1] for e in entries)
    entries = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{m}"}
               for i, (path, m) in enumerate((("", "Transformer"), ("1_Pooling", "Pooling")))]
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": dim, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
               "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    (out / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": max_seq_length, "do_lower_case": False}, indent=2) + "\n")
    (out / "modules.json").write_text(json.dumps(entries, indent=2) + "\n")
    return "Transformer, Pooling (mean over the attention mask, as the run measured)"


def export_hf(model: nn.Module, tokenizer: Any, run_dir: Path, model_path: Path,
              quiet: bool = False, example: Any = None, task: str | None = None,
              embedding: dict | None = None) -> dict:
    """``<run>/hf/``: what ``AutoModelFor*.from_pretrained`` and ``AutoTokenizer`` load (the
    compressed weights), plus the sparsekit file (``sparsekit.safetensors``, for ``sk.load``);
    ``<run>/hf-compressed-tensors/`` when compressed-tensors can write the model (the summary
    says what was written, or why not). With an ``example`` batch, each directory is loaded
    back and its outputs compared with the measured model's (``max_abs_diff``,
    ``compressed_tensors_max_abs_diff``); ``holds`` says what ``hf/`` holds
    (:func:`export_holds`). ``embedding`` (``{"source": model.path, "max_seq_length": n}``,
    for a run that measures pooled embeddings): ``hf/`` is also a sentence-transformers model
    directory (:func:`export_sentence_transformers`)."""
    from sparsekit.quant.compressed_tensors import CT_DIR, export_compressed_tensors
    from sparsekit.models.hf import export_pretrained

    out = export_pretrained(model, run_dir / "hf", tokenizer, quiet)
    target = out / "sparsekit.safetensors"
    target.unlink(missing_ok=True)
    try:
        os.link(model_path, target)
    except OSError:  # another file system: copy
        shutil.copyfile(model_path, target)
    info = {"dir": str(out), "holds": export_holds(model)}
    if embedding is not None:
        info["sentence_transformers"] = export_sentence_transformers(
            out, embedding["source"], model.config.hidden_size, embedding["max_seq_length"])
    info = {**info,
            **export_compressed_tensors(model, run_dir / CT_DIR, tokenizer, quiet)}
    if example is not None:
        info["max_abs_diff"] = output_gap(model, out, example, task)
        if "compressed_tensors_dir" in info:
            info["compressed_tensors_max_abs_diff"] = output_gap(
                model, Path(info["compressed_tensors_dir"]), example, task, cast=False)
    return info


__all__ = ["build_run_data", "check_input_paths", "check_model_takes_data", "check_task_fits",
           "check_text_sources", "export_hf", "load_dense", "load_hf", "load_safetensors",
           "teacher_data"]
