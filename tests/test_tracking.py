"""TensorBoard output of a run, read back by a real ``tensorboard`` server over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from torch import nn

from sparsekit.config import Config
from sparsekit.pipeline import run
from sparsekit.tracking import LAYOUT, Tracker, flatten


def tiny_config(cache: Path) -> Config:
    cfg = Config(cache_dir=str(cache))
    cfg.data.kwargs = {"num_samples": 300}
    cfg.train.dense_steps, cfg.train.finetune_steps = 60, 30
    cfg.train.log_every = cfg.train.eval_every = cfg.train.checkpoint_every = 10
    cfg.schedule.end, cfg.schedule.every = 20, 10
    cfg.tracker.histogram_every = 10
    cfg.bench.repeats, cfg.bench.batch_size = 3, 32
    cfg.train.quiet = True
    return cfg


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("track")
    summary = run(tiny_config(root / "cache"), root / "run")
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, **params: str):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_tensorboard_server_serves_the_run(tiny_run):
    logdir = tiny_run["tensorboard_logdir"]
    port = _free_port()
    tb = Path(sys.executable).with_name("tensorboard")
    cmd = [str(tb)] if tb.exists() else [sys.executable, "-m", "tensorboard.main"]
    proc = subprocess.Popen(
        [*cmd, "--logdir", logdir, "--port", str(port), "--host", "127.0.0.1",
         "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline, tags = time.time() + 60, {}
        while time.time() < deadline:
            try:
                tags = _get(port, "/data/plugin/scalars/tags")
                if tags.get(".", {}).get("eval/accuracy/compressed"):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert list(tags) == ["."], f"expected one run, got {list(tags)}"
        names = set(tags["."])
        assert {"train/loss", "train/lr", "eval/accuracy/dense", "eval/accuracy/compressed",
                "sparsity/global", "sparsity/conv2", "speed/latency_ms/dense",
                "speed/throughput/compressed", "speed/speedup", "size/bytes/compressed",
                "final/sparsity"} <= names
        points = _get(port, "/data/plugin/scalars/scalars", run=".", tag="eval/accuracy/compressed")
        assert points[-1][2] == pytest.approx(tiny_run["compressed"]["accuracy"])
        sparsity = _get(port, "/data/plugin/scalars/scalars", run=".", tag="sparsity/global")
        assert sparsity[-1][2] == pytest.approx(tiny_run["sparsity"], abs=1e-6)
        loss = _get(port, "/data/plugin/scalars/scalars", run=".", tag="train/loss")
        assert [p[1] for p in loss] == [0, 10, 20, 29]  # every log_every steps and the last
        layout = _get(port, "/data/plugin/custom_scalars/layout")
        titles = {c["title"] for c in layout["category"]}
        assert "dense vs compressed" in titles
        runs = _get(port, "/data/runs")
        assert runs == ["."]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_one_run_with_hparams_text_and_histograms(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = Path(tiny_run["tensorboard_logdir"])
    event_dirs = {p.parent for p in logdir.rglob("events.out.tfevents.*")}
    assert event_dirs == {logdir}  # no timestamped hparams sub-run
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0, "tensors": 0})
    acc.Reload()
    plugins = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info",
            "_hparams_/session_end_info"} <= set(plugins)
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        plugins["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["prune.pattern"].string_value == "2:4"
    assert start.hparams["train.finetune_steps"].number_value == 30
    assert {"summary/text_summary", "config/text_summary"} <= set(acc.Tags()["tensors"])
    hist = acc.Tags()["histograms"]
    assert "weights/conv2" in hist
    steps = [e.step for e in acc.Histograms("weights/conv2")]
    # the linear ramp moves the masks at steps 10 and 20 (every=10, end=20), then the final
    assert steps == [10, 20, 30]
    assert (logdir.parent / "config.yaml").exists()


def test_histograms_are_rate_limited(tmp_path):
    tracker = Tracker(tmp_path, histogram_every=100)
    model = nn.Linear(4, 4)
    written = [tracker.weight_histograms(model, s) for s in (0, 50, 99, 100, 150, 250)]
    assert written == [True, False, False, True, False, True]
    assert tracker.weight_histograms(model, 260, force=True)
    tracker.close()
    disabled = Tracker(tmp_path / "off", enabled=False)
    disabled.scalars({"a": 1.0}, 0)
    assert not disabled.weight_histograms(model, 0) and not (tmp_path / "off").exists()


def test_flatten_and_layout():
    assert flatten({"a": {"b": {"c": 1}}, "d": None}) == {"a.b.c": 1, "d": "None"}
    tags = [t for cat in LAYOUT.values() for chart in cat.values() for t in chart[1]]
    assert "eval/accuracy/dense" in tags and "eval/accuracy/compressed" in tags
