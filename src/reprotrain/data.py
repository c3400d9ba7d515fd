"""Datasets and batches.

    dataset = load_dataset(cfg.data)            # synthetic, digits, or a prepared .npz
    batches = Batches(dataset, 64, device, resident=True, seed=0)
    for inputs, targets in batches.take(steps): ...

Two sources need no download: `synthetic` (a learnable 10-class problem made from a seed)
and `digits` (the 8x8 handwritten digits that ship inside scikit-learn). `prepare` writes
either to an .npz file that DVC versions; training can read that file back (`data.file`).
"""

from __future__ import annotations

import hashlib
import itertools
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reprotrain.errors import ConfigError, DataError
from reprotrain.outputs import write_atomic
from reprotrain.schema import DataConfig

ARRAYS = ("x_train", "y_train", "x_val", "y_val")


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # float32 [n, features]
    y_train: np.ndarray  # int64 [n]
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])


def load_dataset(cfg: DataConfig) -> Dataset:
    """The dataset `cfg` describes: read from cfg.file when set, else generated/loaded in memory."""
    if cfg.file:
        dataset = read_npz(Path(cfg.file), cfg.num_classes)
    elif cfg.name == "synthetic":
        dataset = _split(cfg, *make_synthetic(cfg))
    else:
        dataset = _split(cfg, *load_digits(cfg))
    if dataset.num_features != cfg.num_features:
        raise ConfigError(
            f"data.num_features={cfg.num_features} but the {dataset.name} data has "
            f"{dataset.num_features} features per sample",
            hint=f"set data.num_features={dataset.num_features} (the model's input size follows it)",
        )
    return dataset


def make_synthetic(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian classes around random centres: separable enough to learn, noisy enough to take steps."""
    rng = np.random.default_rng(cfg.seed)
    centres = rng.standard_normal((cfg.num_classes, cfg.num_features), dtype=np.float32)
    labels = rng.integers(0, cfg.num_classes, size=cfg.num_samples or 8192)
    noise = rng.standard_normal((labels.size, cfg.num_features), dtype=np.float32)
    features = (centres[labels] + cfg.noise * noise) / np.float32(np.sqrt(1.0 + cfg.noise**2))
    return features.astype(np.float32), labels.astype(np.int64)


def load_digits(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as sklearn_digits  # imported only when used

    digits = sklearn_digits()
    features = (digits.data / 16.0).astype(np.float32)  # pixel values 0..16 -> 0..1
    labels = digits.target.astype(np.int64)
    if cfg.num_samples is not None:
        order = np.random.default_rng(cfg.seed).permutation(labels.size)[: cfg.num_samples]
        features, labels = features[order], labels[order]
    return features, labels


def _split(cfg: DataConfig, features: np.ndarray, labels: np.ndarray) -> Dataset:
    order = np.random.default_rng(cfg.seed + 1).permutation(labels.size)
    n_val = max(1, int(round(labels.size * cfg.val_fraction)))
    val, train = order[:n_val], order[n_val:]
    return Dataset(
        cfg.name, features[train], labels[train], features[val], labels[val], cfg.num_classes
    )


def write_npz(dataset: Dataset, path: Path) -> str:
    """Write atomically and return the file's md5, as DVC computes it."""
    arrays = {key: getattr(dataset, key) for key in ARRAYS}
    write_atomic(
        path,
        lambda handle: np.savez(
            handle, name=np.array(dataset.name), num_classes=np.array(dataset.num_classes), **arrays
        ),
    )
    return file_md5(path)


def read_npz(path: Path, num_classes: int) -> Dataset:
    """Read a prepared dataset, turning every way it can be broken into one DataError line."""
    fix = "re-create it with `dvc repro prepare` (or `python -m reprotrain.prepare`)"
    if not path.is_file():
        raise DataError(f"prepared data file {str(path)!r} does not exist", hint=fix)
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ARRAYS if key not in archive.files]
            if missing:
                raise DataError(
                    f"prepared data file {str(path)!r} lacks arrays {missing}", hint=fix
                )
            arrays = {key: archive[key] for key in ARRAYS}
            name = str(archive["name"]) if "name" in archive.files else path.stem
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as error:
        raise DataError(
            f"prepared data file {str(path)!r} is corrupt or truncated ({type(error).__name__}: {error})",
            hint=fix,
        ) from None
    _check_arrays(path, arrays, num_classes, fix)
    return Dataset(
        name,
        arrays["x_train"].astype(np.float32),
        arrays["y_train"].astype(np.int64),
        arrays["x_val"].astype(np.float32),
        arrays["y_val"].astype(np.int64),
        num_classes,
    )


