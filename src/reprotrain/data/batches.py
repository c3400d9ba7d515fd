"""Shuffled mini-batches of the training split, epoch after epoch, resumable at any step.

    batches = make_batches(splits.train, cfg.train, device)
    for inputs, targets in batches.take(total_steps, start=step_reached): ...

Two ways, the same batches (each epoch's order is drawn from (seed, epoch) alone, so a
resumed run, or the other way, sees exactly what an uninterrupted run sees; with
`data.shuffle=false` every epoch reads the split in order):

- **resident**: the whole split lives on the device; a batch is a slice of the epoch's
  shuffled copy, so nothing is copied inside the loop. For data that fits (train.resident_data)
  and items of one shape (tensors, or tuples and dicts of them). Its items are read once,
  seeded from (seed, rank) alone: what they draw is the same in every run (and drawn once:
  a dataset that augments every time it is read wants train.resident_data=false).
- **streamed**: a `torch.utils.data.DataLoader` reads the batches the sampler names
  (`train.num_workers` worker processes, pinned memory for a GPU) and collates them
  (`data.collate_fn`: padding to the longest item, say); the loop moves each batch to the
  device, as the lesson does. Each step's items are read and collated seeded from (seed,
  rank, step) (SeededReads): what a dataset draws from `random`, NumPy or torch is the same
  after a resume and whatever `train.num_workers`. In a container, workers share batches
  through /dev/shm: `runtime.shm_size` (1g) bounds it.
The ragged tail of an epoch is dropped: every step sees a full batch.

Under torchrun (`rank` of `world` processes) a step's global batch is `batch_size x world`
samples of the epoch's order, and each rank reads its own `batch_size` slice of it: the ranks
together see what one process with the global batch would, in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from reprotrain.data.splits import MapDataset, nbytes, to_tensors
from reprotrain.data.structure import map_tensors
from reprotrain.errors import ConfigError
from reprotrain.seeding import seeded

RESIDENT_HOST_LIMIT = 1 << 30  # materialise a non-tensor dataset only up to 1 GiB
RESIDENT_STREAM = 0  # the seeds a resident split's items are read with (steps are >= 1)


class Batches(Protocol):
    """The training batches: `take(total, start)` yields the batches of steps start+1..total."""

    batches_per_epoch: int

    def take(self, total: int, start: int = 0) -> Iterator[Any]: ...


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The sample order of one epoch, from (seed, epoch) alone: no state carried between epochs."""
    if not shuffle:
        return torch.arange(n)
    (state,) = np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(state)))


class EpochBatches:
    """A batch sampler: `(step, sample indices)` for steps start+1..total (this rank's slice)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start: int,
        total: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
    ) -> None:
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.start, self.total = start, total
        self.batches_per_epoch = n // (batch_size * world)
        self.offset, self.stride = rank * batch_size, batch_size * world

    def __len__(self) -> int:
        return self.total - self.start

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        epoch, position = divmod(self.start, self.batches_per_epoch)
        step = self.start
        while step < self.total:
            order = epoch_order(self.n, self.seed, epoch, self.shuffle)
            for i in range(position, self.batches_per_epoch):
                if step >= self.total:
                    return
                first = i * self.stride + self.offset
                step += 1
                yield step, order[first : first + self.batch_size].tolist()
            epoch, position = epoch + 1, 0


class SeededReads:
    """The dataset as the DataLoader reads it: each step's items are read and collated with
    Python's `random`, NumPy's global generator and torch's CPU generator seeded from (seed,
    rank, step) (seeding.seeded), so what the dataset or the collate function draws (a sampled
    pair, an augmentation, a masked token) depends on the step alone: the same in a worker
    process or in this one, after a resume, whatever ran before."""

    def __init__(
        self,
        dataset: MapDataset,
        seed: int,
        rank: int,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        self.dataset, self.seed, self.rank = dataset, seed, rank
        self.collate_fn = collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, draw: tuple[int, list[int]]) -> Any:
        """The collated batch of `draw` = (step, indices); the DataLoader's own collate step
        passes it on (`as_read`)."""
        step, indices = draw
        with seeded(self.seed, self.rank, step):
            many = getattr(self.dataset, "__getitems__", None)
            items = list(many(indices)) if many is not None else [self.dataset[i] for i in indices]
            return self.collate_fn(items)


def as_read(batch: Any) -> Any:
    """The DataLoader's collate step for SeededReads, which has collated the batch already."""
    return batch


class ResidentBatches:
    """The split on the device; one gather per epoch, then a view per batch."""

    resident = True

    def __init__(
        self,
        dataset: MapDataset,
        batch_size: int,
        device: torch.device,
        seed: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
    ) -> None:
        with seeded(seed, rank, RESIDENT_STREAM):  # what the items draw: the same each run
            self.data = map_tensors(lambda t: t.to(device), to_tensors(dataset))
        self.n = len(dataset)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.batches_per_epoch = self.n // (batch_size * world)
        self.offset, self.stride = rank * batch_size, batch_size * world
        self.device = device

    def take(self, total: int, start: int = 0) -> Iterator[Any]:
        epoch, position = divmod(start, self.batches_per_epoch)

        def epochs() -> Iterator[Any]:
            for number in itertools.count(epoch):
                order = epoch_order(self.n, self.seed, number, self.shuffle).to(self.device)
                shuffled = map_tensors(itemgetter(order), self.data)  # t[order], each tensor
                for i in range(self.batches_per_epoch):
                    first = i * self.stride + self.offset
                    window = slice(first, first + self.batch_size)
                    yield map_tensors(itemgetter(window), shuffled)  # t[window], each tensor

        return itertools.islice(epochs(), position, position + total - start)


