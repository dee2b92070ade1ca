"""Figures for TensorBoard and sweeps, drawn with matplotlib (an optional dependency:
``pip install sparsekit[plots]``). Without it every function returns None and
:data:`MISSING` says why, so a run goes on without its figures.

Figures are rendered to RGB arrays (height, width, 3; uint8) or PNG bytes through matplotlib's
Agg canvas, never through pyplot, so no global figure state or display is involved.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator
except ImportError:  # pragma: no cover - exercised where matplotlib is absent
    Figure = None

MISSING = ("figures skipped: matplotlib is not installed (pip install matplotlib, or "
           "sparsekit[plots])")
DENSE, COMPRESSED = "#7f7f7f", "#1f77b4"  # the same two colours in every figure


def available() -> bool:
    return Figure is not None


def to_rgb(fig: Any) -> np.ndarray:
    """The figure as an (H, W, 3) uint8 array."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def to_png(fig: Any) -> bytes:
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def layer_sparsity(layers: Mapping[str, Mapping[str, Any]], title: str) -> Any | None:
    """Horizontal bars, one per layer in model order: the fraction of its weights that are
    zero (``layers`` as in ``SparsityReport.to_dict()["layers"]``); skipped layers in grey
    with their reason."""
    if Figure is None or not layers:
        return None
    names = list(layers)
    values = [100 * float(layers[n]["sparsity"]) for n in names]
    skipped = [bool(layers[n].get("skipped")) for n in names]
    fig = Figure(figsize=(6.4, 0.8 + 0.32 * len(names)), dpi=100)
    ax = fig.add_subplot()
    y = np.arange(len(names))
    ax.barh(y, values, color=[DENSE if s else COMPRESSED for s in skipped])
    ax.set_yticks(y, names)
    ax.invert_yaxis()  # first layer on top
    ax.set_xlim(0, 100)
    ax.set_xlabel("zero weights (%)")
    ax.set_title(title)
    for i, (v, s) in enumerate(zip(values, skipped)):
        note = f"{v:.1f}%" + ("  skipped: " + str(layers[names[i]]["skipped"]) if s else "")
        ax.text(min(v, 100) + 1, i, note, va="center", fontsize=8, clip_on=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


#: the speed figures the spread figure draws: summary key, axis label
SPEED_AXES = (("latency_ms", "latency, batch 1 (ms; lower is faster)"),
              ("throughput", "throughput (samples/s)"),
              ("tokens_per_s", "generation (tokens/s)"))


def _range(side: Mapping[str, Any], key: str) -> tuple[float, float, float]:
    """(median, p10, p90) of a speed figure; the median thrice where no spread was kept."""
    mid = float(side[key])
    return (mid, min(float(side.get(f"{key}_p10", mid)), mid),
            max(float(side.get(f"{key}_p90", mid)), mid))


def speed_spread(speed: Mapping[str, Mapping[str, Any]], cpu: bool = False) -> Any | None:
    """One panel per speed figure measured for both models (``speed``: ``{"dense": {...},
    "compressed": {...}}`` as in a run summary): a bar from zero to each model's median with
    its p10-p90 range as a whisker, and in the title the ratio ("N x slower" where it is a
    slowdown), or "within noise" where the two ranges overlap. ``cpu``: the figures are CPU
    time, titled so (a masked model runs dense kernels on a CPU: no speedup to show)."""
    keys = [(k, label) for k, label in SPEED_AXES
            if all(speed.get(n, {}).get(k) for n in ("dense", "compressed"))]
    if Figure is None or not keys:
        return None
    fig = Figure(figsize=(4.2 * len(keys), 2.6), dpi=100)
    for i, (key, label) in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        (dm, d10, d90), (cm, c10, c90) = (_range(speed[n], key) for n in ("dense", "compressed"))
        ax.barh([1, 0], [dm, cm], color=[DENSE, COMPRESSED], alpha=0.6, height=0.6)
        ax.errorbar([dm, cm], [1, 0], xerr=[[dm - d10, cm - c10], [d90 - dm, c90 - cm]],
                    fmt="none", ecolor="black", capsize=4, lw=1.2)
        for y, mid, hi in ((1, dm, d90), (0, cm, c90)):
            ax.text(hi, y, f"  {mid:.4g}", va="center", fontsize=8)
        ax.set_yticks([1, 0], ["dense", "compressed"])
        ax.set_xlim(0, max(d90, c90) * 1.3)
        # a few short ticks (12k, not 12000 beside 14000): large throughputs stay readable
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel(label, fontsize=8)
        noise = d10 <= c90 and c10 <= d90
        ratio = dm / cm if key == "latency_ms" else cm / dm
        title = (f"compressed {ratio:.2f}x faster" if ratio >= 1
                 else f"compressed {1 / ratio:.2f}x slower")
        ax.set_title("within noise (p10-p90 overlap)" if noise else title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("CPU time (speedup not measured on CPU): median, whiskers p10-p90 over the "
                 "repeats" if cpu else "speed: median, whiskers p10-p90 over the repeats",
                 fontsize=9)
    fig.tight_layout()
    return fig


def pareto(points: Sequence[Mapping[str, Any]], metric: str) -> Any | None:
    """``metric`` against size (and against latency where measured): one point per run
    (``points``: dicts with ``label``, ``value``, ``size_bytes``, ``latency_ms`` or None, with
    ``latency_ms_p10``/``_p90`` where measured, and ``dense``, the run's dense reference
    ``{"value", "size_bytes", "latency_ms", ...}``), the Pareto front as a line, the dense
    model as a grey star. On the latency panel each point has its p10-p90 whisker; a run
    is only faster than another where their ranges do not overlap (:func:`front_indices`
    with ``spans``), and a run whose range overlaps the dense model's is drawn hollow and
    marked "~ dense speed"."""
    if Figure is None or not points:
        return None
    better_low = metric == "perplexity"
    axes_keys = ["size_bytes"] + (["latency_ms"] if all(p.get("latency_ms") for p in points)
                                  else [])
    fig = Figure(figsize=(5.2 * len(axes_keys) + 0.6, 4.4), dpi=100)
    dense = points[0].get("dense") or {}
    for i, key in enumerate(axes_keys):
        ax = fig.add_subplot(1, len(axes_keys), i + 1)
        xs = [float(p[key]) for p in points]
        ys = [float(p["value"]) for p in points]
        spans = None
        if key == "latency_ms":
            spans = [_range(p, key)[1:] for p in points]
            ax.errorbar(xs, ys, xerr=[[x - lo for x, (lo, _) in zip(xs, spans)],
                                      [hi - x for x, (_, hi) in zip(xs, spans)]],
                        fmt="none", ecolor=COMPRESSED, alpha=0.6, capsize=3)
        noisy = [False] * len(points)
        if spans is not None and dense.get(key):
            _, d10, d90 = _range(dense, key)
            noisy = [lo <= d90 and d10 <= hi for lo, hi in spans]
        ax.scatter([x for x, n in zip(xs, noisy) if not n], [y for y, n in zip(ys, noisy)
                                                            if not n],
                   color=COMPRESSED, label="compressed runs", zorder=3)
        if any(noisy):
            ax.scatter([x for x, n in zip(xs, noisy) if n], [y for y, n in zip(ys, noisy) if n],
                       facecolors="white", edgecolors=COMPRESSED, zorder=3,
                       label="speed within noise of dense")
        for x, y, p, n in zip(xs, ys, points, noisy):
            ax.annotate(p["label"] + ("  (~ dense speed)" if n else ""), (x, y),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = front_indices(xs, ys, better_low, spans)
        ax.plot([xs[j] for j in front], [ys[j] for j in front], color=COMPRESSED, alpha=0.5,
                drawstyle="steps-post", label="Pareto front")
        if dense.get(key) and dense.get("value") is not None:
            if key == "latency_ms":
                _, d10, d90 = _range(dense, key)
                ax.axvspan(d10, d90, color=DENSE, alpha=0.15, label="dense p10-p90")
            ax.scatter([dense[key]], [dense["value"]], marker="*", s=160, color=DENSE,
                       label="dense", zorder=3)
        ax.set_xlabel({"size_bytes": "size (bytes)",
                       "latency_ms": "latency, batch 1 (ms; whiskers p10-p90)"}[key])
        ax.set_ylabel(metric + (" (lower is better)" if better_low else " (%)"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"sweep: {metric} vs {' and '.join(k.split('_')[0] for k in axes_keys)}")
    fig.tight_layout()
    return fig


def front_indices(xs: Sequence[float], ys: Sequence[float], lower_is_better: bool,
                  spans: Sequence[tuple[float, float]] | None = None) -> list[int]:
    """Indices of the points no other point beats, by x: a point is beaten by one at least as
    good on y and on x, and better on one of them. Without ``spans``, smaller x is better;
    with ``spans`` (each point's (p10, p90) on x) a point is better on x only where its whole
    range lies below the other's, and ranges that overlap count as the same x (a difference
    within the noise is no trade-off).

    >>> front_indices([1, 2, 3, 4], [50, 90, 80, 95], lower_is_better=False)
    [0, 1, 3]
    >>> front_indices([1.00, 1.10, 3], [90, 95, 99], False, [(0.9, 1.2), (1.0, 1.3), (2.8, 3.2)])
    [1, 2]
    """
    sign = 1 if lower_is_better else -1
    n = len(xs)
    if spans is None:
        spans = [(x, x) for x in xs]

    def beats(a: int, b: int) -> bool:
        faster = spans[a][1] < spans[b][0]
        same = not faster and not spans[b][1] < spans[a][0]
        better, equal = sign * ys[a] < sign * ys[b], ys[a] == ys[b]
        if spans[a] == (xs[a], xs[a]) and spans[b] == (xs[b], xs[b]):  # exact: plain dominance
            faster, same = xs[a] < xs[b], xs[a] == xs[b]
        return (faster and (better or equal)) or (same and better)

    kept = [i for i in range(n) if not any(beats(j, i) for j in range(n) if j != i)]
    return sorted(kept, key=lambda i: (xs[i], sign * ys[i]))
