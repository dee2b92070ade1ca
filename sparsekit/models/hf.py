"""Hugging Face transformers models: loaded from a local directory or GGUF file, or built from a
config.

A model source (``model.path``) is a transformers directory (config.json, weights, tokenizer
files), a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file and no config.json:
a GGUF file loads as the transformers model its metadata describes (transformers' GGUF reader,
which needs the ``gguf`` package), its quantized tensors (Q4_1, Q8_0, ...) dequantized to
float32, with the tokenizer it carries.

Nothing here ever reaches the network: a directory must exist locally and every
``from_pretrained`` call passes ``local_files_only=True`` (no process-wide environment variable
is touched). Every model built or loaded here carries the rebuild spec
``model._sparsekit_spec = {"builder": "hf", "kwargs": {"task": ..., "config": {...}}}``, so
``sk.save`` stores enough to rebuild it through the allow-listed builder :func:`hf` (its config
as JSON; no code is imported from the file).

>>> m = hf("causal_lm", {"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
...                      "intermediate_size": 32, "num_hidden_layers": 1,
...                      "num_attention_heads": 2, "num_key_value_heads": 2})
>>> type(m).__name__, m._sparsekit_spec["kwargs"]["task"]
('LlamaForCausalLM', 'causal_lm')
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit.errors import FileFormatError, UnsafeFileError, UsageError
from sparsekit.io.files import follow_umask
from sparsekit.models.registry import register_model
from sparsekit.names import AUTO_CLASSES  # model.task -> the transformers Auto class

# attention implementations built into transformers; any other name (a hub kernel such as
# "kernels-community/flash-attn") would make transformers look it up online
SAFE_ATTENTION = ("eager", "sdpa")
_ATTENTION_KEYS = ("attn_implementation", "_attn_implementation")
# the files one of which every saved tokenizer has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "tokenizer.model", "spiece.model")


def is_hf_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def check_config_offline(config: Any, where: str) -> None:
    """Refuse a config (a dict as config.json holds it, sub-configs included) that would make
    transformers reach the network or run code of its own: an attention implementation other
    than :data:`SAFE_ATTENTION` (a hub kernel), or an ``auto_map`` (remote code).
    :class:`~sparsekit.errors.UnsafeFileError` names ``where`` and the key."""
    if isinstance(config, dict):
        if config.get("auto_map"):  # code of its own, which transformers would fetch and run
            raise UnsafeFileError(
                f"{where}: auto_map names model code outside transformers "
                f"({str(config['auto_map'])[:80]}); sparsekit never loads remote or custom code "
                "from a config: refused"
            )
        for key, value in config.items():
            if key in _ATTENTION_KEYS and value is not None and value not in SAFE_ATTENTION:
                raise UnsafeFileError(
                    f"{where}: {key}={value!r} is not one of transformers' built-in attention "
                    f"implementations ({', '.join(SAFE_ATTENTION)}): transformers would look it "
                    "up online; refused (set it to 'sdpa' or remove it)"
                )
            check_config_offline(value, where)
    elif isinstance(config, list):
        for value in config:
            check_config_offline(value, where)


# The JSON files of a model or tokenizer directory that transformers reads and that can name
# code of the directory's own (``auto_map``: AutoTokenizer, AutoConfig, AutoModel*, processors)
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json",
                     "processor_config.json", "feature_extractor_config.json")


def check_dir_offline(directory: Path, option: str, path: str | os.PathLike) -> None:
    """Refuse a model or tokenizer directory whose JSON files (:data:`CODE_NAMING_FILES`) name
    code of their own (``auto_map``) or a hub kernel (:func:`check_config_offline`): one line
    naming ``option`` and the file. Without this, transformers asks on a terminal whether to
    run the directory's code, and "y" runs it; sparsekit never asks."""
    for name in CODE_NAMING_FILES:
        if (directory / name).is_file():
            config = _read_config_json(directory / name, option)
            check_config_offline(config, f"{option}={os.fspath(path)!r} ({name})")