def _check_arrays(path: Path, arrays: dict[str, np.ndarray], num_classes: int, fix: str) -> None:
    where = f"prepared data file {str(path)!r}"
    for split in ("train", "val"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
            raise DataError(
                f"{where}: x_{split} has shape {x.shape} and y_{split} {y.shape}; "
                "expected [n, features] and [n] with n > 0",
                hint=fix,
            )
        if not np.issubdtype(x.dtype, np.floating) or not np.all(np.isfinite(x)):
            raise DataError(f"{where}: x_{split} holds NaN/inf or non-float values", hint=fix)
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
            raise DataError(
                f"{where}: y_{split} labels span {y.min()}..{y.max()}; allowed 0..{num_classes - 1}",
                hint=f"set data.num_classes to match the data, or {fix}",
            )
    if arrays["x_train"].shape[1] != arrays["x_val"].shape[1]:
        raise DataError(f"{where}: train and validation features differ in width", hint=fix)


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Batches:
    """Shuffled mini-batches of the training split, forever (epoch after epoch).

    When `resident`, the whole split lives on the device and a batch is a slice of a
    per-epoch shuffled copy: no host-to-device copy inside the loop. Otherwise batches
    stay on the host (pinned for CUDA) and the loop copies each with non_blocking=True.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, device: torch.device, *, resident: bool, seed: int
    ) -> None:
        n = dataset.x_train.shape[0]
        if batch_size > n:
            raise ConfigError(
                f"train.batch_size={batch_size} is larger than the training split ({n} samples)",
                hint=f"use train.batch_size<={n} or more data (data.num_samples)",
            )
        home = device if resident else torch.device("cpu")
        self.x = torch.from_numpy(dataset.x_train).to(home)
        self.y = torch.from_numpy(dataset.y_train).to(home)
        if not resident and device.type == "cuda":
            self.x, self.y = self.x.pin_memory(), self.y.pin_memory()  # lets copies overlap compute
        self.batch_size = batch_size
        # Drop the ragged tail: every step sees a full batch.
        self.batches_per_epoch = n // batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def epochs(self, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(skip):  # the orders those epochs would have had: same RNG draws
            torch.randperm(self.x.shape[0], generator=self.generator)
        while True:
            order = torch.randperm(self.x.shape[0], generator=self.generator).to(self.x.device)
            x_epoch, y_epoch = self.x[order], self.y[order]  # one gather per epoch, then views
            if self.x.is_pinned():
                x_epoch, y_epoch = x_epoch.pin_memory(), y_epoch.pin_memory()
            for i in range(self.batches_per_epoch):
                window = slice(i * self.batch_size, (i + 1) * self.batch_size)
                yield x_epoch[window], y_epoch[window]

    def take(self, steps: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches for steps start+1..steps: a resumed run sees what an uninterrupted one would."""
        epoch, position = divmod(start, self.batches_per_epoch)
        return itertools.islice(self.epochs(skip=epoch), position, position + steps - start)


def fits_on_device(dataset: Dataset, device: torch.device) -> bool:
    """Keep the data resident when it takes under a quarter of the device's free memory."""
    if device.type != "cuda":
        return True  # cpu/mps: host memory is where it already is
    free, _total = torch.cuda.mem_get_info(device)
    return dataset.x_train.nbytes + dataset.y_train.nbytes < free // 4
