"""TensorBoard logging for a run: scalars, weight histograms, figures, hparams, text and a
custom-scalars layout.

A run's logs go under ``<run_dir>/tb/<short name>/``, named for what the run is (its recipe
and the overrides that matter, paths cut to their last component, long names cut with a short
hash) so that ``tensorboard --logdir runs`` lists short, readable names. In it, two TensorBoard
runs with the same tags: ``<short name>/compressed`` (everything: training, the compressed
model's metrics, figures, text, hparams) and ``<short name>/dense`` (the dense model's metrics
only, logged at step 0, at every evaluation and at the end, so it is a reference line across
the whole run). Grouping runs by the regex :data:`COLOR_GROUP` (TensorBoard's "Color runs by"
menu, or the URL :func:`dashboard_url` gives) draws the two of a run in one colour. Speed is
logged as its median and its 10th and 90th percentiles over the repeats (``speed/<name>``,
``speed/<name>_p10``, ``speed/<name>_p90``) and drawn as the figure ``speed/spread``. The
hparams summaries are written with the low-level summary API into the compressed event
stream, not through ``SummaryWriter.add_hparams`` (which opens a timestamped sub-run): the
compressed run's metrics first and the dense reference once, last; string hparams with a fixed
set of values declare it (the dashboard filters on it), other strings are left to the
``config`` text. Writers flush on an interval (``flush_secs``), not on every call. The
custom-scalars layout is written when the run closes and holds only charts whose tags were
logged, so a classification run has no perplexity chart.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from datetime import datetime, timezone
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary

from sparsekit import _compat
from sparsekit.run import figures

# one chart per quantity: the dense and compressed runs log the same tag
LAYOUT = {
    "dense vs compressed": {
        "accuracy": ["Multiline", ["eval/accuracy"]],
        "perplexity": ["Multiline", ["eval/perplexity"]],
        "latency (ms, batch 1, median)": ["Multiline", ["speed/latency_ms"]],
        "throughput (samples/s, median)": ["Multiline", ["speed/throughput"]],
        "generation (tokens/s, median)": ["Multiline", ["speed/tokens_per_s"]],
        "size (bytes)": ["Multiline", ["size/bytes"]],
    },
    # each speed figure's median with its p10-p90 band (a margin chart: value, lower, upper)
    "speed spread (median, p10-p90)": {
        f"{name}, p10-p90": ["Margin", [f"speed/{key}", f"speed/{key}_p10", f"speed/{key}_p90"]]
        for key, name in (("latency_ms", "latency (ms, batch 1)"),
                          ("throughput", "throughput (samples/s)"),
                          ("tokens_per_s", "generation (tokens/s)"))
    },
    "training": {
        "loss": ["Multiline", ["train/loss"]],
        "learning rate": ["Multiline", ["train/lr"]],
        "sparsity": ["Multiline", ["sparsity/global"]],
    },
}
# overrides that do not change what a run computes: left out of its name
_NOT_IN_NAME = ("hydra.", "hydra/", "cache_dir", "resume", "train.quiet", "tracker.", "tracker=",
                "bench.", "bench=")
#: hparams every run records, beside the recipe and the keys its command line set. Few: the
#: dashboard shows five hparam columns (those marked as differing first) before the metrics
CORE_HPARAMS = ("prune.pattern", "prune.sparsity", "quant.scheme")
#: TensorBoard's "color runs by regex": the dense and compressed runs of one run, one colour
COLOR_GROUP = r"(.*)/(?:dense|compressed)$"
NAME_MAX = 64  # characters of a run's short name


def dashboard_url(port: int = 6006, host: str = "localhost") -> str:
    """The TensorBoard address that opens with runs coloured by :data:`COLOR_GROUP`.

    >>> dashboard_url()
    'http://localhost:6006/?runColorGroup=regex:(.*)%2F(%3F:dense%7Ccompressed)%24#timeseries'
    """
    from urllib.parse import quote

    return f"http://{host}:{port}/?runColorGroup=regex:{quote(COLOR_GROUP, safe='():*')}#timeseries"


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second (``2026-12-03T01:40:00+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """The versions a run's results depend on: sparsekit, torch, Python."""
    import sparsekit

    return {"sparsekit": sparsekit.__version__, "torch": torch.__version__,
            "python": platform.python_version()}


