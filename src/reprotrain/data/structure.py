"""Batches of any shape: a tensor, or tuples, lists and dicts of them, nested.

    move_to(batch, device)             # every tensor in it, on the device
    map_tensors(lambda t: t[:2], batch)
    collate([dataset[0], dataset[1]])  # torch's default_collate: items -> one batch

An object that is none of these but has `.to(device)` (a Hugging Face `BatchEncoding`) is
moved with it; anything else (strings, numbers) is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in batch.items()}
        kind: Callable[..., Any] = type(batch)  # its constructor may take a dict, or not
        try:
            return kind(mapped)  # dict, OrderedDict, ...: the same kind of mapping
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def move_to(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on `device`. non_blocking: from pinned host memory the copy
    overlaps GPU work; a tensor already there is returned as it is."""
    if not isinstance(batch, torch.Tensor | Mapping | tuple | list) and hasattr(batch, "to"):
        return batch.to(device)
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of `batch`, in order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor (0 for none)."""
    found = tensors(batch)
    return int(found[0].shape[0]) if found and found[0].ndim else 0


def describe(batch: Any) -> str:
    """A batch's shapes for a message: `(64x784, 64)`, `{input_ids: 2x12, labels: 2}`."""
    if isinstance(batch, torch.Tensor):
        return "x".join(map(str, batch.shape)) or "a scalar"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, tuple | list):
        return "(" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def collate(items: list[Any], collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """Items -> one batch, as the DataLoader makes it (`collate_fn`, else torch's default)."""
    return (collate_fn or default_collate)(items)
