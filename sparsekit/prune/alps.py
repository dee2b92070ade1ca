"""ALPS: one-shot pruning by ADMM with a penalty schedule, then a conjugate-gradient refit of
the kept weights (Meng, Behdin, Wang & Mazumder 2024, "ALPS: Improved Optimization for Highly
Sparse One-Shot Pruning for Large Language Models").

Per layer, with ``W0`` the dense ``(rows, cols)`` weight and ``H = 2 X X^T / n`` its Hessian
(the same statistics SparseGPT collects), it minimises the layer's reconstruction error

    f(W) = tr((W - W0) H (W - W0)^T) = ||(W - W0) X||^2 * 2 / n

subject to ``W`` having the pattern (N:M along the columns, or an exact unstructured count):

1. ADMM on the split ``W = Z``, ``Z`` in the pattern set, with the penalty ``rho`` raised
   geometrically, faster while the support still changes a lot::

       W <- (W0 H + rho Z - L) (H + rho I)^-1      (one eigendecomposition of H serves all rho)
       Z <- project(W + L / rho)                     (top-N of every M / top-k by magnitude)
       L <- L + rho (W - Z)

   until the support of ``Z`` stops changing and ``rho`` is large (``W`` and ``Z`` agree).
2. The support of ``Z`` is fixed and the kept weights are refit exactly (up to ``cg_iters``
   steps of preconditioned conjugate gradient on ``f``, every row independently).

Everything runs in float32 on the weight's device, the Hessian normalised to a unit diagonal
and dampened like SparseGPT's (``percdamp * mean(diag H)``). The calibration passes (which
inputs each layer sees, block by block, from the already pruned layers before it) are
SparseGPT's: :func:`sparsekit.prune.sparsegpt.sparsegpt_prune` with this module's layer solver.
"""

from __future__ import annotations

from typing import Any

import torch

from sparsekit.errors import UsageError
from sparsekit.prune.patterns import prune_count
from sparsekit.prune.reconstruct import Reconstruct
from sparsekit.prune.sparsegpt import dead_inputs, sparsegpt_prune

__all__ = ["ALPS", "admm_prune", "layer_error", "pattern_project", "refit"]


def pattern_project(
    w: torch.Tensor, nm: tuple[int, int] | None, count: int
) -> torch.Tensor:
    """Keep-mask of the weights of largest magnitude in the pattern: the ``N`` largest of every
    ``M`` consecutive columns of each row, or (``nm`` None) all but the ``count`` smallest of
    the matrix. ``w``: ``(rows, cols)``; returns bool of the same shape."""
    a = w.abs()
    if nm is not None:
        n, m = nm
        groups = a.reshape(a.shape[0], -1, m)
        idx = groups.topk(n, dim=-1).indices
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
        return keep.reshape(w.shape)
    keep = torch.ones_like(w, dtype=torch.bool)
    if count:
        keep.view(-1)[a.reshape(-1).topk(count, largest=False).indices] = False
    return keep


