"""TensorBoard logging for a run: scalars, weight histograms, hparams, text and a layout.

Everything goes into ONE log directory (one TensorBoard run): the hparams summaries are written
with the low-level summary API into that same event stream, not through
``SummaryWriter.add_hparams`` (which opens a timestamped sub-run). The writer flushes on an
interval (``flush_secs``), not on every call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary

# dense and compressed metrics, side by side in the custom-scalars dashboard
LAYOUT = {
    "dense vs compressed": {
        "accuracy": ["Multiline", ["eval/accuracy/dense", "eval/accuracy/compressed"]],
        "perplexity": ["Multiline", ["eval/perplexity/dense", "eval/perplexity/compressed"]],
        "latency (ms, batch 1)": [
            "Multiline", ["speed/latency_ms/dense", "speed/latency_ms/compressed"]
        ],
        "throughput (samples/s)": [
            "Multiline", ["speed/throughput/dense", "speed/throughput/compressed"]
        ],
        "size (bytes)": ["Multiline", ["size/bytes/dense", "size/bytes/compressed"]],
    },
    "training": {
        "loss": ["Multiline", ["train/loss"]],
        "sparsity": ["Multiline", ["sparsity/global"]],
    },
}


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
    """Writes one run's TensorBoard events under ``logdir``. ``enabled=False`` makes every
    method a no-op, so the pipeline never branches on tracking. ``purge_step`` (on resume)
    drops events at or after that step left by the interrupted run."""

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
        self.writer = (
            SummaryWriter(str(self.logdir), flush_secs=flush_secs, purge_step=purge_step)
            if enabled
            else None
        )
        if self.writer is not None and purge_step is None:
            self.writer.add_custom_scalars(LAYOUT)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

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

    def hparams(self, config: Mapping[str, Any], metrics: Mapping[str, float], step: int) -> None:
        """One hparams entry for this run: the flattened ``config`` and final ``metrics``
        (also written as scalars, which is where the hparams dashboard reads them)."""
        if self.writer is None:
            return
        hp = {k: v for k, v in flatten(config).items() if isinstance(v, (int, float, str, bool))}
        exp, ssi, sei = hparams_summary(hp, dict(metrics))
        file_writer = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        self.scalars(metrics, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
