"""The course's SimpleMLP, generalised to `depth` hidden layers.

    model = MLP(in_features=784, num_classes=10)            # 784 -> 512 -> ReLU -> 10

`in_features` and `num_classes` follow the data: reprotrain passes them when it builds the
model (see build.py), so conf/model/mlp.yaml sets only the shape of the hidden part.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden_size: int = 512,
        depth: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("depth", depth)):
            if value < 1:
                raise ValueError(f"{name}={value} must be an integer >= 1")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        layers: list[nn.Module] = [nn.Flatten()]  # a sample of any shape becomes a vector
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden_size), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
