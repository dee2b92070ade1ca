"""The ``sparsekit`` command: help, bad input, recipes at tiny size, sweeps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import sparsekit as sk
from sparsekit.run.cli import main, recipe_names
from sparsekit.data import build_data
from sparsekit.io.runstate import read_run_state, write_run_state
from sparsekit.run import pipeline
from sparsekit.run.train import evaluate

# tiny sizes so that every recipe runs end to end in a few seconds
TINY_MNIST = [
    "data.kwargs.num_samples=300", "train.dense_steps=40", "train.finetune_steps=20",
    "train.log_every=10", "train.eval_every=10", "train.checkpoint_every=10",
    "schedule.end=10", "schedule.every=5", "bench.repeats=2", "bench.batch_size=16",
    "train.quiet=true",
]
TINY_LM = [
    "data.kwargs.max_bytes=30000", "data.kwargs.seq_len=32", "model.kwargs.seq_len=32",
    "model.kwargs.d_model=32", "model.kwargs.n_layers=1", "model.kwargs.n_heads=2",
    "data.eval_batches=2", "train.dense_steps=20", "train.finetune_steps=10",
    "train.warmup_steps=2", "train.log_every=5", "train.eval_every=5",
    "train.checkpoint_every=5", "schedule.end=5", "schedule.every=5", "bench.repeats=2",
    "bench.batch_size=8", "train.quiet=true",
]


def run_cli(args: list[str], cwd: Path, capsys) -> tuple[int, str, str]:
    """Run the command in this process from ``cwd``; returns (exit code, stdout, stderr)."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(old)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["recipe=nope"], "recipe=nope: unknown option; allowed: "),
        (["model=nope"], "model=nope: unknown option; allowed: custom, hf, mnist1d_cnn, tiny_lm"),
        (["prune=dense"], "prune=dense: unknown option; allowed: "),
        (["model.name=nope"], "model.name='nope' is not allowed; choose one of: mnist1d_cnn"),
        (["prune.pattern=3:2"], "prune.pattern='3:2' is not allowed; choose 'unstructured'"),
        (["prune.sparsity=1.5"], "prune.sparsity=1.5 must be a finite number in [0, 1) (or null)"),
        (["prune.criterion=random"], "prune.criterion='random' is not allowed; choose one of"),
        (["schedule.kind=step"], "schedule.kind='step' is not allowed; choose one of: oneshot"),
        (["quant.scheme=int4"], "quant.scheme='int4' is not allowed; choose one of: none"),
        (["prune.sparsity=lots"], "prune.sparsity=lots: Value 'lots' of type 'str'"),
        (["prune.typo=1"], "prune.typo: unknown key; allowed keys in prune: pattern"),
        (["-m", "prune=unstructured", "prune.sparsity=0.5,1.5"], "prune.sparsity=1.5 must be"),
        (["resume=true"], "resume=true: no unfinished run"),
        (["runs/x"], "cannot parse 'runs/x': arguments are key=value or group=option"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, expected, tmp_path, capsys):
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("sparsekit: error: ")
    assert expected in err, err
    if args[0].startswith(("recipe=", "prune=")):  # lists every option of the group
        assert ("mnist1d_cnn_24, " if args[0][0] == "r" else "nm24, none, ") in err
    assert not (tmp_path / "runs").exists()


def test_bad_input_from_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sparsekit", "prune.pattern=3:2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "prune.pattern" in proc.stderr


FIRST_CHECK = """
import sys
from sparsekit.run.cli import main
for arg in sys.argv[1:]:
    try:
        main([arg])
    except SystemExit as e:
        print(arg, e.code, "torch" in sys.modules)
"""


