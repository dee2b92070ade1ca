"""TensorBoard output of a run, read back by a real ``tensorboard`` server over HTTP."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

import sparsekit
from sparsekit.run import figures
from sparsekit.run.config import Config
from sparsekit.run.pipeline import run
from sparsekit.progress import progress
from sparsekit.run.tracking import (
    COLOR_GROUP,
    LAYOUT,
    Tracker,
    flatten,
    layout,
    run_logdir,
    sweep_figures,
)


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


TINY_SWEEP = [
    "-m", "recipe=mnist1d_cnn_unstructured90_cubic", "prune.sparsity=0.5,0.8",
    "data.kwargs.num_samples=300", "train.dense_steps=40", "train.finetune_steps=20",
    "train.log_every=10", "train.eval_every=10", "schedule.end=10", "schedule.every=5",
    "bench.repeats=2", "bench.batch_size=16", "hydra.sweep.dir=sweep",
]


@pytest.fixture(scope="module")
def cli_sweep(tmp_path_factory):
    """A two-run sweep through the real command, its output going to a pipe (not a
    terminal) with progress bars NOT silenced by SPARSEKIT_QUIET."""
    root = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if k != "SPARSEKIT_QUIET"}
    done = subprocess.run([sys.executable, "-m", "sparsekit", *TINY_SWEEP,
                           f"cache_dir={root / 'cache'}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "sweep", done


@contextlib.contextmanager
def tensorboard(logdir: Path):
    """A real ``tensorboard`` on 127.0.0.1 and a free port; yields the port; killed after."""
    port = _free_port()
    tb = Path(sys.executable).with_name("tensorboard")
    cmd = [str(tb)] if tb.exists() else [sys.executable, "-m", "tensorboard.main"]
    proc = subprocess.Popen(
        [*cmd, "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1",
         "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for(port: int, path: str, ready, seconds: float = 60):
    """GET ``path`` until ``ready(answer)`` or the deadline; returns the last answer."""
    deadline, got = time.time() + seconds, None
    while time.time() < deadline:
        try:
            got = _get(port, path)
            if ready(got):
                break
        except OSError:
            pass
        time.sleep(0.5)
    return got


@pytest.mark.slow
def test_tensorboard_compares_the_runs_of_a_sweep(cli_sweep):
    sweep, _ = cli_sweep
    summaries = [json.loads((sweep / n / "summary.json").read_text()) for n in ("0", "1")]
    with tensorboard(sweep) as port:
        images = _wait_for(port, "/data/plugin/images/tags", lambda t: len(t) == 3)
        runs = _get(port, "/data/runs")
        tags = _get(port, "/data/plugin/scalars/tags")
        layout_ = _get(port, "/data/plugin/custom_scalars/layout")
        points = {(r, t): _get(port, "/data/plugin/scalars/scalars", run=r, tag=t)
                  for r in runs for t in ("eval/accuracy", "train/loss", "sparsity/global")
                  if t in tags.get(r, {})}
        by_layer = {r: _get(port, "/data/plugin/images/images", run=r, tag="sparsity/by_layer")
                    for r in runs if r.endswith("/compressed")}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/data/plugin/hparams/experiment",
            data=json.dumps({"experimentName": ""}).encode(),
            headers={"Content-Type": "application/json", "X-XSRF-Protected": "1"})
        with urllib.request.urlopen(request, timeout=5) as r:
            experiment = json.loads(r.read())
    # run names say what the run is (recipe, the swept value, ...), short and without paths;
    # each run directory holds <name>/compressed and <name>/dense, the sweep one more
    assert len(runs) == 5 and "tb/sweep" in runs
    for n, sparsity in (("0", "0.5"), ("1", "0.8")):
        mine = sorted(r for r in runs if r.startswith(f"{n}/tb/"))
        assert [r.rsplit("/", 1)[1] for r in mine] == ["compressed", "dense"]
        label = mine[0].rsplit("/", 1)[0]
        assert mine[1] == f"{label}/dense"
        short = label.split("/tb/", 1)[1]
        assert short.startswith(f"mnist1d_cnn_unstructured90_cubic,sparsity={sparsity}~")
        assert len(short) <= 64 and "/" not in short
        assert re.fullmatch(COLOR_GROUP, mine[0]).group(1) == label  # one colour group
        assert summaries[int(n)]["tensorboard_logdir"].endswith(label.split("/", 1)[1])
        comp_run, dense_run, s = mine[0], mine[1], summaries[int(n)]
        assert {"train/loss", "train/lr", "eval/accuracy", "sparsity/global", "sparsity/conv2",
                "speed/latency_ms", "speed/throughput", "size/bytes",
                "final/sparsity"} <= set(tags[comp_run])
        assert "speed/speedup" not in tags[comp_run]  # CPU time is no speedup
        # the dense run: the same tags for the same quantities (speed with its spread)
        speed = {f"speed/{k}{end}" for k in ("latency_ms", "throughput")
                 for end in ("", "_p10", "_p90")}
        assert set(tags[dense_run]) == {"eval/accuracy", "size/bytes", *speed}
        assert speed <= set(tags[comp_run])
        for side in ("dense", "compressed"):
            got = s[side]
            assert got["latency_ms_p10"] <= got["latency_ms"] <= got["latency_ms_p90"]
            assert got["throughput_p10"] <= got["throughput"] <= got["throughput_p90"]
        assert not any(t.startswith(("channels/", "eval/perplexity")) for t in tags[comp_run])
        comp = points[comp_run, "eval/accuracy"]
        dense = points[dense_run, "eval/accuracy"]
        assert comp[-1][2] == pytest.approx(s["compressed"]["accuracy"])
        # dense is a reference line over the whole run: at step 0, at every eval, at the end
        assert dense[0][1] == 0 and dense[-1][1] == comp[-1][1]
        assert {p[1] for p in comp} <= {p[1] for p in dense}
        assert [p[2] for p in dense] == pytest.approx([s["dense"]["accuracy"]] * len(dense))
        assert points[comp_run, "sparsity/global"][-1][2] == pytest.approx(s["sparsity"],
                                                                            abs=1e-6)
        assert [p[1] for p in points[comp_run, "train/loss"]] == [0, 10, 19]
        # the per-layer figure at each mask update and at the end
        steps = [im["step"] for im in by_layer[comp_run]]
        assert len(steps) >= 2 and steps[-1] == comp[-1][1]
    # only charts for tags that exist (no perplexity here); one tag per chart, which the
    # dense and compressed runs both log, so TensorBoard draws them in two colours
    cats = layout_["category"]
    assert [c["title"] for c in cats] == ["dense vs compressed", "speed spread (median, p10-p90)",
                                          "training"]
    charts = {c["title"]: c["multiline"]["tag"] for c in cats[0]["chart"]}
    # the speed figures' spread: a margin chart each (median, p10, p90: exact tags)
    margins = {c["title"]: c["margin"]["series"] for c in cats[1]["chart"]}
    assert margins == {f"{name}, p10-p90": [{"value": f"speed/{key}", "lower": f"speed/{key}_p10",
                                              "upper": f"speed/{key}_p90"}]
                       for key, name in (("latency_ms", "latency (ms, batch 1)"),
                                         ("throughput", "throughput (samples/s)"))}
    # exact tags: a chart's tags are regexes, and the median's must not draw its p10/p90
    assert charts == {"accuracy": ["^eval/accuracy$"],
                      "latency (ms, batch 1, median)": ["^speed/latency_ms$"],
                      "throughput (samples/s, median)": ["^speed/throughput$"],
                      "size (bytes)": ["^size/bytes$"]}
    every_tag = set().union(*(set(t) for t in tags.values()))
    for cat in cats:
        for chart in cat["chart"]:
            for pattern in chart.get("multiline", {}).get("tag", []):
                assert [t for t in every_tag if re.search(pattern, t)] == [
                    pattern.strip("^$").replace("\\", "")], chart
    # hparams: the overridden keys (the swept one among them) first, then the final metrics
    infos = [h["name"] for h in experiment["hparamInfos"]]
    marked = [h["name"] for h in experiment["hparamInfos"] if h.get("differs")]
    assert "prune.sparsity" in marked and infos[:len(marked)] == marked
    # the compressed model's metrics first, the dense reference once, last
    assert [m["name"]["tag"] for m in experiment["metricInfos"]] == [
        "final/accuracy/compressed", "final/sparsity", "final/size_bytes",
        "final/accuracy/dense"]  # no final/speedup on a CPU
    # what the dashboard warns about ("cannot process domain type"): a hparam that is not a
    # number and declares no values
    for info in experiment["hparamInfos"]:
        assert info["type"] == "DATA_TYPE_FLOAT64" or info.get("domainDiscrete"), info
    assert {"recipe", "prune.pattern", "quant.scheme"} <= {
        h["name"] for h in experiment["hparamInfos"]}
    assert not any(h["name"] in ("cache_dir", "prune.include") for h in experiment["hparamInfos"])
    assert images["tb/sweep"] == {"sweep/pareto": {
        "displayName": "sweep/pareto", "description": "", "samples": 1}}


def test_sweep_writes_a_pareto_png_and_hparams_lead_with_the_swept_key(cli_sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    sweep, done = cli_sweep
    png = sweep / "pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"sweep figure: {png.relative_to(sweep.parent)}" in done.stdout
    (logdir,) = (sweep / "1" / "tb").iterdir()
    acc = EventAccumulator(str(logdir / "compressed"), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/experiment"]
    exp = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    names = [h.name for h in exp.hparam_infos]
    assert names[:3] == ["recipe", "prune.sparsity", "data.kwargs.num_samples"]
    # the overridden keys (not where caches and logs go) are marked as differing, which
    # TensorBoard lists first and shows by default
    marked = {h.name for h in exp.hparam_infos if h.differs}
    assert marked == {"recipe", "prune.sparsity", "data.kwargs.num_samples", "train.dense_steps",
                      "train.finetune_steps", "train.log_every", "train.eval_every",
                      "schedule.end", "schedule.every"}
    assert [m.name.tag for m in exp.metric_infos][0] == "final/accuracy/compressed"
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["prune.sparsity"].number_value == 0.8
    assert start.hparams["recipe"].string_value == "mnist1d_cnn_unstructured90_cubic"


def test_console_is_clean_off_a_terminal_and_ends_with_the_layer_table(cli_sweep):
    _, done = cli_sweep
    for stream in (done.stdout, done.stderr):
        assert "\x1b" not in stream and "\r" not in stream  # no tqdm redraws, no ANSI codes
    for part in done.stdout.split("Sparsity by layer:")[1:]:  # one table per run
        rows = part.strip().splitlines()
        assert rows[0].split()[:4] == ["layer", "params", "zeros", "sparsity"]
        # the recipe keeps conv1 dense: the pruned layers, then the total
        assert [r.split()[0] for r in rows[1:5]] == ["conv2", "conv3", "linear", "global"]
    assert done.stdout.count("Sparsity by layer:") == 2


def test_summary_records_recipe_versions_and_utc_times(cli_sweep):
    sweep, _ = cli_sweep
    s = json.loads((sweep / "0" / "summary.json").read_text())
    assert s["recipe"] == "mnist1d_cnn_unstructured90_cubic"
    assert "prune.sparsity=0.5" in s["overrides"]
    assert s["versions"]["sparsekit"] == sparsekit.__version__
    assert s["versions"]["torch"] == torch.__version__
    start, end = (datetime.fromisoformat(s[k]) for k in ("started_utc", "ended_utc"))
    assert start.utcoffset() == end.utcoffset() == timedelta(0)
    assert timedelta(0) <= end - start <= timedelta(seconds=s["seconds"] + 2)
    assert abs(datetime.now(start.tzinfo) - end) < timedelta(minutes=10)


def test_progress_bars_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("SPARSEKIT_QUIET", raising=False)
    items = range(3)
    assert progress(items, file=io.StringIO()) is items  # a pipe or a file: no bar at all
    term = Terminal()
    assert list(progress(items, file=term, desc="x")) == [0, 1, 2]
    assert "x: 100%" in term.getvalue()
    assert progress(items, quiet=True, file=Terminal()) is items


def test_without_matplotlib_figures_are_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    tracker = Tracker(tmp_path / "tb")
    layers = {"fc": {"sparsity": 0.5, "skipped": None}}
    assert tracker.layer_sparsity(layers, 0)  # drawn with matplotlib
    monkeypatch.setattr(figures, "Figure", None)
    assert not tracker.layer_sparsity(layers, 1)
    assert not tracker.layer_sparsity(layers, 2)
    tracker.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "compressed"),
                           size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("sparsity/by_layer")] == [0]
    assert [e.step for e in acc.Tensors("figures/text_summary")] == [1]  # said once
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / "summary.json").write_text(json.dumps({
        "metric": "accuracy", "dense": {"accuracy": 0.9, "size_bytes": 10},
        "compressed": {"accuracy": 0.8, "size_bytes": 5}}))
    assert sweep_figures(tmp_path / "sweep") is None
    assert figures.MISSING in capsys.readouterr().out


def test_one_run_with_hparams_text_and_histograms(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = Path(tiny_run["tensorboard_logdir"])
    event_dirs = {p.parent for p in logdir.rglob("events.out.tfevents.*")}
    # one file each for the compressed and the dense run; no timestamped hparams sub-run
    assert event_dirs == {logdir / "compressed", logdir / "dense"}
    assert len(list(logdir.rglob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(logdir / "compressed"),
                           size_guidance={"histograms": 0, "tensors": 0})
    acc.Reload()
    plugins = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info",
            "_hparams_/session_end_info"} <= set(plugins)
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        plugins["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["prune.pattern"].string_value == "2:4"
    assert start.hparams["recipe"].string_value == "default"  # no recipe=: the default run
    assert "train.finetune_steps" not in start.hparams  # not set: in the config text only
    assert {"summary/text_summary", "config/text_summary"} <= set(acc.Tags()["tensors"])
    hist = acc.Tags()["histograms"]
    assert "weights/conv2" in hist
    steps = [e.step for e in acc.Histograms("weights/conv2")]
    # the linear ramp moves the masks at steps 10 and 20 (every=10, end=20), then the final
    assert steps == [10, 20, 30]
    assert (logdir.parent.parent / "config.yaml").exists()
    assert logdir.parent.name == "tb" and logdir.name == "default"
    # the speed figure: dense and compressed with their p10-p90 whiskers
    acc = EventAccumulator(str(logdir / "compressed"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("speed/spread")] == [tiny_run["finetune_steps"]]


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
    assert "eval/accuracy" in tags and "eval/perplexity" in tags
    lm = layout(["eval/perplexity", "train/loss"])  # a language model's run, without bench
    assert lm == {"dense vs compressed": {"perplexity": ["Multiline", ["eval/perplexity"]]},
                  "training": {"loss": ["Multiline", ["train/loss"]]}}
    assert layout(["final/sparsity"]) == {}


def test_a_resumed_run_keeps_its_tensorboard_directory(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "- recipe=mnist1d_cnn_24\n- train.seed=1\n- cache_dir=/tmp/x\n")
    first = run_logdir(run_dir)
    assert first.parent == run_dir / "tb"
    assert first.name == "mnist1d_cnn_24,seed=1"
    first.mkdir(parents=True)
    assert run_logdir(run_dir, resume=True) == first  # the interrupted run's directory
    assert run_logdir(tmp_path / "fresh", resume=True).name == "default"


def test_speed_and_pareto_figures_say_when_a_difference_is_within_noise():
    """Overlapping p10-p90 ranges are called noise, not a speedup; on the Pareto figure a run
    within noise of the dense model is hollow and no trade-off is drawn from noise."""
    noisy = {"dense": {"latency_ms": 0.058, "latency_ms_p10": 0.055, "latency_ms_p90": 0.070},
             "compressed": {"latency_ms": 0.059, "latency_ms_p10": 0.056,
                            "latency_ms_p90": 0.062}}
    fig = figures.speed_spread(noisy)
    assert fig.axes[0].get_title() == "within noise (p10-p90 overlap)"
    assert fig.axes[0].get_xlim()[0] == 0  # bars from zero: no zoomed axis
    clear = {"dense": {"latency_ms": 2.0, "latency_ms_p10": 1.9, "latency_ms_p90": 2.1},
             "compressed": {"latency_ms": 1.0, "latency_ms_p10": 0.9, "latency_ms_p90": 1.1}}
    assert figures.speed_spread(clear).axes[0].get_title() == "compressed 2.00x faster"
    slower = {"dense": clear["compressed"], "compressed": clear["dense"]}
    fig = figures.speed_spread(slower, cpu=True)  # a slowdown, labelled so; CPU time
    assert fig.axes[0].get_title() == "compressed 2.00x slower"
    assert fig._suptitle.get_text().startswith("CPU time (speedup not measured on CPU)")
    fast = {k: {"throughput": v, "throughput_p10": v * 0.9, "throughput_p90": v * 1.1}
            for k, v in (("dense", 123456.0), ("compressed", 140000.0))}
    ax = figures.speed_spread(fast).axes[0]  # readable axis: a few ticks, in k
    ax.figure.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert 2 <= len(ticks) <= 6 and all(len(t) <= 4 and t[-1] in "0k" for t in ticks), ticks
    assert figures.speed_spread({"dense": {}, "compressed": {}}) is None
    equal = {"latency_ms": 0.1 + 0.2, "latency_ms_p10": 0.3, "latency_ms_p90": 0.3}
    assert figures.speed_spread({"dense": equal, "compressed": equal}) is not None
    dense = {"value": 95.0, "size_bytes": 100, **noisy["dense"]}
    points = [  # b's 0.097 ms is an outlier inside a's range: not faster, and less accurate
        {"label": "a", "value": 93.0, "size_bytes": 50, "latency_ms": 0.060,
         "latency_ms_p10": 0.057, "latency_ms_p90": 0.101, "dense": dense},
        {"label": "b", "value": 92.0, "size_bytes": 40, "latency_ms": 0.097,
         "latency_ms_p10": 0.090, "latency_ms_p90": 0.104, "dense": dense},
        {"label": "c", "value": 90.0, "size_bytes": 30, "latency_ms": 0.030,
         "latency_ms_p10": 0.029, "latency_ms_p90": 0.031, "dense": dense},
    ]
    fig = figures.pareto(points, "accuracy")
    ax = fig.axes[1]
    assert "latency" in ax.get_xlabel()
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["a  (~ dense speed)", "b", "c"]
    assert "speed within noise of dense" in [t.get_text() for t in ax.get_legend().get_texts()]
    front = [line for line in ax.get_lines() if line.get_label() == "Pareto front"][0]
    assert list(front.get_xdata()) == [0.030, 0.060]  # c, then a; b is beaten by a