def transformers_module() -> Any:
    """``import transformers``, or a :class:`UsageError` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise UsageError(
            "Hugging Face models need the transformers package: pip install 'sparsekit[hf]'"
        ) from None
    return transformers


@contextlib.contextmanager
def quiet_progress(quiet: bool = False) -> Iterator[None]:
    """transformers' own progress bars (loading, saving) off inside the block when sparsekit
    is quiet (``quiet`` or SPARSEKIT_QUIET=1), restored afterwards."""
    from sparsekit.progress import is_quiet

    tf_logging = transformers_module().utils.logging
    if not is_quiet(quiet) or not tf_logging.is_progress_bar_enabled():
        yield
        return
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.enable_progress_bar()


def task_from_architectures(architectures: list[str] | None) -> str:
    """The task a config's ``architectures`` names (``LlamaForCausalLM`` -> ``causal_lm``);
    ``feature_extraction`` (the bare model) when none is recognised.

    >>> task_from_architectures(["BertForMaskedLM"]), task_from_architectures(None)
    ('masked_lm', 'feature_extraction')
    """
    for arch in architectures or []:
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal_lm"
        if arch.endswith("ForMaskedLM"):
            return "masked_lm"
        if arch.endswith("ForSequenceClassification"):
            return "sequence_classification"
    return "feature_extraction"


def _check_task(task: str) -> str:
    if task not in AUTO_CLASSES:
        raise UsageError(f"model.task={task!r} is not allowed; choose one of: "
                         f"{', '.join(AUTO_CLASSES)}")
    return task


def _auto_class(task: str) -> Any:
    return getattr(transformers_module(), AUTO_CLASSES[_check_task(task)])


def config_dict(config: Any) -> dict[str, Any]:
    """A transformers config as a JSON-ready dict (every field, so a rebuild does not depend on
    the defaults of the transformers version that reads it)."""
    return json.loads(config.to_json_string(use_diff=False))


def _mark(model: nn.Module, task: str) -> nn.Module:
    model._sparsekit_spec = {"builder": "hf",
                             "kwargs": {"task": task, "config": config_dict(model.config)}}
    return model


def hf(task: str, config: dict) -> nn.Module:
    """The allow-listed builder: a transformers model for ``task`` (one of
    :data:`AUTO_CLASSES`) built from ``config`` (a config dict with ``model_type``, as
    ``config.json`` holds it) with freshly initialised weights."""
    tf = transformers_module()
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UsageError("model.config must be a dict with a 'model_type' (as in config.json), "
                         f"got {str(config)[:80]!r}")
    check_config_offline(config, "model.config")
    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = tf.AutoConfig.for_model(config["model_type"], **rest)
    except ValueError as e:
        raise UsageError(f"model.config: {str(e).splitlines()[0]}") from None
    return _mark(_auto_class(task).from_config(cfg), task)


def _read_config_json(path: Path, option: str) -> dict:
    if not path.is_file():
        raise UsageError(f"{option}={os.fspath(path)!r}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileFormatError(f"{option}={os.fspath(path)!r} is not a JSON config: {e}") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{option}={os.fspath(path)!r} is not a JSON object")
    return data


def build_from_config(config: dict | str | os.PathLike, task: str | None = None) -> nn.Module:
    """``model.config``: a dict, or the path of a config.json; random weights. ``task`` None:
    from the config's ``architectures`` (``causal_lm`` when it names none)."""
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_json(Path(config).expanduser(), "model.config")
    config = dict(config)
    if task is None:
        archs = config.get("architectures")
        task = task_from_architectures(archs) if archs else "causal_lm"
    return hf(task, config)


