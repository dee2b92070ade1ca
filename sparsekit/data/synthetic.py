"""Random images with random labels, for speed-only recipes (no download, no disk).

Each sample is drawn from its own seeded generator, so the dataset holds no tensors and item
``i`` is the same on every call.

>>> train, eval_ = synthetic_images(num_train=4, num_eval=2, image_size=8)
>>> x, y = train[3]
>>> x.shape, torch.equal(x, train[3][0]), 0 <= int(y) < 10, len(eval_)
(torch.Size([3, 8, 8]), True, True, 2)
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """``num_samples`` images (3, image_size, image_size), standard normal, labels uniform in
    ``[0, num_classes)``."""

    def __init__(self, num_samples: int, image_size: int, num_classes: int, seed: int) -> None:
        self.num_samples, self.image_size = num_samples, image_size
        self.num_classes, self.seed = num_classes, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(3, self.image_size, self.image_size, generator=g)
        return x, torch.randint(self.num_classes, (), generator=g)


def synthetic_images(
    num_train: int = 256,
    num_eval: int = 64,
    image_size: int = 224,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[SyntheticImages, SyntheticImages]:
    """``(train, eval)`` synthetic image datasets (for ``data._target_``)."""
    return (
        SyntheticImages(num_train, image_size, num_classes, seed),
        SyntheticImages(num_eval, image_size, num_classes, seed + 1),
    )
