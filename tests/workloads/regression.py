"""A regression workload: scikit-learn's diabetes data (bundled, no download) and a small MLP.

    splits = diabetes()             # features float32 [n, 10] -> target float32 [] per sample
    model = RegressionMLP(in_features=10)
    model(features).shape           # [batch, 1], as a tutorial's model ends: nn.Linear(..., 1)

The model is written the way tutorials write one: its last layer is `nn.Linear(hidden, 1)`, and
it does not squeeze that output to the target's `[batch]`.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import TensorDataset

from reprotrain.data import Splits


def diabetes(val_fraction: float = 0.2, seed: int = 0, scale_target: bool = True) -> Splits:
    """442 patients, 10 features each, standardised with the training split's mean and spread.

    scale_target: standardise the target (disease progression, 25..346) the same way, so a mean
    squared error starts near 1; False keeps it in its own units.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    features, target = load_diabetes(return_X_y=True, scaled=False)
    order = np.random.default_rng(seed).permutation(len(target))
    n_val = max(1, round(len(target) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    features = (features - features[train].mean(0)) / features[train].std(0)
    if scale_target:
        target = (target - target[train].mean()) / target[train].std()
    features, target = features.astype(np.float32), target.astype(np.float32)
    return Splits(
        TensorDataset(torch.from_numpy(features[train]), torch.from_numpy(target[train])),
        TensorDataset(torch.from_numpy(features[val]), torch.from_numpy(target[val])),
        num_classes=None,
    )


class RegressionMLP(nn.Module):
    """Two hidden layers with ReLU, one output: the predicted value."""

    def __init__(self, in_features: int, hidden_size: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