def _one_gguf(directory: Path, option: str, path: str | os.PathLike) -> str | None:
    """The one ``.gguf`` file in ``directory``, None when there is none; a one-line
    :class:`UsageError` naming them when there are several."""
    found = sorted(f.name for f in directory.iterdir()
                   if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise UsageError(f"{option}={os.fspath(path)!r} holds {len(found)} GGUF files "
                         f"({', '.join(found)}): name one, e.g. {option}={directory / found[0]}")
    return found[0] if found else None


def model_source(path: str | os.PathLike, option: str = "model.path") -> tuple[Path, str | None]:
    """``(directory, gguf)`` for a model source: a transformers directory holding a config.json
    (``gguf`` None), a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file and no
    config.json (``gguf``: the file's name in ``directory``). A one-line :class:`UsageError`
    naming ``option`` otherwise (never a hub lookup)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{option}={os.fspath(path)!r}: no such directory or file (models are "
                         "only read from local directories and .gguf files; nothing is "
                         "downloaded)")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p.parent, p.name
        raise UsageError(f"{option}={os.fspath(path)!r} is not a directory (nor a .gguf file)")
    if (p / "config.json").is_file():
        return p, None
    gguf = _one_gguf(p, option, path)
    if gguf is None:
        raise UsageError(f"{option}={os.fspath(path)!r} has no config.json: not a transformers "
                         "model directory (save one with model.save_pretrained(DIR)), and holds "
                         "no .gguf file")
    return p, gguf


def check_model_dir(path: str | os.PathLike, option: str = "model.path") -> Path:
    """``path`` as a model source (see :func:`model_source`): a local directory holding a
    config.json or one ``.gguf`` file, or a ``.gguf`` file; a one-line :class:`UsageError`
    naming ``option`` otherwise (never a hub lookup)."""
    model_source(path, option)
    return Path(path).expanduser()


def _gguf_kwargs(file: Path) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that read GGUF ``file`` into a plain float32
    model: its quantized weights dequantized at load time (transformers versions that can keep
    them packed would otherwise fetch a matmul kernel from the hub)."""
    tf = transformers_module()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"reading the GGUF file {os.fspath(file)!r} needs the "
                         f"{' and '.join(missing)} package(s): pip install 'sparsekit[hf]'")
    kwargs: dict[str, Any] = {"gguf_file": os.fspath(file), "dtype": torch.float32}
    config_class = getattr(tf, "GgufConfig", None)
    if config_class is not None and "dequantize" in inspect.signature(config_class).parameters:
        kwargs["quantization_config"] = config_class(gguf_file=os.fspath(file), dequantize=True)
    return kwargs


def _plain_after_gguf(model: nn.Module, where: str) -> nn.Module:
    """The model transformers read from a GGUF file without its GGUF loading state (the
    ``quantization_config`` the file's name went into, the quantizer): its weights are plain
    float tensors, and ``save_pretrained`` writes them as any transformers model's."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = [name for name, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if packed:
        raise FileFormatError(f"{where}: transformers kept {len(packed)} layer(s) in GGUF blocks "
                              f"(e.g. {packed[0]}); sparsekit needs them dequantized")
    return model


def load_pretrained(path: str | os.PathLike, task: str | None = None,
                    quiet: bool = False) -> nn.Module:
    """The model of model source ``path`` (a local directory, or a ``.gguf`` file or a
    directory holding one: :func:`model_source`) through the Auto class of ``task``, offline;
    ``quiet``: no loading progress bar. ``task`` None: from its config's ``architectures``
    (a GGUF file, whose metadata names none: ``causal_lm``). A GGUF file loads in float32."""
    directory, gguf = model_source(path)
    where = f"model.path={os.fspath(path)!r}"
    kwargs: dict[str, Any] = {}
    config: dict = {}
    if gguf is None:
        config = _read_config_json(directory / "config.json", "model.path")
        check_dir_offline(directory, "model.path", path)
        if task is None:
            task = task_from_architectures(config.get("architectures"))
    else:
        kwargs = _gguf_kwargs(directory / gguf)
        task = task or "causal_lm"
    try:
        with quiet_progress(quiet):
            model, info = _auto_class(task).from_pretrained(
                os.fspath(directory), local_files_only=True, output_loading_info=True,
                trust_remote_code=False, **kwargs)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        source = f" from GGUF file {gguf}" if gguf else ""
        raise FileFormatError(f"{where}: cannot load a {task} model{source}: "
                              f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if gguf is not None:
        model = _plain_after_gguf(model, where)
        check_config_offline(config_dict(model.config), f"{where} (GGUF metadata)")
    missing = list(info.get("missing_keys") or [])
    if missing and task == "feature_extraction":  # the bare model: at most a pooler is new
        warnings.warn(f"{where}: {len(missing)} tensor(s) of the bare "
                      f"model are not in the checkpoint and start random (e.g. {missing[0]})",
                      UserWarning, stacklevel=2)
    elif missing and gguf is not None:  # the file's metadata names no task
        raise UsageError(f"{where} holds no weights for {len(missing)} tensor(s) a {task} "
                         f"model needs (e.g. {missing[0]}): they would be random; set "
                         f"model.task to the file's task (one of: {', '.join(AUTO_CLASSES)})")
    elif missing:  # a head transformers would initialise at random, saying so only in a log
        found = task_from_architectures(config.get("architectures"))
        raise UsageError(
            f"{where} holds no weights for {len(missing)} tensor(s) a "
            f"{task} model needs (e.g. {missing[0]}): they would be random; its config says "
            f"{config.get('architectures')} ({found}): set model.task={found} or leave "
            "model.task unset"
        )
    return _mark(model, task)


def load_tokenizer(path: str | os.PathLike, option: str = "model.path") -> Any:
    """The tokenizer of ``path`` (``AutoTokenizer``, offline): the tokenizer files saved in a
    local directory, else the tokenizer a ``.gguf`` file carries (``path`` the file, or a
    directory holding exactly one and no tokenizer files)."""
    p = Path(path).expanduser()
    gguf: Path | None = None
    if p.is_file() and p.suffix.lower() == ".gguf":
        p, gguf = p.parent, p
    elif not p.is_dir():
        raise UsageError(f"{option}={os.fspath(path)!r}: no such directory (nor a .gguf file)")
    elif not any((p / f).is_file() for f in TOKENIZER_FILES):
        name = _one_gguf(p, option, path)
        if name is None:
            raise FileFormatError(
                f"{option}={os.fspath(path)!r} holds no tokenizer (none of "
                f"{', '.join(TOKENIZER_FILES)}, no .gguf file): save one there with "
                "tokenizer.save_pretrained(DIR), or set data.tokenizer=DIR"
            )
        gguf = p / name
    check_dir_offline(p, option, path)
    tf = transformers_module()
    kwargs = {} if gguf is None else {"gguf_file": _gguf_kwargs(gguf)["gguf_file"]}
    try:
        return tf.AutoTokenizer.from_pretrained(os.fspath(p), local_files_only=True,
                                                trust_remote_code=False, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise FileFormatError(
            f"{option}={os.fspath(path)!r} holds no loadable tokenizer ({str(e).splitlines()[0]});"
            " save one there with tokenizer.save_pretrained or set data.tokenizer=DIR"
        ) from None


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under its original transformers keys: sparsekit's quantized layers
    (``weight`` in int8/fp8 plus ``weight_scale``) become float weights in the model's dtype
    (the quantized values times their scales), so ``from_pretrained`` of the plain architecture
    reads them."""
    from sparsekit.io.checkpoint import plain_state_dict

    dtype = model.get_input_embeddings().weight.dtype
    sd = plain_state_dict(model)
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight"):  # sparsekit.quant's quantized layers
            sd.pop(f"{name}.weight_scale", None)
            sd[f"{name}.weight"] = module.dequantized_weight(dtype)
    return sd


