"""Importance scores for weights (higher = keep), and the calibration statistics they need.

- magnitude: ``|W|``.
- wanda (Sun et al. 2023): ``|W_ij| * ||X_j||_2``, where ``X_j`` is input feature ``j`` over all
  calibration tokens. For a conv, features are the unfolded ``(in, kh, kw)`` patch positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.prune.calibration import CalibrationFn, run_calibration
from sparsekit.prune.shards import ShardComm, all_reduce_dict
from sparsekit.errors import ConfigTypeError, ModelCallError, NumericsError, UsageError

CRITERIA = ("magnitude", "wanda", "sparsegpt")


def check_finite_weight(name: str, weight: torch.Tensor) -> None:
    """NumericsError naming layer ``name`` when its weight holds NaN or inf (no score can rank
    such weights, and a mask picked from them would be arbitrary)."""
    w = weight.detach()
    if w.is_floating_point() and not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise NumericsError(
            f"layer {name!r} has {bad} non-finite (NaN or inf) weight(s) of {w.numel()}: fix or "
            "exclude the layer before pruning it"
        )


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
        raise UsageError(
            f"input norm has {norm.shape[1]} features per group, weight has {w.shape[1]}"
        )
    rows = norm.repeat_interleave(w.shape[0] // groups, dim=0)
    return (w * rows).reshape(weight.shape)


def conv_pads(conv: nn.modules.conv._ConvNd) -> list[int]:
    """``F.pad`` widths (last spatial dimension first, left then right) equivalent to the
    conv's padding, ``padding='same'`` included (the extra pixel on the right, as PyTorch)."""
    pads: list[int] = []
    for d in reversed(range(len(conv.kernel_size))):
        if conv.padding == "valid":
            lo = hi = 0
        elif conv.padding == "same":
            total = conv.dilation[d] * (conv.kernel_size[d] - 1)
            lo, hi = total // 2, total - total // 2
        else:
            lo = hi = conv.padding[d]
        pads += [lo, hi]
    return pads


def conv_columns(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """The conv's input as GEMM rows: ``(groups, n_positions, in/groups * prod(kernel))``,
    ordered like ``conv.weight[g * out_g:(g + 1) * out_g].flatten(1)``, so that
    ``conv(x)`` (without bias) equals ``rows @ weight_g.T`` for each group ``g``."""
    nd = len(conv.kernel_size)
    if x.dim() == nd + 1:  # unbatched input
        x = x.unsqueeze(0)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv_pads(conv), mode=mode)
    return im2col(x, conv.kernel_size, conv.stride, conv.dilation, conv.groups)


def im2col(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int], groups: int = 1) -> torch.Tensor:
    """The one im2col of sparsekit (criteria, SparseGPT, quantized convs): an already padded
    batched input ``(B, C, *spatial)`` as ``(groups, B * positions, C/groups * prod(kernel))``,
    rows ordered by sample then output position (row-major), columns by channel then kernel
    position, as ``weight.flatten(1)``; any number of spatial dimensions."""
    nd = len(kernel_size)
    for d in range(nd):
        span = dilation[d] * (kernel_size[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])[..., :: dilation[d]]
    # x: (B, C, *out_positions, *kernel) -> (B * positions, C, *kernel)
    c = x.shape[1]
    x = x.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    x = x.reshape(-1, groups, c // groups * x.shape[-nd:].numel())
    return x.transpose(0, 1)


def gemm_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input as GEMM rows ``(tokens, in * prod(kernel))``: Linear treats every
    leading dimension as a token; a conv's rows are its unfolded patches (im2col, any padding
    mode, stride, dilation; for ``groups > 1`` the groups' features side by side)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        cols = conv_columns(module, x)  # (groups, tokens, in/groups * prod(kernel))
        return cols.transpose(0, 1).reshape(cols.shape[1], -1)
    raise ConfigTypeError(f"no GEMM form for {type(module).__name__}")


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

    def check_reached(self) -> None:
        """ValueError naming the layers no calibration batch reached."""
        missing = [n for n in self.modules if n not in self.sq]
        if missing:
            raise ModelCallError(
                f"calibration never reached layer(s) {missing}: the model did not call them on "
                "any calibration batch; exclude them or pass batches that use them"
            )

    def norms(self) -> dict[str, torch.Tensor]:
        """L2 norm of each input feature, float32, per module name. NumericsError naming the
        layer when its calibration inputs held NaN or inf."""
        self.check_reached()
        for name, sq in self.sq.items():
            if not bool(torch.isfinite(sq).all()):
                raise NumericsError(
                    f"the calibration inputs of layer {name!r} contain NaN or inf (or overflow): "
                    "Wanda cannot score its weights; check the calibration batches and the layers "
                    "before it"
                )
        return {n: s.sqrt().float() for n, s in self.sq.items()}


def collect_input_norms(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    calibration: Iterable[Any],
    calibration_fn: CalibrationFn | None = None,
    comm: ShardComm | None = None,
) -> dict[str, torch.Tensor]:
    """Run the calibration batches and return each module's input feature L2 norms.

    With ``comm`` (several ranks, see :mod:`sparsekit.prune.shards`) each rank runs its own share
    of the calibration data and the squared norms are summed over ranks before the square root,
    so every rank gets the norms of all ranks' data together."""
    with InputNormCollector(modules) as collector:
        run_calibration(model, calibration, calibration_fn)
    if comm is not None:
        collector.check_reached()  # raise before entering the collective, not inside it
        collector.sq = all_reduce_dict(collector.sq, comm)
    return collector.norms()