@dataclass
class Reading:
    """How the split is read: shuffled each epoch or in order (`data.shuffle`), and how items
    become a batch (`data.collate_fn`; None: torch's default_collate)."""

    shuffle: bool = True
    collate_fn: Callable[[list[Any]], Any] | None = None


class LoaderBatches:
    """Batches read by a DataLoader from any map-style Dataset."""

    resident = False

    def __init__(
        self,
        dataset: MapDataset,
        train: Any,
        device: torch.device,
        reading: Reading,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.dataset, self.batch_size, self.seed = dataset, train.batch_size, train.seed
        self.rank, self.world, self.shuffle = rank, world, reading.shuffle
        self.batches_per_epoch = len(dataset) // (self.batch_size * world)
        self.collate_fn = reading.collate_fn
        self.options = {
            "num_workers": train.num_workers,
            "pin_memory": train.pin_memory and device.type == "cuda",  # copies overlap compute
            "persistent_workers": train.persistent_workers and train.num_workers > 0,
        }

    def take(self, total: int, start: int = 0) -> Iterator[Any]:
        sampler = EpochBatches(
            len(self.dataset),
            self.batch_size,
            self.seed,
            start,
            total,
            self.rank,
            self.world,
            self.shuffle,
        )
        # Each batch is read seeded from its step (SeededReads); the generator seeds the
        # workers' own streams, the same each run.
        reads = SeededReads(self.dataset, self.seed, self.rank, self.collate_fn)
        loader = DataLoader(
            as_torch_dataset(reads),
            batch_sampler=cast(Any, sampler),  # yields (step, indices): SeededReads reads them
            collate_fn=as_read,
            generator=torch.Generator().manual_seed(self.seed),
            **self.options,
        )
        return iter(loader)


def make_batches(
    dataset: MapDataset,
    train: Any,
    device: torch.device,
    reading: Reading | None = None,
    rank: int = 0,
    world: int = 1,
) -> ResidentBatches | LoaderBatches:
    reading = reading or Reading()
    n = len(dataset)
    if train.batch_size * world > n:
        per = f" x {world} processes" if world > 1 else ""
        raise ConfigError(
            f"train.batch_size={train.batch_size}{per} is larger than the training split "
            f"({n} samples)",
            hint=f"use train.batch_size<={n // world}, or more data",
        )
    if keep_resident(dataset, train, device, reading):
        return ResidentBatches(
            dataset, train.batch_size, device, train.seed, rank, world, reading.shuffle
        )
    return LoaderBatches(dataset, train, device, reading, rank, world)


def keep_resident(dataset: MapDataset, train: Any, device: torch.device, reading: Reading) -> bool:
    """auto: resident when the split is in tensors already (or small) and its items collate
    without a collate_fn, no workers were asked for, and on a GPU it takes under a quarter
    of the free memory."""
    if reading.collate_fn is not None:
        if train.resident_data is True:
            raise ConfigError(
                "train.resident_data=true with data.collate_fn: a collate function makes each "
                "batch from its items, so the split cannot be kept as one resident batch",
                hint="drop train.resident_data=true (auto streams it), or drop data.collate_fn",
            )
        return False
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


def as_torch_dataset(dataset: MapDataset) -> Dataset[Any]:
    """The split as torch's stubs type DataLoader's and Subset's argument. Any map-style
    dataset is one at run time: the DataLoader only asks for `__getitem__` and `__len__`."""
    return cast(Dataset[Any], dataset)


def validation_batch_size(batch_size: int, val_batch_size: int | None = None) -> int:
    """Validation reads batches of `train.val_batch_size`, else of `train.batch_size`: a loss
    that sums over its batch (reduction='sum') then gives `val/loss` on `train/loss`'s scale,
    and a mean loss the same per-sample mean whatever the batch (each batch's loss is weighted
    by what it averaged over: step.evaluate)."""
    return val_batch_size or batch_size


def val_batches(
    dataset: MapDataset,
    device: torch.device,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    rank: int = 0,
    world: int = 1,
) -> Iterator[Any]:
    """The validation split in order, in batches of `batch_size`, for evaluation; under
    torchrun each rank reads every `world`-th sample from its rank on."""
    if isinstance(dataset, TensorDataset) and world == 1 and collate_fn is None:
        tensors = dataset.tensors
        for start in range(0, len(dataset), batch_size):
            yield tuple(t[start : start + batch_size] for t in tensors)
        return
    whole = as_torch_dataset(dataset)
    share = Subset(whole, range(rank, len(dataset), world)) if world > 1 else whole
    yield from DataLoader(
        share, batch_size=batch_size, collate_fn=collate_fn, pin_memory=device.type == "cuda"
    )
