"""GPTQ: int4 weights quantized column by column with second-order error compensation
(Frantar, Ashkboos, Hoefler & Alistarh 2022), optionally pruning N:M in the same sweep
(SparseGPT's Algorithm 1 with quantization, Frantar & Alistarh 2023).

For each layer, from the Hessian ``H = 2 X X^T / n`` of its calibration inputs ``X`` (collected
by SparseGPT's machinery, :func:`sparsekit.prune.sparsegpt.sparsegpt_prune`: layer by layer in
the order the model calls them, one transformer block's activations alive at a time, each
layer seeing the outputs of the layers already quantized before it), the sweep

1. dampens H (``percdamp * mean(diag H)`` on the diagonal; always-zero inputs get ``H_jj = 1``)
   and takes the upper Cholesky factor ``U`` of ``H^-1``;
2. walks the columns in blocks of ``blocksize`` (the "lazy batch" update: updates beyond the
   block are applied once per block); at the first column of each group of ``group_size``
   inputs it computes the group's scales from the *current* (already error-compensated)
   weights, ``max |w| / 7`` per output channel, as the GPTQ reference code does;
3. with an N:M ``pattern``, at every M-th column chooses the ``M - N`` weights of each row to
   prune in the next M columns by SparseGPT's saliency ``w^2 / U_jj^2``;
4. rounds the column (``clamp(round(w / s), -8, 7)``; pruned entries are 0) and spreads the
   rounding and pruning error over the later columns: ``W[:, j:] -= ((w_j - q_j) / U_jj)
   U[j, j:]``.

Weights that are exactly zero when the sweep starts (an already pruned model) stay zero: they
are treated as pruned, their compensated value moved onto the later columns like any pruning
error, so quantizing a finalized 2:4 model keeps its pattern.

``act_order`` processes columns in order of decreasing ``diag H`` (the GPTQ paper's "act-order"
heuristic); the group scales are then computed up front from the unquantized weight (the
reference's ``static_groups``), so every group stays a contiguous block of inputs and the
layer's storage does not change. It cannot be combined with an N:M pattern, whose groups must
stay consecutive columns.

>>> torch.manual_seed(0) and None
>>> net = nn.Sequential(nn.Linear(128, 16))
>>> layers, errors = gptq_quantize(net, {"0": net[0]}, "int4_weight", [torch.randn(64, 128)],
...                                GPTQ())
>>> q = layers["0"]
>>> q.weight.dtype, tuple(q.weight_scale.shape), int(q.weight.min()) >= -8, errors["0"] < 0.1
(torch.int8, (16, 1), True, True)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparsekit.errors import UsageError
from sparsekit.names import QUANT_METHODS as METHODS
from sparsekit.nn import shards
from sparsekit.nn.calibration import CalibrationFn
from sparsekit.prune.patterns import parse_pattern
from sparsekit.prune.sparsegpt import dead_inputs, inverse_cholesky, sparsegpt_prune
from sparsekit.quant.formats import Format, Scheme, get_scheme
from sparsekit.quant.modules import QuantLinear
from sparsekit.quant.numerics import absmax_scale, quantize


@dataclass(frozen=True)
class GPTQ:
    """GPTQ's settings (``quantize_(..., method=GPTQ(...))``; ``method="gptq"`` takes these
    defaults). ``blocksize``: columns per lazy-batch block; ``percdamp``: dampening, a fraction
    of ``mean(diag H)``; ``act_order``: columns in order of decreasing ``diag H``;
    ``pattern``: an ``"N:M"`` string to prune in the same sweep (joint SparseGPT + GPTQ), or
    None to quantize only."""

    blocksize: int = 128
    percdamp: float = 0.01
    act_order: bool = False
    pattern: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.blocksize, int) and self.blocksize > 0):
            raise UsageError(f"GPTQ blocksize must be a positive number of columns, got "
                             f"{self.blocksize!r}")
        if not (isinstance(self.percdamp, (int, float)) and self.percdamp > 0):
            raise UsageError(f"GPTQ percdamp must be > 0 (fraction of mean(diag H)), got "
                             f"{self.percdamp!r}")
        nm = self.nm
        if nm is not None and self.act_order:
            raise UsageError(f"GPTQ act_order=True cannot prune {self.pattern!r} in the same "
                             "sweep: N:M groups must stay consecutive columns")
        if nm is not None and self.blocksize % nm[1]:
            raise UsageError(f"GPTQ blocksize {self.blocksize} must be a multiple of M={nm[1]} "
                             f"for pattern {self.pattern!r}")

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(N, M)`` of ``pattern``, or None."""
        if self.pattern is None:
            return None
        nm = parse_pattern(self.pattern)
        if nm is None:
            raise UsageError(f"GPTQ pattern must be 'N:M' (for example '2:4') or None, got "
                             f"{self.pattern!r}")
        return nm


