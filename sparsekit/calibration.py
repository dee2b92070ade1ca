"""Running calibration batches through a model (Wanda, SparseGPT, quantization)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

CalibrationFn = Callable[[nn.Module, Any], Any]


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def call_model(model: nn.Module, batch: Any, calibration_fn: CalibrationFn | None = None) -> Any:
    """Feed one calibration batch: a tensor as ``model(x)``, a tuple/list as ``model(*b)``, a
    dict as ``model(**b)``; ``calibration_fn(model, batch)`` overrides all of these."""
    if calibration_fn is not None:
        return calibration_fn(model, batch)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    batch = _to_device(batch, device)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    raise TypeError(
        f"calibration batch of type {type(batch).__name__} is not a tensor, tuple, list or dict; "
        "pass calibration_fn=lambda model, batch: ... to feed it"
    )


@torch.no_grad()
@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; its training flag restored afterwards, also on
    an exception."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def run_calibration(
    model: nn.Module,
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None = None,
) -> int:
    """Run every batch through ``model`` in eval mode without gradients; restores the training
    flag afterwards. Returns the number of batches. Raises ValueError when there are none."""
    if calibration is None:
        raise ValueError("calibration is required for this criterion: pass an iterable of batches")
    n = 0
    with eval_mode(model):
        for batch in calibration:
            call_model(model, batch, calibration_fn)
            n += 1
    if n == 0:
        raise ValueError("calibration yielded no batches")
    return n
