"""Importance scores for weights (higher = keep), and the calibration statistics they need.

- magnitude: ``|W|``.
- wanda (Sun et al. 2023): ``|W_ij| * ||X_j||_2``, where ``X_j`` is input feature ``j`` over all
  calibration tokens. For a conv, features are the unfolded ``(in, kh, kw)`` patch positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.calibration import CalibrationFn, run_calibration
from sparsekit.distributed import ShardComm, all_reduce_dict

CRITERIA = ("magnitude", "wanda", "sparsegpt")


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    """``|W|`` in float32, the weight's shape."""
    return weight.detach().abs().float()


def wanda(weight: torch.Tensor, input_norm: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Wanda score ``|W_ij| * ||X_j||_2`` with the weight's shape.

    ``input_norm`` holds the L2 norm of each GEMM input feature, length ``in * prod(kernel)``
    (for a grouped conv, of all groups: the feature block of group ``g`` serves output rows
    ``g * out/groups ... (g+1) * out/groups - 1``).
    """
    w = weight.detach().abs().float().reshape(weight.shape[0], -1)
    norm = input_norm.float().reshape(groups, -1)
    if norm.shape[1] != w.shape[1]:
        raise ValueError(
            f"input norm has {norm.shape[1]} features per group, weight has {w.shape[1]}"
        )
    rows = norm.repeat_interleave(w.shape[0] // groups, dim=0)
    return (w * rows).reshape(weight.shape)


def _same_padding(module: nn.Module) -> tuple[int, ...]:
    pad = module.padding
    if pad == "valid":
        return (0,) * len(module.kernel_size)
    if pad == "same":
        return tuple(d * (k - 1) // 2 for k, d in zip(module.kernel_size, module.dilation))
    return tuple(pad)


def gemm_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input as GEMM rows ``(tokens, in * prod(kernel))``.

    Linear: every leading dimension is a token. Conv1d/2d: unfolded patches (as im2col).
    Conv3d has no unfold in torch: each channel's features repeat over the kernel positions
    (the same per-channel norm for every tap), an approximation documented here.
    """
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        two_d = isinstance(module, nn.Conv2d)
        x4 = x if two_d else x.unsqueeze(-2)
        k = module.kernel_size if two_d else (1, module.kernel_size[0])
        d = module.dilation if two_d else (1, module.dilation[0])
        p = _same_padding(module) if two_d else (0, _same_padding(module)[0])
        s = module.stride if two_d else (1, module.stride[0])
        cols = F.unfold(x4, k, dilation=d, padding=p, stride=s)  # (B, C*kh*kw, L)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    if isinstance(module, nn.Conv3d):
        taps = int(torch.tensor(module.kernel_size).prod())
        per_channel = x.transpose(0, 1).reshape(x.shape[1], -1).t()  # (tokens, C)
        return per_channel.repeat_interleave(taps, dim=1)
    raise TypeError(f"no GEMM form for {type(module).__name__}")


class InputNormCollector:
    """Forward hooks that accumulate the squared L2 norm of every GEMM input feature.

    Use as a context manager; hooks are removed on exit, even on error.
    """

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = dict(modules)
        self.sq: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> InputNormCollector:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            cols = gemm_inputs(module, args[0].detach())
            sq = cols.double().pow(2).sum(0)
            self.sq[name] = self.sq[name] + sq if name in self.sq else sq

        return hook

    def norms(self) -> dict[str, torch.Tensor]:
        """L2 norm of each input feature, float32, per module name."""
        missing = [n for n in self.modules if n not in self.sq]
        if missing:
            raise ValueError(f"calibration never reached layer(s) {missing}")
        return {n: s.sqrt().float() for n, s in self.sq.items()}


def collect_input_norms(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None = None,
    comm: ShardComm | None = None,
) -> dict[str, torch.Tensor]:
    """Run the calibration batches and return each module's input feature L2 norms.

    With ``comm`` (several ranks, see :mod:`sparsekit.distributed`) each rank runs its own share
    of the calibration data and the squared norms are summed over ranks before the square root,
    so every rank gets the norms of all ranks' data together."""
    with InputNormCollector(modules) as collector:
        run_calibration(model, calibration, calibration_fn)
    if comm is not None:
        collector.norms()  # raise for a layer never reached before entering the collective
        collector.sq = all_reduce_dict(collector.sq, comm)
    return collector.norms()
