"""A user's own project folder for tests: a package with a model and a dataset of its own,
and a config folder naming them with `_target_`s (as the README's "Bring your own model")."""

from __future__ import annotations

from pathlib import Path

USER_MODELS = '''
import torch
from torch import nn


class TinyConvNet(nn.Module):
    """A user's own model: one conv layer and a linear head, for C x H x W images."""

    def __init__(self, input_shape, num_classes, width=8):
        super().__init__()
        channels, height, wide = input_shape
        self.conv = nn.Conv2d(channels, width, kernel_size=3, padding=1)
        self.head = nn.Linear(width * height * wide, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))
'''

USER_DATA = '''
import numpy as np
import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """A user's own map-style dataset of 1x6x6 images: class k is a bright pixel row k."""

    def __init__(self, count, seed):
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 3, size=count)
        self.images = rng.normal(0, 0.3, size=(count, 1, 6, 6)).astype(np.float32)
        for i, label in enumerate(self.labels):
            self.images[i, 0, label * 2] += 1.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return torch.from_numpy(self.images[index]), int(self.labels[index])


def blobs(train_size=256, val_size=64, seed=0):
    return {"train": Blobs(train_size, seed), "val": Blobs(val_size, seed + 1), "num_classes": 3}


def mismatched():
    return {"train": Blobs(64, 0), "val": [(torch.zeros(1, 5, 5), 0)], "num_classes": 3}


def not_splits():
    return 42
'''


def user_project(folder: Path) -> Path:
    """A user's folder: a package with a model and a dataset, and a config folder."""
    package = folder / "my_project"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(USER_MODELS)
    (package / "data.py").write_text(USER_DATA)
    conf = folder / "my_conf"
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir(parents=True)
    (conf / "model" / "tiny.yaml").write_text("_target_: my_project.models.TinyConvNet\nwidth: 8\n")
    (conf / "data" / "blobs.yaml").write_text(
        "_target_: my_project.data.blobs\ntrain_size: 256\nval_size: 64\nseed: 0\n"
    )
    return folder
