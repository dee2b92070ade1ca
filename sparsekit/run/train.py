"""The training loop, used for the dense baseline and for fine-tuning under a pruner.

One plain loop: fetch the batch for this step, forward, loss (task loss, optionally mixed with
distillation from a teacher), backward, optimizer step, then the pruner's step so masks follow
their schedule. Batches are a pure function of (seed, step), which is what lets a resumed run
see exactly the batches the interrupted one would have seen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from sparsekit.run import distributed as D
from sparsekit.prune.distill import Distiller, embedding_agreement, kl_loss
from sparsekit.nn.training import autocast, batch_tokens, peak_memory_gb
from sparsekit.prune.schedules import lr_at
from sparsekit.nn.calibration import to_device, eval_mode
from sparsekit.errors import UsageError
from sparsekit.progress import progress
from sparsekit.io.runstate import follow_parameters

StepHook = Callable[[int, dict[str, float]], None]


def make_optimizer(
    params: Any, name: str, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """``adam`` | ``adamw`` | ``sgd`` (momentum 0.9)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise UsageError(f"train.optimizer={name!r} is not allowed; choose one of: adam, adamw, sgd")


def get_batch(dataset: Dataset, indices: torch.Tensor) -> Any:
    if isinstance(dataset, TensorDataset):  # fast path: one gather per tensor
        return tuple(t[indices] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in indices])


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Indices of the training batch at ``step``: epoch ``e`` is a permutation drawn from
    ``seed + e``; the last incomplete batch of an epoch is dropped.

    >>> batch_indices(10, 5, seed=0, step=0).tolist() == batch_indices(10, 5, 0, 2).tolist()
    False
    """
    per_epoch = max(1, n // batch_size)
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[pos * batch_size : (pos + 1) * batch_size]


def eval_batches(dataset: Dataset, batch_size: int, max_batches: int | None = None) -> Iterator:
    """Batches over ``dataset`` in order (at most ``max_batches``)."""
    n = len(dataset)
    for i, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield get_batch(dataset, torch.arange(start, min(n, start + batch_size)))


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or ``.logits`` of a transformers
    ``ModelOutput`` (HF models return one)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model returned {type(output).__name__}, neither a tensor nor an "
                    "output with .logits")


def task_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class logits (B, C) or token logits (B, T, V) with targets (B[, T]);
    targets of -100 are ignored (the unmasked positions of a masked LM)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton et al.: ``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, mean over samples
    (tokens for a language model); :func:`sparsekit.prune.distill.kl_loss`."""
    return kl_loss(student, teacher, temperature)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    task: str,
    batch_size: int = 500,
    max_batches: int | None = None,
    quiet: bool = False,
    reference: nn.Module | None = None,
) -> dict[str, float]:
    """``{"loss", "accuracy"}`` for classification, ``{"loss", "perplexity"}`` (per target
    token, ``exp`` of the mean cross-entropy in nats; targets of -100 are not counted) for a
    language model, ``{"loss", "cosine"}`` for ``task="embedding"``: the mean cosine between
    the pooled embeddings of ``model`` and of ``reference`` (the dense model) over the
    inputs, and ``loss = 1 - cosine``."""
    if task == "embedding":
        if reference is None:
            raise UsageError("evaluating embeddings needs the dense model as reference=")
        inputs = (x for x, _ in eval_batches(dataset, batch_size, max_batches))
        cos = embedding_agreement(model, reference, inputs)
        return {"loss": 1.0 - cos, "cosine": cos}
    with eval_mode(model):
        device = next(model.parameters()).device
        loss_sum, correct, count = 0.0, 0, 0
        batches = eval_batches(dataset, batch_size, max_batches)
        total = -(-len(dataset) // batch_size)
        total = total if max_batches is None else min(total, max_batches)
        for x, y in progress(batches, quiet, desc="eval", leave=False, total=total):
            x, y = to_device(x, device), y.to(device)
            logits = logits_of(model(x))
            loss_sum += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"
            ).item()
            correct += (logits.argmax(-1) == y).sum().item()
            count += (y != -100).sum().item()
    if count == 0:  # an accuracy of 0 / 0 would read as 0%
        raise UsageError(
            f"evaluation saw no samples (dataset of {len(dataset)}, max_batches={max_batches}): "
            "pass max_batches >= 1 or None, and a non-empty evaluation set"
        )
    loss = loss_sum / count
    if task == "lm":
        return {"loss": loss, "perplexity": math.exp(loss)}
    return {"loss": loss, "accuracy": correct / count}