def layout(tags: Iterable[str]) -> dict[str, dict[str, list]]:
    """:data:`LAYOUT` cut to the charts whose tags were all logged (``tags``); empty
    categories dropped."""
    have = set(tags)
    out = {}
    for title, charts in LAYOUT.items():
        kept = {name: chart for name, chart in charts.items() if set(chart[1]) <= have}
        if kept:
            out[title] = kept
    return out


def anchored(charts: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    """A layout whose tags are exact: custom scalars read a multiline chart's tags as regexes,
    and ``speed/latency_ms`` alone would also draw ``speed/latency_ms_p10`` and ``_p90`` (a
    margin chart's tags are exact already).

    >>> anchored({"c": {"latency": ["Multiline", ["speed/latency_ms"]]}})
    {'c': {'latency': ['Multiline', ['^speed/latency_ms$']]}}
    """
    return {title: {name: [kind, tags if kind == "Margin" else
                           [f"^{re.escape(t)}$" for t in tags]]
                    for name, (kind, tags) in group.items()} for title, group in charts.items()}


def read_overrides(run_dir: str | os.PathLike) -> list[str]:
    """The command-line overrides Hydra recorded for a run (``.hydra/overrides.yaml``), or []
    for a run made without Hydra (the API)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.exists() else []


def recipe_of(overrides: Sequence[str]) -> str | None:
    """The ``recipe=NAME`` among ``overrides`` (the last one wins), or None."""
    names = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")]
    return names[-1] if names else None


def run_label(overrides: Sequence[str]) -> str:
    """A short name for what a run is: its recipe, then the overrides that change what it
    computes (``prune.sparsity=0.5`` as ``sparsity=0.5``; a path as its group and last
    component: ``model.path=/data/llama-1b`` as ``model=llama-1b``); ``default`` for none.
    A name longer than :data:`NAME_MAX` keeps its first parts that fit, then ``~`` and a hash
    of the whole name.

    >>> run_label(["recipe=mnist1d_cnn_24", "prune.sparsity=0.5", "cache_dir=/tmp/c"])
    'mnist1d_cnn_24,sparsity=0.5'
    >>> run_label(["prune=unstructured", "train.seed=1", "hydra.run.dir=x"])
    'prune=unstructured,seed=1'
    >>> run_label(["recipe=llm_sparsegpt_24", "model.path=/tmp/a/llama-1b/",
    ...            "data.path=/tmp/b/wiki.txt"])
    'llm_sparsegpt_24,model=llama-1b,data=wiki.txt'
    >>> run_label(["recipe=mnist1d_cnn_24", *(f"train.k{i}=123456" for i in range(9))])
    'mnist1d_cnn_24,k0=123456,k1=123456,k2=123456,k3=123456~d6bd5a'
    """
    parts = []
    for o in overrides:
        o = o.lstrip("+~")
        if o.startswith(_NOT_IN_NAME) or "=" not in o:
            continue
        key, value = o.split("=", 1)
        if key == "recipe":
            parts.insert(0, value)
        elif "/" in value or os.sep in value:  # a path: where it points, not the whole path
            parts.append(f"{key.split('.', 1)[0]}={Path(value.strip(chr(39) + chr(34))).name}")
        elif "." in key:
            parts.append(f"{key.rsplit('.', 1)[1]}={value}")
        else:
            parts.append(f"{key}={value}")
    label = re.sub(r"[^A-Za-z0-9_.,=+:-]+", "-", ",".join(parts)) or "default"
    if len(label) <= NAME_MAX:
        return label
    digest = hashlib.sha256(label.encode()).hexdigest()[:6]
    kept = ""
    for part in label.split(","):  # whole parts, in order, while they fit
        longer = f"{kept},{part}" if kept else part
        if len(longer) > NAME_MAX - 7:
            break
        kept = longer
    return f"{kept or label[:NAME_MAX - 7]}~{digest}"


def run_logdir(run_dir: str | os.PathLike, resume: bool = False) -> Path:
    """``<run_dir>/tb/<short name>`` (:func:`run_label`); a resumed run continues the log
    directory it already has."""
    root = Path(run_dir) / "tb"
    if resume and root.is_dir():
        existing = sorted(p for p in root.iterdir() if p.is_dir())
        if existing:
            return existing[-1]
    return root / run_label(read_overrides(run_dir))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``; lists become strings (hparams take scalars only).

    >>> flatten({"prune": {"pattern": "2:4", "include": ["*"]}, "seed": 0})
    {'prune.pattern': '2:4', 'prune.include': "['*']", 'seed': 0}
    """
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif v is None or isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


class Tracker:
    """Writes one run's TensorBoard events under ``logdir``: ``logdir/compressed`` and
    ``logdir/dense`` (:meth:`dense`, opened on first use). ``enabled=False`` makes every method
    a no-op, so the pipeline never branches on tracking. ``purge_step`` (on resume) drops
    events at or after that step left by the interrupted run."""

    def __init__(
        self,
        logdir: str | os.PathLike,
        enabled: bool = True,
        flush_secs: int = 10,
        histogram_every: int = 200,
        histograms: bool = True,
        purge_step: int | None = None,
    ) -> None:
        self.logdir = Path(logdir)
        self.enabled = enabled
        self.histograms = histograms
        self.histogram_every = histogram_every
        self._last_hist: int | None = None
        self._tags: set[str] = set()
        self._flush_secs, self._purge_step = flush_secs, purge_step
        self._dense: SummaryWriter | None = None
        self.writer = (
            SummaryWriter(str(self.logdir / "compressed"), flush_secs=flush_secs,
                          purge_step=purge_step)
            if enabled
            else None
        )

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)
            self._tags.add(tag)

    def dense(self, values: Mapping[str, float], step: int) -> None:
        """The dense model's ``values`` at ``step``, in the ``dense`` run, under the same tags
        as the compressed model's."""
        if self.writer is None:
            return
        if self._dense is None:
            self._dense = SummaryWriter(str(self.logdir / "dense"), flush_secs=self._flush_secs,
                                        purge_step=self._purge_step)
        for tag, value in values.items():
            self._dense.add_scalar(tag, float(value), step)
            self._tags.add(tag)

    def figure(self, tag: str, fig: Any, step: int) -> bool:
        """A matplotlib figure (see :mod:`sparsekit.run.figures`) as an image; False when there is
        none (matplotlib missing: the reason goes to the ``figures`` text once)."""
        if self.writer is None:
            return False
        if fig is None:
            if not figures.available() and "figures" not in self._tags:
                self.text("figures", figures.MISSING, step)
                self._tags.add("figures")
            return False
        self.writer.add_image(tag, figures.to_rgb(fig), step, dataformats="HWC")
        return True

    def layer_sparsity(self, layers: Mapping[str, Mapping[str, Any]], step: int) -> bool:
        """The per-layer sparsity bar chart (``layers`` as in ``SparsityReport.to_dict()``)
        as image ``sparsity/by_layer`` at ``step``."""
        if self.writer is None:
            return False
        fig = figures.layer_sparsity(layers, f"zero weights by layer, step {step}")
        return self.figure("sparsity/by_layer", fig, step)

    def weight_histograms(self, model: nn.Module, step: int, force: bool = False) -> bool:
        """Histograms of every >=2-D weight, at most once per ``histogram_every`` steps unless
        ``force``. Returns whether they were written."""
        if self.writer is None or not self.histograms:
            return False
        recent = self._last_hist is not None and step - self._last_hist < self.histogram_every
        if recent and not force:
            return False
        self._last_hist = step
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
                self.writer.add_histogram(f"weights/{name}", weight.detach().float().cpu(), step)
        return True

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, markdown, step)

    def hparams(self, config: Mapping[str, Any], metrics: Mapping[str, float], step: int,
                overrides: Sequence[str] = (),
                domains: Mapping[str, Sequence[str]] | None = None) -> None:
        """One hparams entry for this run: ``recipe`` and the keys set by ``overrides`` (a
        sweep's swept keys among them) first, then the keys of :data:`CORE_HPARAMS` (the whole
        config is the ``config`` text); and the final ``metrics``, in their order (also
        written as scalars, which is where the dashboard reads them). TensorBoard lists first,
        and shows by default, the hparams marked as differing between runs, so the overridden
        ones are marked. A string hparam
        is kept only with its set of values in ``domains`` (this run's value added; booleans
        are declared ``[False, True]``): the dashboard filters runs on a string's declared
        values and warns about a string without them. The others (paths, lists) are in the
        ``config`` text."""
        if self.writer is None:
            return
        domains = dict(domains or {})
        flat = {"recipe": recipe_of(overrides) or "default", **flatten(config)}
        keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides
                if "=" in o and not o.lstrip("+~").startswith(_NOT_IN_NAME)]
        hp: dict[str, Any] = {}
        discrete: dict[str, list] = {}
        for k in dict.fromkeys(["recipe", *(k for k in keys if k in flat),
                                *(k for k in CORE_HPARAMS if k in flat)]):
            v = flat[k]
            if isinstance(v, bool):
                hp[k], discrete[k] = v, [False, True]
            elif isinstance(v, (int, float)):
                hp[k] = v
            elif isinstance(v, str) and k in domains:
                hp[k], discrete[k] = v, list(dict.fromkeys([*map(str, domains[k]), v]))
        exp, ssi, sei = hparams_summary(hp, dict(metrics), discrete)
        mark_differing(exp, {"recipe", *keys} & set(hp))
        file_writer = _compat.summary_file_writer(self.writer)
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        self.scalars(metrics, step)

    def close(self) -> None:
        """Write the custom-scalars layout for the tags logged, and close the writers."""
        if self.writer is not None:
            self.writer.add_custom_scalars(anchored(layout(self._tags)))
            self.writer.close()
        if self._dense is not None:
            self._dense.close()


