"""sensitivity(): exact restore, metrics against a direct computation; allocate(): target met,
optimal against brute force, prefers insensitive layers; TensorBoard charts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.prune.sensitivity import SensitivityTable


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.fc1 = nn.Linear(8 * 8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


def make_case(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    net.bn.running_mean.uniform_(-0.1, 0.1)  # non-default buffers
    x = torch.randn(64, 4, 8)
    target = net(x).detach() + 0.1 * torch.randn(64, 4)

    def mse(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return float(((model(x) - target) ** 2).mean())

    return net, x, mse


@pytest.mark.parametrize(
    ("criterion", "pattern"),
    [("magnitude", "unstructured"), ("wanda", "unstructured"), ("sparsegpt", "2:4")],
)
def test_restores_every_tensor_exactly_and_measures_each_layer_alone(criterion, pattern):
    net, x, mse = make_case()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = {n: p for n, p in net.named_parameters()}
    calib = [x[:32], x[32:]]
    kwargs = {} if pattern != "unstructured" else {"sparsities": [0.3, 0.8]}
    table = sk.sensitivity(
        net, mse, pattern=pattern, criterion=criterion, calibration=calib, **kwargs
    )
    after = net.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is params[n] for n, p in net.named_parameters())
    assert net.training  # the training flag is restored too
    assert list(table.metrics) == ["conv", "fc1", "fc2"]
    for name, values in table.metrics.items():
        for level, value in zip(table.levels, values):
            ref = copy.deepcopy(net)
            sparsity = None if pattern != "unstructured" else level
            sk.prune_(ref, sparsity, pattern=pattern, criterion=criterion, include=[name],
                      calibration=calib)
            assert value == pytest.approx(mse(ref), rel=1e-6), (name, level)
            assert value != pytest.approx(table.baseline)
    assert table.params == {"conv": 96, "fc1": 2048, "fc2": 128}


def test_restores_when_evaluate_raises():
    net, _, mse = make_case()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    calls = []

    def flaky(model):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("evaluation failed")
        return mse(model)

    with pytest.raises(RuntimeError, match="evaluation failed"):
        sk.sensitivity(net, flaky, sparsities=[0.5, 0.9])
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_nm_table_lists_layers_that_cannot_take_the_pattern():
    net, _, mse = make_case()
    net.conv = nn.Conv1d(4, 8, 3, padding=1, groups=2)  # in/groups * kernel = 6
    table = sk.sensitivity(net, mse, pattern="2:4")
    assert table.levels == [0.5]
    assert list(table.metrics) == ["fc1", "fc2"]
    assert "multiple of M=4" in table.skipped["conv"]
    assert "skipped" in str(table)


def test_str_and_dict_round_trip():
    net, _, mse = make_case()
    table = sk.sensitivity(net, mse, sparsities=[0.5], include=["fc*"])
    assert SensitivityTable.from_dict(table.to_dict()) == table
    lines = str(table).splitlines()
    assert lines[0].split() == ["layer", "params", "0%", "50%"]
    assert lines[1].split()[:2] == ["fc1", "2048"]


def predicted(table: SensitivityTable, levels: dict[str, float]) -> float:
    """The documented prediction: sum of per-layer degradations, linearly interpolated."""
    total = 0.0
    for name, level in levels.items():
        xs = torch.tensor([0.0, *table.levels], dtype=torch.float64)
        ys = torch.tensor([0.0, *table.degradation(name)], dtype=torch.float64)
        i = int(
            torch.searchsorted(xs, torch.tensor(level, dtype=torch.float64)).clamp(1, len(xs) - 1)
        )
        t = (level - xs[i - 1]) / (xs[i] - xs[i - 1])
        total += float(ys[i - 1] + t * (ys[i] - ys[i - 1]))
    return total


def weighted(table: SensitivityTable, levels: dict[str, float]) -> float:
    return sum(levels[n] * table.params[n] for n in levels) / sum(table.params.values())


def test_allocate_meets_target_and_is_optimal_against_brute_force():
    # convex degradation curves: "b" is sensitive, "a" is not; accuracy-like (higher is better)
    table = SensitivityTable(
        levels=[0.25, 0.5, 0.75, 0.9],
        baseline=0.9,
        metrics={"a": [0.9, 0.89, 0.86, 0.8], "b": [0.88, 0.8, 0.6, 0.3]},
        params={"a": 3000, "b": 1000},
        higher_is_better=True,
    )
    for target in (0.3, 0.5, 0.7):
        levels = sk.allocate(table, target)
        assert weighted(table, levels) == pytest.approx(target, abs=1e-9)
        assert levels["a"] > levels["b"]
        best = predicted(table, levels)
        for i in range(901):  # every level of "a" on a 0.001 grid, "b" fills the target
            la = i / 1000
            lb = (target * 4000 - la * 3000) / 1000
            if 0 <= lb <= 0.9:
                assert predicted(table, {"a": la, "b": lb}) >= best - 1e-9


def test_allocate_on_a_measured_table_drives_the_pruner():
    net, x, mse = make_case()
    table = sk.sensitivity(net, mse, sparsities=[0.25, 0.5, 0.75, 0.9])
    levels = sk.allocate(table, 0.6)
    assert set(levels) == {"conv", "fc1", "fc2"}
    assert weighted(table, levels) == pytest.approx(0.6, abs=1e-9)
    report = sk.prune_(net, sparsity=levels)
    zeros = sum(report.layers[n].zeros for n in levels)
    assert abs(zeros - 0.6 * sum(table.params.values())) <= len(levels) / 2


def test_allocate_bad_input():
    table = SensitivityTable([0.5], 1.0, {"a": [2.0]}, {"a": 10})
    with pytest.raises(ValueError, match="reachable"):
        sk.allocate(table, 0.6)
    with pytest.raises(ValueError, match="target"):
        sk.allocate(table, 1.0)
    with pytest.raises(ValueError, match="unstructured"):
        sk.allocate(SensitivityTable([0.5], 1.0, {"a": [2.0]}, {"a": 8}, pattern="2:4"), 0.2)


def test_sensitivity_bad_input():
    net, _, mse = make_case()
    with pytest.raises(ValueError, match="sparsities"):
        sk.sensitivity(net, mse, sparsities=[0.5, 1.0])
    with pytest.raises(ValueError, match="leave sparsities=None"):
        sk.sensitivity(net, mse, sparsities=[0.5], pattern="2:4")
    with pytest.raises(ValueError, match="calibration"):
        sk.sensitivity(net, mse, criterion="wanda")


def test_log_sensitivity_one_chart_per_layer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    table = SensitivityTable(
        [0.5, 0.9], 2.0, {"a": [2.5, 4.0], "b.c": [2.1, 2.2]}, {"a": 1, "b.c": 1}
    )
    with SummaryWriter(str(tmp_path)) as writer:
        table.log(writer)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["sensitivity/a", "sensitivity/b.c"]
    got = [(e.step, e.value) for e in events.Scalars("sensitivity/a")]
    assert got == [(0, 2.0), (50, 2.5), (90, 4.0)]


def test_pipeline_sensitivity_stage_sets_per_layer_levels(tmp_path):
    """``sensitivity.enabled=true sensitivity.target=0.6`` on the (tiny) text-LM recipe: the scan
    is written, sk.allocate's levels reach the target, and the pruner applies them."""
    import json

    from hydra import compose, initialize_config_dir

    from sparsekit.run.cli import register_configs, to_config
    from sparsekit.prune.patterns import prune_count
    from sparsekit.run.pipeline import run
    from sparsekit.run.resources import conf_dir

    overrides = [
        "recipe=stdlib_lm_24",
        "model.kwargs.d_model=16",
        "model.kwargs.n_layers=1",
        "model.kwargs.n_heads=2",
        "model.kwargs.seq_len=16",
        "data.kwargs.seq_len=16",
        "data.kwargs.max_bytes=20000",
        "data.batch_size=4",
        "data.eval_batches=1",
        "train.dense_steps=2",
        "train.warmup_steps=1",
        "train.quiet=true",
        "bench.enabled=false",
        "prune.pattern=unstructured",
        "prune.criterion=magnitude",
        "prune.sparsity=0.5",
        "prune.fine_tune=false",
        "sensitivity.enabled=true",
        "sensitivity.sparsities=[0.5,0.9]",
        "sensitivity.target=0.6",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = to_config(compose("config", overrides=overrides))
    summary = run(cfg, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "sensitivity.json").read_text())
    table, levels = SensitivityTable.from_dict(saved["table"]), saved["allocation"]
    assert set(levels) == {"blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2"}
    assert weighted(table, levels) == pytest.approx(0.6, abs=1e-9)
    zeros = sum(prune_count(table.params[n], lv) for n, lv in levels.items())
    assert summary["sparsity"] == zeros / sum(table.params.values())
    assert "blocks.0.fc1" in (tmp_path / "run" / "sensitivity.md").read_text()


def test_config_rejects_inconsistent_sensitivity_options():
    from sparsekit.run.config import Config, ConfigError, validate

    cfg = Config()  # prune.pattern 2:4: no per-layer levels to allocate
    cfg.sensitivity.enabled, cfg.sensitivity.target = True, 0.5
    with pytest.raises(ConfigError, match="sensitivity.target=0.5 needs"):
        validate(cfg)
    cfg.sensitivity.target, cfg.sensitivity.sparsities = None, [0.5, 1.0]
    with pytest.raises(ConfigError, match="sensitivity.sparsities"):
        validate(cfg)
