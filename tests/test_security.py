"""Files never run code: malicious checkpoint headers, planted run directories and pickles in
every ``.pt`` sparsekit reads. Each case asserts that the payload's marker file never appears
and that a sparsekit error names the file (or that the file is set aside and reported)."""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import sparsekit as sk
from sparsekit.run.cli import latest_run, main, resume_argv
from sparsekit.run.config import Config
from sparsekit.errors import FileFormatError, UnsafeFileError
from sparsekit.models import build_model
from sparsekit.run.loading import load_dense
from sparsekit.run.pipeline import CHECKPOINT, baseline_key, run
from sparsekit.io.runstate import (
    STATE_FILE,
    load_latest_checkpoint,
    previous_path,
    read_run_state,
    save_checkpoint,
)


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def write_header(path: Path, model_spec: object) -> Path:
    """A sparsekit checkpoint of one tensor whose header names ``model_spec``."""
    header = {"format": "sparsekit", "version": 1, "model": model_spec, "channels": None,
              "quant": None, "sparse": {}, "bitmask": {}, "aliases": {}}
    save_file({"weight": torch.zeros(2, 2)}, str(path),
              metadata={"sparsekit": json.dumps(header)})
    return path


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module on sys.path whose import (or call) creates the marker."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef build(**kw):\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("evil_mod", None)


# --- headers ---------------------------------------------------------------------------------

def test_header_naming_build_model_with_subprocess_target(tmp_path):
    marker = tmp_path / "pwned"
    spec = {"_target_": "sparsekit.models.build_model", "name": "x", "target": "subprocess.run",
            "kwargs": {"args": ["touch", str(marker)]}}
    path = write_header(tmp_path / "evil.safetensors", spec)
    with pytest.raises(UnsafeFileError, match=r"evil.safetensors.*sparsekit.models.build_model"):
        sk.load(path)
    assert not marker.exists()


def test_header_naming_load_state_dict_from_url(tmp_path):
    marker = tmp_path / "pwned"
    remote = tmp_path / "remote.pt"
    torch.save({"w": Payload(marker)}, remote)
    spec = {"_target_": "torchvision.models._api.load_state_dict_from_url",
            "url": remote.as_uri(), "model_dir": str(tmp_path / "dl"), "file_name": "x.pt"}
    path = write_header(tmp_path / "evil.safetensors", spec)
    with pytest.raises(UnsafeFileError, match=r"evil.safetensors.*load_state_dict_from_url"):
        sk.load(path)
    assert not marker.exists() and not (tmp_path / "dl").exists()


@pytest.mark.parametrize("spec", [
    {"_target_": "sparsekit.imports.import_object", "path": "evil_mod.build", "option": "x"},
    {"_target_": "evil_mod.build"},
    {"_target_": "sparsekit.models.cnn1d.evil_mod"},
    {"builder": "evil_mod.build", "kwargs": {}},
    {"builder": "evil_mod", "kwargs": {}},
    {"builder": "torchvision", "kwargs": {"name": "evil_mod"}},
    {"builder": "torchvision", "kwargs": {"name": "resnet18", "weights": "evil_mod"}},
    {"builder": "mnist1d_cnn", "kwargs": {"_target_": "evil_mod.build"}},
    {"builder": "mnist1d_cnn", "kwargs": {"num_classes": 3}, "_target_": "evil_mod.build"},
    {"builder": "hf", "kwargs": {"config": {"model_type": "evil_mod"}}},
    "evil_mod.build",
], ids=lambda s: json.dumps(s)[:60])
def test_header_never_imports_a_module_from_file_content(tmp_path, evil_module, spec):
    path = write_header(tmp_path / "evil.safetensors", spec)
    with pytest.raises(FileFormatError, match="evil.safetensors"):
        sk.load(path)
    assert not evil_module.exists()
    assert "evil_mod" not in sys.modules