def mark_differing(experiment: Any, names: set[str]) -> None:
    """Set ``differs`` on the hparams ``names`` of an hparams experiment summary (in place)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    value = experiment.value[0]
    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in names
    value.metadata.plugin_data.content = data.SerializeToString()


def sweep_points(sweep_dir: str | os.PathLike) -> tuple[str, list[dict[str, Any]]]:
    """The metric and one point per finished run of a sweep (``<sweep_dir>/<n>/summary.json``,
    labelled by the overrides in which it differs from the others); accuracy in %, latency
    with its p10/p90 where the summary has them."""
    points, metric = [], "accuracy"
    runs = sorted((p for p in Path(sweep_dir).glob("*/summary.json")),
                  key=lambda p: (len(p.parent.name), p.parent.name))
    for path in runs:
        s = json.loads(path.read_text())
        metric = s["metric"]
        scale = 100.0 if metric == "accuracy" else 1.0
        side = {k: {"value": scale * s[k][metric], "size_bytes": s[k]["size_bytes"],
                    **{f"latency_ms{end}": s[k].get(f"latency_ms{end}")
                       for end in ("", "_p10", "_p90") if s[k].get(f"latency_ms{end}")}}
                for k in ("dense", "compressed")}
        points.append({"label": run_label(read_overrides(path.parent)), **side["compressed"],
                       "dense": side["dense"]})
    # name each point by what differs between the runs: the swept values
    parts = [p["label"].split(",") for p in points]
    common = set.intersection(*map(set, parts)) if parts else set()
    for p, ps in zip(points, parts):
        p["label"] = ",".join(x for x in ps if x not in common) or p["label"]
    return metric, points


def sweep_figures(sweep_dir: str | os.PathLike) -> Path | None:
    """After a sweep: ``<sweep_dir>/pareto.png`` (the metric vs size and latency, one point
    per run) and the same image in TensorBoard under ``<sweep_dir>/tb/sweep``. Returns the
    PNG's path, or None (no finished run, or no matplotlib: then it says so)."""
    metric, points = sweep_points(sweep_dir)
    fig = figures.pareto(points, metric)
    if fig is None:
        if points:
            print(figures.MISSING)
        return None
    png = Path(sweep_dir) / "pareto.png"
    png.write_bytes(figures.to_png(fig))
    with SummaryWriter(str(Path(sweep_dir) / "tb" / "sweep")) as writer:
        writer.add_image("sweep/pareto", figures.to_rgb(fig), 0, dataformats="HWC")
        writer.add_text("sweep/runs", "\n".join(
            f"- {p['label']}: {metric} {p['value']:.4g}, {p['size_bytes']:,} bytes"
            + (f", {p['latency_ms']:.3f} ms" if p.get("latency_ms") else "") for p in points))
    return png
