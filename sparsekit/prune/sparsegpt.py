"""SparseGPT: one-shot pruning with OBS weight reconstruction (Frantar & Alistarh 2023).

For each selected layer, in the order the model calls them, the solver

1. collects the layer's Hessian ``H = 2 X X^T / n`` from its calibration inputs ``X``
   (``(in, n)`` in GEMM form: a Linear's rows of features; a conv's unfolded patches), as a
   running average over batches, through a forward pre-hook on the *partly pruned* model, so a
   layer sees the outputs of the layers already pruned before it;
2. dampens it (``percdamp * mean(diag H)`` added to the diagonal; inputs that are always zero
   get ``H_jj = 1``), and takes the upper Cholesky factor ``U`` of ``H^-1``;
3. walks the columns in blocks of ``blocksize``: at the start of a block it chooses the weights
   to prune by the OBS saliency ``w^2 / U_jj^2`` (unstructured: the block's share of the layer's
   exact budget; N:M: the ``M - N`` lowest of every group of ``M`` columns), then prunes column
   by column, spreading each pruned weight's error over the not yet processed columns of the
   same row (``W[:, j:] -= (w_j / U_jj) U[j, j:]``); updates outside the block are applied once
   per block (the "lazy batch" update).

When the layers sit in a transformer's repeated blocks (an ``nn.ModuleList`` of one block
class, found by :func:`find_blocks`), those passes run block by block instead of through the
whole model: every block's inputs are recorded in one pass, each block is solved from its own
inputs and then run once to give the next block its inputs (same weights as whole-model passes,
one block's activations alive at a time; a Llama block costs five partial block passes instead
of four whole-model passes).

Only one layer's Hessian is alive at a time (layers that receive the very same input tensor
share one, and one calibration pass). Everything runs in float32; weights are written back in
their own dtype. Conv layers of any dimension, padding mode and group count are supported: the
inputs are unfolded into patches matching the weight flattened as ``(out, in/groups * kernel)``,
with one Hessian per group.

``solver`` (of :func:`sparsegpt_prune`) replaces the per-layer column sweep while keeping the
calibration machinery above: GPTQ (:mod:`sparsekit.quant.gptq`) passes its quantizing sweep
(with or without N:M pruning in the same pass) through it.
"""

from __future__ import annotations

import warnings

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sparsekit.nn.calibration import (
    CalibrationFn,
    check_calibration,
    conv_columns,
    eval_mode,
    run_calibration,
)
from sparsekit.errors import ConfigTypeError, NumericsError, UsageError
from sparsekit.nn.select import check_finite_weight
from sparsekit.prune.masks import original_weight
from sparsekit.nn.shards import ShardComm
from sparsekit.progress import progress
from sparsekit.prune.patterns import prune_count
from sparsekit.prune.reconstruct import Reconstruct, reconstruct_block

__all__ = ["SparseGPT", "conv_columns", "hessian_spec", "obs_prune", "sparsegpt_prune"]

# A per-layer column sweep replacing obs_prune (joint GPTQ): (layer name, weight (rows, cols)
# float32, Hessian (cols, cols) float32) -> (new float32 weight, bool keep-mask), both (rows, cols).
LayerSolver = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# A criterion's one-shot solver (ALPS): (weight (rows, cols) float32, Hessian (cols, cols),
#  level or None, nm or None, budget offset, layer name) -> (new weight, keep-mask)
MatrixSolver = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def reduce_hessian(h: torch.Tensor, n: int, c: ShardComm | None) -> tuple[torch.Tensor, int]:
    """Combine SparseGPT Hessians averaged over ``n`` input rows on each rank into the average
    over all ranks' rows: ``H = sum_r n_r H_r / sum_r n_r``. Returns ``(H, total rows)``;
    identity when ``c`` is None. ``h`` is ``(groups, cols, cols)`` float32."""
    if c is None:
        return h, n
    weighted = c.all_reduce_sum(h.double() * n)
    total = int(c.all_reduce_sum(torch.tensor([n], dtype=torch.int64)).item())
    if total == 0:
        raise ValueError("sparsegpt: no calibration rows on any rank")
    return (weighted / total).to(h.dtype), total