def fit(
    model: nn.Module,
    dataset: Dataset,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    warmup: int = 0,
    lr_schedule: str = "cosine",
    grad_clip: float = 0.0,
    dropout: bool = True,
    pruner: Any = None,
    teacher: nn.Module | None = None,
    distill_alpha: float = 0.0,
    temperature: float = 2.0,
    distiller: Distiller | None = None,
    on_step: StepHook | None = None,
    quiet: bool = False,
    desc: str = "train",
    shard: bool = False,
    log_every: int = 1,
    precision: str = "fp32",
    max_seconds: float | None = None,
) -> int:
    """Train ``model`` (in eval mode if ``dropout=False``) for steps ``start_step .. steps - 1``.
    After each optimizer step the ``pruner`` (a :class:`~sparsekit.prune.scheduled.ScheduledPruner`:
    masks or channels) steps (the optimizer follows any parameters it replaced), then
    ``on_step(step, metrics)`` runs (logging, evaluation, checkpoints). Distillation:
    ``distiller`` (a :class:`Distiller`), or ``teacher`` with ``temperature`` (KL on the logits);
    its loss weighs ``distill_alpha``, the task loss ``1 - distill_alpha`` (unlabeled data at 1).
    ``metrics`` (:func:`_step_metrics`) every ``log_every`` steps and at the last step, empty
    otherwise (the loss is read back from the device only then). ``shard``: under torchrun,
    with ``model`` wrapped in DDP or FSDP2, each rank trains on its equal slice of every global
    batch (the loss reported is the mean over ranks). ``precision="bf16"``: bf16 autocast;
    ``max_seconds``: stop at the first step past it. Returns the steps done."""
    model.train(dropout)
    device = next(model.parameters()).device
    distiller = _distiller(distiller, teacher, distill_alpha, temperature)
    bf16, start, tokens = autocast(device, precision), time.perf_counter(), 0
    bar = progress(range(start_step, steps), quiet, desc=desc, initial=start_step, total=steps)
    for step in bar:
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            return step
        for group in optimizer.param_groups:
            group["lr"] = lr_now = lr_at(step, steps, lr, warmup, lr_schedule)
        x, y = _step_batch(dataset, batch_size, seed, step, shard, device)
        tokens += batch_tokens(x)
        with bf16:
            loss = _step_loss(model, x, y, distiller, distill_alpha)
        _optimizer_step(model, optimizer, loss, grad_clip)
        if pruner is not None and pruner.step(step):
            follow_parameters(optimizer, model)  # channel pruning made new, narrower ones
        if on_step is not None:
            logged = step % log_every == 0 or step == steps - 1
            on_step(step, _step_metrics(loss, lr_now, shard, tokens, start, device)
                    if logged else {})
    return steps


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                    grad_clip: float) -> None:
    """Backward, gradient clipping (``grad_clip`` > 0: the largest total norm), one step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()


def _step_batch(dataset: Dataset, batch_size: int, seed: int, step: int, shard: bool,
                device: torch.device) -> tuple[Any, torch.Tensor]:
    """Step ``step``'s batch ``(inputs, targets)`` on ``device``: this rank's slice of it when
    ``shard``."""
    idx = batch_indices(len(dataset), batch_size, seed, step)
    x, y = get_batch(dataset, D.rank_slice(idx) if shard else idx)
    return to_device(x, device), y.to(device)


def _step_metrics(loss: torch.Tensor, lr: float, shard: bool, tokens: int, start: float,
                  device: torch.device) -> dict[str, float]:
    """The logged metrics of a step: ``train/loss`` (read back from the device, the mean over
    ranks when ``shard``), ``train/lr``, ``train/tokens_per_s`` (``tokens`` seen since
    ``start``, a perf_counter time) and on CUDA ``train/peak_memory_gb``."""
    loss_value = D.mean_over_ranks(loss.detach()) if shard else loss.detach()
    metrics = {"train/loss": loss_value.item(), "train/lr": lr,
               "train/tokens_per_s": tokens / max(time.perf_counter() - start, 1e-9)}
    if device.type == "cuda":
        metrics["train/peak_memory_gb"] = peak_memory_gb(device)
    return metrics


def _distiller(distiller: Distiller | None, teacher: nn.Module | None, distill_alpha: float,
               temperature: float) -> Distiller | None:
    """What :func:`fit` distills with: ``distiller``, else KL on ``teacher``'s logits at
    ``temperature``; None when ``distill_alpha`` is not positive."""
    if distill_alpha <= 0:
        return None
    if distiller is None and teacher is not None:
        return Distiller(teacher, target="logits", loss="kl", temperature=temperature)
    return distiller


def _step_loss(model: nn.Module, x: Any, y: torch.Tensor, distiller: Distiller | None,
               distill_alpha: float) -> torch.Tensor:
    """One step's loss: the task loss, or its mix with ``distiller``'s (weight
    ``distill_alpha``; the distillation loss alone at 1, where ``y`` is never read)."""
    if distiller is None:
        return task_loss(logits_of(model(x)), y)
    out, kd = distiller(model, x)
    return kd if distill_alpha >= 1 else (
        (1 - distill_alpha) * task_loss(logits_of(out), y) + distill_alpha * kd)
