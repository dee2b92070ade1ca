"""Clear errors, nothing silently wrong (issue 13, items 9-12): each case asserts the error type,
that its message names the layer, option or file, and that nothing was changed by a refusal."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

import sparsekit as sk
import sparsekit.run.context as context
import sparsekit.run.pipeline as pipeline
from sparsekit.nn.calibration import call_model, eval_mode, run_calibration
from sparsekit.run.cli import check_overrides, main, register_configs
from sparsekit.errors import (
    ConfigTypeError,
    FileFormatError,
    ModelCallError,
    NumericsError,
    StorageError,
    UnsafeFileError,
    UsageError,
    storage_errors,
)
from sparsekit.run.train import evaluate


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# item 12: calibration runs without autograd


def test_eval_mode_turns_autograd_off_and_restores_training():
    model = mlp().train()
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(
        (torch.is_grad_enabled(), out.requires_grad, m.training)))
    with eval_mode(model):
        assert not torch.is_grad_enabled()
        out = model(torch.randn(2, 8))
    assert not out.requires_grad and out.grad_fn is None  # no graph recorded
    assert torch.is_grad_enabled() and model.training
    run_calibration(model, [torch.randn(2, 8)])
    assert seen == [(False, False, False), (False, False, False)]
    assert torch.is_grad_enabled() and model.training
    with eval_mode(model, grad=True):  # channel pruning traces autograd graphs
        assert model(torch.randn(2, 8)).requires_grad


# ---------------------------------------------------------------------------------------------
# item 11: calibration calls name the layer, the batch and calibration_fn


def test_wrong_shape_batch_names_the_layer_and_the_shape():
    model = mlp()
    with pytest.raises(ModelCallError) as e:
        sk.prune_(model, 0.5, criterion="wanda", calibration=[torch.randn(3, 8)] * 2 +
                  [torch.randn(3, 7)])
    msg = str(e.value)
    assert "layer '0' (Linear)" in msg and "tensor(3, 7)" in msg and "mat1 and mat2" in msg


class DictModel(nn.Module):
    """sentence-transformers style: ``forward(self, features: dict)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, features: dict) -> torch.Tensor:
        return self.fc(features["x"] * features["scale"])


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x * scale)


def test_dict_batches_go_by_keyword_or_as_one_dict_by_signature():
    batch = {"x": torch.randn(5, 8), "scale": torch.tensor(2.0)}
    for cls in (DictModel, KwModel):
        model = cls()
        ref = model.fc(batch["x"] * 2.0)
        torch.testing.assert_close(call_model(model, batch), ref)
        report = sk.prune_(model, 0.5, criterion="wanda", calibration=[batch])
        assert report.global_sparsity == pytest.approx(0.5)


def test_batches_that_fit_no_signature_say_how_to_pass_calibration_fn():
    with pytest.raises(ModelCallError, match="calibration_fn=lambda model, batch"):
        call_model(KwModel(), {"x": torch.randn(2, 8)})  # scale missing
    with pytest.raises(ModelCallError, match=r"tuple\(tensor\(2, 8\), tensor\(2\)\)"):
        call_model(mlp(), (torch.randn(2, 8), torch.zeros(2)))  # (x, y) pairs
    with pytest.raises(ConfigTypeError, match="calibration_fn"):
        call_model(mlp(), "text")
    with pytest.raises(ConfigTypeError, match=r"calibration=\[batch\]"):
        run_calibration(mlp(), torch.randn(2, 8))
    for criterion in ("wanda", "sparsegpt"):  # not iterated row by row as 1-sample batches
        with pytest.raises(ConfigTypeError, match=r"got one tensor\(3, 8\)"):
            sk.prune_(mlp(), 0.5, criterion=criterion, calibration=torch.randn(3, 8))
    # calibration_fn serves any other model
    seen = []
    run_calibration(DictModel(), [[1, 2]], lambda m, b: seen.append(b))
    assert seen == [[1, 2]]


def test_bad_regex_names_the_pattern():
    with pytest.raises(UsageError, match=r"'re:\[' is not a valid regular expression"):
        sk.Pruner(mlp(), 0.5, include="re:[")
    with pytest.raises(ConfigTypeError, match="must be strings"):
        sk.Pruner(mlp(), 0.5, include=[3])