def save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *args: Any,
                    state_dict: dict | None = None, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained`` for a model with sparsekit-quantized layers (bound on
    the model by :func:`guard_save_pretrained`): their int8/fp8 weights and scales have no
    place in the transformers format (the scales would be dropped, and ``from_pretrained``
    would read the raw 8-bit values), so it writes the dequantized weights, with a warning."""
    if state_dict is None:
        warnings.warn(
            "save_pretrained: this model has sparsekit-quantized layers, which the transformers "
            "format cannot hold; writing their dequantized weights (from_pretrained loads the "
            "same function). sk.save(model, path) keeps them quantized and compressed",
            UserWarning, stacklevel=2)
        state_dict = hf_state_dict(self)
    return type(self).save_pretrained(self, save_directory, *args, state_dict=state_dict,
                                      **kwargs)


def guard_save_pretrained(model: nn.Module) -> None:
    """After sparsekit quantized layers of transformers model ``model``: its
    ``save_pretrained`` becomes :func:`save_pretrained` (dequantized weights, a warning)
    instead of silently dropping the scales."""
    if is_hf_model(model) and "save_pretrained" not in vars(model):
        model.save_pretrained = types.MethodType(save_pretrained, model)


def export_pretrained(model: nn.Module, out_dir: str | os.PathLike,
                      tokenizer: Any = None, quiet: bool = False) -> Path:
    """Write ``out_dir`` so that the matching ``AutoModelFor*.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load it: config.json, model.safetensors (the pruned
    weights; quantized layers as their dequantized values) and the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress(quiet):
        model.save_pretrained(os.fspath(out), state_dict=hf_state_dict(model))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.fspath(out))
    follow_umask(out)
    return out


register_model("hf", hf, doc="a transformers model built from its config (random weights)")
