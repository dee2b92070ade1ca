"""Knowledge distillation from the dense model into the pruned one, for any model.

A :class:`Distiller` holds the teacher (usually the dense copy) and what to match, chosen by
the model's task unless given:

============================  ==========================  ==========
task                          target                      loss
============================  ==========================  ==========
feature_extraction            ``pooled`` (sentence         ``cosine``
                              embedding: the mean of the
                              last hidden state over the
                              attention mask)
causal_lm, masked_lm,         ``logits``                  ``kl``
sequence_classification,
classification
============================  ==========================  ==========

- ``kl``: Hinton et al., ``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, mean over
  samples (tokens for a language model); only for ``logits``.
- ``cosine``: ``1 - cos(student, teacher)`` per vector (per sequence for ``pooled``, per token
  for ``last_hidden``), averaged.
- ``mse``: the mean squared difference of the vectors' entries.
- ``feature_weight > 0`` adds per-layer feature matching: the mean over the model's
  ``hidden_states`` (transformers: ``output_hidden_states=True``, one per block) of the
  ``feature_loss`` (cosine or mse per token) between student and teacher, times
  ``feature_weight``.

The masks stay held by the :class:`~sparsekit.Pruner` the whole time: the Distiller computes a
loss; the caller's loop (or :func:`distill_`) steps the optimizer and then the pruner, which
puts every pruned weight back to zero.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit.checks import check_int, check_module
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.nn.calibration import eval_mode, to_device
from sparsekit.nn.training import autocast, batch_tokens, check_precision, peak_memory_gb
from sparsekit.prune.schedules import lr_at
from sparsekit.names import DISTILL_LOSSES as LOSSES
from sparsekit.names import DISTILL_TARGETS as TARGETS

EMBEDDING_TASKS = ("feature_extraction", "embedding")

__all__ = ["DistillRun", "Distiller", "distill_", "embedding_agreement", "kl_loss",
           "pooled_embedding", "vector_loss"]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is a 16-bit float (losses in fp16 lose too much); else as is."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def kl_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 2.0) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, mean over the rows of the last
    dimension (samples, or tokens of a language model). The T^2 keeps gradients comparable
    across temperatures.

    >>> round(float(kl_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.0]]))), 6)
    0.0
    """
    s = F.log_softmax(_wide(student).reshape(-1, student.shape[-1]) / temperature, dim=-1)
    t = F.log_softmax(_wide(teacher).reshape(-1, teacher.shape[-1]) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def vector_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """``cosine``: the mean of ``1 - cos`` over the vectors of the last dimension; ``mse``: the
    mean squared difference of their entries. ``weight`` (the vectors' leading shape, e.g. an
    attention mask) weighs each vector; padding gets 0.

    >>> vector_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]), "cosine")
    tensor(1.)
    """
    s, t = _wide(student), _wide(teacher)
    if kind == "cosine":
        per = 1 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)
    elif kind == "mse":
        per = (s - t).pow(2).mean(-1)
    else:
        raise UsageError(f"distillation loss {kind!r} compares vectors: use 'cosine' or 'mse'")
    if weight is None:
        return per.mean()
    w = weight.to(per.dtype).expand_as(per)
    return (per * w).sum() / w.sum().clamp_min(1e-12)