@pytest.mark.parametrize("spec,kind", [
    ({"_target_": "sparsekit.models.cnn1d.mnist1d_cnn", "channels": 8}, nn.Module),
    ({"_target_": "sparsekit.models.lm.tiny_lm", "d_model": 16, "n_layers": 1, "n_heads": 2,
      "seq_len": 8}, nn.Module),
    ({"_target_": "torchvision.models.get_model", "name": "squeezenet1_1", "num_classes": 3},
     nn.Module),
])
def test_old_headers_of_builtin_targets_still_load(tmp_path, spec, kind):
    """Files written before the registry name these exact targets: they map onto it."""
    target = spec.pop("_target_")
    name = {"sparsekit.models.cnn1d.mnist1d_cnn": "mnist1d_cnn",
            "sparsekit.models.lm.tiny_lm": "tiny_lm"}.get(target)
    model = build_model(name or spec.pop("name"), kwargs=spec)
    sk.save(model, tmp_path / "m.safetensors")
    old = dict(model._sparsekit_spec["kwargs"], _target_=target)
    # rewrite the header in the old form, keeping the tensors
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["sparsekit"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header["model"] = old
    save_file(tensors, str(tmp_path / "old.safetensors"),
              metadata={"sparsekit": json.dumps(header)})
    back = sk.load(tmp_path / "old.safetensors")
    assert isinstance(back, kind)
    assert back._sparsekit_spec == model._sparsekit_spec
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


# --- run directories -------------------------------------------------------------------------

def plant_run(root: Path, overrides: list[str] | str,
              name: str = "2026-01-01_00-00-00") -> Path:
    """A run directory that looks killed mid fine-tuning (resumable) with these overrides (a
    list, or overrides.yaml's text as it is)."""
    d = root / "runs" / name
    (d / ".hydra").mkdir(parents=True)
    text = overrides if isinstance(overrides, str) else json.dumps(overrides) + "\n"
    (d / ".hydra" / "overrides.yaml").write_text(text)
    (d / "config.yaml").write_text("{}\n")
    (d / STATE_FILE).write_text(json.dumps({"state": "running"}))
    model = nn.Linear(2, 2)
    save_checkpoint(d / CHECKPOINT, step=3, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return d


def malicious_overrides(marker: Path) -> list[list[str]]:
    touch = f"[touch,{marker}]"
    return [
        ["model=custom", "model._target_=subprocess.run", f"+model.kwargs.args={touch}"],
        ["data=custom", "data._target_=subprocess.run", f"+data.kwargs.args={touch}"],
        ["+hydra.callbacks.x._target_=subprocess.run", f"+hydra.callbacks.x.args={touch}"],
        ["hydra/launcher=evil"],
        [f"model={{_target_: subprocess.run, args: {touch}}}"],
        ["+prune.x._target_=subprocess.run"],
    ]


@pytest.mark.parametrize("case", range(6))
def test_resume_true_never_picks_a_run_that_imports_code(tmp_path, monkeypatch, capsys, case):
    marker = tmp_path / "pwned"
    plant_run(tmp_path, malicious_overrides(marker)[case])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPARSEKIT_QUIET", "1")
    assert latest_run(Path("runs")) is None
    with pytest.raises(SystemExit) as exit_:
        main(["resume=true"])
    assert exit_.value.code == 2
    assert "no unfinished run that can continue" in capsys.readouterr().err
    assert not marker.exists()


def test_resume_true_picks_the_safe_run_beside_a_planted_one(tmp_path):
    marker = tmp_path / "pwned"
    safe = plant_run(tmp_path, ["prune.sparsity=0.5", "recipe=mnist1d_cnn_24"],
                     name="2026-01-01_00-00-00")
    evil = plant_run(tmp_path, malicious_overrides(marker)[0], name="2026-01-02_00-00-00")
    os.utime(evil / CHECKPOINT, (2e9, 2e9))  # the planted one is the newest
    assert latest_run(tmp_path / "runs") == safe


def test_resume_dir_prints_what_it_imports_first(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "pwned"
    d = plant_run(tmp_path, malicious_overrides(marker)[0])
    argv = resume_argv([f"resume={d}", "train.quiet=true"])
    err = capsys.readouterr().err
    assert "import code" in err and "model._target_=subprocess.run" in err
    assert "model._target_=subprocess.run" in argv and argv[-1] == "resume=true"
    assert not marker.exists()


# --- pickles in every .pt sparsekit reads ----------------------------------------------------

def evil_checkpoint(path: Path, marker: Path, how: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "pruner state":  # a real checkpoint whose pruner entry carries the payload
        model = nn.Linear(2, 2)
        save_checkpoint(path, step=3, model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        state = torch.load(path, weights_only=True)
        state["pruner"] = {"version": 1, "masks": Payload(marker)}
        torch.save(state, path)
    elif how == "torch.save":
        torch.save({"model": Payload(marker)}, path)
    else:  # a bare pickle, not torch's zip format
        with open(path, "wb") as f:
            pickle.dump(Payload(marker), f)
    return path


HOW = ["pruner state", "torch.save", "pickle"]


@pytest.mark.parametrize("how", HOW)
def test_pickled_resume_checkpoint(tmp_path, how):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    evil_checkpoint(run_dir / CHECKPOINT, marker, how)
    cfg = Config()
    cfg.cache_dir = str(tmp_path / "cache")
    with pytest.raises(FileFormatError, match=r"last.pt"):
        run(cfg, run_dir, resume=True)
    assert not marker.exists()
    assert read_run_state(run_dir)["state"] == "failed"
    assert latest_run(tmp_path) is None  # failed before any usable checkpoint


@pytest.mark.parametrize("how", HOW)
def test_pickled_checkpoint_falls_back_to_previous(tmp_path, how):
    marker = tmp_path / "pwned"
    path = tmp_path / CHECKPOINT
    model = nn.Linear(2, 2)
    save_checkpoint(path, step=7, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    os.replace(path, previous_path(path))
    evil_checkpoint(path, marker, how)
    with pytest.warns(UserWarning, match=r"last.pt is damaged.*holds pickled objects"):
        assert load_latest_checkpoint(path)["step"] == 7
    assert not marker.exists()


@pytest.mark.parametrize("how", HOW)
def test_pickled_model_checkpoint(tmp_path, how):
    marker = tmp_path / "pwned"
    path = evil_checkpoint(tmp_path / "weights.pt", marker, how)
    with pytest.raises(FileFormatError, match="weights.pt"):
        load_dense(build_model("mnist1d_cnn"), str(path))
    garbage = tmp_path / "weights.safetensors"
    garbage.write_bytes(path.read_bytes())
    with pytest.raises(FileFormatError, match="weights.safetensors"):
        load_dense(build_model("mnist1d_cnn"), str(garbage))
    assert not marker.exists()


def tiny_config(tmp_path: Path) -> Config:
    cfg = Config()
    cfg.cache_dir = str(tmp_path / "cache")
    cfg.data.kwargs = {"num_samples": 300}
    t = cfg.train
    t.dense_steps, t.finetune_steps, t.checkpoint_every, t.log_every, t.eval_every = 20, 4, 2, 2, 2
    t.quiet, t.device = True, "cpu"
    cfg.schedule.end, cfg.schedule.every = 2, 1
    cfg.bench.enabled = False
    cfg.tracker.kind = "none"
    return cfg


def test_pickled_partial_and_corrupt_baseline_are_moved_aside_and_rebuilt(tmp_path):
    """A damaged baseline cache entry and a pickled ``.partial.pt`` next to it: both are named
    in a warning, moved to ``<name>.corrupt-<time>``, and the baseline is trained again."""
    marker = tmp_path / "pwned"
    cfg = tiny_config(tmp_path)
    baselines = tmp_path / "cache" / "baselines"
    key = baseline_key(cfg)
    baselines.mkdir(parents=True)
    (baselines / f"{key}.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\"")
    evil_checkpoint(baselines / f"{key}.partial.pt", marker, "pruner state")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(cfg, tmp_path / "run")
    text = "\n".join(str(w.message) for w in caught)
    assert f"{key}.safetensors is damaged" in text
    assert f"{key}.partial.pt is damaged" in text and "holds pickled objects" in text
    assert not marker.exists()
    names = sorted(p.name for p in baselines.iterdir())
    assert f"{key}.safetensors" in names  # rebuilt
    assert any(n.startswith(f"{key}.safetensors.corrupt-") for n in names)
    assert any(n.startswith(f"{key}.partial.pt.corrupt-") for n in names)
    assert summary["dense_source"].startswith("trained")
    assert read_run_state(tmp_path / "run")["state"] == "finished"


def test_pickled_sharded_checkpoint(tmp_path):
    """FSDP2 checkpoints (torch.distributed.checkpoint) unpickle their index and non-tensor
    items with no restriction by default; sparsekit's reader refuses both."""
    import torch.distributed.checkpoint as dcp

    from sparsekit.run.distributed import load_sharded, save_sharded

    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        dcp.save({"w": torch.ones(3), "step": Payload(marker)}, checkpoint_id=tmp_path / "a")
        with pytest.raises(UnsafeFileError, match=r"a \(item 'step'\) holds pickled objects"):
            load_sharded({"w": torch.zeros(3), "step": 0}, tmp_path / "a")
        save_sharded({"w": torch.ones(3), "step": 3}, tmp_path / "b")
        ok = {"w": torch.zeros(3), "step": 0}
        load_sharded(ok, tmp_path / "b")
        assert ok["step"] == 3 and torch.equal(ok["w"], torch.ones(3))
        with open(tmp_path / "b" / ".metadata", "wb") as f:
            pickle.dump(Payload(marker), f)
        with pytest.raises(UnsafeFileError, match=r"b/.metadata names posix.system"):
            load_sharded(ok, tmp_path / "b")
    assert not marker.exists()


def test_resume_never_takes_a_run_whose_process_is_alive(tmp_path, capsys):
    """run_state.json records the process id and host: resume=true passes over a run still
    running in another process, resume=DIR refuses it in one line; once that process is gone
    the run is the one resume=true continues."""
    import socket
    import subprocess

    import time

    from sparsekit.io.runstate import read_run_state, still_running

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    older = plant_run(tmp_path, ["prune.sparsity=0.5"], name="2026-01-01_00-00-00")
    (older / STATE_FILE).write_text(json.dumps({"state": "running", "pid": gone.pid,
                                                "host": socket.gethostname()}))
    # a killed run whose process nobody reaped (a zombie: containers whose init never reaps)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat = Path(f"/proc/{zombie.pid}/stat")
        for _ in range(200):
            if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        assert still_running({"state": "running", "pid": zombie.pid,
                              "host": socket.gethostname()}) is None
    finally:
        zombie.wait()
    # this process, as recorded by write_run_state: the same pid started at another time is
    # another process
    from sparsekit.io.runstate import write_run_state

    write_run_state(tmp_path, "running")
    me = read_run_state(tmp_path)
    if "started" in me:  # Linux
        # alive, but started well after this process (the parent is no good: a wrapper such as
        # `timeout` execs its child within the same clock tick)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            me["pid"] = other.pid
            assert still_running(me) is None
        finally:
            other.kill()
            other.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        newer = plant_run(tmp_path, ["prune.sparsity=0.7"], name="2026-01-02_00-00-00")
        (newer / STATE_FILE).write_text(json.dumps({"state": "running", "pid": live.pid,
                                                    "host": socket.gethostname()}))
        os.utime(newer / CHECKPOINT, (2e9, 2e9))  # the live one is the newest
        assert latest_run(tmp_path / "runs") == older
        with pytest.raises(SystemExit) as exit_:
            resume_argv([f"resume={newer}"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"is still running (process {live.pid} on this host)" in err
        assert len(err.strip().splitlines()) == 1
    finally:
        live.kill()
        live.wait()
    assert latest_run(tmp_path / "runs") == newer


def test_a_rank_of_the_same_torchrun_job_does_not_block_resume(monkeypatch):
    """Under torchrun each rank resolves resume=true; rank 0 may already have marked the run
    running with its own pid: a sibling of the same launcher is this job, not another run."""
    import socket
    import subprocess

    from sparsekit.io.runstate import still_running

    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        info = {"state": "running", "pid": sibling.pid, "host": socket.gethostname()}
        assert still_running(info) == sibling.pid  # another process's run
        # the sibling's parent is this process: pretend this is rank 1, forked by the same agent
        monkeypatch.setattr(os, "getppid", lambda: os.getpid())
        assert still_running(info) == sibling.pid  # outside torchrun: a sibling is another run
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        assert still_running(info) is None
    finally:
        sibling.kill()
        sibling.wait()
