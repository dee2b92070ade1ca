"""Portable compressed checkpoints: ``save`` / ``load`` through one safetensors file.

The file holds tensors and one JSON metadata entry (key ``"sparsekit"``)::

    {"format": "sparsekit", "version": 1,
     "model": {"builder": NAME, "kwargs": {...}} | null,  # registered builder to rebuild it
     "channels": plan | null,      # sparsekit.prune.channels.channel_plan(model), applied first
     "quant": plan | null,         # sparsekit.quant.quant_plan(model), applied before load
     "sparse": {key: {"shape": [...]}},   # tensors stored as 2:4 kept values + metadata
     "bitmask": {key: {"shape": [...]}},  # tensors stored as non-zeros + a 1-bit mask
     "aliases": {key: canonical_key}}     # tied tensors stored once

A tensor whose rows (``shape[0]`` by the rest, flattened, as for N:M masks) have at most two
non-zeros in every group of four along the last axis is stored as ``key::values`` (the two kept
entries of each group, shape ``(rows, cols // 2)``, original dtype) and ``key::meta24`` (uint8:
each group's code 0..5 names which two of its four positions are kept, and three codes share a
byte as ``c0 + 6 c1 + 36 c2``). That is 0.54x the dense bytes for bf16 weights and 0.29x for
int8/float8 weights (before the small per-channel scales). Other sparse tensors (unstructured
pruning) are stored as ``key::nonzeros`` (the non-zero entries in order) and ``key::bitmask``
(one bit per entry, numpy.packbits little-endian) when that is smaller than dense: 90% sparse
fp32 weights take 0.13x. Nothing is pickled and nothing is imported: loading reads tensors
and JSON only, and the model is rebuilt by the builder ``model`` names in the registry
(:func:`sparsekit.register_model`) or passed as a freshly built ``model`` to :func:`load`.

>>> import tempfile, os, torch
>>> lin = torch.nn.Linear(8, 2, bias=False)
>>> with torch.no_grad():
...     _ = lin.weight.copy_(torch.tensor([[1., 0, 2, 0, 0, 3, 0, 4], [0, 0, 5, 6, 7, 0, 0, 8]]))
>>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
>>> save(lin, path)
>>> back = load(path, model=torch.nn.Linear(8, 2, bias=False))
>>> torch.equal(back.weight, lin.weight)
True
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import parametrize

from sparsekit.checks import check_module
from sparsekit.io.files import atomic_write
from sparsekit.errors import (
    ConfigTypeError,
    FileFormatError,
    UnsafeFileError,
    UsageError,
    file_errors,
)
from sparsekit.io.zeros import COMPRESSIBLE, is_2to4, mask_from_zeros
from sparsekit.registry import Registry

FORMAT = "sparsekit"
VERSION = 1
_META_KEY = "sparsekit"
_VALUES = "::values"
_META24 = "::meta24"
_NONZEROS = "::nonzeros"
_BITMASK = "::bitmask"
# the six ways to keep two of four positions, in code order 0..5
_PAIRS = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
_CODE = torch.full((4, 4), -1, dtype=torch.uint8)
_CODE[_PAIRS[:, 0], _PAIRS[:, 1]] = torch.arange(6, dtype=torch.uint8)
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as raw integers of its item size, shape (shape[0], rest): packing moves bits
    only, so it is exact for every dtype (float8 included)."""
    return t.contiguous().view(_RAW[t.element_size()]).reshape(t.shape[0], -1)