def test_a_mistake_is_answered_before_torch_is_imported(tmp_path):
    """A syntax, key, group, fixed-choice or number mistake is answered without importing
    torch (the first check: about a second); a registry's name (quant.scheme) is checked after
    torch's import, still as one line and exit 2."""
    bad = ["prune.sparsity=2", "prune.typo=1", "prune=dense", "prune.pattern=3:2",
           "quant.method=foo", "train.distill.loss=l1", "runs/x", "quant.scheme=int9"]
    proc = subprocess.run([sys.executable, "-c", FIRST_CHECK, *bad], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = [line.split() for line in proc.stdout.splitlines()]
    assert answers == [[a, "2", "False"] for a in bad[:-1]] + [[bad[-1], "2", "True"]]
    assert proc.stderr.count("sparsekit: error: ") == len(bad), proc.stderr


def test_help_lists_groups_options_and_recipes(tmp_path, capsys):
    code, out, _ = run_cli(["--help"], tmp_path, capsys)
    assert code == 0
    section = out.split("== Configuration groups", 1)[1].split("== Config (", 1)[0]
    groups = dict(ln.split(": ", 1) for ln in section.splitlines() if ": " in ln)
    assert set(groups) == {"model", "data", "prune", "schedule", "quant", "train", "tracker",
                           "bench", "accel", "recipe"}
    assert {"nm24", "none", "unstructured"} <= set(groups["prune"].split(", "))
    assert {"fp8", "int8", "int8_weight_only", "none", "fp8_static", "int8_static"} <= set(
        groups["quant"].split(", "))
    assert groups["schedule"] == "cubic, linear, oneshot"
    assert set(recipe_names()) == set(groups["recipe"].split(", "))


@pytest.mark.parametrize("recipe", ["mnist1d_cnn_24", "mnist1d_cnn_unstructured90_cubic",
                                    "mnist1d_cnn_24_wanda_oneshot", "stdlib_lm_24",
                                    "mnist1d_24_int8_qat", "mnist1d_24_fp8_qat"])
def test_recipe_smoke(recipe, tmp_path, capsys):
    tiny = TINY_LM if recipe.startswith("stdlib") else TINY_MNIST
    code, out, err = run_cli([f"recipe={recipe}", f"cache_dir={tmp_path / 'cache'}", *tiny],
                             tmp_path, capsys)
    assert code == 0, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("config.yaml", "summary.md", "model.safetensors", ".hydra/config.yaml"):
        assert (run_dir / name).exists(), name
    (logdir,) = (run_dir / "tb").iterdir()  # tb/<recipe>,<overrides> (long: cut, ~<hash>)
    assert re.match(f"{recipe}[,~]", logdir.name) and f"TensorBoard logdir: {logdir}" in out
    assert list((logdir / "compressed").glob("events.out.tfevents.*"))
    assert list((logdir / "dense").glob("events.out.tfevents.*"))
    if recipe == "mnist1d_cnn_unstructured90_cubic":
        assert summary["sparsity"] == pytest.approx(0.9, abs=0.01)
    elif recipe == "stdlib_lm_24":
        assert summary["metric"] == "perplexity" and summary["sparsity"] > 0.4
        assert 1 < summary["compressed"]["perplexity"] < 256
    else:
        assert 0.45 < summary["sparsity"] < 0.5  # conv1 (5 inputs) cannot take 2:4
        assert summary["skipped_layers"] == {
            "conv1": "input dimension 5 (in * kernel) is not a multiple of M=4"
        }
    if "qat" in recipe:  # the quantization outcome per layer reaches the summary
        statuses = {ly["name"]: ly["status"] for ly in summary["quant"]["layers"]}
        assert statuses and set(statuses.values()) == {"quantized"}
    else:
        assert summary["quant"] is None
    if recipe == "mnist1d_24_fp8_qat":  # as a static-scale recipe: the scales saved and used
        code, out, err = run_cli([f"recipe={recipe}", "quant=fp8_static",
                                  f"cache_dir={tmp_path / 'cache'}", *tiny], tmp_path, capsys)
        assert code == 0, err
        static_dir = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        static = json.loads((static_dir / "summary.json").read_text())
        assert static["quant"]["scheme"] == "fp8_static"
        model = sk.load(static_dir / "model.safetensors")
        scales = [m.input_scale for m in model.modules() if hasattr(m, "input_scale")]
        assert len(scales) == len(static["quant"]["layers"]) and all(s > 0 for s in scales)
        data = build_data("mnist1d", kwargs={"num_samples": 300}, cache_dir=tmp_path / "cache")
        accuracy = evaluate(model, data.eval, "classification", quiet=True)["accuracy"]
        assert accuracy == static["compressed"]["accuracy"]
    if recipe == "mnist1d_cnn_24":
        # the saved model rebuilds from its recorded factory and scores what the run reported
        model = sk.load(run_dir / "model.safetensors")
        data = build_data("mnist1d", kwargs={"num_samples": 300}, cache_dir=tmp_path / "cache")
        accuracy = evaluate(model, data.eval, "classification", quiet=True)["accuracy"]
        assert accuracy == summary["compressed"]["accuracy"]
    assert summary["finetune_steps"] == (0 if "oneshot" in recipe else
                                         (10 if recipe.startswith("stdlib") else 20))


def test_progress_lines_and_the_run_log_without_a_terminal(tmp_path, capsys, monkeypatch):
    """stdout and stderr not terminals (captured): every long loop logs plain lines with its
    count, elapsed time and ETA to stderr, and sparsekit.log holds them, the stage lines and
    the end-of-run table."""
    import sparsekit.progress

    monkeypatch.delenv("SPARSEKIT_QUIET", raising=False)
    monkeypatch.setattr(sparsekit.progress, "QUIET_FIRST_S", 0.0)  # lines from the first item
    tiny = [a for a in TINY_MNIST if a != "train.quiet=true"]
    code, out, err = run_cli([f"cache_dir={tmp_path / 'cache'}", *tiny], tmp_path, capsys)
    assert code == 0, err
    assert "\r" not in err and "\x1b" not in err
    for line in ("dense training: 4/40 (10%), ", "fine-tuning: 20/20 (100%), ", "stage dense ...",
                 "stage fine_tune ..."):
        assert line in err, err
    eta = re.search(r"^dense training: 20/40 \(50%\), [\d.]+ s elapsed, ETA [\d.]+ s$", err, re.M)
    assert eta, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    log = (run_dir / "sparsekit.log").read_text()
    assert eta.group(0) in log and "stage fine_tune ..." in log
    assert out.strip().splitlines()[-1] in log  # the table's last line
    assert "stage dense" not in out  # stdout keeps the table alone
    # on a CPU the speed rows are CPU time, and no speedup is claimed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["speedup"] is None and summary["speed_notes"][0] == pipeline.CPU_SPEED
    assert "| latency b=1 (ms, CPU time) |" in out and "Speedup not measured on CPU" in out


def test_second_run_reuses_cached_baseline(tmp_path, capsys):
    args = [f"cache_dir={tmp_path / 'cache'}", *TINY_MNIST, "train.finetune_steps=0",
            "bench=off", "tracker=none", "hydra.run.dir=r1"]
    assert run_cli(args, tmp_path, capsys)[0] == 0
    assert run_cli([*args, "hydra.run.dir=r2"], tmp_path, capsys)[0] == 0
    first = json.loads((tmp_path / "r1" / "summary.json").read_text())
    second = json.loads((tmp_path / "r2" / "summary.json").read_text())
    assert first["dense_source"].startswith("trained")
    assert second["dense_source"].startswith("cached")
    assert first["dense"]["accuracy"] == second["dense"]["accuracy"]
    assert len(list((tmp_path / "cache" / "baselines").iterdir())) == 1


def test_sweep_gives_one_run_and_one_tensorboard_run_each(tmp_path, capsys):
    args = ["-m", "prune=unstructured", "prune.sparsity=0.5,0.75", "schedule=oneshot",
            f"cache_dir={tmp_path / 'cache'}", *TINY_MNIST, "bench=off",
            "hydra.sweep.dir=sweep"]
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 0, err
    runs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir() and p.name != "tb")
    assert [p.name for p in runs] == ["0", "1"]
    # the sweep's own figure: a PNG and a TensorBoard run of its own
    assert (tmp_path / "sweep" / "pareto.png").exists()
    assert list((tmp_path / "sweep" / "tb" / "sweep").glob("events.out.tfevents.*"))
    got = []
    for r in runs:
        (logdir,) = (r / "tb").iterdir()  # named for its overrides
        swept = "0.5" if r.name == "0" else "0.75"
        assert re.match(f"prune=unstructured,sparsity={swept}[,~]", logdir.name)
        # a compressed and a dense (reference) TensorBoard run, one event file each
        assert sorted(p.name for p in logdir.iterdir()) == ["compressed", "dense"]
        assert len(list(logdir.rglob("events.out.tfevents.*"))) == 2
        got.append(json.loads((r / "summary.json").read_text())["sparsity"])
    assert got == pytest.approx([0.5, 0.75], abs=0.01)


