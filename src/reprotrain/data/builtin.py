"""Built-in data sources: no download, the same samples from the same seed.

data=synthetic        reprotrain.data.synthetic   Gaussian classes, 784 features, from a seed
data=digits           reprotrain.data.digits      scikit-learn's 1797 8x8 digits, as 64 features
data=digits_images    reprotrain.data.digits      the same digits as 1x8x8 images (images: true)
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from reprotrain.data.splits import Splits


def synthetic(
    num_samples: int = 8192,
    num_features: int = 784,
    num_classes: int = 10,
    noise: float = 8.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Gaussian classes around random centres: separable enough to learn, noisy enough to take steps."""
    _check(num_samples=num_samples, num_features=num_features, val_fraction=val_fraction)
    if num_classes < 2 or noise < 0:
        raise ValueError(f"num_classes={num_classes} must be >= 2 and noise={noise} >= 0")
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((num_classes, num_features), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=num_samples)
    draws = rng.standard_normal((labels.size, num_features), dtype=np.float32)
    features = (centres[labels] + noise * draws) / np.float32(np.sqrt(1.0 + noise**2))
    return split(
        features.astype(np.float32), labels.astype(np.int64), num_classes, val_fraction, seed
    )


def digits(
    num_samples: int | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    images: bool = False,
) -> Splits:
    """The 8x8 handwritten digits inside scikit-learn: 64 features in 0..1, or 1x8x8 images."""
    from sklearn.datasets import load_digits  # ~0.5 s of imports, only for this source

    _check(num_samples=num_samples, val_fraction=val_fraction)
    loaded = load_digits()
    features = (loaded.data / 16.0).astype(np.float32)  # pixel values 0..16 -> 0..1
    labels = loaded.target.astype(np.int64)
    if num_samples is not None:
        order = np.random.default_rng(seed).permutation(labels.size)[:num_samples]
        features, labels = features[order], labels[order]
    if images:
        features = features.reshape(-1, 1, 8, 8)  # C x H x W
    return split(features, labels, 10, val_fraction, seed)


def split(
    features: np.ndarray, labels: np.ndarray, num_classes: int, val_fraction: float, seed: int
) -> Splits:
    order = np.random.default_rng(seed + 1).permutation(labels.size)
    n_val = max(1, int(round(labels.size * val_fraction)))
    val, train = order[:n_val], order[n_val:]
    return Splits(
        TensorDataset(torch.from_numpy(features[train]), torch.from_numpy(labels[train])),
        TensorDataset(torch.from_numpy(features[val]), torch.from_numpy(labels[val])),
        num_classes,
    )


def _check(**values: float | None) -> None:
    for name, value in values.items():
        if value is None:
            continue
        if name == "val_fraction" and not 0 < value < 1:
            raise ValueError(f"val_fraction={value} must be in (0, 1)")
        if name == "num_samples" and value < 10:
            raise ValueError(f"num_samples={value} must be an integer >= 10, or null for all")
        if name == "num_features" and value < 1:
            raise ValueError(f"num_features={value} must be an integer >= 1")