def layer_error(w: torch.Tensor, w0: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``tr((W - W0) H (W - W0)^T)``: the layer's output error on its calibration inputs."""
    d = (w - w0).to(h.dtype)
    return ((d @ h) * d).sum()


def refit(
    w0: torch.Tensor, h: torch.Tensor, keep: torch.Tensor, w: torch.Tensor | None = None,
    iters: int = 50, tol: float = 1e-6,
) -> torch.Tensor:
    """The weights on the support ``keep`` that minimise :func:`layer_error`, by conjugate
    gradient, every row its own system (preconditioned by ``diag H``), started from ``w``
    (default: ``W0`` on the support). Stops after ``iters`` steps, or when every row's
    residual is below ``tol`` times its starting one. Returns ``(rows, cols)`` with zeros off
    the support."""
    mask = keep.to(w0.dtype)
    x = (w0 if w is None else w) * mask
    inv_diag = 1.0 / h.diagonal().clamp_min(1e-12)
    r = ((w0 - x) @ h) * mask  # minus the gradient, on the support
    z = r * inv_diag
    p = z.clone()
    rz = (r * z).sum(1, keepdim=True)
    start = rz.abs().clamp_min(1e-30)
    for _ in range(iters):
        hp = (p @ h) * mask
        php = (p * hp).sum(1, keepdim=True)
        alpha = torch.where(php > 0, rz / php.clamp_min(1e-30), torch.zeros_like(rz))
        x = x + alpha * p
        r = r - alpha * hp
        z = r * inv_diag
        rz_new = (r * z).sum(1, keepdim=True)
        if bool((rz_new.abs() <= tol * tol * start).all()):
            break
        p = z + torch.where(rz > 0, rz_new / rz.clamp_min(1e-30), torch.zeros_like(rz)) * p
        rz = rz_new
    return x * mask


def admm_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    percdamp: float = 0.01,
    rho: float = 0.1,
    iters: int = 300,
    cg_iters: int = 50,
    budget_offset: int = 0,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """ALPS on one ``(rows, cols)`` weight matrix given its ``(cols, cols)`` Hessian (see the
    module docstring). Unstructured: exactly ``prune_count`` of the matrix's weights are pruned
    (``budget_offset`` as in :func:`sparsekit.prune.sparsegpt.obs_prune`); N:M: ``N`` kept of
    every ``M`` consecutive columns. ``rho``: the first ADMM penalty, relative to the unit
    diagonal of the normalised Hessian. Returns ``(new_weight, keep_mask)``, float32 with zeros
    where pruned, and bool (True = kept)."""
    if (sparsity is None) == (nm is None):
        raise UsageError(f"layer {name!r}: give exactly one of sparsity (unstructured) or nm")
    if not rho > 0 or iters < 1 or cg_iters < 0:
        raise UsageError(f"alps: rho must be > 0, iters >= 1 and cg_iters >= 0; got rho={rho}, "
                         f"iters={iters}, cg_iters={cg_iters}")
    w0 = weight.detach().float()
    rows, cols = w0.shape
    if nm is not None and cols % nm[1]:
        raise UsageError(f"layer {name!r}: input dimension {cols} is not a multiple of M={nm[1]}")
    count = 0 if nm is not None else (prune_count(budget_offset + rows * cols, sparsity)
                                       - prune_count(budget_offset, sparsity))
    h = hessian.detach().float().clone()
    dead = dead_inputs(h, name, "alps")
    w0 = torch.where(dead.unsqueeze(0), torch.zeros_like(w0), w0)  # inputs always zero
    h += percdamp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype, device=h.device)
    # normalise to a unit diagonal: W' = W * s, H' = H / (s s^T), with s = sqrt(diag H)
    s = h.diagonal().sqrt()
    hn = h / s.unsqueeze(0) / s.unsqueeze(1)
    v0 = w0 * s
    evals, evecs = torch.linalg.eigh(hn.double())
    evals, evecs = evals.float().clamp_min(0), evecs.float()
    target, support = v0 @ hn, pattern_project(v0, nm, count)  # W0 H in the normalised space
    z, keep, lam = v0 * support, support, torch.zeros_like(v0)
    for it in range(iters):
        rhs = (target + rho * z - lam) @ evecs
        v = (rhs / (evals + rho)) @ evecs.T
        keep = pattern_project(v + lam / rho, nm, count)
        z = (v + lam / rho) * keep
        lam = lam + rho * (v - z)
        if it % 3 == 2:
            changed = int((keep != support).sum()) / max(1, int(keep.sum()))
            support = keep
            if changed == 0 and rho > 10.0:
                break
            rho *= 1.3 if changed > 0.01 else 1.2 if changed > 0.001 else 1.1
    v = refit(v0, hn, keep, z, iters=cg_iters) if cg_iters else z
    return v / s, keep


class ALPS:
    """ALPS as a registered solver (``criterion="alps"``): SparseGPT's calibration passes, block
    by block (each block calibrated on the outputs of the already pruned blocks before it),
    with :func:`admm_prune` solving each layer. Options: ``percdamp`` (Hessian damping, a
    fraction of ``mean(diag H)``), ``rho`` (the first ADMM penalty), ``iters`` (the most ADMM
    steps), ``cg_iters`` (conjugate-gradient steps of the final refit), ``sequential`` (False:
    every layer calibrated on the dense model's inputs), ``reconstruct_steps`` and
    ``reconstruct_lr`` (block reconstruction after each block, as for SparseGPT)."""

    needs_calibration = True
    options = ("percdamp", "rho", "iters", "cg_iters", "sequential", "reconstruct_steps",
               "reconstruct_lr")

    def __init__(self, percdamp: float = 0.01, rho: float = 0.1, iters: int = 300,
                 cg_iters: int = 50, sequential: bool = True, reconstruct_steps: int = 0,
                 reconstruct_lr: float = 1e-4) -> None:
        self.percdamp, self.rho, self.iters = percdamp, rho, iters
        self.cg_iters, self.sequential = cg_iters, sequential
        self.reconstruct_steps, self.reconstruct_lr = reconstruct_steps, reconstruct_lr
        self.reconstruction: Reconstruct | None = None  # the last solve's cost and gain
        self.check()

    def check(self) -> None:
        """UsageError naming the option out of range."""
        for key, low in (("percdamp", 0.0), ("rho", 0.0)):
            if not getattr(self, key) > low:
                raise UsageError(f"alps option {key}={getattr(self, key)!r} must be > {low}")
        for key, low in (("iters", 1), ("cg_iters", 0)):
            if getattr(self, key) < low:
                raise UsageError(f"alps option {key}={getattr(self, key)!r} must be >= {low}")
        Reconstruct(self.reconstruct_steps, self.reconstruct_lr)

    def layer_solver(self, weight: torch.Tensor, hessian: torch.Tensor, sparsity: float | None,
                     nm: tuple[int, int] | None, budget_offset: int, name: str):
        return admm_prune(weight, hessian, sparsity, nm, self.percdamp, self.rho, self.iters,
                          self.cg_iters, budget_offset, name)

    def solve(self, layers: Any, levels: dict[str, float | None],
              nm: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        self.reconstruction = Reconstruct(self.reconstruct_steps, self.reconstruct_lr)
        return sparsegpt_prune(
            layers.model, dict(layers.modules), levels, nm, layers.calibration,
            layers.calibration_fn, percdamp=self.percdamp, comm=layers.comm,
            sequential=self.sequential, layer_solver=self.layer_solver,
            refit=self.reconstruction)