def test_load_state_dict_checks_every_field_before_changing_anything():
    model = mlp()
    pruner = sk.Pruner(model, 0.5)
    pruner.step(0)
    good = pruner.state_dict()
    before = {n: m.clone() for n, m in pruner.masks.items()}
    bad_cases = [
        ({"version": 1}, UsageError, "lacks field"),
        ({**good, "version": 7}, UsageError, r"state\['version'\] is 7"),
        ({**good, "progress": 5.0}, UsageError, r"\['progress'\] must be a number in \[0, 1\]"),
        ({**good, "progress": float("nan")}, UsageError, "progress"),
        ({**good, "progress": "1"}, UsageError, "progress"),
        ({**good, "last_step": -5}, UsageError, "last_step"),
        ({**good, "last_step": 1.5}, UsageError, "last_step"),
        ({**good, "criterion": "random"}, UsageError, "criterion='random'"),
        ({**good, "masks": {"0": good["masks"]["0"]}}, UsageError, "covers layers"),
        ({**good, "masks": {**good["masks"], "0": torch.ones(3, 3, dtype=torch.bool)}},
         UsageError, r"state\['masks'\]\['0'\] has shape \(3, 3\)"),
        ({**good, "masks": {**good["masks"], "0": good["masks"]["0"].float()}},
         ConfigTypeError, "must be a bool tensor"),
        ([1, 2], ConfigTypeError, "must be a dict"),
    ]
    for state, err, match in bad_cases:
        with pytest.raises(err, match=match):
            pruner.load_state_dict(state)
        assert all(torch.equal(pruner.masks[n], before[n]) for n in before), state
    assert pruner.progress == 1.0
    nm = sk.Pruner(mlp(), pattern="2:4")
    wrong = {**nm.state_dict(), "masks": {k: torch.zeros_like(v) for k, v in
                                          nm.state_dict()["masks"].items()}}
    with pytest.raises(UsageError, match="not a 2:4 mask"):
        nm.load_state_dict(wrong)
    pruner.load_state_dict(good)  # a valid state still loads


# ---------------------------------------------------------------------------------------------
# item 10 / 11: numerics


def test_nan_weights_and_activations_name_the_layer():
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    keys, before = list(model.state_dict()), state_of(model)
    for criterion in ("magnitude", "sparsegpt"):
        with pytest.raises(NumericsError, match="layer '2' has 1 non-finite") as e:
            sk.prune_(model, 0.5, criterion=criterion, calibration=[torch.randn(4, 8)])
        assert "percdamp" not in str(e.value)
        assert list(model.state_dict()) == keys  # rolled back: no masks left behind
        torch.testing.assert_close(state_of(model), before, equal_nan=True)
    x = torch.randn(4, 8)
    x[0, 3] = float("nan")
    for criterion in ("wanda", "sparsegpt"):
        with pytest.raises(NumericsError, match="calibration inputs of layer '0'"):
            sk.prune_(mlp(), 0.5, criterion=criterion, calibration=[x])


# ---------------------------------------------------------------------------------------------
# item 10: silent wrongs


def test_second_pruner_on_the_same_layers_is_refused():
    model = mlp()
    first = sk.Pruner(model, 0.8)
    with pytest.raises(UsageError, match="layer '0' already has a pruning mask"):
        sk.Pruner(model, 0.5)
    with pytest.raises(UsageError, match="layer '2' already has a pruning mask"):
        sk.Pruner(model, 0.5, include="2")
    first.step(0)  # the 0.8 pruner's masks are its own: 0.8, not the 0.5 of the refused one
    assert first.report().global_sparsity == pytest.approx(0.8, abs=0.01)
    assert len(model[0].parametrizations.weight) == 1


def test_pruners_on_disjoint_layers_are_independent():
    model = mlp()
    a = sk.Pruner(model, 0.8, include="0")
    b = sk.Pruner(model, 0.25, include="2")
    a.step(0)
    b.step(0)
    assert a.report().layers["0"].sparsity == pytest.approx(0.8, abs=0.01)
    assert b.report().layers["2"].sparsity == pytest.approx(0.25)
    a.finalize()
    assert sk.Pruner(model, 0.5, include="0") is not None  # finalized: free again


def test_failed_prune_leaves_the_model_as_it_was():
    model = mlp()
    keys, before = list(model.state_dict()), state_of(model)
    with pytest.raises(ModelCallError, match="layer '0'"):
        sk.prune_(model, 0.5, criterion="wanda", calibration=[torch.randn(2, 5)])
    assert list(model.state_dict()) == keys
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    torch.testing.assert_close(state_of(model), before)
    assert sk.prune_(model, 0.5).global_sparsity == pytest.approx(0.5)  # and can be pruned


def test_channel_pruning_a_quantized_model_is_refused():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    sk.quantize_(model, "int8_weight_only")
    with pytest.raises(UsageError, match=r"quantized: 0 \(int8_weight_only\), 2 "):
        sk.prune_channels_(model, torch.randn(2, 8), ratio=0.5)


def test_channel_ratio_that_rounding_turns_into_nothing_is_an_error():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    before = state_of(model)
    with pytest.raises(UsageError, match=r"ratio 0.8 with round_to=4 removed no channel"):
        sk.prune_channels_(model, torch.randn(2, 8), ratio=0.8, round_to=4)
    torch.testing.assert_close(state_of(model), before)  # the model is as it was
    report = sk.prune_channels_(model, torch.randn(2, 8), ratio=0.5, round_to=4)
    assert model[0].out_features == 8 and report is not None


