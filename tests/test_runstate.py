"""Resume checkpoints: plain data, atomic, RNG states restored exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.runstate import load_checkpoint, restore, save_checkpoint


def test_roundtrip_restores_model_optimizer_pruner_and_rngs(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    pruner = sk.Pruner(model, pattern="2:4", schedule=sk.Linear(start=0, end=4, every=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        pruner.step(step)
    path = save_checkpoint(tmp_path / "ck.pt", step=2, model=model, optimizer=opt, pruner=pruner)
    expected = (torch.rand(3), np.random.rand(2), random.random())
    assert not list(tmp_path.glob(".*.tmp"))

    fresh = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fresh_pruner = sk.Pruner(fresh, pattern="2:4", schedule=sk.Linear(start=0, end=4, every=2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    torch.rand(100)  # move the RNGs: restore must put them back
    np.random.rand(7)
    state = load_checkpoint(path)  # weights_only=True inside
    assert restore(state, fresh, fresh_opt, fresh_pruner) == 3
    got = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and (got[1] == expected[1]).all()
    assert got[2] == expected[2]
    for name, mask in pruner.masks.items():
        assert torch.equal(fresh_pruner.masks[name], mask)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_pruner.progress == pruner.progress
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_rejects_foreign_files(tmp_path):
    torch.save({"hello": 1}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a sparsekit resume checkpoint"):
        load_checkpoint(tmp_path / "x.pt")
