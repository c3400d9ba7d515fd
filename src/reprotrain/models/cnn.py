"""A small convolutional network for C x H x W images (the digits as 1 x 8 x 8, say).

    model = SmallCNN(input_shape=(1, 8, 8), num_classes=10)

Two blocks of 3x3 convolution, batch norm, ReLU and 2x2 max-pooling, then a linear
classifier. `input_shape` and `num_classes` follow the data (build.py passes them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: int = 32,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"input_shape={tuple(input_shape)} is not C x H x W: SmallCNN takes images "
                "(use data=digits_images, or model=mlp for feature vectors)"
            )
        if channels < 1:
            raise ValueError(f"channels={channels} must be an integer >= 1")
        in_channels, height, width = input_shape
        blocks: list[nn.Module] = []
        for out_channels in (channels, 2 * channels):
            blocks += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(),
            ]
            if height >= 2 and width >= 2:
                blocks.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            in_channels = out_channels
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(in_channels * height * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
