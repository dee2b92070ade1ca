"""What both training loops (the command line's ``fit`` and ``distill_``) share per step: the
arithmetic they run in, how many tokens a batch holds, and the peak memory they report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sparsekit.errors import UsageError

PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str) -> None:
    """UsageError unless ``precision`` is one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise UsageError(f"precision={precision!r} is not allowed; choose one of: "
                         f"{', '.join(PRECISIONS)}")


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """bf16 autocast on ``device`` for ``precision="bf16"`` (off for fp32: weights and
    optimizer stay float32 either way); resets the CUDA peak-memory counter that
    :func:`peak_memory_gb` reads, so the peak is the loop's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak CUDA memory allocated since :func:`autocast` (GiB); None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def batch_tokens(batch: Any) -> int:
    """Tokens (a 2-D integer tensor's or ``input_ids``' elements) or samples of a batch.

    >>> batch_tokens(torch.zeros(4, 16, dtype=torch.long)), batch_tokens(torch.zeros(4, 3))
    (64, 4)
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else (
        batch[0] if isinstance(batch, (tuple, list)) and batch else batch)
    if isinstance(ids, torch.Tensor):
        return ids.numel() if not ids.dtype.is_floating_point else ids.shape[0]
    return 1
