"""Text the user may not have: token sequences sampled from the dense teacher itself.

Calibration (Wanda, SparseGPT, ALPS, GPTQ) and distillation need inputs that look like what the
model will see. When the user's text is scarce, or of one domain only, the dense causal LM can
write its own: :func:`teacher_samples` starts every sequence at the start token (BOS), samples
the first ``first_tokens`` tokens from the teacher's full distribution (variety: each sequence
picks its own topic, as LLM-QAT's data-free generation does), and the rest at ``temperature``
within the nucleus of mass ``top_p`` (Holtzman et al. 2020), in batches over the model's KV
cache. An end-of-text token does not stop a sequence: the teacher goes on to a new document,
as documents are joined in the text path's token stream (:mod:`sparsekit.data.hf_text`).

Samples are reproducible: one ``torch.Generator`` on the model's device, seeded with ``seed``,
draws every token, batch after batch. With ``cache_dir`` they are kept as a safetensors file
keyed by a hash of the model's weights and config, the seed and every setting (the device type
and dtype too: they change the numbers).

:class:`TeacherWindows` makes ``[n, seq_len + 1]`` samples the ``(input, next-token target)``
windows of the text path; :class:`MixedWindows` interleaves them with the user's windows at a
fixed fraction; :func:`mix_bundle` does both for a run's training and calibration sets, never
for its held-out evaluation set.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import warnings
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from sparsekit.data.bundle import DataBundle
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.io.files import atomic_write
from sparsekit.progress import progress

VERSION = 1
Progress = Callable[[int, int], None]


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` (..., V) with every token outside the nucleus set to -inf: the nucleus is the
    smallest set of most probable tokens whose probability reaches ``top_p`` (a token is kept
    while the mass of the more probable ones is below ``top_p``; the most probable always).

    >>> top_p_filter(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 0.8).isinf().tolist()
    [False, False, True, True]
    """
    if top_p >= 1:
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.float().softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
    drop = (before >= top_p).scatter(-1, order, before >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): the argmax at ``temperature`` 0, else a draw
    from ``softmax(logits / temperature)`` restricted to the ``top_p`` nucleus. Returns (B,)
    int64 on the logits' device."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = top_p_filter(logits.float() / temperature, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def start_token(model: nn.Module, start: int | None = None) -> int:
    """The token every sample starts from: ``start``, else the model's BOS token id (its
    config's, then its generation config's), else its EOS (GPT-2 style models mark document
    starts with it); ValueError naming ``start=`` when the model has neither."""
    if start is not None:
        return int(start)
    for holder in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        for attr in ("bos_token_id", "eos_token_id"):
            tid = getattr(holder, attr, None)
            if isinstance(tid, (list, tuple)):
                tid = tid[0] if tid else None
            if tid is not None:
                return int(tid)
    raise UsageError("teacher samples: the model's config names no bos_token_id or "
                     "eos_token_id; pass start= (the token id every sample starts from)")


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 of what decides a model's outputs: every state_dict tensor (name, dtype, shape,
    bytes) and its config (without the path it was loaded from)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        spec = {k: v for k, v in config.to_dict().items()
                if k not in ("_name_or_path", "transformers_version")}
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters(), None)
    if p is None:
        raise ConfigTypeError("teacher samples: the model has no parameters")
    return p.device, p.dtype


def _check_length(model: nn.Module, seq_len: int) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UsageError(f"teacher samples: seq_len={seq_len} is longer than the model's "
                         f"max_position_embeddings={limit}")


def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its KV cache by: ``cache`` (transformers >= 5.2x,
    which deprecates the old name) or ``past_key_values``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _forward(model: nn.Module, ids: torch.Tensor, past: Any,
             name: str) -> tuple[torch.Tensor, Any]:
    """The next-token logits (B, V) after ``ids`` and the updated KV cache (passed and
    returned as ``name``)."""
    try:
        out = model(input_ids=ids, use_cache=True, **{name: past})
    except TypeError as e:
        raise ConfigTypeError(
            f"teacher samples need a causal LM whose forward takes input_ids, {name} and "
            f"use_cache (a transformers *ForCausalLM); {type(model).__name__}: {e}") from e
    logits, cache = getattr(out, "logits", None), getattr(out, name, None)
    if not isinstance(logits, torch.Tensor) or cache is None:
        raise ConfigTypeError(f"teacher samples: {type(model).__name__} returned no logits and "
                              f"{name} (a transformers *ForCausalLM does)")
    return logits[:, -1], cache


