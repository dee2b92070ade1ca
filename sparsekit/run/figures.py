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


def pareto(points: Sequence[Mapping[str, Any]], metric: str) -> Any | None:
    """``metric`` against size (and against latency where measured): one point per run
    (``points``: dicts with ``label``, ``value``, ``size_bytes``, ``latency_ms`` or None and
    ``dense``, the run's dense reference ``{"value", "size_bytes", "latency_ms"}``), the
    Pareto front as a line, the dense model as a grey star."""
    if Figure is None or not points:
        return None
    better_low = metric == "perplexity"
    axes_keys = ["size_bytes"] + (["latency_ms"] if all(p.get("latency_ms") for p in points)
                                  else [])
    fig = Figure(figsize=(5.2 * len(axes_keys) + 0.6, 4.4), dpi=100)
    for i, key in enumerate(axes_keys):
        ax = fig.add_subplot(1, len(axes_keys), i + 1)
        xs = [float(p[key]) for p in points]
        ys = [float(p["value"]) for p in points]
        ax.scatter(xs, ys, color=COMPRESSED, label="compressed runs", zorder=3)
        for x, y, p in zip(xs, ys, points):
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        front = front_indices(xs, ys, better_low)
        ax.plot([xs[j] for j in front], [ys[j] for j in front], color=COMPRESSED, alpha=0.5,
                drawstyle="steps-post", label="Pareto front")
        dense = points[0].get("dense") or {}
        if dense.get(key) and dense.get("value") is not None:
            ax.scatter([dense[key]], [dense["value"]], marker="*", s=160, color=DENSE,
                       label="dense", zorder=3)
        ax.set_xlabel({"size_bytes": "size (bytes)", "latency_ms": "latency, batch 1 (ms)"}[key])
        ax.set_ylabel(metric + (" (lower is better)" if better_low else " (%)"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"sweep: {metric} vs {' and '.join(k.split('_')[0] for k in axes_keys)}")
    fig.tight_layout()
    return fig


def front_indices(xs: Sequence[float], ys: Sequence[float], lower_is_better: bool) -> list[int]:
    """Indices of the points no other point beats on both axes (smaller x, better y), by x.

    >>> front_indices([1, 2, 3, 4], [50, 90, 80, 95], lower_is_better=False)
    [0, 1, 3]
    """
    sign = 1 if lower_is_better else -1
    order = sorted(range(len(xs)), key=lambda i: (xs[i], sign * ys[i]))
    out: list[int] = []
    for i in order:
        if not out or sign * ys[i] < sign * ys[out[-1]]:
            out.append(i)
    return out