def pooled_embedding(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``hidden`` ``(batch, tokens, dim)`` over the tokens the attention mask keeps
    (all tokens without one): the sentence embedding of sentence-transformers' mean pooling."""
    if attention_mask is None:
        return hidden.mean(1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def _attention_mask(batch: Any) -> torch.Tensor | None:
    return batch.get("attention_mask") if isinstance(batch, Mapping) else None


def _field(output: Any, name: str, what: str) -> Any:
    if name == "logits" and isinstance(output, torch.Tensor):
        return output
    if name == "last_hidden" and isinstance(output, torch.Tensor) and output.dim() == 3:
        return output
    key = {"last_hidden": "last_hidden_state"}.get(name, name)
    value = getattr(output, key, None)
    if value is None and isinstance(output, Mapping):
        value = output.get(key)
    if value is None:
        raise UsageError(f"distillation target {what!r} needs the model's output to have "
                         f"{key!r}; the model returned {type(output).__name__}")
    return value


class Distiller:
    """The distillation loss of a student against ``teacher`` (see the module docstring).

    Args:
        teacher: the model to match (kept in eval mode, never trained).
        task: the model's task (``feature_extraction``, ``causal_lm``, ``masked_lm``,
            ``sequence_classification``, ``classification``); picks the defaults.
        target: ``logits`` | ``last_hidden`` | ``pooled`` | ``auto``.
        loss: ``kl`` (logits only) | ``cosine`` | ``mse`` | ``auto``.
        temperature: the KL's softening temperature (> 0).
        feature_weight: weight of the per-layer feature matching (0: off).
        feature_loss: ``cosine`` | ``mse``, per token, for the feature matching.

    >>> torch.manual_seed(0) and None
    >>> teacher = nn.Linear(4, 3)
    >>> student = nn.Linear(4, 3)
    >>> d = Distiller(teacher, task="classification")
    >>> out, loss = d(student, torch.randn(8, 4))
    >>> d.target, d.loss, out.shape, bool(loss > 0)
    ('logits', 'kl', torch.Size([8, 3]), True)
    """

    def __init__(self, teacher: nn.Module, task: str = "classification", target: str = "auto",
                 loss: str = "auto", temperature: float = 2.0, feature_weight: float = 0.0,
                 feature_loss: str = "cosine") -> None:
        if target not in TARGETS:
            raise UsageError(f"distillation target={target!r} is not allowed; choose one of: "
                             f"{', '.join(TARGETS)}")
        if loss not in LOSSES:
            raise UsageError(f"distillation loss={loss!r} is not allowed; choose one of: "
                             f"{', '.join(LOSSES)}")
        if feature_loss not in ("cosine", "mse"):
            raise UsageError(f"feature_loss={feature_loss!r}: choose cosine or mse")
        if not temperature > 0 or not feature_weight >= 0:
            raise UsageError(f"temperature must be > 0 and feature_weight >= 0, got "
                             f"{temperature!r}, {feature_weight!r}")
        embedding = task in EMBEDDING_TASKS
        self.target = target if target != "auto" else "pooled" if embedding else "logits"
        self.loss = loss if loss != "auto" else "kl" if self.target == "logits" else "cosine"
        if self.loss == "kl" and self.target != "logits":
            raise UsageError(f"loss='kl' compares distributions: it needs target='logits', not "
                             f"{self.target!r}; use cosine or mse")
        check_module(teacher, "teacher", "sk.Distiller: ")
        self.teacher, self.task, self.temperature = teacher.eval(), task, temperature
        self.feature_weight, self.feature_loss = feature_weight, feature_loss

    def _call(self, model: nn.Module, batch: Any) -> Any:
        """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else
        ``model(batch)``; asking for ``hidden_states`` when features are matched."""
        extra = {"output_hidden_states": True} if self.feature_weight > 0 else {}
        if isinstance(batch, Mapping):
            return model(**batch, **extra)
        if isinstance(batch, (tuple, list)):
            return model(*batch, **extra)
        return model(batch, **extra)

    def compare(self, student_out: Any, teacher_out: Any, batch: Any) -> torch.Tensor:
        """The loss between two outputs of the same ``batch`` (see the module docstring)."""
        mask = _attention_mask(batch)
        s, t = (_field(o, "logits" if self.target == "logits" else "last_hidden", self.target)
                for o in (student_out, teacher_out))
        if self.target == "logits" and self.loss == "kl":
            loss = kl_loss(s, t, self.temperature)
        elif self.target == "pooled":
            loss = vector_loss(pooled_embedding(s, mask), pooled_embedding(t, mask), self.loss)
        else:
            loss = vector_loss(s, t, self.loss, mask if s.dim() == 3 else None)
        if self.feature_weight > 0:
            hs, ht = (_field(o, "hidden_states", "feature matching")
                      for o in (student_out, teacher_out))
            feats = [vector_loss(a, b, self.feature_loss, mask) for a, b in zip(hs, ht)]
            loss = loss + self.feature_weight * torch.stack(feats).mean()
        return loss

    def __call__(self, student: nn.Module, batch: Any) -> tuple[Any, torch.Tensor]:
        """``(student output, loss)`` on ``batch`` (a dict as keywords, a tuple or list as
        positional arguments, a tensor as the one argument); the teacher runs without
        gradients."""
        with torch.no_grad():
            teacher_out = self._call(self.teacher, batch)
        student_out = self._call(student, batch)
        return student_out, self.compare(student_out, teacher_out, batch)


def _check_distill(model: nn.Module, batches: Iterable[Any], steps: int, pruner: Any,
                   warmup: int = 0, precision: str = "fp32",
                   max_seconds: float | None = None) -> Iterable[Any]:
    """distill_'s argument checks; the batches as a re-iterable (a one-pass iterator listed)."""
    check_module(model, where="sk.distill_: ")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigTypeError(f"steps must be an integer >= 0, got {steps!r}")
    check_int("warmup", warmup, 0)
    check_precision(precision)
    if max_seconds is not None and not max_seconds > 0:
        raise UsageError(f"max_seconds={max_seconds!r} must be > 0 (or None: no limit)")
    if pruner is None and any(
            bool((m.weight == 0).any()) for m in model.modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() > 1):
        raise UsageError("distill_: the model has zero weights but no pruner= holds them; "
                         "distill under the Pruner (before finalize) so they stay zero")
    return list(batches) if iter(batches) is batches else batches


class DistillRun(list):
    """The loss of every step :func:`distill_` ran (a list of floats, as before), with what the
    run cost: ``steps_done`` (the last step + 1, counting steps of earlier runs it resumed),
    ``resumed_from`` (the step it resumed at; 0 for a fresh run), ``seconds`` (wall time of
    the steps, this run and those it resumed together), ``tokens`` (input tokens of a language
    model's batches, or samples, seen by the student), ``tokens_per_s`` (this run's),
    ``peak_memory_gb`` (CUDA: peak allocated memory; None on CPU) and ``finished`` (False when
    ``max_seconds`` stopped it: call again with the same ``checkpoint`` to go on)."""

    steps_done: int = 0
    resumed_from: int = 0
    seconds: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    peak_memory_gb: float | None = None
    finished: bool = True

    def summary(self) -> dict[str, Any]:
        """The cost figures as a JSON-friendly dict."""
        return {k: getattr(self, k) for k in ("steps_done", "resumed_from", "seconds", "tokens",
                                              "tokens_per_s", "peak_memory_gb", "finished")}


def _save_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                run: DistillRun) -> None:
    from sparsekit.io.files import atomic_torch_save

    atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "losses": list(run), "steps_done": run.steps_done,
                       "seconds": run.seconds, "tokens": run.tokens}, path)


