"""Block reconstruction: after a transformer block's layers are pruned, fit the block's kept
weights so that its outputs match the dense model's (beyond one layer at a time).

One-shot solvers (SparseGPT, ALPS) fit each layer to its own inputs; the error each leaves
adds up through the nonlinearities and the residual stream of the block and of the blocks
after it. Reconstruction (as in EBFT, Guo et al. 2024, and BRECQ's block output objective)
minimizes, for each block ``b`` in turn,

    L(W_b) = sum_i || f_b(x_i; W_b) - y_i ||^2 / sum_i || y_i ||^2

over the block's weights with the masks fixed, where ``x_i`` are the block's inputs in the
pruned model (the blocks before it already pruned and refitted) and ``y_i`` are the *dense*
model's outputs of the same block on the dense model's own inputs (the error the blocks before
left is corrected here too). Adam on the kept weights (every pruned weight's gradient is masked,
so it stays exactly zero), a cosine-decayed learning rate, the calibration calls cycled
``steps`` times in total; the block's other parameters (norms, biases) are fitted too. The
cost is ``steps`` forward and backward passes of one block per block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sparsekit.errors import UsageError

__all__ = ["Reconstruct", "reconstruct_block"]


@dataclass
class Reconstruct:
    """Settings of block reconstruction. ``steps``: Adam steps per block (one calibration call
    each, cycled; 0 = off); ``lr``: the peak learning rate (cosine decay to 0 over the steps).
    ``seconds`` accumulates the time spent, ``blocks`` the blocks refitted and ``loss_before``/
    ``loss_after`` each block's relative output error before and after (the cost and the gain,
    for reports)."""

    steps: int = 0
    lr: float = 1e-4
    seconds: float = 0.0
    blocks: int = 0
    loss_before: list[float] = field(default_factory=list)
    loss_after: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise UsageError(f"reconstruct_steps={self.steps!r} must be an integer >= 0 (Adam "
                             "steps per transformer block; 0 = no reconstruction)")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise UsageError(f"reconstruct_lr={self.lr!r} must be a learning rate in (0, 1)")

    def summary(self) -> dict[str, float]:
        """Cost and gain over the blocks refitted so far (JSON-friendly)."""
        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else float("nan")

        return {"steps_per_block": self.steps, "lr": self.lr, "blocks": self.blocks,
                "seconds": round(self.seconds, 3),
                "block_error_before": mean(self.loss_before),
                "block_error_after": mean(self.loss_after)}


def _relative_error(outs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
    num = sum(float((o.float() - t.float()).pow(2).sum()) for o, t in zip(outs, targets))
    den = sum(float(t.float().pow(2).sum()) for t in targets)
    return num / max(den, 1e-30)


def _fit(block: nn.Module, params: dict[str, nn.Parameter], keep: dict[str, torch.Tensor],
         feed: Callable[[nn.Module, tuple], torch.Tensor], items: Sequence[tuple],
         targets: Sequence[torch.Tensor], settings: Reconstruct) -> None:
    """The Adam steps of :func:`reconstruct_block` (gradients on), on float32 master copies
    of ``params`` (so small steps are not lost where a block runs in half precision), each
    step on one calibration item, masked gradients, cosine-decayed learning rate."""
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    optimizer = torch.optim.Adam(list(masters.values()), lr=settings.lr)
    scale = sum(float(t.float().pow(2).mean()) for t in targets) / len(targets)
    for p in params.values():
        p.requires_grad_(True)
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = 0.5 * settings.lr * (1 + math.cos(math.pi * step / settings.steps))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        i = step % len(items)
        out = feed(block, items[i])
        loss = (out.float() - targets[i].float()).pow(2).mean() / max(scale, 1e-30)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, master), g in zip(masters.items(), grads):
            master.grad = None if g is None else (g.float() * keep[n] if n in keep else
                                                  g.float())
        optimizer.step()
        with torch.no_grad():
            for n in keep:
                masters[n].mul_(keep[n])
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(masters[n])


def reconstruct_block(
    block: nn.Module,
    feed: Callable[[nn.Module, tuple], torch.Tensor],
    items: Sequence[tuple],
    targets: Sequence[torch.Tensor],
    masks: dict[str, torch.Tensor],
    settings: Reconstruct,
) -> None:
    """Fit ``block``'s parameters in place so that ``feed(block, items[i])`` approaches
    ``targets[i]`` (relative squared error, see the module's docstring). ``masks`` maps the
    block's parameter names (as ``block.named_parameters()`` gives them, e.g.
    ``"mlp.up_proj.weight"``) to bool keep-masks of the same shape: those weights keep their
    zeros. The block runs in eval mode (no dropout) throughout."""
    if settings.steps == 0 or not items:
        return
    if len(items) != len(targets):
        raise ValueError(f"reconstruct_block: {len(items)} calibration items but "
                         f"{len(targets)} targets")
    start = time.perf_counter()
    params = {n: p for n, p in block.named_parameters() if p.dtype.is_floating_point}
    unknown = sorted(set(masks) - set(params))
    if unknown:
        raise ValueError(f"reconstruct_block: masks for parameters the block does not have: "
                         f"{unknown}")
    keep = {n: masks[n].to(device=params[n].device, dtype=params[n].dtype) for n in masks}
    was_training = block.training
    block.eval()
    flags = {n: p.requires_grad for n, p in params.items()}
    with torch.no_grad():
        settings.loss_before.append(_relative_error([feed(block, it) for it in items], targets))
    try:
        with torch.enable_grad():
            _fit(block, params, keep, feed, items, targets, settings)
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
        block.train(was_training)
    with torch.no_grad():
        settings.loss_after.append(_relative_error([feed(block, it) for it in items], targets))
    settings.blocks += 1
    settings.seconds += time.perf_counter() - start
