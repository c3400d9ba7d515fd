"""A user's own project folder for tests: a package with a model and a dataset of its own,
and a config folder naming them with `_target_`s (as the README's "Bring your own model")."""

from __future__ import annotations

from pathlib import Path

USER_MODELS = '''
import mlflow
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


class LoggingNet(TinyConvNet):
    """A user's model that logs to the MLflow run itself, as the README shows."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 1:
                mlflow.log_text(mlflow.active_run().info.run_id, "user/run_id.txt")
            if self.calls % 10 == 0:
                mlflow.log_metric("user/forward_calls", self.calls, step=self.calls)
        return super().forward(x)


class UncopyableNet(TinyConvNet):
    """A model MLflow cannot save (it cannot be copied, so no CPU snapshot can be made)."""

    def __deepcopy__(self, memo):
        raise TypeError("UncopyableNet holds a handle that cannot be copied")
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
    (conf / "model" / "logging.yaml").write_text("_target_: my_project.models.LoggingNet\n")
    (conf / "model" / "uncopyable.yaml").write_text("_target_: my_project.models.UncopyableNet\n")
    (conf / "data" / "blobs.yaml").write_text(
        "_target_: my_project.data.blobs\ntrain_size: 256\nval_size: 64\nseed: 0\n"
    )
    return folder