def _resume(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
            steps: int) -> DistillRun:
    """The run saved at ``path`` loaded into ``model`` and ``optimizer`` (a fresh run when the
    file does not exist)."""
    from sparsekit.io.files import safe_torch_load

    run = DistillRun()
    if not os.path.exists(path):
        return run
    state = safe_torch_load(path)
    if not isinstance(state, dict) or not {"model", "optimizer", "steps_done"} <= set(state):
        raise UsageError(f"checkpoint={path!r} is not a distill_ checkpoint")
    if state["steps_done"] > steps:
        raise UsageError(f"checkpoint={path!r} ran {state['steps_done']} steps, more than "
                         f"steps={steps}: resume with the steps it was started with")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    run.extend(float(v) for v in state["losses"])
    run.steps_done = run.resumed_from = int(state["steps_done"])
    run.seconds, run.tokens = float(state["seconds"]), int(state["tokens"])
    return run


def distill_(
    model: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int,
    lr: float = 1e-4,
    task: str = "classification",
    pruner: Any = None,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    warmup: int = 0,
    dropout: bool = True,
    precision: str = "fp32",
    max_seconds: float | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = 120.0,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
    log_every: int = 50,
    **distiller: Any,
) -> DistillRun:
    """Train ``model`` for ``steps`` AdamW steps (``lr`` warmed up over ``warmup`` steps, then
    cosine decay to 10%: :func:`~sparsekit.prune.schedules.lr_at`) to match ``teacher`` on
    ``batches`` (cycled; re-iterable) with the :class:`Distiller` loss of ``task`` (keywords
    ``target``, ``loss``, ``temperature``, ``feature_weight``, ``feature_loss`` go to it);
    ``dropout=False``: in eval mode (no dropout; batch norms on running statistics). ``pruner``
    (a :class:`~sparsekit.Pruner` of ``model`` holding its masks) steps after every optimizer
    step, so pruned weights stay zero; without one, ``model`` must have no zeros to keep: make
    the Pruner, prune, distill, then ``pruner.finalize()``. Returns the loss per step as a
    :class:`DistillRun` (a list, with the run's cost: tokens/s, peak memory, seconds).

    ``precision="bf16"``: forward passes under bf16 autocast (float32 weights, optimizer);
    ``max_seconds``: stop at the first step past it. ``checkpoint``: a file saved atomically
    every ``checkpoint_every`` seconds and at the end, from which a later call with the same
    model, batches and ``steps`` resumes exactly. ``on_log(step, metrics)`` every
    ``log_every`` steps (``distill/loss``, ``distill/lr``, ``distill/tokens_per_s``).

    >>> import copy, sparsekit as sk; torch.manual_seed(0) and None
    >>> teacher = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> student = copy.deepcopy(teacher)
    >>> pruner = sk.Pruner(student, pattern="2:4"); pruner.step(0)
    True
    >>> losses = distill_(student, teacher, [torch.randn(32, 8)], steps=20, lr=1e-2,
    ...                   pruner=pruner)
    >>> losses[-1] < losses[0], sk.sparsity_report(pruner.finalize()).global_sparsity
    (True, 0.5)
    """
    batches = list(_check_distill(model, batches, steps, pruner, warmup, precision, max_seconds))
    loop = _Loop(Distiller(teacher, task=task, **distiller), batches, steps, lr, warmup,
                 grad_clip, pruner, precision, max_seconds, on_log, log_every)
    optimizer = torch.optim.AdamW(loop.params(model), lr=lr, weight_decay=weight_decay)
    path = None if checkpoint is None else os.fspath(checkpoint)
    run = _resume(path, model, optimizer, steps) if path else DistillRun()
    model.train(dropout)
    try:
        loop.run(model, optimizer, run, path, checkpoint_every)
    finally:
        model.eval()
    return run


