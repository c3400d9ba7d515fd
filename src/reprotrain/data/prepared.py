"""A prepared dataset: any data source written to one .npz file that DVC versions.

    python -m reprotrain.prepare                     # data/dataset.npz from params.yaml's data
    python -m reprotrain.train data.file=data/dataset.npz

The file holds x_train, y_train, x_val, y_val (samples of any shape; float inputs, or
integer ones such as token ids, kept as they are) and num_classes; for data whose items are
dicts, each key's arrays as `train/<key>` and `val/<key>` instead.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from reprotrain.data.splits import MapDataset, Splits, to_tensors
from reprotrain.errors import DataError
from reprotrain.outputs import write_atomic

ARRAYS = ("x_train", "y_train", "x_val", "y_val")
FIX = "re-create it with `dvc repro prepare` (or `python -m reprotrain.prepare`)"


def write_npz(splits: Splits, path: Path, collate_fn: Any = None) -> str:
    """Write atomically and return the file's md5, as DVC computes it. Each split is one
    batch of all its items (`collate_fn`, data.collate_fn: padded to the longest)."""
    # name -> numpy array (Any: the type checker matches **arrays to savez's allow_pickle too)
    arrays: dict[str, Any] = {}
    for split in ("train", "val"):
        dataset = getattr(splits, split)
        whole = to_tensors(dataset) if collate_fn is None else collate_fn(items_of(dataset))
        if isinstance(whole, dict):
            arrays.update({f"{split}/{key}": value.numpy() for key, value in whole.items()})
        elif len(whole) == 2:
            arrays[f"x_{split}"], arrays[f"y_{split}"] = (t.numpy() for t in whole)
        else:
            raise DataError(
                f"prepare writes (input, target) pairs or dicts of arrays; the {split} items "
                f"are {len(whole)}-tuples",
                hint="return (input, target) or a dict from __getitem__, or train from "
                "data._target_ directly (data.file=null)",
            )
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
            if any(name.startswith("train/") for name in archive.files):
                return _read_dicts(path, archive)
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
        numbers = np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
        if not numbers or (np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x))):
            raise DataError(f"{where}: x_{split} holds NaN/inf or non-numeric values", hint=FIX)
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


class DictDataset(Dataset):
    """Items that are dicts of tensors, from one tensor per key (a prepared file's)."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns
        self.length = len(next(iter(columns.values())))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: column[index] for key, column in self.columns.items()}


def _read_dicts(path: Path, archive: Any) -> Splits:
    classes = int(archive["num_classes"]) if "num_classes" in archive.files else -1
    splits = []
    for split in ("train", "val"):
        prefix = f"{split}/"
        columns = {
            name.removeprefix(prefix): torch.from_numpy(archive[name])
            for name in archive.files
            if name.startswith(prefix)
        }
        if not columns or len({len(c) for c in columns.values()}) != 1:
            raise DataError(
                f"prepared data file {str(path)!r}: the {split} arrays are missing or differ "
                "in length",
                hint=FIX,
            )
        splits.append(DictDataset(columns))
    return Splits(splits[0], splits[1], classes if classes > 0 else None)


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    _update_with_file(digest, path)
    return digest.hexdigest()


def files_md5(path: Path) -> str:
    """md5 of the files under a folder (each one's path relative to it, then its bytes, in
    path order), of one file, or of nothing where `path` does not exist: the content of the
    files a dataset reads, read in chunks, never item by item."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.md5()
    for file in files:
        if not file.is_file():
            continue
        name = file.relative_to(path).as_posix() if file != path else file.name
        digest.update(name.encode() + b"\0")
        _update_with_file(digest, file)
        digest.update(b"\0")
    return digest.hexdigest()


def _update_with_file(digest: Any, path: Path) -> None:
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)


def items_of(dataset: MapDataset) -> list[Any]:
    return [dataset[i] for i in range(len(dataset))]