def pack_2to4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 2:4 tensor into (values (rows, cols/2), same dtype; meta (ceil(groups/3),) uint8).
    Groups with fewer than two non-zeros keep their lowest-index zeros."""
    if not is_2to4(t):
        raise ValueError(f"tensor of shape {tuple(t.shape)} does not hold a 2:4 pattern")
    raw = _rows(t.detach().cpu())
    rows, cols = raw.shape
    groups = raw.reshape(rows, cols // 4, 4)
    nz = t.detach().cpu().reshape(rows, cols // 4, 4).float().ne(0)
    # non-zeros first, then lower positions: a deterministic choice of exactly two per group
    score = nz.to(torch.int8) * 8 + torch.arange(3, -1, -1, dtype=torch.int8)
    idx = score.topk(2, dim=-1).indices.sort(dim=-1).values
    values = groups.gather(-1, idx).reshape(rows, cols // 2).view(t.dtype)
    codes = _CODE[idx[..., 0], idx[..., 1]].flatten()
    codes = torch.cat([codes, codes.new_zeros(-codes.numel() % 3)])
    meta = codes[0::3] + 6 * codes[1::3] + 36 * codes[2::3]  # at most 215: fits a byte
    return values.contiguous(), meta


def unpack_2to4(values: torch.Tensor, meta: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`pack_2to4`: the dense tensor of ``shape`` with zeros restored."""
    rows = shape[0]
    cols = values.shape[1] * 2
    ngroups = rows * cols // 4
    m = meta.long()
    codes = torch.stack([m % 6, m // 6 % 6, m // 36], dim=1).flatten()[:ngroups]
    if codes.numel() != ngroups or bool(meta.gt(215).any()):
        raise ValueError(f"corrupt 2:4 metadata for a tensor of shape {shape}")
    idx = _PAIRS[codes].reshape(rows, cols // 4, 2)
    raw_vals = values.contiguous().view(_RAW[values.element_size()]).reshape(rows, cols // 4, 2)
    dense = raw_vals.new_zeros(rows, cols // 4, 4).scatter_(-1, idx, raw_vals)
    return dense.reshape(shape).view(values.dtype).reshape(shape)


def pack_bitmask(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(non-zero entries in row-major order, same dtype; packed 1-bit mask, uint8)."""
    raw = t.detach().cpu().contiguous().reshape(-1)
    nz = mask_from_zeros(raw)
    bits = np.packbits(nz.numpy(), bitorder="little")
    return raw[nz].clone(), torch.from_numpy(bits)


def unpack_bitmask(nonzeros: torch.Tensor, bits: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`pack_bitmask`."""
    numel = int(np.prod(shape)) if shape else 1
    mask = torch.from_numpy(
        np.unpackbits(bits.numpy(), count=numel, bitorder="little").astype(bool)
    )
    if int(mask.sum()) != nonzeros.numel():
        raise ValueError(f"corrupt bitmask for a tensor of shape {shape}")
    raw = nonzeros.view(_RAW[nonzeros.element_size()])
    dense = raw.new_zeros(numel)
    dense[mask] = raw
    return dense.view(nonzeros.dtype).reshape(shape)


def _bitmask_pays(t: torch.Tensor) -> bool:
    """Non-zeros plus one bit per entry take less than 0.9x of the dense bytes."""
    if t.dtype not in COMPRESSIBLE or t.numel() < 64:
        return False
    nnz = int(mask_from_zeros(t).sum())
    return nnz * t.element_size() + t.numel() / 8 < 0.9 * t.numel() * t.element_size()


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with masks folded: a parametrized tensor (sparsekit's masks) is
    stored under its plain key (``fc.weight``) with its effective, masked value."""
    sd = dict(model.state_dict())
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        prefix = f"{name}." if name else ""
        for pname in list(module.parametrizations.keys()):
            drop = f"{prefix}parametrizations.{pname}."
            for k in [k for k in sd if k.startswith(drop)]:
                del sd[k]
            sd[f"{prefix}{pname}"] = getattr(module, pname).detach()
    return sd


# Structure a model carries beyond what its builder makes: pruned channel widths, quantized
# layers. The layer that owns it (sparsekit.prune.channels, sparsekit.quant) registers how to
# describe it (``plan(model)``, JSON data) and how to rebuild it on a fresh model
# (``apply(model, plan)``), so storage imports nothing above it. Rebuilt in this order.
SECTIONS = ("channels", "quant")
_OWNERS = {"channels": "sparsekit.prune.channels", "quant": "sparsekit.quant"}
_Check = Callable[[nn.Module, Any, str], None]
_PLANS: Registry[tuple[Callable[[nn.Module], Any], Callable[[nn.Module, Any], Any],
                       _Check | None]] = Registry("checkpoint section")
# ``load(accelerate=...)`` hands the loaded model to sparsekit.accel, which registers itself
_ACCELERATE: list[Callable[..., nn.Module]] = []


def register_plan(section: str, plan: Callable[[nn.Module], Any],
                  apply: Callable[[nn.Module, Any], Any], check: _Check | None = None) -> None:
    """Store ``plan(model)`` under ``section`` in every file :func:`save` writes, and call
    ``apply(model, plan)`` on the fresh model before :func:`load` reads the weights;
    ``check(model, plan, path)`` after it read them: the loaded values against their format
    (a :class:`~sparsekit.errors.FileFormatError` naming the tensor)."""
    if section not in SECTIONS:
        raise UsageError(f"checkpoint section {section!r} is not one of {SECTIONS}")
    _PLANS.register(section, (plan, apply, check))


def register_accelerator(accelerate: Callable[..., nn.Module]) -> None:
    """The function ``load(accelerate=kwargs)`` calls as ``accelerate(model, **kwargs)``."""
    _ACCELERATE[:] = [accelerate]


def _plan(section: str, model: nn.Module) -> Any:
    """The registered plan of ``model`` for ``section``; None when nothing is registered or
    the plan is empty (nothing to rebuild)."""
    if section not in _PLANS:
        return None
    return _PLANS[section][0](model) or None


def _handler(section: str, path: str | os.PathLike) -> Callable[[nn.Module, Any], Any]:
    if section not in _PLANS:
        raise FileFormatError(
            f"{path} holds a {section} plan and nothing is registered to rebuild it: load it "
            f"with sparsekit.load, or import {_OWNERS[section]} first"
        )
    return _PLANS[section][1]


def _check_save_args(model: Any, path: Any) -> None:
    check_module(model, where="sk.save: ")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigTypeError(f"sk.save: path must be a file path (str or os.PathLike), got "
                              f"{type(path).__name__} {path!r:.60}")
    if getattr(model, "_sparsekit_accelerated", False):
        raise ValueError(
            "sk.save got an accelerated model (its GPU kernels' weights are not portable): "
            "save the model before sk.accelerate, and pass accelerate=... to sk.load"
        )


def save(model: nn.Module, path: str | os.PathLike, *, compress: bool = True) -> None:
    """Write ``model`` to ``path`` (one safetensors file, written atomically).

    When ``compress`` is true, tensors holding a 2:4 pattern are stored as kept values plus
    2.7-bit group codes, and other sparse tensors as non-zeros plus a 1-bit mask where
    smaller. The rebuild spec ``model._sparsekit_spec`` (set by sparsekit's model builders)
    and the channel / quantization plans are stored in the JSON metadata."""
    _check_save_args(model, path)
    sd = plain_state_dict(model)
    tensors: dict[str, torch.Tensor] = {}
    sparse: dict[str, dict] = {}
    bitmask: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entry {key!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.device.type == "meta":
            raise UsageError(f"sk.save: state_dict entry {key!r} is on the meta device (no "
                             "values to save): load or materialize the model's weights first")
        if t.numel():
            ident = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
            )
            if ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
        t = t.cpu()
        if compress and is_2to4(t):
            values, meta = pack_2to4(t)
            tensors[key + _VALUES] = values
            tensors[key + _META24] = meta
            sparse[key] = {"shape": list(t.shape)}
        elif compress and _bitmask_pays(t):
            tensors[key + _NONZEROS], tensors[key + _BITMASK] = pack_bitmask(t)
            bitmask[key] = {"shape": list(t.shape)}
        else:
            tensors[key] = t.contiguous().clone()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": getattr(model, "_sparsekit_spec", None),
        **{section: _plan(section, model) for section in SECTIONS},
        "sparse": sparse,
        "bitmask": bitmask,
        "aliases": aliases,
    }
    meta = {_META_KEY: json.dumps(header)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def _read_safetensors(path: str | os.PathLike, tensors: bool) -> tuple[dict, dict]:
    """(metadata, tensors if ``tensors``) of a safetensors file; a truncated or corrupt file
    raises :class:`~sparsekit.errors.FileFormatError` naming it."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            raw = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # SafetensorError, OSError (EINVAL on a truncated mmap), ...
        raise FileFormatError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None
    return meta, raw


def is_sparsekit_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file with sparsekit's metadata (False: a plain
    safetensors file); FileFormatError when it is no readable safetensors file at all."""
    meta, _ = _read_safetensors(path, tensors=False)
    return _META_KEY in meta


@file_errors
def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of a sparsekit checkpoint; FileFormatError for any other file."""
    meta, _ = _read_safetensors(path, tensors=False)
    if _META_KEY not in meta:
        raise FileFormatError(
            f"{path} is not a sparsekit checkpoint (no {_META_KEY!r} metadata)"
        )
    try:
        header = json.loads(meta[_META_KEY])
    except ValueError as e:
        raise FileFormatError(f"{path}: its {_META_KEY!r} metadata is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: its {_META_KEY!r} metadata is not a JSON object")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise FileFormatError(
            f"{path}: unsupported checkpoint format {header.get('format')!r} "
            f"version {header.get('version')!r}; this sparsekit reads {FORMAT!r} {VERSION}"
        )
    return header


@file_errors
def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The dense state dict stored in ``path`` (2:4 tensors expanded, zeros restored)."""
    header = read_header(path)
    _, raw = _read_safetensors(path, tensors=True)
    sd: dict[str, torch.Tensor] = {}
    for key, info in header["sparse"].items():
        sd[key] = unpack_2to4(raw.pop(key + _VALUES), raw.pop(key + _META24), info["shape"])
    for key, info in header.get("bitmask", {}).items():
        sd[key] = unpack_bitmask(raw.pop(key + _NONZEROS), raw.pop(key + _BITMASK), info["shape"])
    sd.update(raw)
    for key, target in header["aliases"].items():
        if key in sd or target not in sd:  # a tie names one stored tensor, for a key not stored
            raise FileFormatError(f"{path}: corrupt header, alias {key!r} -> {target!r}")
        sd[key] = sd[target]
    return sd


# old headers (``{"_target_": ..., **kwargs}``): only these exact targets, each mapped onto
# its registered builder (None: the kwargs pass as they are)
_OLD_TARGETS = {
    "sparsekit.models.cnn1d.mnist1d_cnn": "mnist1d_cnn",
    "sparsekit.models.lm.tiny_lm": "tiny_lm",
    "torchvision.models.get_model": "torchvision",
}


def model_from_spec(spec: Any, path: str | os.PathLike = "<spec>") -> nn.Module:
    """Build the model a checkpoint header names: ``{"builder": NAME, "kwargs": {...}}`` with
    ``NAME`` registered in :mod:`sparsekit.models.registry`. Nothing is imported by name: a
    header naming anything else raises :class:`~sparsekit.errors.UnsafeFileError` (the old
    ``{"_target_": ...}`` form is read for sparsekit's own built-in targets only)."""
    from sparsekit.models.registry import build_registered, registered_models

    if not isinstance(spec, dict):
        raise FileFormatError(f"{path}: model spec must be a JSON object, got {spec!r}")
    if "_target_" in spec:
        target = spec["_target_"]
        if not isinstance(target, str) or target not in _OLD_TARGETS:
            raise UnsafeFileError(
                f"{path}: the model spec names {target!r}, which sparsekit never imports from "
                "a file; build the model yourself and pass model=..., or register its builder "
                "with sparsekit.register_model"
            )
        spec = {"builder": _OLD_TARGETS[target],
                "kwargs": {k: v for k, v in spec.items() if k != "_target_"}}
    name, kwargs = spec.get("builder"), spec.get("kwargs", {})
    if set(spec) - {"builder", "kwargs"} or not isinstance(name, str):
        raise FileFormatError(
            f"{path}: model spec must be {{'builder': NAME, 'kwargs': {{...}}}}, got {spec!r}"
        )
    if name not in registered_models():
        raise UnsafeFileError(
            f"{path}: the model spec names builder {name!r}, which is not registered "
            f"(registered: {', '.join(registered_models())}); register it in code with "
            "sparsekit.register_model, or pass model=..."
        )
    try:
        return build_registered(name, kwargs)
    except (UsageError, ConfigTypeError) as e:
        raise FileFormatError(f"{path}: cannot build its model: {e}") from None


def _check_load_args(path: Any, model: Any, device: Any, strict: Any, accelerate: Any
                     ) -> torch.device:
    """sk.load's arguments, checked before the file is read (so that a mistake in them is not
    reported as a bad file); returns ``device`` as a torch.device."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigTypeError(f"sk.load: path must be a file path, got {type(path).__name__}")
    if os.path.isdir(path):
        raise UsageError(
            f"sk.load({os.fspath(path)!r}): that is a directory; sk.load reads the one file "
            "sk.save wrote (model.safetensors). For a transformers directory use "
            "sparsekit.models.hf.load_pretrained(DIR) (or AutoModelFor*.from_pretrained)"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigTypeError(
            f"sk.load: model must be a freshly built nn.Module of the checkpoint's architecture "
            f"(or None to rebuild it from the file), got {type(model).__name__} {model!r:.60}"
        )
    if not isinstance(strict, bool):
        raise ConfigTypeError(f"sk.load: strict must be True or False, got {strict!r}")
    if accelerate is not None and not isinstance(accelerate, dict):
        raise ConfigTypeError(
            f"sk.load: accelerate must be a dict of sk.accelerate arguments or None, got "
            f"{type(accelerate).__name__}")
    if not isinstance(device, (str, torch.device)):
        raise ConfigTypeError(f"sk.load: device must be a string such as 'cpu' or 'cuda:0', "
                              f"or a torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"sk.load: device={device!r} is not a torch device; use 'cpu', "
                         "'cuda', 'cuda:0', ...") from None


def load(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    *,
    device: str | torch.device = "cpu",
    strict: bool = True,
    accelerate: dict[str, Any] | None = None,
) -> nn.Module:
    """Read a checkpoint written by :func:`save` into ``model`` (a freshly built module of the
    same architecture) or, when ``model`` is None, into one rebuilt from the stored spec.

    Parameters take the stored dtypes. ``accelerate``: keyword arguments for
    :func:`sparsekit.accel.accelerate` (``example_inputs`` included); on a machine with CUDA the
    loaded model goes straight to the accelerated form, without CUDA the dense masked model is
    returned (with a warning). A stored spec builds the model only through the registry
    (:func:`sparsekit.register_model`); loading never imports code named by the file.
    The arguments are checked before the file is read (a ConfigTypeError or UsageError naming
    the argument)."""
    device = _check_load_args(path, model, device, strict, accelerate)
    return _load(path, model, device, strict, accelerate)


@file_errors
def _load(path: str | os.PathLike, model: nn.Module | None, device: torch.device, strict: bool,
          accelerate: dict[str, Any] | None) -> nn.Module:
    header = read_header(path)
    if model is None:
        if header["model"] is None:
            raise ValueError(
                f"{path} stores no model spec (the model had no _sparsekit_spec): pass "
                "model=<a freshly built module of the same architecture> to sk.load"
            )
        model = model_from_spec(header["model"], path)
    for section in SECTIONS:
        if header.get(section):
            _handler(section, path)(model, header[section])
    sd = load_state_dict(path)
    current = model.state_dict(keep_vars=True)
    for key, t in sd.items():
        if key in current and current[key].shape != t.shape:
            raise FileFormatError(f"{path}: {key} has shape {list(t.shape)}; the model's "
                                  f"{key} has shape {list(current[key].shape)}")
        # take the stored dtype (e.g. bf16) in place, so tied parameters stay tied
        if key in current and current[key].dtype != t.dtype:
            current[key].data = current[key].data.to(t.dtype)
    model.load_state_dict(sd, strict=strict)
    for section in SECTIONS:
        check = _PLANS[section][2] if header.get(section) and section in _PLANS else None
        if check is not None:
            check(model, header[section], os.fspath(path))
    model.to(device)
    if accelerate is not None:
        if not torch.cuda.is_available():
            warnings.warn(
                "sk.load(accelerate=...): no CUDA device, returning the dense model", stacklevel=2
            )
            return model
        if not _ACCELERATE:
            raise UsageError("sk.load(accelerate=...) needs sparsekit.accel: call sparsekit.load, "
                             "or import sparsekit.accel first")
        return _ACCELERATE[0](model.cuda(), **accelerate)
    return model