def test_evaluate_with_no_batches_is_an_error_not_zero_accuracy():
    data = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randint(0, 4, (10,)))
    with pytest.raises(UsageError, match="no samples"):
        evaluate(mlp(), data, "classification", max_batches=0)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_eval_batches_zero_is_a_usage_error(value, capsys):
    register_configs()
    with pytest.raises(SystemExit) as e:
        check_overrides([f"data.eval_batches={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"data.eval_batches={value}" in err


def _ddp_module_check(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        model = mlp()
        ddp = nn.parallel.DistributedDataParallel(model)
        pruner = sk.Pruner(ddp.module, 0.5, schedule=sk.Linear(0, 2, 1))
        assert not parametrize.is_parametrized(model[0])  # held masks: DDP's hooks intact
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            pruner.step(step)
        for name, mask in pruner.masks.items():
            w = model.get_submodule(name).weight
            assert bool((w[~mask] == 0).all())
            assert float((~mask).float().mean()) == pytest.approx(0.5)
        open(out, "w").close()
    finally:
        dist.destroy_process_group()


def test_pruner_on_ddp_module_after_wrapping_trains():
    # a world of one in this process (a spawned one costs an interpreter importing torch); the
    # group is destroyed again before the test ends
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ok")
        _ddp_module_check(0, os.path.join(d, "init"), out)
        assert os.path.exists(out)
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------
# item 9: the command line


def test_storage_errors_name_the_file(tmp_path):
    target = tmp_path / "m.pt"
    with pytest.raises(StorageError, match=f"cannot write {target}: the write failed"):
        with storage_errors(target):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")
    with pytest.raises(StorageError, match=f"cannot write {target}: No space left on device"):
        with storage_errors(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(IndexError):  # not a storage failure: left alone
        with storage_errors(target):
            raise IndexError("x")


TINY = ["data.kwargs.num_samples=300", "train.dense_steps=2", "train.finetune_steps=2",
        "train.checkpoint_every=1", "schedule.end=1", "schedule.every=1", "bench.enabled=false",
        "train.quiet=true", "tracker=none"]


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    torch.save(nn.Linear(3, 4).state_dict(), d / "other.pt")
    sk.save(nn.Sequential(nn.Linear(3, 4)), d / "other.safetensors")
    (d / "random.safetensors").write_bytes(os.urandom(256))
    (d / "random.pt").write_bytes(os.urandom(256))

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {d / 'PWNED'}",))

    torch.save({"model": Payload()}, d / "pickled.pt")
    (d / "file").write_text("not a directory")
    return d


def cli(args: list[str], cwd, capsys) -> tuple[int, str]:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        main([*TINY, f"cache_dir={cwd / 'cache'}", *args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(old)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "expected", "error"),
    [
        (["model.checkpoint=other.pt"], "model.checkpoint='other.pt' is a checkpoint of another "
         "architecture than CNN1d", FileFormatError),
        (["model.checkpoint=other.safetensors"], "model.checkpoint='other.safetensors' is a "
         "checkpoint of another architecture than CNN1d", FileFormatError),
        (["model.checkpoint=random.safetensors"], "model.checkpoint='random.safetensors' is not a "
         "readable checkpoint", FileFormatError),
        (["model.checkpoint=random.pt"], "model.checkpoint='random.pt' is not a readable "
         "checkpoint", FileFormatError),
        (["model.checkpoint=pickled.pt"], "model.checkpoint='pickled.pt': refused to load",
         UnsafeFileError),
        (["cache_dir=file/cache"], "cannot create the cache directory (cache_dir) file/cache: "
         "Not a directory", StorageError),
        (["hydra.run.dir=file/run"], "cannot create the run directory hydra.run.dir=file/run",
         StorageError),
        (["model=torchvision"], "model 'resnet18' cannot take the inputs of data=mnist1d: calling "
         "the model on batch tensor(2, 1, 40) failed in layer 'conv1' (Conv2d)", ModelCallError),
    ],
)
def test_runtime_failures_are_one_line_exit_1(args, expected, error, cli_dir, capsys):
    code, err = cli(args, cli_dir, capsys)
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("sparsekit: error: "), err
    assert expected in err
    assert "Traceback" not in err and "Error executing job" not in err
    assert not (cli_dir / "PWNED").exists()


def test_full_disk_is_one_line_naming_the_file(cli_dir, capsys, monkeypatch):
    def full(*_a, **_k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 470")

    monkeypatch.setattr(torch, "save", full)
    code, err = cli(["hydra.run.dir=full1"], cli_dir, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert "sparsekit: error: cannot write " in err and ".partial.pt: the write failed" in err

    def enospc(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "atomic_write", enospc)
    code, err = cli(["hydra.run.dir=full2"], cli_dir, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"cannot write {cli_dir / 'full2' / 'config.yaml'}: No space left on device" in err


def test_an_unexpected_error_keeps_its_traceback_and_says_it_is_a_bug(cli_dir, capsys,
                                                                      monkeypatch):
    def broken(*_a, **_k):
        raise IndexError("index 3 is out of bounds")

    monkeypatch.setattr(context, "evaluate", broken)  # RunContext.evaluate calls it
    code, err = cli(["hydra.run.dir=bug"], cli_dir, capsys)
    assert code == 1
    assert "Traceback" in err and "IndexError: index 3 is out of bounds" in err
    assert err.strip().splitlines()[-1].startswith(
        "sparsekit: internal error: an unexpected IndexError is a bug")
