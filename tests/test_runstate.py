"""Resume checkpoints: plain data, atomic, RNG states restored exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import FileFormatError
from sparsekit.io.runstate import (
    load_checkpoint,
    load_latest_checkpoint,
    previous_path,
    read_run_state,
    restore,
    save_checkpoint,
    write_run_state,
)


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
    with pytest.raises(FileFormatError, match="x.pt is not a sparsekit resume checkpoint"):
        load_checkpoint(tmp_path / "x.pt")


def _two_checkpoints(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "checkpoints" / "last.pt"
    save_checkpoint(path, step=4, model=model, optimizer=opt)
    save_checkpoint(path, step=9, model=model, optimizer=opt)
    return path


def test_damaged_last_checkpoint_falls_back_to_previous(tmp_path):
    path = _two_checkpoints(tmp_path)
    assert previous_path(path).name == "last.prev.pt"
    assert load_latest_checkpoint(path)["step"] == 9
    path.write_bytes(path.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match=r"last.pt is damaged.*previous checkpoint .*last.prev"):
        state = load_latest_checkpoint(path)
    assert state["step"] == 4
    # the damaged file is kept for inspection, out of the way of the next save
    assert not path.exists() and list(path.parent.glob("last.pt.corrupt-*"))


def test_unrecoverable_checkpoint_names_the_file(tmp_path):
    path = _two_checkpoints(tmp_path)
    for p in (path, previous_path(path)):
        p.write_bytes(b"\0" * 10)
    with pytest.raises(FileFormatError, match=r"cannot resume from .*last.pt"):
        load_latest_checkpoint(path)
    assert path.exists()  # a run directory's checkpoint is not discarded
    with pytest.warns(UserWarning, match="starting over"):
        assert load_latest_checkpoint(path, discard=True) is None  # a cache entry is
    assert not path.exists() and len(list(path.parent.glob("*.corrupt-*"))) == 2
    assert load_latest_checkpoint(tmp_path / "none.pt") is None


def test_run_state_file(tmp_path):
    assert read_run_state(tmp_path) is None
    write_run_state(tmp_path, "running")
    assert read_run_state(tmp_path)["state"] == "running"
    write_run_state(tmp_path, "failed", "ValueError: boom")
    assert read_run_state(tmp_path)["error"] == "ValueError: boom"
    with pytest.raises(ValueError, match="allowed: running, paused, failed, finished"):
        write_run_state(tmp_path, "stopped")
    (tmp_path / "run_state.json").write_text("{not json")
    assert read_run_state(tmp_path) is None
