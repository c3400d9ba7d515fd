"""What a `data` target returns, made uniform: train and validation datasets and the class count.

A `data._target_` may return any of
    Splits(train=..., val=..., num_classes=10)
    {"train": ..., "val": ..., "num_classes": 10}      # or a tuple (train, val, num_classes)
where `train` and `val` are map-style `torch.utils.data.Dataset`s (`__len__`, `__getitem__`
returning `(input, target)`, a longer tuple, or a dict such as `{"input_ids": ...,
"labels": ...}`) or `(inputs, targets)` pairs of tensors or NumPy arrays. `num_classes` is the
class count (a language model's vocabulary), or None when the targets are not classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import TensorDataset, default_collate

from reprotrain.data.structure import tensors
from reprotrain.errors import DataError

FIX = "return Splits(train, val, num_classes) or {'train': ..., 'val': ..., 'num_classes': N} from data._target_ (see the README's 'Bring your own model')"


class MapDataset(Protocol):
    """A map-style dataset: `len(dataset)` items, `dataset[i]` each: a TensorDataset, or a
    `torch.utils.data.Dataset` subclass with `__len__` (torch's `Dataset` declares none)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...


@dataclass
class Splits:
    train: MapDataset
    val: MapDataset
    num_classes: int | None = None  # None: the targets are not class labels


def as_splits(built: Any, target: str) -> Splits:
    """Accept every form above; anything else is one DataError line naming the target."""
    if isinstance(built, Splits):
        splits = built
    elif isinstance(built, Mapping) and {"train", "val"} <= set(built):
        splits = Splits(built["train"], built["val"], built.get("num_classes"))
    elif isinstance(built, tuple) and len(built) in (2, 3):
        splits = Splits(*built)
    else:
        raise DataError(
            f"data._target_={target!r} returned a {type(built).__name__}, not train and "
            "validation data",
            hint=FIX,
        )
    splits.train = _dataset(splits.train, "train", target)
    splits.val = _dataset(splits.val, "val", target)
    if splits.num_classes is not None and (
        not isinstance(splits.num_classes, int | np.integer) or splits.num_classes < 1
    ):
        raise DataError(
            f"data._target_={target!r} returned num_classes={splits.num_classes!r}; "
            "allowed: an integer >= 1, or None when the targets are not classes",
            hint=FIX,
        )
    _check_samples(splits, target)
    return splits


def _dataset(data: Any, split: str, target: str) -> MapDataset:
    if isinstance(data, tuple | list) and len(data) == 2:
        inputs, targets = (
            torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a for a in data
        )
        if inputs.shape[0] != targets.shape[0]:
            raise DataError(
                f"data._target_={target!r}: {split} inputs hold {inputs.shape[0]} samples but "
                f"targets {targets.shape[0]}",
                hint="give one target per input sample",
            )
        return TensorDataset(inputs, targets)
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise DataError(
            f"data._target_={target!r}: the {split} split is a {type(data).__name__}, not a "
            "map-style Dataset (with __len__ and __getitem__) or an (inputs, targets) pair",
            hint=FIX,
        )
    return data


def sample_of(dataset: MapDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (input, target) pair as tensors."""
    item = dataset[0]
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise DataError(
            f"a {type(dataset).__name__} item is a {type(item).__name__}, not an (input, target) pair",
            hint="make __getitem__ return (input, target)",
        )
    return sample_of_item(item)


def first_batch(dataset: MapDataset, count: int = 1, collate_fn: Any = None) -> Any:
    """The first `count` items as one batch, as the loader would make it."""
    items = [dataset[i] for i in range(min(count, len(dataset)))]
    try:
        return (collate_fn or default_collate)(items)
    except Exception as error:  # default_collate's TypeError/RuntimeError, or the user's
        raise DataError(
            f"the items of a {type(dataset).__name__} cannot be made into a batch "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})",
            hint="return tensors (or tuples and dicts of them) of one shape from __getitem__, "
            "or give data.collate_fn to pad them",
        ) from None


def input_sample(dataset: MapDataset) -> torch.Tensor | None:
    """A (input, target) item's input as a tensor; None for items of another form (dicts)."""
    item = dataset[0]
    if isinstance(item, tuple | list) and len(item) == 2:
        try:
            return sample_of_item(item)[0]
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _check_samples(splits: Splits, target: str) -> None:
    for split in ("train", "val"):
        if len(getattr(splits, split)) == 0:
            raise DataError(f"data._target_={target!r}: the {split} split is empty", hint=FIX)
    train, val = splits.train[0], splits.val[0]
    if _pair(train) and _pair(val):
        (x_train, y_train), (x_val, y_val) = sample_of_item(train), sample_of_item(val)
        if x_train.shape != x_val.shape or y_train.shape != y_val.shape:
            raise DataError(
                f"data._target_={target!r}: train samples are {_shape(x_train)} -> "
                f"{_shape(y_train)} but validation samples {_shape(x_val)} -> {_shape(y_val)}",
                hint="give both splits samples of one shape",
            )
    elif _form(train) != _form(val):
        raise DataError(
            f"data._target_={target!r}: train items are {_form(train)} but validation items "
            f"{_form(val)}",
            hint="give both splits items of one form",
        )


def _pair(item: Any) -> bool:
    return (
        isinstance(item, tuple | list)
        and len(item) == 2
        and all(torch.is_tensor(v) or isinstance(v, np.ndarray | int | float) for v in item)
    )


def _form(item: Any) -> str:
    if isinstance(item, Mapping):
        return "dicts with keys " + ", ".join(sorted(map(str, item)))
    if isinstance(item, tuple | list):
        return f"{len(item)}-tuples"
    return type(item).__name__ + "s"


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "a scalar"


def to_tensors(dataset: MapDataset) -> Any:
    """The whole split as one batch: `(inputs, targets)` tensors for (input, target) items, a
    dict of tensors for dict items (for data that stays resident on the device)."""
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    return first_batch(dataset, len(dataset))


def sample_of_item(item: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = item
    return (
        x if torch.is_tensor(x) else torch.as_tensor(np.asarray(x)),
        y if torch.is_tensor(y) else torch.as_tensor(np.asarray(y)),
    )


def nbytes(dataset: MapDataset) -> int:
    """Bytes of the split as resident tensors, estimated from its first item."""
    if isinstance(dataset, TensorDataset):
        return sum(t.numel() * t.element_size() for t in dataset.tensors)
    one = first_batch(dataset, 1)
    return len(dataset) * sum(t.numel() * t.element_size() for t in tensors(one))