def blobs(n: int = 400, dim: int = 16):
    """Four Gaussian blobs: the kind of function ``data._target_`` names."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(4, dim, generator=g)[y] * 3 + torch.randn(n, dim, generator=g)
    k = n * 3 // 4
    return TensorDataset(x[:k], y[:k]), TensorDataset(x[k:], y[k:])


def mlp(dim: int = 16, width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, 4))


def test_bring_your_own_model_and_data(tmp_path, capsys):
    args = ["model=custom", f"model._target_={__name__}.mlp", "+model.kwargs.width=64",
            "data=custom", f"data._target_={__name__}.blobs", "+data.kwargs.n=600",
            f"cache_dir={tmp_path / 'cache'}", "train.dense_steps=60", "train.finetune_steps=20",
            "schedule.end=10", "schedule.every=5", "bench.repeats=2", "train.quiet=true",
            "hydra.run.dir=byo"]
    code, out, err = run_cli(args, tmp_path, capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "byo" / "summary.json").read_text())
    assert summary["dense"]["accuracy"] > 0.9 and summary["compressed"]["accuracy"] > 0.9
    assert summary["sparsity"] == pytest.approx(0.5)
    code, _, err = run_cli(["model=custom"], tmp_path, capsys)
    assert code == 2 and "model._target_" in err
    code, _, err = run_cli(["model=custom", "model.kwargs.width=3"], tmp_path, capsys)
    assert code == 2 and "+model.kwargs.width=VALUE" in err



def test_dense_baseline_is_reproducible(tmp_path, capsys):
    """Same config, fresh cache: bit-identical baseline (the cache key means 'this config', so
    training it again must give the same weights, whatever ran before in the process)."""
    # on CPU: GPU kernels (cuDNN, atomics) are not bit-reproducible from run to run
    common = [*TINY_MNIST, "train.finetune_steps=0", "bench=off", "tracker=none",
              "train.device=cpu"]
    for i in (1, 2):
        torch.rand(i)  # a different global RNG state before each run
        args = [*common, f"cache_dir={tmp_path / f'c{i}'}", f"hydra.run.dir=r{i}"]
        assert run_cli(args, tmp_path, capsys)[0] == 0
    (a,), (b,) = [list((tmp_path / f"c{i}" / "baselines").iterdir()) for i in (1, 2)]
    assert a.name == b.name and a.read_bytes() == b.read_bytes()


def test_latest_run_is_the_newest_unfinished(tmp_path):
    """resume=true: a run finished later does not shadow one that was killed."""
    import os

    from sparsekit.run.cli import latest_run
    from sparsekit.run.pipeline import CHECKPOINT

    def make(name, files, mtime):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("[]\n")
        for f in files:
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).write_text("x")
            os.utime(d / f, (mtime, mtime))
        return d

    assert latest_run(tmp_path) is None
    killed_in_dense = make("a", ["config.yaml"], 100)
    assert latest_run(tmp_path) == killed_in_dense
    killed_in_finetune = make("b", ["config.yaml", str(CHECKPOINT)], 200)
    assert latest_run(tmp_path) == killed_in_finetune
    make("c", ["config.yaml", str(CHECKPOINT), "summary.json"], 300)  # finished, newest
    assert latest_run(tmp_path) == killed_in_finetune
    # with run_state.json: a finished run, and one that failed before any checkpoint, are
    # skipped; a run that failed after checkpointing (a full disk, say) can continue
    finished = make("d", ["config.yaml", str(CHECKPOINT)], 400)
    write_run_state(finished, "finished")
    failed_at_startup = make("e", ["config.yaml"], 500)
    write_run_state(failed_at_startup, "failed", "FileFormatError: x")
    assert latest_run(tmp_path) == killed_in_finetune
    failed_later = make("f", ["config.yaml", str(CHECKPOINT)], 600)
    write_run_state(failed_later, "failed", "StorageError: disk full")
    assert latest_run(tmp_path) == failed_later
    killed = make("g", ["config.yaml"], 700)
    write_run_state(killed, "running")  # the process was killed before its first checkpoint
    assert latest_run(tmp_path) == killed


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, capsys,
                                                                    monkeypatch):
    import sparsekit.run.cli as cli

    monkeypatch.setattr(cli.time, "strftime", lambda fmt, *a: "2026-01-01_00-00-00")
    args = [f"cache_dir={tmp_path / 'cache'}", *TINY_MNIST, "train.finetune_steps=0",
            "bench=off", "tracker=none"]
    for _ in range(2):
        code, _, err = run_cli(args, tmp_path, capsys)
        assert code == 0, err
    runs = sorted((tmp_path / "runs").iterdir())
    assert [p.name for p in runs] == ["default_2026-01-01_00-00-00",
                                      "default_2026-01-01_00-00-00_1"]
    for r in runs:
        summary = json.loads((r / "summary.json").read_text())
        assert Path(summary["run_dir"]) == r.resolve()
        assert read_run_state(r)["state"] == "finished"
    # sweeps: each gets its own parent directory, made at once
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        firsts = [cli.unique_run_dir(["-m", "prune.sparsity=0.5,0.7"])[-1] for _ in range(2)]
    finally:
        os.chdir(old)
    assert firsts == ["hydra.sweep.dir='multirun/default_2026-01-01_00-00-00'",
                      "hydra.sweep.dir='multirun/default_2026-01-01_00-00-00_1'"]
    assert cli.unique_run_dir(["--help"]) == ["--help"]
    assert cli.unique_run_dir(["hydra.run.dir=x"]) == ["hydra.run.dir=x"]


def test_a_run_that_failed_at_startup_is_not_resumed(tmp_path, capsys):
    args = [f"cache_dir={tmp_path / 'cache'}", *TINY_MNIST, "bench=off", "tracker=none",
            f"model.checkpoint={tmp_path / 'missing.pt'}"]
    code, _, err = run_cli(args, tmp_path, capsys)
    assert code == 2 and "missing.pt" in err
    assert not (tmp_path / "runs").exists()  # a missing file: refused before the run starts
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    code, _, err = run_cli([*args[:-1], f"model.checkpoint={tmp_path / 'bad.pt'}"], tmp_path,
                           capsys)
    assert code != 0 and "bad.pt" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    state = read_run_state(run_dir)
    assert state["state"] == "failed" and "bad.pt" in state["error"]
    code, _, err = run_cli(["resume=true"], tmp_path, capsys)
    assert code == 2 and "no unfinished run that can continue" in err


def test_under_torchrun_rank_0_alone_resolves_resume(monkeypatch):
    """``resume=true`` under torchrun: rank 0 resolves it and broadcasts the answer (argv, or
    its exit code); the other ranks never look at the run directories themselves (they raced
    with rank 0's Hydra rewriting them). Without torchrun, or without ``resume=``, it is
    :func:`resume_argv` itself."""
    import sparsekit.run.cli as cli
    import sparsekit.run.distributed as D

    sent = []

    def broadcast(box, src):  # rank 0 fills the box; on the other ranks it holds rank 0's
        assert src == 0
        if box[0] is None:
            box[0] = sent[-1]
        else:
            sent.append(box[0])

    monkeypatch.setattr(D, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(D, "init", lambda: None)
    monkeypatch.setattr(D, "is_distributed", lambda: True)
    monkeypatch.setattr(D.dist, "broadcast_object_list", broadcast)
    resolved = ["lr=0.1", "hydra.run.dir='/runs/a'", "resume=true"]
    monkeypatch.setattr(cli, "resume_argv", lambda argv: resolved)
    monkeypatch.setattr(D, "is_main", lambda: True)
    assert cli.shared_resume_argv(["resume=true"]) == resolved
    assert sent == [("value", resolved)]

    def must_not_run(argv):
        raise AssertionError("a non-zero rank resolved resume= itself")

    monkeypatch.setattr(cli, "resume_argv", must_not_run)
    monkeypatch.setattr(D, "is_main", lambda: False)
    assert cli.shared_resume_argv(["resume=true"]) == resolved

    def no_run(argv):
        raise SystemExit(2)

    monkeypatch.setattr(cli, "resume_argv", no_run)
    monkeypatch.setattr(D, "is_main", lambda: True)
    with pytest.raises(SystemExit) as e0:
        cli.shared_resume_argv(["resume=true"])
    monkeypatch.setattr(D, "is_main", lambda: False)
    with pytest.raises(SystemExit) as e1:
        cli.shared_resume_argv(["resume=true"])
    assert e0.value.code == e1.value.code == 2 and sent[-1] == ("exit", 2)

    def broken(argv):  # an unexpected error on rank 0: the others exit too, not hang
        raise OSError("disk gone")

    monkeypatch.setattr(cli, "resume_argv", broken)
    monkeypatch.setattr(D, "is_main", lambda: True)
    with pytest.raises(OSError, match="disk gone"):
        cli.shared_resume_argv(["resume=true"])
    monkeypatch.setattr(D, "is_main", lambda: False)
    with pytest.raises(SystemExit) as e1:
        cli.shared_resume_argv(["resume=true"])
    assert e1.value.code == cli.EXIT_RUNTIME and len(sent) == 3

    monkeypatch.setattr(cli, "resume_argv", lambda argv: ["plain"])
    assert cli.shared_resume_argv(["lr=0.1"]) == ["plain"]  # no resume=: no broadcast
    monkeypatch.setattr(D, "launched_by_torchrun", lambda: False)
    assert cli.shared_resume_argv(["resume=true"]) == ["plain"]
    assert len(sent) == 3


def test_hydra_argv_is_the_one_rewrite_of_the_command_line(tmp_path, monkeypatch, capsys):
    """What Hydra runs, from what was typed: a new run gets a directory of its own (a sweep: a
    parent of its own), made only after the overrides checked out; a named directory, a help
    flag or ``resume=DIR`` makes none (resume replays the recorded overrides in that run's
    directory, then the new ones); under torchrun every rank takes rank 0's directory."""
    import sparsekit.run.cli as cli
    import sparsekit.run.distributed as D

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda fmt, *a: "2026-01-01_00-00-00")
    cli.register_configs()
    stamp = "default_2026-01-01_00-00-00"  # the run directory: recipe (default), then time
    assert cli.hydra_argv(["prune.sparsity=0.5"]) == [
        "prune.sparsity=0.5", f"hydra.run.dir='runs/{stamp}'"]
    assert cli.hydra_argv(("prune.sparsity=0.5",))[-1] == f"hydra.run.dir='runs/{stamp}_1'"
    made = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert made == [stamp, f"{stamp}_1"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.hydra_argv(["prune.sparsity=1.5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("sparsekit: error: prune.sparsity")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == made  # none made
    for unchanged in (["--help"], ["--cfg", "job"], ["hydra.run.dir=mine", "train.seed=2"]):
        assert cli.hydra_argv(unchanged) == unchanged
    assert cli.hydra_argv(["-m", "train.seed=1,2"]) == [
        "-m", "train.seed=1,2", f"hydra.sweep.dir='multirun/{stamp}'"]

    old = tmp_path / "runs" / "old"
    (old / ".hydra").mkdir(parents=True)
    (old / ".hydra" / "overrides.yaml").write_text("- train.seed=7\n- resume=true\n")
    assert cli.hydra_argv([f"resume={old}", "train.seed=3"]) == [
        "train.seed=7", "train.seed=3", f"hydra.run.dir='{old.resolve()}'", "resume=true"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [*made, "old"]

    asked = []

    def rank0_made(make, code):  # a rank other than 0: rank 0's answer, nothing made here
        asked.append(code)
        return "runs/rank0"

    monkeypatch.setattr(D, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(D, "init", lambda: None)
    monkeypatch.setattr(D, "from_rank0", rank0_made)
    assert cli.hydra_argv(["train.seed=4"]) == ["train.seed=4", "hydra.run.dir='runs/rank0'"]
    assert asked == [cli.EXIT_RUNTIME]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [*made, "old"]
    monkeypatch.setattr(D, "from_rank0", lambda make, code: make())  # rank 0 makes it
    assert cli.hydra_argv(["train.seed=4"])[-1] == f"hydra.run.dir='runs/{stamp}_2'"


def test_dense_checkpoint_can_be_a_sparsekit_file(tmp_path):
    """model.checkpoint may be the model.safetensors of an earlier run (compressed 2:4 and
    bitmask tensors), as well as a plain safetensors state dict."""
    from safetensors.torch import save_model

    import sparsekit as sk
    from sparsekit.models import build_model
    from sparsekit.run.loading import load_dense

    torch.manual_seed(0)
    src = build_model("mnist1d_cnn")
    sk.prune_(src, pattern="2:4", include=["conv2", "conv3", "linear"])
    sk.save(src, tmp_path / "run.safetensors")
    save_model(src, str(tmp_path / "plain.safetensors"))
    for name in ("run.safetensors", "plain.safetensors"):
        dst = build_model("mnist1d_cnn")
        load_dense(dst, str(tmp_path / name))
        for k, v in src.state_dict().items():
            assert torch.equal(dst.state_dict()[k], v), (name, k)


def test_imports_code_flags_everything_beyond_registered_choices():
    from sparsekit.run.cli import imports_code

    safe = ["model=tiny_lm", "recipe=mnist1d_cnn_24", "prune.sparsity=0.5",
            "+model.kwargs.width=3", "data=stdlib_text", "model@x=mnist1d_cnn"]
    risky = ["model=custom", "model@x=custom", "data=custom", "model._target_=os.system",
             "+data.kwargs._target_=os.system", "hydra/launcher=joblib",
             "hydra.searchpath=[file:///tmp]", "model={_target_: os.system}", "--config-dir=/x",
             "recipe=not_packaged", "nokey", "unknown.key=1"]
    assert imports_code(safe) == []
    assert imports_code(risky) == risky


def test_a_sweep_composes_the_config_once(monkeypatch):
    """Swept keys are set on copies of one composed config; a swept group is composed anew."""
    from sparsekit.run import cli

    calls = []
    real = cli.compose
    monkeypatch.setattr(cli, "compose", lambda *a, **k: calls.append(k["overrides"]) or
                        real(*a, **k))
    cli.register_configs()
    cli.check_overrides(["prune=unstructured", "prune.sparsity=0.5,0.7,0.9", "train.seed=1,2"])
    assert calls == [["prune=unstructured", "prune.sparsity=0.5", "train.seed=1"]]
    calls.clear()
    cli.check_overrides(["prune=nm24,none", "schedule.end=10,20"])
    assert calls == [["prune=nm24", "schedule.end=10"], ["prune=none", "schedule.end=10"]]
    with pytest.raises(SystemExit) as e:  # a bad later value is still found before any run
        cli.check_overrides(["prune=unstructured", "prune.sparsity=0.5,0.7,1.5"])
    assert e.value.code == 2


def test_run_directories_start_with_the_recipe_so_tensorboard_names_differ():
    from sparsekit.run.cli import run_dir_label

    assert run_dir_label([]) == "default"
    assert run_dir_label(["recipe=llm_sparsegpt_24", "prune.sparsity=0.5"]) == "llm_sparsegpt_24"
    assert run_dir_label(["recipe=file:/tmp/my recipe.yaml"]) == "my_recipe"
    assert run_dir_label(["recipe=a", "recipe=b"]) == "b"
