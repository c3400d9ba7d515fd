"""A prepared dataset: any data source written to one .npz file that DVC versions.

    python -m reprotrain.prepare                     # data/dataset.npz from params.yaml's data
    python -m reprotrain.train data.file=data/dataset.npz

The file holds x_train, y_train, x_val, y_val (samples of any shape) and num_classes.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from reprotrain.data.splits import Splits, to_tensors
from reprotrain.errors import DataError
from reprotrain.outputs import write_atomic

ARRAYS = ("x_train", "y_train", "x_val", "y_val")
FIX = "re-create it with `dvc repro prepare` (or `python -m reprotrain.prepare`)"


def write_npz(splits: Splits, path: Path) -> str:
    """Write atomically and return the file's md5, as DVC computes it."""
    (x_train, y_train), (x_val, y_val) = to_tensors(splits.train), to_tensors(splits.val)
    arrays = {
        "x_train": x_train.numpy(),
        "y_train": y_train.numpy(),
        "x_val": x_val.numpy(),
        "y_val": y_val.numpy(),
    }
    classes = -1 if splits.num_classes is None else int(splits.num_classes)
    write_atomic(
        path, lambda handle: np.savez(handle, num_classes=np.array(classes), **arrays), "--out"
    )
    return file_md5(path)


def read_npz(path: Path) -> Splits:
    """Read a prepared dataset, turning every way it can be broken into one DataError line."""
    if not path.is_file():
        raise DataError(f"prepared data file {str(path)!r} does not exist", hint=FIX)
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ARRAYS if key not in archive.files]
            if missing:
                raise DataError(
                    f"prepared data file {str(path)!r} lacks arrays {missing}", hint=FIX
                )
            arrays = {key: archive[key] for key in ARRAYS}
            classes = int(archive["num_classes"]) if "num_classes" in archive.files else -1
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as error:
        raise DataError(
            f"prepared data file {str(path)!r} is corrupt or truncated ({type(error).__name__})",
            hint=FIX,
        ) from None
    num_classes = classes if classes > 0 else None
    _check_arrays(path, arrays, num_classes)
    return Splits(
        TensorDataset(torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])),
        TensorDataset(torch.from_numpy(arrays["x_val"]), torch.from_numpy(arrays["y_val"])),
        num_classes,
    )


def _check_arrays(path: Path, arrays: dict[str, np.ndarray], num_classes: int | None) -> None:
    where = f"prepared data file {str(path)!r}"
    for split in ("train", "val"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 2 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
            raise DataError(
                f"{where}: x_{split} has shape {x.shape} and y_{split} {y.shape}; "
                "expected [n, ...] and [n, ...] with n > 0",
                hint=FIX,
            )
        if not np.issubdtype(x.dtype, np.floating) or not np.all(np.isfinite(x)):
            raise DataError(f"{where}: x_{split} holds NaN/inf or non-float values", hint=FIX)
        if num_classes is not None and (
            not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes
        ):
            raise DataError(
                f"{where}: y_{split} labels span {y.min()}..{y.max()}; allowed 0..{num_classes - 1}",
                hint=FIX,
            )
    if arrays["x_train"].shape[1:] != arrays["x_val"].shape[1:]:
        raise DataError(
            f"{where}: train samples are {arrays['x_train'].shape[1:]}, validation samples "
            f"{arrays['x_val'].shape[1:]}",
            hint=FIX,
        )


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