def as_method(method: str | GPTQ) -> GPTQ | None:
    """The GPTQ settings ``method`` names (None for round-to-nearest, ``"rtn"``)."""
    if isinstance(method, GPTQ):
        return method
    if method == "rtn":
        return None
    if method == "gptq":
        return GPTQ()
    raise UsageError(f"unknown quantization method {method!r}; allowed: "
                     f"{', '.join(map(repr, METHODS))} or a sparsekit.quant.GPTQ(...)")


@dataclass
class SweepResult:
    """One layer's GPTQ result: ``q`` int8 (rows, cols) in [qmin, qmax], ``scale`` float32
    (rows, cols // group_size), ``keep`` bool (rows, cols) (False where pruned), ``weight`` the
    dequantized float32 weight ``q * scale``, and ``rel_error`` the relative output error on the
    calibration inputs, ``sqrt(tr(D H D^T) / tr(W H W^T))`` with ``D = W - weight``."""

    q: torch.Tensor
    scale: torch.Tensor
    keep: torch.Tensor
    weight: torch.Tensor
    rel_error: float


@torch.no_grad()
def _dead_inputs(h: torch.Tensor, cols: int, group_size: int, nm: tuple[int, int] | None,
                 name: str) -> torch.Tensor:
    """The inputs no calibration batch reached (their Hessian diagonal set to 1, in place),
    after checking the layer's shape against the group size and N:M."""
    if group_size <= 0 or cols % group_size:
        raise UsageError(f"layer {name!r}: input dimension {cols} is not a multiple of the group "
                         f"size {group_size}")
    if nm is not None and cols % nm[1]:
        raise UsageError(f"layer {name!r}: input dimension {cols} is not a multiple of M={nm[1]}")
    return dead_inputs(h, name, "gptq")


def _prune_group(w1: torch.Tensor, d: torch.Tensor, dead: torch.Tensor, prune1: torch.Tensor,
                 i: int, nm: tuple[int, int]) -> None:
    """Mark in ``prune1`` (in place) the M - N columns of each row's group of M starting at
    block column ``i`` with the least OBS saliency w^2 / d^2 (zeros already: first)."""
    score = w1[:, i : i + nm[1]].square() / d[i : i + nm[1]].square()
    score[:, dead] = 0.0
    score[prune1[:, i : i + nm[1]]] = -1.0  # zeros already: pruned first
    idx = score.topk(nm[1] - nm[0], dim=1, largest=False).indices
    prune1[:, i : i + nm[1]].scatter_(1, idx, True)


def _group_scale(w: torch.Tensor, w1: torch.Tensor, err: torch.Tensor, u: torch.Tensor, i: int,
                 i1: int, i2: int, group_size: int, fmt: Format) -> torch.Tensor:
    """The scale of the group starting at column j = i1 + i, from its current weights: in this
    block (``w1``), and beyond it (``w`` with this block's pending updates from its first i
    columns)."""
    j = i1 + i
    cur = w1[:, i : i + group_size]
    if j + group_size > i2:
        beyond = w[:, i2 : j + group_size] - err[:, :i] @ u[i1:j, i2 : j + group_size]
        cur = torch.cat([cur, beyond], dim=1)
    return absmax_scale(cur.abs().amax(dim=1), fmt)


def _rel_error(original: torch.Tensor, new: torch.Tensor, h: torch.Tensor) -> float:
    """sqrt(tr(D H D^T) / tr(W H W^T)), D = W - W_new: the relative output error."""
    diff = original - new
    ref = float((original @ h * original).sum())
    return (max(float((diff @ h * diff).sum()), 0.0) / ref) ** 0.5 if ref > 0 else 0.0


