"""Shuffled mini-batches of the training split, epoch after epoch, resumable at any step.

    batches = make_batches(splits.train, cfg.train, device)
    for inputs, targets in batches.take(total_steps, start=step_reached): ...

Two ways, the same batches (each epoch's order is drawn from (seed, epoch) alone, so a
resumed run, or the other way, sees exactly what an uninterrupted run sees):

- **resident**: the whole split lives on the device; a batch is a slice of the epoch's
  shuffled copy, so nothing is copied inside the loop. For data that fits (train.resident_data).
- **streamed**: a `torch.utils.data.DataLoader` reads the batches the sampler names
  (`train.num_workers` worker processes, pinned memory for a GPU); the loop moves each batch
  to the device, as the lesson does. In a container, workers share batches through /dev/shm:
  `runtime.shm_size` (1g) bounds it.
The ragged tail of an epoch is dropped: every step sees a full batch.

Under torchrun (`rank` of `world` processes) a step's global batch is `batch_size x world`
samples of the epoch's order, and each rank reads its own `batch_size` slice of it: the ranks
together see what one process with the global batch would, in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from reprotrain.data.splits import nbytes, to_tensors
from reprotrain.errors import ConfigError

RESIDENT_HOST_LIMIT = 1 << 30  # materialise a non-tensor dataset only up to 1 GiB


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch, from (seed, epoch) alone: no state carried between epochs."""
    (state,) = np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(state)))


class EpochBatches:
    """A batch sampler: the sample indices of steps start+1..total (this rank's slice)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start: int,
        total: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.start, self.total = start, total
        self.batches_per_epoch = n // (batch_size * world)
        self.offset, self.stride = rank * batch_size, batch_size * world

    def __len__(self) -> int:
        return self.total - self.start

    def __iter__(self) -> Iterator[list[int]]:
        epoch, position = divmod(self.start, self.batches_per_epoch)
        step = self.start
        while step < self.total:
            order = epoch_order(self.n, self.seed, epoch)
            for i in range(position, self.batches_per_epoch):
                if step >= self.total:
                    return
                first = i * self.stride + self.offset
                yield order[first : first + self.batch_size].tolist()
                step += 1
            epoch, position = epoch + 1, 0


class ResidentBatches:
    """The split on the device; one gather per epoch, then a view per batch."""

    resident = True

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        device: torch.device,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        inputs, targets = to_tensors(dataset)
        self.x, self.y = inputs.to(device), targets.to(device)
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = self.x.shape[0] // (batch_size * world)
        self.offset, self.stride = rank * batch_size, batch_size * world

    def take(self, total: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, position = divmod(start, self.batches_per_epoch)

        def epochs() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for number in itertools.count(epoch):
                order = epoch_order(self.x.shape[0], self.seed, number).to(self.x.device)
                x_epoch, y_epoch = self.x[order], self.y[order]
                for i in range(self.batches_per_epoch):
                    first = i * self.stride + self.offset
                    window = slice(first, first + self.batch_size)
                    yield x_epoch[window], y_epoch[window]

        return itertools.islice(epochs(), position, position + total - start)


class LoaderBatches:
    """Batches read by a DataLoader from any map-style Dataset."""

    resident = False

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        device: torch.device,
        seed: int,
        train: Any,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world = rank, world
        self.batches_per_epoch = len(dataset) // (batch_size * world)
        self.options = {
            "num_workers": train.num_workers,
            "pin_memory": train.pin_memory and device.type == "cuda",  # copies overlap compute
            "persistent_workers": train.persistent_workers and train.num_workers > 0,
        }

    def take(self, total: int, start: int = 0) -> Iterator[Any]:
        sampler = EpochBatches(
            len(self.dataset), self.batch_size, self.seed, start, total, self.rank, self.world
        )
        # The generator seeds the workers (their torch/random seeds): the same each run.
        loader = DataLoader(
            self.dataset,
            batch_sampler=sampler,
            generator=torch.Generator().manual_seed(self.seed),
            **self.options,
        )
        return iter(loader)


def make_batches(
    dataset: Dataset, train: Any, device: torch.device, rank: int = 0, world: int = 1
) -> ResidentBatches | LoaderBatches:
    n = len(dataset)
    if train.batch_size * world > n:
        per = f" x {world} processes" if world > 1 else ""
        raise ConfigError(
            f"train.batch_size={train.batch_size}{per} is larger than the training split "
            f"({n} samples)",
            hint=f"use train.batch_size<={n // world}, or more data",
        )
    if keep_resident(dataset, train, device):
        return ResidentBatches(dataset, train.batch_size, device, train.seed, rank, world)
    return LoaderBatches(dataset, train.batch_size, device, train.seed, train, rank, world)


def keep_resident(dataset: Dataset, train: Any, device: torch.device) -> bool:
    """auto: resident when the split is in tensors already (or small), no workers were asked
    for, and on a GPU it takes under a quarter of the free memory."""
    if train.resident_data != "auto":
        return bool(train.resident_data)
    if train.num_workers > 0:
        return False
    size = nbytes(dataset)
    if not isinstance(dataset, TensorDataset) and size > RESIDENT_HOST_LIMIT:
        return False
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return size < free // 4
    return True


def val_batches(dataset: Dataset, device: torch.device, batch_size: int = 4096) -> Iterator[Any]:
    """The validation split in order, in large batches, for evaluation."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = dataset.tensors[:2]
        for start in range(0, inputs.shape[0], batch_size):
            yield inputs[start : start + batch_size], targets[start : start + batch_size]
        return
    yield from DataLoader(dataset, batch_size=batch_size, pin_memory=device.type == "cuda")
