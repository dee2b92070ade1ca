"""Criteria are registered by name: a toy criterion added from outside the package (one file,
one registration) works in the API, in the config schema, in --help and on the command line."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.run.config import Config, ConfigError, choices, validate
from sparsekit.prune.criteria import CRITERIA

# the toy: keep the *smallest* weights (the opposite of magnitude), so its masks are checkable
TOY = '''
import sparsekit as sk


class Smallest:
    """Scores 1 / (1 + |W|): the largest weights are pruned first."""

    def score(self, layers):
        return {name: 1 / (1 + layers.weight(name).abs().float()) for name in layers.modules}
'''
PLUGIN = "toy_sparsekit_plugin"


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    """``toy_criterion.py`` in tmp_path registering ``toy`` in code when imported."""
    (tmp_path / "toy_criterion.py").write_text(TOY + '\nsk.register_criterion("toy", Smallest())\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("toy_criterion")
    CRITERIA.unregister("toy")
    sys.modules.pop("toy_criterion", None)


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """An installed distribution (a dist-info on sys.path) declaring the entry point
    ``toy = toy_sparsekit_plugin:Smallest`` in the group ``sparsekit.criteria``."""
    (tmp_path / f"{PLUGIN}.py").write_text(TOY)
    info = tmp_path / "toy_sparsekit_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-sparsekit-plugin\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(f"[sparsekit.criteria]\ntoy = {PLUGIN}:Smallest\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    CRITERIA.unregister("toy")  # forget earlier scans, as a process started after the install
    yield tmp_path
    CRITERIA.unregister("toy")
    sys.modules.pop(PLUGIN, None)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_builtins_are_registered_once():
    assert CRITERIA.names()[:3] == ("magnitude", "wanda", "sparsegpt")
    assert choices()["prune.criterion"] == CRITERIA.names()
    assert sorted(CRITERIA) == sorted(set(CRITERIA.names()))  # each name once


def test_toy_criterion_from_the_api(toy_module):
    model = mlp()
    dense = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    sk.prune_(model, sparsity=0.25, criterion="toy")
    for w, layer in zip(dense, (model[0], model[2])):
        k = round(0.25 * w.numel())
        pruned = torch.zeros(w.numel(), dtype=torch.bool)
        pruned[w.abs().flatten().topk(k).indices] = True  # reference: the k largest go
        torch.testing.assert_close(layer.weight.detach().flatten(),
                                   torch.where(pruned, 0.0, w.flatten()))
    # 2:4: each group of 4 inputs keeps its 2 smallest weights
    model = mlp()
    w = model[0].weight.detach().clone()
    pruner = sk.Pruner(model, pattern="2:4", criterion="toy")
    pruner.step(0)
    groups = w.abs().reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(2, dim=1, largest=False).indices, True)
    assert torch.equal(pruner.masks["0"], keep.reshape(w.shape))
    assert pruner.state_dict()["criterion"] == "toy"


def test_toy_criterion_reaches_config_and_help(toy_module):
    cfg = Config()
    cfg.prune.criterion = "toy"
    validate(cfg)  # a scoring criterion: any schedule
    assert "toy" in choices()["prune.criterion"]
    CRITERIA.unregister("toy")
    with pytest.raises(ConfigError, match="prune.criterion='toy' is not allowed; choose one of: "
                                          "magnitude, wanda, sparsegpt"):
        validate(cfg)


def test_a_score_of_the_wrong_shape_names_the_criterion_and_layer():
    class Bad:
        def score(self, layers):
            return {n: torch.zeros(3) for n in layers.modules}

    sk.register_criterion("bad_shape", Bad())
    try:
        with pytest.raises(TypeError, match="criterion 'bad_shape' gave layer '0' a score"):
            sk.prune_(mlp(), sparsity=0.5, criterion="bad_shape")
    finally:
        CRITERIA.unregister("bad_shape")
    sk.register_criterion("negative", type("Negative", (), {
        "score": lambda self, layers: {n: -layers.weight(n).abs() for n in layers.modules}})())
    try:
        with pytest.raises(ValueError, match="criterion 'negative' gave layer '0' negative"):
            sk.prune_(mlp(), sparsity=0.5, criterion="negative")
    finally:
        CRITERIA.unregister("negative")
    with pytest.raises(TypeError, match="score\\(layers\\) or a solve"):
        sk.register_criterion("nothing", object())


def test_a_name_never_imports_code(tmp_path, monkeypatch):
    """A name that no installed distribution declares is refused, not imported, even when a
    module of that name is importable (a checkpoint or run directory names criteria, not code)."""
    (tmp_path / "evil_criterion.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("evil_criterion", "evil_criterion:Smallest"):
        with pytest.raises(ValueError, match=f"unknown criterion '{name}'"):
            sk.Pruner(mlp(), sparsity=0.5, criterion=name)
    pruner = sk.Pruner(mlp(), sparsity=0.5)
    with pytest.raises(ValueError, match="criterion='evil_criterion'"):
        pruner.load_state_dict({**pruner.state_dict(), "criterion": "evil_criterion"})
    assert "evil_criterion" not in sys.modules


@pytest.mark.slow
def test_toy_plugin_from_the_command_line(toy_plugin, tmp_path, capsys):
    """``sparsekit prune.criterion=toy``, the toy installed as an entry point: its one-shot
    masks (no fine-tuning) are the complement of magnitude's on the same dense model."""
    from test_cli import TINY_MNIST, run_cli

    args = ["prune=unstructured", "prune.sparsity=0.5", "schedule=oneshot",
            "prune.fine_tune=false", "bench=off", "tracker=none",
            f"cache_dir={tmp_path / 'cache'}", *TINY_MNIST]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(toy_plugin), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "sparsekit", *args, "prune.criterion=toy",
                           "hydra.run.dir=toy"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # here too the toy is only an entry point (the fixture put its dist-info on sys.path)
    code, help_text, _ = run_cli(["--help"], tmp_path, capsys)
    assert code == 0 and "prune.criterion: magnitude, wanda, sparsegpt, alps, toy" in help_text
    code, _, err = run_cli([*args, "prune.criterion=magnitude", "hydra.run.dir=mag"],
                           tmp_path, capsys)
    assert code == 0, err
    toy, mag = (sk.load(tmp_path / d / "model.safetensors").state_dict() for d in ("toy", "mag"))
    weights = [k for k in toy if k.endswith("weight")]
    assert weights
    for k in weights:
        assert not ((toy[k] != 0) & (mag[k] != 0)).any(), k  # disjoint masks
    # together: the dense weights (one threshold over all layers: prune=unstructured is global)
    toy_w, mag_w = (torch.cat([sd[k].flatten() for k in weights]) for sd in (toy, mag))
    dense = (toy_w + mag_w).abs()
    assert int((toy_w == 0).sum()) == int((mag_w == 0).sum()) == dense.numel() // 2
    assert dense[toy_w != 0].max() <= dense[toy_w == 0].min()  # the toy kept the smallest


def test_unknown_criterion_on_the_command_line_lists_the_registered_ones(tmp_path, capsys):
    from test_cli import run_cli

    code, _, err = run_cli(["prune.criterion=toy"], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "prune.criterion='toy' is not allowed; choose one of: magnitude, wanda, sparsegpt" in err
    assert not Path(tmp_path / "runs").exists()
