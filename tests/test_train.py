"""The training loop: learning-rate schedule, deterministic batches, distillation loss,
evaluation, and masks that stay put while fine-tuning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import sparsekit as sk
from sparsekit.run.train import (
    batch_indices,
    distill_loss,
    eval_batches,
    evaluate,
    fit,
    lr_at,
    make_optimizer,
)


def blobs(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    centers = torch.randn(4, 16, generator=g) * 3
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y)


def test_lr_schedule():
    assert lr_at(0, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    mid = 10 + 45
    assert lr_at(mid, 100, 1.0, warmup=10) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at(50, 100, 0.3, schedule="constant") == 0.3


def test_batches_cover_each_epoch_once_and_are_reproducible():
    n, bs = 50, 8  # 6 full batches per epoch, 2 samples dropped
    epoch0 = torch.cat([batch_indices(n, bs, seed=3, step=s) for s in range(6)])
    assert len(set(epoch0.tolist())) == 48
    assert torch.equal(batch_indices(n, bs, 3, 4), batch_indices(n, bs, 3, 4))
    assert not torch.equal(batch_indices(n, bs, 3, 0), batch_indices(n, bs, 3, 6))  # new epoch
    assert not torch.equal(batch_indices(n, bs, 3, 0), batch_indices(n, bs, 4, 0))


def test_distill_loss_matches_formula_in_float64():
    s, t, temp = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64), 3.0
    p_t = torch.softmax(t / temp, -1)
    ref = (p_t * (p_t.log() - torch.log_softmax(s / temp, -1))).sum(-1).mean() * temp**2
    torch.testing.assert_close(distill_loss(s, t, temp), ref)
    assert distill_loss(t, t, temp).item() == pytest.approx(0.0, abs=1e-12)
    # token logits (B, T, V) average over tokens
    s3, t3 = s.view(1, 5, 7), t.view(1, 5, 7)
    torch.testing.assert_close(distill_loss(s3, t3, temp), ref)


def test_evaluate_against_reference():
    ds = blobs(70)
    model = nn.Linear(16, 4)
    out = evaluate(model, ds, "classification", batch_size=32, quiet=True)
    x, y = ds.tensors
    with torch.no_grad():
        logits = model(x)
    assert out["accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    assert out["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    lm = evaluate(model, ds, "lm", batch_size=32, quiet=True)
    assert lm["perplexity"] == pytest.approx(math.exp(lm["loss"]))
    assert len(list(eval_batches(ds, 32, max_batches=2))) == 2


def test_fit_learns_and_respects_masks():
    ds = blobs()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = evaluate(model, ds, "classification", quiet=True)["accuracy"]
    opt = make_optimizer(model.parameters(), "adamw", 1e-2)
    fit(model, ds, opt, steps=60, lr=1e-2, batch_size=32, seed=0, quiet=True)
    after = evaluate(model, ds, "classification", quiet=True)["accuracy"]
    assert after > max(0.9, before)

    pruner = sk.Pruner(model, pattern="2:4", schedule=sk.OneShot(0))
    seen = []
    fit(model, ds, opt, steps=20, lr=1e-3, batch_size=32, seed=1, pruner=pruner,
        teacher=None, on_step=lambda s, m: seen.append((s, m)), quiet=True)
    assert [s for s, _ in seen] == list(range(20))
    assert set(seen[0][1]) == {"train/loss", "train/lr", "train/tokens_per_s"}  # CPU: no memory
    assert seen[0][1]["train/tokens_per_s"] > 0  # samples a second for a classifier
    seen.clear()
    fit(model, ds, opt, steps=20, lr=1e-3, batch_size=32, seed=1, pruner=pruner,
        on_step=lambda s, m: seen.append((s, m)), quiet=True, log_every=8)
    assert [s for s, m in seen if m] == [0, 8, 16, 19]  # the loss is read only when logged
    assert [s for s, _ in seen] == list(range(20))
    zeros = (model[0].weight == 0).reshape(32, -1, 4).sum(-1)
    assert bool((zeros >= 2).all())  # the 2:4 pattern held through 19 optimizer steps


def test_fit_without_dropout_trains_in_eval_mode():
    """dropout=False: at lr 0 the logged loss of every step is the eval-mode loss of its
    batch (dropout p=0.5 would change it), and the model trains in eval mode."""
    ds = blobs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    opt = make_optimizer(model.parameters(), "adamw", 0.0)
    for dropout in (False, True):
        seen: list = []
        fit(model, ds, opt, steps=3, lr=0.0, batch_size=32, seed=0, dropout=dropout,
            on_step=lambda s, m, seen=seen: seen.append((m["train/loss"], model.training)),
            quiet=True)
        with torch.no_grad():
            want = [F.cross_entropy(model.eval()(ds[batch_indices(len(ds), 32, 0, s)][0]),
                                    ds[batch_indices(len(ds), 32, 0, s)][1]).item()
                    for s in range(3)]
        got = [loss for loss, _ in seen]
        assert (got == pytest.approx(want, rel=1e-5)) is not dropout
        assert [training for _, training in seen] == [dropout] * 3


def test_fit_with_distillation_moves_towards_teacher():
    ds = blobs()
    teacher = nn.Linear(16, 4)
    student = nn.Linear(16, 4)
    x = ds.tensors[0]
    gap = lambda: distill_loss(student(x), teacher(x), 2.0).item()  # noqa: E731
    start = gap()
    opt = make_optimizer(student.parameters(), "adam", 5e-2)
    fit(student, ds, opt, steps=40, lr=5e-2, batch_size=64, seed=0, teacher=teacher,
        distill_alpha=1.0, temperature=2.0, quiet=True)
    assert gap() < 0.2 * start


def test_make_optimizer_rejects_unknown():
    with pytest.raises(ValueError, match="train.optimizer"):
        make_optimizer(nn.Linear(2, 2).parameters(), "lion", 1e-3)
