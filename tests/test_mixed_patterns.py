"""Mixed patterns (2:4 where it is cheap, dense where it hurts): allocate honours its target
exactly, prune_ takes a per-layer pattern mapping; SparseGPT block by block with a
calibration_fn that splits batches, and its non-sequential option."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.prune import sparsegpt
from sparsekit.prune.patterns import is_nm
from sparsekit.nn.select import select_modules
from sparsekit.prune.sparsegpt import obs_prune


def table24(degradations, params):
    names = [f"l{i}" for i in range(len(params))]
    return sk.SensitivityTable([0.5], 1.0, {n: [1.0 + d] for n, d in zip(names, degradations)},
                               dict(zip(names, params)), pattern="2:4")


@pytest.mark.parametrize("seed", range(5))
def test_dense_layers_is_exactly_the_n_most_sensitive(seed):
    g = torch.Generator().manual_seed(seed)
    degr = torch.rand(12, generator=g).tolist()
    params = torch.randint(10, 1000, (12,), generator=g).tolist()
    t = table24(degr, params)
    for n in (0, 1, 5, 12):
        plan = sk.allocate(t, dense_layers=n)
        dense = {k for k, v in plan.items() if v == "dense"}
        assert len(dense) == n
        assert set(plan.values()) <= {"dense", "2:4"}
        worst = sorted(t.metrics, key=lambda k: -t.metrics[k][0])[:n]
        assert dense == set(worst)


@pytest.mark.parametrize("seed", range(5))
def test_dense_params_never_exceeds_its_budget_and_is_maximal(seed):
    g = torch.Generator().manual_seed(seed)
    degr = torch.rand(10, generator=g).tolist()
    params = torch.randint(10, 1000, (10,), generator=g).tolist()
    t = table24(degr, params)
    total = sum(params)
    for frac in (0.0, 0.1, 0.3, 0.6):
        plan = sk.allocate(t, dense_params=frac)
        used = sum(t.params[k] for k, v in plan.items() if v == "dense")
        assert used <= frac * total
        left = [k for k, v in plan.items() if v != "dense"]
        assert all(used + t.params[k] > frac * total for k in left)  # nothing else fits


def test_allocate_refuses_mixed_targets():
    t = table24([0.1, 0.2], [10, 10])
    with pytest.raises(UsageError, match="give exactly one of dense_layers"):
        sk.allocate(t, dense_layers=1, dense_params=0.5)
    with pytest.raises(UsageError, match="not target= or max_level="):
        sk.allocate(t, 0.5)
    with pytest.raises(UsageError, match=r"dense_layers=3 must be an integer in \[0, 2\]"):
        sk.allocate(t, dense_layers=3)


def test_sensitivity_at_24_then_prune_with_the_mapping():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                        nn.Linear(16, 4))
    x = torch.randn(64, 8)
    target = net(x).detach()

    def mse(m):
        with torch.no_grad():
            return float((m(x) - target).pow(2).mean())

    table = sk.sensitivity(net, mse, pattern="2:4")
    plan = sk.allocate(table, dense_layers=1)
    worst = max(table.metrics, key=lambda k: table.metrics[k][0])
    assert plan[worst] == "dense"
    before = {k: m.weight.detach().clone() for k, m in select_modules(net).items()}
    report = sk.prune_(net, pattern=plan)
    for name, m in select_modules(net).items():
        if name == worst:
            assert torch.equal(m.weight, before[name])
            assert report.layers[name].skipped == "dense in the per-layer pattern"
        else:
            assert is_nm(m.weight, 2, 4) and report.layers[name].sparsity == 0.5
    # unstructured and 2:4 in one mapping; a key that matches nothing is an error
    net2 = copy.deepcopy(net)
    rep = sk.prune_(net2, 0.75, pattern={"0": "unstructured", "*": "2:4"})
    assert rep.layers["0"].sparsity == 0.75 and rep.layers["2"].sparsity == 0.5
    with pytest.raises(UsageError, match="pattern key 'nope' matches no selected layer"):
        sk.prune_(net2, pattern={"nope": "dense"})
    with pytest.raises(UsageError, match=r"pattern\['0'\]: unknown pattern '3:9x'"):
        sk.prune_(net2, pattern={"0": "3:9x"})


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.relu(self.fc1(h)))


class Stack(nn.Module):
    def __init__(self, d=8, n=3, shared=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.shared = shared

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if self.shared:  # block 0 used twice: its calls cannot be replayed one block at a time
            x = self.blocks[0](x)
        return x


def split_halves(model, batch):
    """A calibration_fn that feeds each batch in two halves."""
    half = batch["x"].shape[0] // 2
    model(batch["x"][:half])
    model(batch["x"][half:])


def test_blocks_one_at_a_time_with_a_calibration_fn_that_splits(monkeypatch):
    torch.manual_seed(0)
    model = Stack()
    twin = copy.deepcopy(model)
    batches = [{"x": torch.randn(16, 8)} for _ in range(3)]
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    mods = select_modules(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        got = sparsegpt.sparsegpt_prune(model, mods, {}, (2, 4), batches, split_halves,
                                        blocksize=8)
    # one batch for the call order, one recording pass: not one pass per layer group
    assert len(calls) == 2 * (1 + len(batches))
    monkeypatch.setattr(sparsegpt, "find_blocks", lambda *a: None)
    twin_mods = select_modules(twin)
    want = sparsegpt.sparsegpt_prune(twin, twin_mods, {}, (2, 4), batches, split_halves,
                                     blocksize=8)
    for k in got:
        assert torch.equal(got[k], want[k]), k
        torch.testing.assert_close(mods[k].weight, twin_mods[k].weight, rtol=0, atol=1e-5)


def test_shared_blocks_fall_back_with_a_warning():
    torch.manual_seed(0)
    model = Stack(shared=True)
    with pytest.warns(RuntimeWarning, match="not all called equally often"):
        sparsegpt.sparsegpt_prune(model, select_modules(model), {}, (2, 4),
                                  [torch.randn(8, 8)], blocksize=8)
    assert all(is_nm(m.weight, 2, 4) for m in select_modules(model).values())


@pytest.mark.parametrize("blocks", [False, True])
def test_not_sequential_uses_the_dense_inputs(blocks, monkeypatch):
    torch.manual_seed(0)
    model = Stack(n=2)
    dense = copy.deepcopy(model)
    if not blocks:
        monkeypatch.setattr(sparsegpt, "find_blocks", lambda *a: None)
    x = torch.randn(32, 8)
    sparsegpt.sparsegpt_prune(model, select_modules(model), {}, (2, 4), [x], blocksize=8,
                              sequential=False)
    # the last layer's Hessian from the dense model's inputs to it
    seen = []
    dense.blocks[1].fc2.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    dense(x)
    inp = seen[0].reshape(-1, 16).double()
    h = (2 * inp.T @ inp / inp.shape[0]).float()
    want, _ = obs_prune(dense.blocks[1].fc2.weight, h, nm=(2, 4), blocksize=8)
    torch.testing.assert_close(model.blocks[1].fc2.weight, want, rtol=1e-5, atol=1e-5)


def test_command_line_keeps_the_most_sensitive_layers_dense(hf_dirs, tmp_path, capsys):
    import json

    from test_cli import run_cli

    args = ["recipe=llm_sparsegpt_24", f"model.path={hf_dirs['llama']}",
            f"data.path={hf_dirs['text']}", f"cache_dir={tmp_path / 'c'}", "data.seq_len=32",
            "prune.calibration_batches=2", "data.eval_batches=2", "data.batch_size=4",
            "train.quiet=true", "tracker=none", "sensitivity.enabled=true",
            "sensitivity.dense_layers=2", "prune.options.blocksize=32"]
    code, _, err = run_cli(args, tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    sens = json.loads((run_dir / "sensitivity.json").read_text())
    dense = [n for n, v in sens["allocation"].items() if v == "dense"]
    degr = {n: v[0] for n, v in sens["table"]["metrics"].items()}
    assert sorted(dense) == sorted(sorted(degr, key=lambda n: -degr[n])[:2])
    model = sk.load(run_dir / "model.safetensors")
    for name in sens["allocation"]:
        weight = model.get_submodule(name).weight
        assert is_nm(weight, 2, 4) != (name in dense), name