def gptq_sweep(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: Format,
    group_size: int,
    method: GPTQ | None = None,
    name: str = "weight",
) -> SweepResult:
    """Quantize one ``(rows, cols)`` weight given its ``(cols, cols)`` Hessian (see the module
    docstring), pruning ``method.pattern`` in the same sweep when set. ``group_size`` divides
    ``cols`` (``cols``: one scale per row)."""
    method = method or GPTQ()
    nm = method.nm
    w, h = weight.detach().float().clone(), hessian.detach().float().clone()
    rows, cols = w.shape
    dead = _dead_inputs(h, cols, group_size, nm, name)
    original, h_error = w.clone(), hessian.detach().float()
    fixed = w == 0  # already pruned: stays zero
    groups = cols // group_size
    scale = torch.zeros(rows, groups, dtype=torch.float32, device=w.device)
    perm = None
    if method.act_order:
        # static groups: scales from the unquantized weight, each group contiguous in storage
        scale = absmax_scale(w.abs().reshape(rows, groups, group_size).amax(dim=2), fmt)
        perm = torch.argsort(h.diagonal(), descending=True)
        w, h, dead, fixed = w[:, perm], h[perm][:, perm], dead[perm], fixed[:, perm]
    group_of = (perm if perm is not None else torch.arange(cols, device=w.device)) // group_size
    u = inverse_cholesky(h, method.percdamp, name, "gptq")
    del h
    q = torch.zeros(rows, cols, dtype=fmt.dtype, device=w.device)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=w.device)
    for i1 in range(0, cols, method.blocksize):
        i2 = min(i1 + method.blocksize, cols)
        w1, u1, prune1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2], fixed[:, i1:i2].clone()
        d, err = u1.diagonal(), torch.zeros_like(w1)
        for i in range(i2 - i1):
            j = i1 + i
            if nm is not None and i % nm[1] == 0:
                _prune_group(w1, d, dead[j : j + nm[1]], prune1, i, nm)
            if perm is None and j % group_size == 0:
                scale[:, j // group_size] = _group_scale(w, w1, err, u, i, i1, i2, group_size,
                                                         fmt)
            s = scale[:, group_of[j]]
            col = w1[:, i]
            qi = quantize(col, s, fmt)
            qi[prune1[:, i]] = 0
            deq = qi.float() * s
            e = (col - deq) / d[i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            w1[:, i] = deq
            err[:, i] = e
            q[:, j] = qi
        w[:, i1:i2] = w1
        keep[:, i1:i2] = ~prune1
        w[:, i2:] -= err @ u[i1:i2, i2:]
    if perm is not None:
        inverse = torch.argsort(perm)
        q, keep = q[:, inverse], keep[:, inverse]
    new = q.float() * scale.repeat_interleave(group_size, dim=1)
    return SweepResult(q, scale, keep, new, _rel_error(original, new, h_error))


def gptq_quantize(
    model: nn.Module,
    modules: dict[str, nn.Linear],
    scheme: str | Scheme | dict[str, str | Scheme],
    calibration: Iterable[Any],
    method: GPTQ,
    calibration_fn: CalibrationFn | None = None,
) -> tuple[dict[str, QuantLinear], dict[str, float]]:
    """GPTQ-quantize ``modules`` (qualified name -> Linear of ``model``) with the grouped
    (int4) ``scheme`` (or one per layer: name -> scheme), layer by layer on the
    ``calibration`` batches; returns the quantized
    layers, leaving the swap to the caller, and each one's relative output error on its
    calibration inputs (:class:`SweepResult`, without the bias). The
    float layers are overwritten with their dequantized (and, with ``method.pattern``, pruned)
    weights as the sweep goes, so later layers calibrate on the quantized model's outputs.
    Under torchrun every Hessian is averaged over all ranks."""
    schemes = {name: get_scheme(scheme[name] if isinstance(scheme, dict) else scheme)
               for name in modules}
    for s in schemes.values():
        if not s.grouped:
            raise UsageError(f"method='gptq' quantizes int4 weights (int4_weight, "
                             f"int4_weight_g64, ..., int4_weight_channel), not {s.name!r}")
    for name, m in modules.items():
        if not isinstance(m, nn.Linear):
            raise UsageError(f"gptq: layer {name!r} is a {type(m).__name__}; GPTQ takes Linear "
                             "layers")
    results: dict[str, SweepResult] = {}

    def solver(name: str, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        own = schemes[name]
        r = gptq_sweep(w, h, own.weight, own.layer_group_size(w.shape[1]), method, name)
        results[name] = r
        return r.weight, r.keep

    sparsegpt_prune(model, dict(modules), dict.fromkeys(modules, 0.0), None, calibration,
                    calibration_fn, method.blocksize, method.percdamp, shards.comm(),
                    solver=solver)
    layers = {name: QuantLinear.from_quantized(modules[name], schemes[name], r.q, r.scale)
              for name, r in results.items()}
    return layers, {name: r.rel_error for name, r in results.items()}