def hessian_spec(module: nn.Module) -> tuple:
    """What determines a layer's Hessian from its input: layers with equal specs that receive
    the same input tensor have the same Hessian."""
    if isinstance(module, nn.Linear):
        return ("linear", module.in_features)
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        return (
            "conv",
            module.in_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            module.padding_mode,
        )
    raise ConfigTypeError(
        f"sparsegpt supports nn.Linear and nn.Conv1d/2d/3d, not {type(module).__name__}"
    )


def _input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(groups, n, columns)`` float32 GEMM rows of one call's input."""
    x = x.detach().float()
    if isinstance(module, nn.Linear):
        return x.reshape(1, -1, x.shape[-1])
    return conv_columns(module, x)


class _Collected(Exception):
    """Raised by a Hessian hook to skip the rest of a block's forward pass."""


class _Hessian:
    """Running average of ``2 X X^T`` over all inputs seen: ``(groups, cols, cols)`` float32."""

    def __init__(self) -> None:
        self.h: torch.Tensor | None = None
        self.n = 0

    def add(self, rows: torch.Tensor) -> None:
        k = rows.shape[1]
        if k == 0:
            return
        if self.h is None:
            g, _, c = rows.shape
            self.h = torch.zeros(g, c, c, dtype=torch.float32, device=rows.device)
        # rescale the old average before adding, so H never holds a large un-normalised sum
        self.h *= self.n / (self.n + k)
        self.n += k
        rows = rows * (2.0 / self.n) ** 0.5
        self.h += rows.transpose(1, 2) @ rows

    def hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: add the call's input."""
        self.add(_input_rows(module, args[0] if args else kwargs["input"]))

    def hook_then_stop(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """:meth:`hook`, then stop the forward pass: the rest of it cannot change H."""
        self.hook(module, args, kwargs)
        raise _Collected


def dead_inputs(h: torch.Tensor, name: str, who: str = "sparsegpt") -> torch.Tensor:
    """The inputs no calibration batch reached (diag H = 0), their diagonal set to 1 in place
    so that H can be inverted; UsageError (from ``who``) when no input was ever nonzero."""
    dead = h.diagonal() == 0
    if bool(dead.all()):
        raise UsageError(f"{who}: layer {name!r} saw only zero inputs during calibration; "
                         "exclude it")
    h[dead, dead] = 1.0
    return dead


def inverse_cholesky(h: torch.Tensor, percdamp: float, name: str,
                     who: str = "sparsegpt") -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1``, damp = ``percdamp * mean(diag H)``; retries
    with 10x the damping (up to 4 times) when float32 round-off leaves the dampened H not
    positive definite (UsageError from ``who`` after that)."""
    damp = percdamp * float(h.diagonal().mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if int(info) == 0:
                return upper
        damp *= 10.0
    raise UsageError(f"{who}: the Hessian of layer {name!r} is not positive definite even with "
                     f"damping {damp:.3g}; raise percdamp")


def obs_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    budget_offset: int = 0,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune one ``(rows, cols)`` weight matrix given its ``(cols, cols)`` Hessian.

    Unstructured: prunes exactly ``prune_count(rows * cols, sparsity)`` weights, split over the
    column blocks in proportion to their size (``budget_offset`` shifts the split for matrices
    that are parts of a larger tensor, e.g. conv groups). N:M: keeps ``N`` of every ``M``
    consecutive columns in each row. Returns ``(new_weight, keep_mask)``: float32 weights with
    zeros where pruned, and a bool mask (True = kept), both ``(rows, cols)``.
    """
    if (sparsity is None) == (nm is None):
        raise UsageError(f"layer {name!r}: give exactly one of sparsity (unstructured) or nm")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    rows, cols = w.shape
    if nm is not None:
        _check_nm_shape(nm, cols, blocksize, name)
    dead = dead_inputs(h, name)
    u = inverse_cholesky(h, percdamp, name)
    del h

    keep = torch.ones_like(w, dtype=torch.bool)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        prune1 = torch.zeros_like(w1, dtype=torch.bool)
        if nm is None:
            k = prune_count(budget_offset + rows * i2, sparsity) - prune_count(
                budget_offset + rows * i1, sparsity
            )
            _choose_in_block(prune1, w1, u1.diagonal(), dead[i1:i2], k)
        err = _sweep_block(w1, u1, prune1, dead[i1:i2], nm)
        w[:, i1:i2] = w1
        keep[:, i1:i2] = ~prune1
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return w, keep


def _check_nm_shape(nm: tuple[int, int], cols: int, blocksize: int, name: str) -> None:
    """UsageError unless the ``cols`` inputs and the blocks of ``blocksize`` split into
    groups of M."""
    m = nm[1]
    if cols % m:
        raise UsageError(f"layer {name!r}: input dimension {cols} is not a multiple of M={m}")
    if blocksize % m:
        raise UsageError(f"blocksize {blocksize} must be a multiple of M={m} for N:M")


def _choose_in_block(prune1: torch.Tensor, w1: torch.Tensor, d: torch.Tensor,
                     dead1: torch.Tensor, k: int) -> None:
    """Unstructured: mark in ``prune1`` the ``k`` weights of the block ``w1`` with the lowest
    OBS saliency ``w^2 / d^2`` (``d``: the diagonal of the block's Cholesky factor)."""
    score = w1.square() / d.square()
    score[:, dead1] = 0.0  # always-zero inputs: pruning them costs nothing
    if k:
        idx = score.reshape(-1).topk(k, largest=False).indices
        prune1.view(-1)[idx] = True


def _sweep_block(w1: torch.Tensor, u1: torch.Tensor, prune1: torch.Tensor,
                 dead1: torch.Tensor, nm: tuple[int, int] | None) -> torch.Tensor:
    """Prune the block ``w1`` column by column in place (``prune1`` marks the weights; N:M
    marks each group of M columns as it reaches it), spreading each pruned weight's error over
    the block's later columns; returns the scaled errors ``(rows, block)`` for the columns
    after the block."""
    d = u1.diagonal()
    err = torch.zeros_like(w1)
    for i in range(w1.shape[1]):
        if nm is not None and i % nm[1] == 0:
            score = w1[:, i : i + nm[1]].square() / d[i : i + nm[1]].square()
            score[:, dead1[i : i + nm[1]]] = 0.0
            idx = score.topk(nm[1] - nm[0], dim=1, largest=False).indices
            prune1[:, i : i + nm[1]].scatter_(1, idx, True)
        col = w1[:, i]
        e = torch.where(prune1[:, i], col, torch.zeros_like(col)) / d[i]
        w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
        w1[:, i] = torch.where(prune1[:, i], torch.zeros_like(col), w1[:, i])
        err[:, i] = e
    return err


def _solve_layer(
    name: str,
    module: nn.Module,
    hess: _Hessian,
    sparsity: float | None,
    nm: tuple[int, int] | None,
    blocksize: int,
    percdamp: float,
    solver: LayerSolver | None = None,
    layer_solver: MatrixSolver | None = None,
) -> torch.Tensor:
    """Prune ``module`` in place from its accumulated Hessian (with ``solver`` instead of
    :func:`obs_prune` when given); returns its keep-mask."""
    if hess.h is None:
        raise UsageError(f"sparsegpt: layer {name!r} received only empty inputs; exclude it")
    if not bool(torch.isfinite(hess.h).all()):
        raise NumericsError(
            f"sparsegpt: the calibration inputs of layer {name!r} contain NaN or inf; check the "
            "calibration batches and the layers before it"
        )
    weight = module.weight.detach()
    groups = hess.h.shape[0]
    w2 = weight.reshape(weight.shape[0], -1).float()
    rows_g = w2.shape[0] // groups
    new, keep = torch.empty_like(w2), torch.empty_like(w2, dtype=torch.bool)
    for g in range(groups):
        sl = slice(g * rows_g, (g + 1) * rows_g)
        if solver is not None:
            if groups != 1:
                raise UsageError(f"layer {name!r}: a custom solver takes ungrouped layers only")
            new[sl], keep[sl] = solver(name, w2[sl], hess.h[g])
            continue
        if layer_solver is not None:
            new[sl], keep[sl] = layer_solver(w2[sl], hess.h[g], sparsity, nm,
                                             g * rows_g * w2.shape[1], name)
            continue
        new[sl], keep[sl] = obs_prune(
            w2[sl],
            hess.h[g],
            sparsity,
            nm,
            blocksize,
            percdamp,
            budget_offset=g * rows_g * w2.shape[1],
            name=name,
        )
    with torch.no_grad():
        target = original_weight(module)
        target.copy_(new.reshape(weight.shape).to(target.dtype))
    return keep.reshape(weight.shape)


def _call_order(
    model: nn.Module,
    modules: dict[str, nn.Module],
    batch: Any,
    calibration_fn: CalibrationFn | None,
) -> list[list[str]]:
    """Groups of layer names in the order the model first calls them on ``batch``; layers that
    receive the very same input tensor(s) with the same Hessian spec form one group (their
    Hessians are equal, and pruning one cannot change the other's input)."""
    calls: dict[str, list[torch.Tensor]] = {}

    def hook(name: str) -> Callable:
        def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls.setdefault(name, []).append(args[0] if args else kwargs["input"])

        return record

    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    try:
        run_calibration(model, [batch], calibration_fn)
    finally:
        for handle in handles:
            handle.remove()
    never = [n for n in modules if n not in calls]
    if never:
        raise UsageError(
            f"sparsegpt: layers {never} were never called by the model during calibration (for "
            "example nn.MultiheadAttention.out_proj, whose weight is used functionally); "
            "exclude them"
        )
    groups: list[list[str]] = []
    for name in calls:  # dicts keep insertion order = first-call order
        if groups:
            prev = groups[-1][0]
            same_input = len(calls[prev]) == len(calls[name]) and all(
                a is b for a, b in zip(calls[prev], calls[name])
            )
            if same_input and hessian_spec(modules[prev]) == hessian_spec(modules[name]):
                groups[-1].append(name)
                continue
        groups.append([name])
    return groups


def sparsegpt_prune(
    model: nn.Module,
    modules: dict[str, nn.Module],
    sparsity: dict[str, float | None],
    nm: tuple[int, int] | None,
    calibration: Iterable,
    calibration_fn: CalibrationFn | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    comm: ShardComm | None = None,
    solver: LayerSolver | None = None,
    sequential: bool = True,
    layer_solver: MatrixSolver | None = None,
    refit: Reconstruct | None = None,
) -> dict[str, torch.Tensor]:
    """Prune ``modules`` (qualified name -> Linear/Conv layer of ``model``) one shot with
    SparseGPT, in place, in the order the model calls them.

    ``sparsity[name]`` is the layer's unstructured target in [0, 1) (exactly
    ``prune_count(numel, sparsity)`` weights are pruned); with ``nm=(N, M)`` every group of ``M``
    consecutive inputs keeps ``N`` weights and ``sparsity`` is ignored. ``calibration`` is an
    iterable of model inputs, fed as :func:`sparsekit.nn.calibration.call_model` does (or through
    ``calibration_fn(model, batch)``); it is read into a list and replayed once per layer group.
    Each layer's weight is overwritten with the OBS-compensated weights (zeros where pruned).
    Returns bool keep-masks (True = kept) of each weight's shape. With ``comm`` (data-parallel
    ranks, each calibrating on its own batches; see :func:`sparsekit.nn.shards.comm`) every
    Hessian is averaged over all ranks' inputs, so every rank computes the same weights.
    ``solver(name, weight, hessian)`` replaces :func:`obs_prune` for every layer (Linear and
    ungrouped convs; ``sparsity`` and ``nm`` are then checked here but applied by the solver).

    ``blocksize``: columns per lazy-update block (a multiple of M for N:M); ``percdamp``: the
    Hessian damping, a fraction of ``mean(diag H)``. ``sequential`` (default): each layer's
    Hessian comes from the model with the layers before it already pruned, so it compensates
    their error; False: every Hessian comes from the dense model. ``layer_solver`` replaces
    :func:`obs_prune` for each weight matrix (another one-shot method on the same Hessians,
    e.g. :func:`sparsekit.prune.alps.admm_prune`); ``refit``: block reconstruction
    (:mod:`sparsekit.prune.reconstruct`).

    >>> torch.manual_seed(0) and None
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> masks = sparsegpt_prune(net, {"0": net[0], "2": net[2]}, {"0": 0.5, "2": 0.5}, None,
    ...                         [torch.randn(16, 8)])
    >>> [int(m.sum()) for m in masks.values()], int((net[2].weight == 0).sum())
    ([32, 16], 16)
    """
    if not modules:
        return {}
    batches = _checked_batches(modules, sparsity, nm, calibration, blocksize, percdamp)
    masks: dict[str, torch.Tensor] = {}
    refit = refit if refit is not None and refit.steps > 0 else None
    solve = (blocksize, percdamp, comm, solver, sequential, layer_solver, refit)
    order = _call_order(model, modules, batches[0], calibration_fn)
    run = (sparsity, nm, batches, calibration_fn, solve, masks)
    if not _prune_through_blocks(model, modules, order, run):
        if refit is not None:
            warnings.warn("block reconstruction needs a model of repeated transformer blocks "
                          "(an nn.ModuleList of one block class): none found, so the layers "
                          "are pruned without it", RuntimeWarning, stacklevel=2)
        _prune_full(model, modules, order, *run)
    return {name: masks[name] for name in modules}


def _checked_batches(modules: dict[str, nn.Module], sparsity: dict[str, float | None],
                     nm: tuple[int, int] | None, calibration: Iterable, blocksize: int,
                     percdamp: float) -> list:
    """The calibration batches as a list, after checking every option and layer
    (UsageError naming the one at fault)."""
    if blocksize < 1:
        raise UsageError(f"blocksize must be a positive number of columns, got {blocksize}")
    if not percdamp > 0:
        raise UsageError(f"percdamp must be > 0 (fraction of mean(diag H)), got {percdamp}")
    for name, module in modules.items():
        hessian_spec(module)
        check_finite_weight(name, module.weight)
        if nm is None:
            level = sparsity.get(name)
            if level is None or not 0 <= level < 1:
                raise UsageError(f"layer {name!r}: sparsity must be in [0, 1), got {level!r}")
    check_calibration(calibration)
    batches = list(calibration) if calibration is not None else []
    if not batches:
        raise UsageError("sparsegpt needs calibration batches: pass calibration=[batch, ...]")
    return batches


def _prune_through_blocks(model: nn.Module, modules: dict[str, nn.Module],
                          order: list[list[str]], run: tuple) -> bool:
    """When the layers of a transformer's repeated blocks (:func:`find_blocks`) form one run in
    call order: the groups before them, then the blocks one at a time (:func:`_prune_blocks`,
    or whole-model passes with a warning when they cannot be replayed), then the groups after;
    ``run`` is ``(sparsity, nm, batches, calibration_fn, solve, masks)``. False, having pruned
    nothing, otherwise."""
    found = find_blocks(model, modules)
    if found is None:
        return False
    prefix, blocks = found
    inside = [all(n.startswith(prefix) for n in g) for g in order]
    first, last = inside.index(True), len(inside) - 1 - inside[::-1].index(True)
    if not all(inside[first : last + 1]):  # the blocks' layers do not form one run
        return False
    with torch.no_grad():
        _prune_full(model, modules, order[:first], *run)
        if not _prune_blocks(model, modules, blocks, prefix, order[first : last + 1], *run):
            warnings.warn(
                f"sparsegpt: the blocks under {prefix[:-1]!r} were not all called equally "
                "often during calibration (shared or skipped blocks), so they cannot be "
                "replayed one at a time: whole-model passes instead (same result, "
                "slower)", RuntimeWarning, stacklevel=3)
            _prune_full(model, modules, order[first : last + 1], *run)
        _prune_full(model, modules, order[last + 1 :], *run)
    return True


class SparseGPT:
    """The SparseGPT solver as a registered criterion (``criterion="sparsegpt"``): one shot,
    calibrated, updates the kept weights (see :func:`sparsegpt_prune`). ``reconstruct_steps``
    > 0 then fits each transformer block to the dense model's block outputs
    (:mod:`sparsekit.prune.reconstruct`; ``reconstruct_lr`` its peak learning rate);
    ``reconstruction`` holds the last solve's cost and gain."""

    needs_calibration = True
    options = ("blocksize", "percdamp", "sequential", "reconstruct_steps", "reconstruct_lr")

    def __init__(self, blocksize: int = 128, percdamp: float = 0.01,
                 sequential: bool = True, reconstruct_steps: int = 0,
                 reconstruct_lr: float = 1e-4) -> None:
        self.blocksize, self.percdamp, self.sequential = blocksize, percdamp, sequential
        self.reconstruct_steps, self.reconstruct_lr = reconstruct_steps, reconstruct_lr
        self.reconstruction: Reconstruct | None = None  # the last solve's cost and gain
        self.check()

    def check(self) -> None:
        """UsageError naming the option out of range."""
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or \
                self.blocksize < 1:
            raise UsageError(f"sparsegpt option blocksize={self.blocksize!r} must be a positive "
                             "number of columns")
        if not self.percdamp > 0:
            raise UsageError(f"sparsegpt option percdamp={self.percdamp!r} must be > 0 (a "
                             "fraction of mean(diag H))")
        Reconstruct(self.reconstruct_steps, self.reconstruct_lr)

    def solve(self, layers: Any, levels: dict[str, float | None],
              nm: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        self.reconstruction = Reconstruct(self.reconstruct_steps, self.reconstruct_lr)
        return sparsegpt_prune(layers.model, dict(layers.modules), levels, nm, layers.calibration,
                               layers.calibration_fn, self.blocksize, self.percdamp, layers.comm,
                               sequential=self.sequential, refit=self.reconstruction)


def _prune_full(
    model: nn.Module, modules: dict[str, nn.Module], groups: list[list[str]],
    sparsity: dict[str, float | None], nm: tuple[int, int] | None, batches: list,
    calibration_fn: CalibrationFn | None, solve: tuple, masks: dict[str, torch.Tensor],
) -> None:
    """Each group in turn: its Hessian from a pass of every batch through the whole model.
    Not sequential: one pass collects every group's Hessian from the dense model (all of them
    alive at once), then every group is solved."""
    sequential = solve[4]
    chunks = [[g] for g in groups] if sequential else [groups]
    for chunk in progress(chunks, desc="sparsegpt: layers", total=len(chunks)):
        hessians = [_Hessian() for _ in chunk]
        handles = [modules[g[0]].register_forward_pre_hook(h.hook, with_kwargs=True)
                   for g, h in zip(chunk, hessians)]
        try:
            run_calibration(model, batches, calibration_fn)
        finally:
            for handle in handles:
                handle.remove()
        for group, hess in zip(chunk, hessians):
            _solve_group(modules, group, hess, sparsity, nm, solve, masks)


def _solve_group(modules: dict[str, nn.Module], group: list[str], hess: _Hessian,
                 sparsity: dict[str, float | None], nm: tuple[int, int] | None, solve: tuple,
                 masks: dict[str, torch.Tensor]) -> None:
    """Every layer of ``group`` pruned from the group's Hessian (summed over ranks first)."""
    blocksize, percdamp, comm, solver, _, layer_solver, _ = solve
    hess.h, hess.n = reduce_hessian(hess.h, hess.n, comm)
    for name in group:
        level = None if nm is not None else sparsity[name]
        masks[name] = _solve_layer(name, modules[name], hess, level, nm, blocksize, percdamp,
                                   solver, layer_solver)


def find_blocks(
    model: nn.Module, modules: dict[str, nn.Module]
) -> tuple[str, nn.ModuleList] | None:
    """The repeated blocks of a transformer (``model.layers`` of a Llama, ``encoder.layer`` of a
    BERT): the ``nn.ModuleList`` of one block class holding the most of ``modules``, as
    ``(qualified name + ".", the list)``; None when no such list holds any."""
    best, best_count = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or len({type(c) for c in m}) != 1:
            continue
        prefix = f"{name}." if name else ""
        count = sum(n.startswith(prefix) for n in modules)
        if count > best_count:
            best, best_count = (prefix, m), count
    return best


class _BlockInputs:
    """What each block receives from the model, recorded in one pass over the calibration
    batches, call by call (however ``calibration_fn`` splits or repeats batches): block 0's
    hidden states per call, and every block's other arguments per call (masks, position
    embeddings: usually the very same tensors for every block, so recording them costs no
    memory). A KV cache is never replayed: ``use_cache`` is off."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.hidden: list[torch.Tensor] = []
        self.by_keyword = False
        self.rest: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]

    def hook(self, index: int) -> Callable:
        def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            kwargs = dict(kwargs)
            if "past_key_values" in kwargs:
                kwargs["past_key_values"] = None
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            if args:
                hidden, rest = args[0], tuple(args[1:])
            else:
                hidden, rest = kwargs.pop("hidden_states"), ()
                self.by_keyword = True
            if index == 0:
                self.hidden.append(hidden.detach())
            self.rest[index].append((rest, kwargs))

        return record

    def replayable(self) -> bool:
        """Whether every block was called as often as the first (so call ``j`` of block ``i``
        takes the output of call ``j`` of block ``i - 1``): blocks shared or skipped are not."""
        return len(self.hidden) > 0 and all(len(r) == len(self.hidden) for r in self.rest)

    def items(self, index: int, hidden: list[torch.Tensor]) -> list[tuple]:
        """Calibration items for block ``index`` (fed by :meth:`feed`) given its inputs."""
        return [(h, *r) for h, r in zip(hidden, self.rest[index])]

    def feed(self, block: nn.Module, item: tuple) -> torch.Tensor:
        hidden, rest, kwargs = item
        out = block(*rest, hidden_states=hidden, **kwargs) if self.by_keyword else block(
            hidden, *rest, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


def _prune_blocks(
    model: nn.Module, modules: dict[str, nn.Module], blocks: nn.ModuleList, prefix: str,
    groups: list[list[str]], sparsity: dict[str, float | None], nm: tuple[int, int] | None,
    batches: list, calibration_fn: CalibrationFn | None, solve: tuple,
    masks: dict[str, torch.Tensor],
) -> bool:
    """SparseGPT over the blocks: the inputs of every block are recorded in one pass of the
    model, then each block in turn has its groups solved from its own inputs and is run once
    more to give the next block's inputs. Sequential: from the pruned block, as the original
    solver does (a group's pass over the block stops at the group's first layer); not
    sequential: one pass of the dense block collects all its groups' Hessians and the next
    block's inputs, then the groups are solved. Only one block's input activations are alive
    at a time. Returns False, having pruned nothing, when the blocks were not all called the
    same number of times (shared or skipped blocks): then the caller warns and falls back to
    whole-model passes."""
    inputs = _record_block_inputs(model, blocks, batches, calibration_fn)
    if not inputs.replayable():
        return False
    by_block: dict[int, list[list[str]]] = {}
    for group in groups:
        by_block.setdefault(int(group[0][len(prefix):].split(".", 1)[0]), []).append(group)
    solved = (modules, sparsity, nm, solve, masks)
    refit = solve[6]
    hidden = inputs.hidden
    dense = list(hidden) if refit is not None else None  # the dense model's stream
    for index, block in progress(enumerate(blocks), desc="sparsegpt: blocks", total=len(blocks)):
        items = inputs.items(index, hidden)
        chunk = by_block.get(index, [])
        targets = None
        if refit is not None and chunk:
            with eval_mode(block):
                targets = [inputs.feed(block, item) for item in inputs.items(index, dense)]
        if not solve[4]:  # not sequential
            hidden = _solve_dense_block(inputs, block, items, chunk, solved)
        else:
            _solve_block_sequentially(inputs, block, items, chunk, solved)
        if targets is not None:
            names = {id(p): n for n, p in block.named_parameters()}
            block_masks = {names[id(original_weight(modules[name]))]: masks[name]
                           for group in chunk for name in group}
            reconstruct_block(block, inputs.feed, items, targets, block_masks, refit)
        if solve[4] and index + 1 < len(blocks) and bool(
                by_block.keys() - set(range(index + 1))):
            with eval_mode(block):
                hidden = [inputs.feed(block, item) for item in items]
        if refit is not None:
            dense = targets if targets is not None else [
                inputs.feed(block, item) for item in inputs.items(index, dense)]
        del items
    return True


def _record_block_inputs(model: nn.Module, blocks: nn.ModuleList, batches: list,
                         calibration_fn: CalibrationFn | None) -> _BlockInputs:
    """Every block's inputs in one pass of the model over ``batches`` (with the model's KV
    cache off for the pass)."""
    inputs = _BlockInputs(blocks)
    handles = [b.register_forward_pre_hook(inputs.hook(i), with_kwargs=True)
               for i, b in enumerate(blocks)]
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    try:
        if use_cache:
            config.use_cache = False
        run_calibration(model, batches, calibration_fn)
    finally:
        for handle in handles:
            handle.remove()
        if use_cache:
            config.use_cache = use_cache
    return inputs


def _solve_dense_block(inputs: _BlockInputs, block: nn.Module, items: list,
                       chunk: list[list[str]], solved: tuple) -> list[torch.Tensor]:
    """Not sequential: one pass of the dense block over ``items`` collects the Hessians of all
    its groups ``chunk`` and the next block's inputs (returned); then the groups are solved.
    ``solved`` is ``(modules, sparsity, nm, solve, masks)``."""
    modules, sparsity, nm, solve, masks = solved
    hessians = [_Hessian() for _ in chunk]
    handles = [modules[g[0]].register_forward_pre_hook(h.hook, with_kwargs=True)
               for g, h in zip(chunk, hessians)]
    try:
        with eval_mode(block):
            outs = [inputs.feed(block, item) for item in items]
    finally:
        for handle in handles:
            handle.remove()
    for group, hess in zip(chunk, hessians):
        _solve_group(modules, group, hess, sparsity, nm, solve, masks)
    return outs


def _solve_block_sequentially(inputs: _BlockInputs, block: nn.Module, items: list,
                              chunk: list[list[str]], solved: tuple) -> None:
    """Sequential: each group of ``chunk`` in turn, its Hessian from a pass of the block (as
    pruned so far) over ``items`` that stops at the group's first layer."""
    modules, sparsity, nm, solve, masks = solved
    for group in chunk:
        hess = _Hessian()
        handle = modules[group[0]].register_forward_pre_hook(hess.hook_then_stop,
                                                             with_kwargs=True)
        try:
            with eval_mode(block):
                for item in items:
                    try:
                        inputs.feed(block, item)
                    except _Collected:
                        pass
        finally:
            handle.remove()
        _solve_group(modules, group, hess, sparsity, nm, solve, masks)
