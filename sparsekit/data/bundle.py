"""What every dataset builder returns: train/eval (and optional calibration) datasets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset


@dataclass
class DataBundle:
    train: Dataset
    eval: Dataset
    info: dict[str, Any] = field(default_factory=dict)  # e.g. num_classes, vocab_size
    calibration: Dataset | None = None  # its own split for calibration; None: train