class _Loop:
    """:func:`distill_`'s steps, from where ``run`` stopped (its settings as attributes)."""

    def __init__(self, distiller: Distiller, batches: list, steps: int, lr: float, warmup: int,
                 grad_clip: float, pruner: Any, precision: str, max_seconds: float | None,
                 on_log: Callable[[int, dict[str, float]], None] | None,
                 log_every: int) -> None:
        self.d, self.batches, self.steps, self.lr, self.warmup = (distiller, batches, steps, lr,
                                                                  warmup)
        self.grad_clip, self.pruner, self.precision = grad_clip, pruner, precision
        self.max_seconds, self.on_log, self.log_every = max_seconds, on_log, log_every

    @staticmethod
    def params(model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer, run: DistillRun,
            path: str | None, checkpoint_every: float) -> None:
        device = next(model.parameters()).device
        bf16 = autocast(device, self.precision)
        start = saved = time.perf_counter()
        tokens0, seconds0 = run.tokens, run.seconds
        for step in range(run.steps_done, self.steps):
            if self.max_seconds is not None and time.perf_counter() - start >= self.max_seconds:
                run.finished = False
                break
            lr_now = lr_at(step, self.steps, self.lr, self.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            batch = to_device(self.batches[step % len(self.batches)], device)
            with bf16:
                _, loss = self.d(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.float().backward()
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params(model), self.grad_clip)
            optimizer.step()
            if self.pruner is not None:
                self.pruner.step(step)
            run.append(float(loss.detach()))
            run.steps_done, run.tokens = step + 1, run.tokens + batch_tokens(batch)
            now = time.perf_counter()
            run.seconds, run.tokens_per_s = (seconds0 + now - start,
                                             (run.tokens - tokens0) / (now - start))
            if self.on_log is not None and (step % self.log_every == 0 or
                                            step == self.steps - 1):
                on = {"distill/loss": run[-1], "distill/lr": lr_now,
                      "distill/tokens_per_s": run.tokens_per_s}
                self.on_log(step, on)
            if path and now - saved >= checkpoint_every:
                _save_state(path, model, optimizer, run)
                saved = now
        run.peak_memory_gb = peak_memory_gb(device)
        if path:
            _save_state(path, model, optimizer, run)


@torch.no_grad()
def embedding_agreement(model: nn.Module, reference: nn.Module, batches: Iterable[Any]) -> float:
    """The mean cosine between the pooled embeddings (:func:`pooled_embedding` of the last
    hidden state) of ``model`` and ``reference`` over all sequences of ``batches``: 1.0 when
    they agree exactly."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with eval_mode(model), eval_mode(reference):
        for batch in batches:
            batch = to_device(batch, device)
            outs = [_field(m(**batch) if isinstance(batch, Mapping) else m(batch),
                           "last_hidden", "pooled") for m in (model, reference)]
            mask = _attention_mask(batch)
            a, b = (pooled_embedding(o.float(), mask) for o in outs)
            cos = F.cosine_similarity(a, b, dim=-1, eps=1e-8)
            total += float(cos.sum())
            count += cos.numel()
    if count == 0:
        raise UsageError("embedding_agreement: no batch")
    return total / count
