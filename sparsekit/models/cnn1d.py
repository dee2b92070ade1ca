"""The small 1-D CNN of the MNIST-1D paper (three strided convolutions and a linear head),
with 32 channels instead of 25 so every layer after the first can take a 2:4 pattern (its
reduction dimension, channels x kernel, is a multiple of 4)."""

from __future__ import annotations

import torch
from torch import nn


class CNN1d(nn.Module):
    """Input (B, 1, in_len) float; output logits (B, num_classes)."""

    def __init__(self, num_classes: int = 10, channels: int = 32, in_len: int = 40) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        length = in_len
        for k in (5, 3, 3):
            length = (length + 2 - k) // 2 + 1
        self.linear = nn.Linear(channels * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.linear(x.flatten(1))


def mnist1d_cnn(num_classes: int = 10, channels: int = 32, in_len: int = 40) -> CNN1d:
    """Factory for :class:`CNN1d`.

    >>> mnist1d_cnn()(torch.zeros(2, 1, 40)).shape
    torch.Size([2, 10])
    """
    return CNN1d(num_classes, channels, in_len)
