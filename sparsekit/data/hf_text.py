"""Local text (.txt / .jsonl) tokenized with a Hugging Face tokenizer into fixed-length windows.

``path`` is a file, a directory (every .txt and .jsonl below it) or a glob; files are read in
sorted order. A .txt file is one document; a .jsonl file holds one JSON object per line whose
``text_field`` (default ``"text"``) is a document. Documents are tokenized without special
tokens and joined with the tokenizer's end-of-text token (EOS, else SEP) between them: one token
stream.

Splitting, without overlap: the *stream* is cut by position into three contiguous parts before
any windowing: training (the first ``1 - calibration_fraction - eval_fraction``), then
calibration, then held-out evaluation (the last ``eval_fraction``). Each part is cut into
non-overlapping windows of ``seq_len + 1`` tokens (inputs ``[i, i + seq_len)``, next-token
targets ``[i + 1, i + seq_len + 1)``), so no token of one part is ever an input or a target in
another. For a masked LM (``task="masked_lm"``) an item is the window with ``mlm_probability``
of its positions (at least one; fixed per window, so evaluation is deterministic) replaced by the
mask token, and targets that are the original tokens there and -100 (ignored) elsewhere.

:func:`held_out_text` windows all of another text (``data.eval_path``) for evaluation instead
of the held-out part.

The token stream is cached under ``cache_dir`` by a SHA-256 of the files' bytes, the
tokenizer's serialized form and ``text_field``; ``seq_len`` and the split fractions are not part
of the key because windows are views of the cached stream.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from sparsekit.data.bundle import DataBundle
from sparsekit.data.text import ByteWindows
from sparsekit.errors import FileFormatError, UsageError
from sparsekit.io.files import atomic_write

SUFFIXES = (".txt", ".jsonl")
VERSION = 1


def text_files(path: str | os.PathLike, option: str = "data.path") -> list[Path]:
    """The .txt/.jsonl files ``path`` names (a file, a directory searched recursively, or a
    glob), sorted; a one-line :class:`UsageError` naming ``option`` when there are none."""
    text = os.fspath(path)
    p = Path(text).expanduser()
    if any(c in text for c in "*?["):
        files = [Path(f) for f in glob.glob(os.path.expanduser(text), recursive=True)]
    elif p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file()]
    elif p.is_file():
        if p.suffix not in SUFFIXES:
            raise UsageError(f"{option}={text!r}: not a .txt or .jsonl file")
        return [p]
    else:
        raise UsageError(f"{option}={text!r}: no such file or directory")
    files = sorted(f for f in files if f.suffix in SUFFIXES and f.is_file())
    if not files:
        raise UsageError(f"{option}={text!r} matches no .txt or .jsonl file")
    return files


def read_documents(path: Path, text_field: str = "text") -> list[str]:
    """The documents of one file (see the module docstring)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FileFormatError(f"data.path: cannot read {path} as UTF-8 text: {e}") from None
    if path.suffix != ".jsonl":
        return [raw]
    docs = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise FileFormatError(f"data.path: {path}:{lineno} is not JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise FileFormatError(
                f"data.path: {path}:{lineno} has no string field {text_field!r} "
                "(set data.kwargs.text_field)")
        docs.append(obj[text_field])
    return docs


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the token ids: the serialized fast tokenizer (its
    vocabulary, merges, normalizer) or, for a slow one, its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(
        sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _separator(tokenizer: Any) -> int | None:
    for attr in ("eos_token_id", "sep_token_id"):
        tid = getattr(tokenizer, attr, None)
        if tid is not None:
            return int(tid)
    return None


def token_stream(files: list[Path], tokenizer: Any, cache_dir: str | os.PathLike,
                 text_field: str = "text") -> torch.Tensor:
    """All documents tokenized and joined (int64, 1-D), cached by content hash."""
    h = hashlib.sha256()
    for f in files:
        h.update(hashlib.sha256(f.read_bytes()).digest())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    h.update(json.dumps({"text_field": text_field, "v": VERSION}).encode())
    path = Path(cache_dir) / f"text_tokens_{h.hexdigest()[:24]}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    sep = _separator(tokenizer)
    ids: list[int] = []
    for f in files:
        for doc in read_documents(f, text_field):
            if not doc.strip():
                continue
            if ids and sep is not None:
                ids.append(sep)
            # a whole document at once (cut into data.seq_len windows later): longer than the
            # model's maximum is expected, so no "Token indices sequence length" warning
            ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
    arr = np.asarray(ids, dtype=np.int32)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            np.save(fh, arr)

    atomic_write(path, write)
    return torch.from_numpy(arr.astype(np.int64))


class MaskedWindows(Dataset):
    """Masked-LM windows: ``(input with masked positions, targets)`` as described above."""

    def __init__(self, data: torch.Tensor, seq_len: int, mask_id: int, probability: float,
                 seed: int) -> None:
        self.windows = ByteWindows(data, seq_len)
        self.mask_id, self.probability, self.seed = mask_id, probability, seed

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.windows[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        chosen = torch.rand(x.shape, generator=g) < self.probability
        chosen[int(torch.randint(len(x), (1,), generator=g))] = True
        target = torch.where(chosen, x, torch.full_like(x, -100))
        return torch.where(chosen, torch.full_like(x, self.mask_id), x), target


def held_out_text(
    path: str | os.PathLike,
    tokenizer: Any,
    seq_len: int,
    cache_dir: str | os.PathLike,
    task: str = "causal_lm",
    text_field: str = "text",
    mlm_probability: float = 0.15,
    seed: int = 0,
) -> Dataset:
    """All of the text in ``path`` (``data.eval_path``) as held-out evaluation windows of a
    ``causal_lm`` (or ``feature_extraction``) model, masked windows of a ``masked_lm`` one; a
    one-line error naming ``data.eval_path`` when it is missing or shorter than one window."""
    files = text_files(path, "data.eval_path")
    stream = token_stream(files, tokenizer, cache_dir, text_field)
    if len(stream) < seq_len + 1:
        raise UsageError(f"data.eval_path={os.fspath(path)!r} is too short: {len(stream)} tokens, "
                         f"less than one window of data.seq_len+1={seq_len + 1}")
    if task == "masked_lm":
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise UsageError("model.task=masked_lm needs a tokenizer with a mask token")
        return MaskedWindows(stream, seq_len, int(mask_id), mlm_probability, seed + 2)
    return ByteWindows(stream, seq_len)


def text_data(
    path: str | os.PathLike,
    tokenizer: Any,
    seq_len: int,
    cache_dir: str | os.PathLike,
    task: str = "causal_lm",
    eval_fraction: float = 0.1,
    calibration_fraction: float = 0.05,
    text_field: str = "text",
    mlm_probability: float = 0.15,
    seed: int = 0,
):
    """A :class:`~sparsekit.data.bundle.DataBundle` (train, eval, calibration) of the text in
    ``path`` for a ``causal_lm`` or ``masked_lm`` model, or a ``feature_extraction`` one (an
    encoder: the windows are its unlabeled inputs, the targets unused, since it learns from
    and is evaluated against the dense model's embeddings); one-line errors for missing,
    empty or too short text."""
    if task not in ("causal_lm", "masked_lm", "feature_extraction"):
        raise UsageError(f"data=text needs model.task=causal_lm or masked_lm (perplexity) or "
                         f"feature_extraction (embedding agreement), not {task!r}")
    for key, v in (("eval_fraction", eval_fraction),
                   ("calibration_fraction", calibration_fraction)):
        if not 0 < v < 1:
            raise UsageError(f"data.kwargs.{key}={v!r} must be in (0, 1)")
    if eval_fraction + calibration_fraction >= 1:
        raise UsageError("data.kwargs.eval_fraction + calibration_fraction must be < 1")
    files = text_files(path)
    stream = token_stream(files, tokenizer, cache_dir, text_field)
    n = len(stream)
    if n == 0:
        raise UsageError(f"data.path={os.fspath(path)!r} holds no text")
    a = int(n * (1 - calibration_fraction - eval_fraction))
    b = int(n * (1 - eval_fraction))
    parts = {"training": stream[:a], "calibration": stream[a:b], "evaluation": stream[b:]}
    for name, part in parts.items():
        if len(part) < seq_len + 1:
            need = int((seq_len + 1) / min(eval_fraction, calibration_fraction,
                                           1 - eval_fraction - calibration_fraction)) + 1
            raise UsageError(
                f"data.path={os.fspath(path)!r} is too short: {n} tokens leave the {name} part "
                f"{len(part)} tokens, less than one window of data.seq_len+1={seq_len + 1}; "
                f"give at least ~{need} tokens or lower data.seq_len")
    if task == "masked_lm":
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise UsageError("model.task=masked_lm needs a tokenizer with a mask token")
        made = {k: MaskedWindows(v, seq_len, int(mask_id), mlm_probability, seed + i)
                for i, (k, v) in enumerate(parts.items())}
    else:
        made = {k: ByteWindows(v, seq_len) for k, v in parts.items()}
    return DataBundle(
        train=made["training"], eval=made["evaluation"], calibration=made["calibration"],
        info={"vocab_size": len(tokenizer), "seq_len": seq_len, "tokens": n,
              "files": len(files), "split_tokens": {k: len(v) for k, v in parts.items()}},
    )