@torch.no_grad()
def sample_batch(model: nn.Module, rows: int, seq_len: int, start: int, *, temperature: float,
                 top_p: float, first_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` sequences of ``seq_len`` tokens (the start token, then ``seq_len - 1`` sampled
    over the KV cache), int64 on the model's device (see the module docstring)."""
    device, _ = _device_dtype(model)
    ids = torch.full((rows, 1), start, dtype=torch.long, device=device)
    out, name = [ids], cache_argument(model)
    logits, past = _forward(model, ids, None, name)
    for t in range(1, seq_len):
        free = t <= first_tokens  # the first tokens: the full distribution, for variety
        nxt = next_tokens(logits, 1.0 if free else temperature, 1.0 if free else top_p,
                          generator)[:, None]
        out.append(nxt)
        if t < seq_len - 1:
            logits, past = _forward(model, nxt, past, name)
    return torch.cat(out, dim=1)


def _settings(n: int, seq_len: int, seed: int, temperature: float, top_p: float,
              first_tokens: int, batch_size: int) -> dict[str, Any]:
    """The arguments checked (ValueError naming the one out of range), as a dict."""
    checks = (("n", n, n >= 1, ">= 1"), ("seq_len", seq_len, seq_len >= 2, ">= 2"),
              ("seed", seed, 0 <= seed < 2**63, "in [0, 2**63)"),
              ("temperature", temperature, 0 <= temperature <= 100, "in [0, 100]"),
              ("top_p", top_p, 0 < top_p <= 1, "in (0, 1]"),
              ("first_tokens", first_tokens, 0 <= first_tokens, ">= 0"),
              ("batch_size", batch_size, batch_size >= 1, ">= 1"))
    for name, value, ok, allowed in checks:
        integer = name not in ("temperature", "top_p")
        if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
                or not ok or value != value):
            raise UsageError(f"teacher samples: {name}={value!r} must be "
                             f"{'an integer' if integer else 'a number'} {allowed}")
    return {"n": n, "seq_len": seq_len, "seed": seed, "temperature": float(temperature),
            "top_p": float(top_p), "first_tokens": first_tokens, "batch_size": batch_size}


def cache_path(model: nn.Module, settings: dict[str, Any],
               cache_dir: str | os.PathLike) -> Path:
    """Where the samples of ``model`` under ``settings`` are cached in ``cache_dir``."""
    device, dtype = _device_dtype(model)
    key = {"model": model_fingerprint(model), "device": device.type, "dtype": str(dtype),
           "torch": torch.__version__.split("+")[0], "v": VERSION, **settings}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"teacher_samples_{digest}.safetensors"


def _read_cached(path: Path, n: int, seq_len: int) -> torch.Tensor | None:
    """The cached samples, or None (with a warning when the file is damaged or of another
    shape: it is then rewritten)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        tokens = load_file(os.fspath(path))["tokens"]
    except (SafetensorError, KeyError, OSError) as e:
        warnings.warn(f"teacher samples cache {path} is unreadable ({e}); sampling again",
                      stacklevel=3)
        return None
    if tokens.dtype != torch.long or tuple(tokens.shape) != (n, seq_len):
        warnings.warn(f"teacher samples cache {path} holds {tuple(tokens.shape)} "
                      f"{tokens.dtype}, not ({n}, {seq_len}) int64; sampling again", stacklevel=3)
        return None
    return tokens


def teacher_samples(
    model: nn.Module,
    n: int,
    seq_len: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
    first_tokens: int = 0,
    batch_size: int = 16,
    start: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    on_progress: Progress | None = None,
) -> torch.Tensor:
    """``n`` token sequences of ``seq_len`` tokens written by the causal LM ``model`` (a
    transformers ``*ForCausalLM``, on any device): int64 (n, seq_len) on the CPU, each row the
    start token (``start``, default the model's BOS) followed by ``seq_len - 1`` sampled tokens.
    The first ``first_tokens`` are drawn from the full distribution, the rest from
    ``softmax(logits / temperature)`` within the ``top_p`` nucleus (``temperature=0``: greedy).
    ``batch_size`` sequences are sampled at a time over the model's KV cache, in eval mode
    (restored after); ``on_progress(done, n)`` is called after each batch. The same model,
    arguments and device give the same tensor. ``cache_dir``: kept there as safetensors and
    read back on the next call (see the module docstring)."""
    settings = _settings(n, seq_len, seed, temperature, top_p, first_tokens, batch_size)
    start = start_token(model, start)
    _check_length(model, seq_len)
    path = None if cache_dir is None else cache_path(model, settings, cache_dir)
    if path is not None and (cached := _read_cached(path, n, seq_len)) is not None:
        if on_progress is not None:
            on_progress(n, n)
        return cached
    device, _ = _device_dtype(model)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        parts, done = [], 0
        while done < n:
            rows = min(batch_size, n - done)
            parts.append(sample_batch(model, rows, seq_len, start, temperature=temperature,
                                      top_p=top_p, first_tokens=first_tokens,
                                      generator=generator).cpu())
            done += rows
            if on_progress is not None:
                on_progress(done, n)
    finally:
        model.train(was_training)
    tokens = torch.cat(parts)
    if path is not None:
        _write_cache(path, tokens, settings)
    return tokens


def _write_cache(path: Path, tokens: torch.Tensor, settings: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    meta = {"settings": json.dumps(settings, sort_keys=True), "format": "sparsekit-teacher",
            "v": str(VERSION)}
    atomic_write(path, lambda tmp: save_file({"tokens": tokens.contiguous()}, tmp, metadata=meta))


class TeacherWindows(Dataset):
    """``(tokens[i, :-1], tokens[i, 1:])``: (n, seq_len + 1) samples as the text path's
    next-token windows of ``seq_len``."""

    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(f"teacher windows need (n, seq_len + 1) tokens, got "
                             f"{tuple(tokens.shape)}")
        self.tokens = tokens.long()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]


class MixedWindows(Dataset):
    """The user's windows and the teacher's, interleaved at fraction ``mix`` of teacher ones:
    item ``i`` is a teacher window when ``floor((i + 1) * mix) > floor(i * mix)``, so every
    prefix of ``k`` items holds exactly ``floor(k * mix)`` of them (calibration reads a prefix;
    training shuffles whole epochs). Each side is taken in order and cycled: the length is the
    least that shows every window of both at least once.

    >>> [w[0].item() for w in MixedWindows(TeacherWindows(torch.zeros(2, 2)),
    ...                                     TeacherWindows(torch.ones(3, 2)), 0.25)]
    [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    """

    def __init__(self, user: Dataset, teacher: Dataset, mix: float) -> None:
        if not 0 < mix < 1:
            raise ValueError(f"mix={mix!r} must be in (0, 1) (0: the user's windows alone, "
                             "1: the teacher's alone)")
        if len(user) == 0 or len(teacher) == 0:
            raise ValueError("mixing needs at least one window on each side")
        self.user, self.teacher, self.mix = user, teacher, mix
        # exact arithmetic: the fraction a float mix stands for (0.1 is 1/10, not 0.1000...01)
        self._ratio = Fraction(mix).limit_denominator(10**6)
        self.length = max(math.ceil(len(teacher) / self._ratio),
                          math.ceil(len(user) / (1 - self._ratio)))

    def _teachers_before(self, i: int) -> int:
        """How many of items ``0 .. i - 1`` are teacher windows: ``floor(i * mix)``."""
        return i * self._ratio.numerator // self._ratio.denominator

    def is_teacher(self, i: int) -> bool:
        return self._teachers_before(i + 1) > self._teachers_before(i)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.length:
            raise IndexError(i)
        t = self._teachers_before(i)
        if self.is_teacher(i):
            return self.teacher[t % len(self.teacher)]
        return self.user[(i - t) % len(self.user)]


def mix_bundle(text: DataBundle | None, tokens: torch.Tensor, mix: float,
               eval_set: Dataset | None = None) -> DataBundle:
    """A run's data with teacher samples ``tokens`` (n, seq_len + 1): training and calibration
    sets that are teacher windows alone (``mix`` 1) or :class:`MixedWindows` with ``text``'s;
    the evaluation set is ``eval_set``, else ``text``'s held-out part: never teacher text."""
    teacher = TeacherWindows(tokens)
    if eval_set is None:
        if text is None:
            raise UsageError("teacher samples leave nothing to evaluate on: give data.path or "
                             "data.eval_path (held-out text)")
        eval_set = text.eval
    if mix >= 1:
        train, calibration = teacher, teacher
    else:
        if text is None:
            raise UsageError(f"data.teacher_mix={mix:g} mixes the teacher's samples with text: "
                             "give data.path, or set data.teacher_mix=1 (data-free)")
        train = MixedWindows(text.train, teacher, mix)
        own = text.train if text.calibration is None else text.calibration
        calibration = MixedWindows(own, teacher, mix)
    info = dict(text.info) if text is not None else {"seq_len": tokens.shape[1] - 1}
    info["teacher"] = {"samples": len(tokens), "mix": mix}
    return DataBundle(train=train, eval=eval_set, calibration=calibration, info=info)


def progress_callback(n: int, quiet: bool = False) -> Progress:
    """An ``on_progress`` for ``n`` samples that draws sparsekit's progress
    (:func:`sparsekit.progress.progress`: a bar on a terminal, else lines on the ``sparsekit``
    logger); nothing when ``quiet``."""
    ticks = iter(progress(range(n), quiet, desc="teacher samples", total=n))
    seen = 0

    def tick(done: int, total: int) -> None:
        nonlocal seen
        for _ in range(done - seen + (done >= total)):  # one more at the end closes the bar
            next(ticks, None)
        seen = done

    return tick
