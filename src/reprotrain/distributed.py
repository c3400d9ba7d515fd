"""Data-parallel training under torchrun: one process per device, one MLflow run.

    torchrun --nproc_per_node=2 -m reprotrain.train device=cpu            # gloo, 2 processes
    torchrun --nproc_per_node=gpu -m reprotrain.train device=cuda         # nccl, one per GPU

torchrun (PyTorch's own launcher) starts the processes and sets RANK, LOCAL_RANK, WORLD_SIZE
and the rendezvous; reprotrain reads them, joins the process group and trains as usual:

- the backend follows the device (`nccl` on CUDA, `gloo` otherwise; `train.backend`), every
  collective times out after `train.dist_timeout_s`;
- each rank works on `cuda:LOCAL_RANK` and reads its own slice of every global batch (the
  epoch's seeded order, so a resumed run sees the same batches): `train.batch_size` is per
  process, the global batch is `batch_size x world_size`;
- DistributedDataParallel averages the gradients during backward (its all-reduce overlaps
  the backward pass and is timed as part of `time/backward_ms`);
- rank 0 alone records the MLflow run, writes checkpoints and outputs; the losses it records
  are the mean over all ranks, so a curve means the same thing at any world size.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

from reprotrain.devices import describe_device
from reprotrain.errors import ConfigError, DeviceError, UserError

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
LOST_RANK_WAIT_S = 2.0  # how long a failed collective waits to see which local peer is gone


class RankLost(UserError):
    """A rank of the job stopped answering: the run ends FAILED, naming it."""


@dataclass(frozen=True)
class Member:
    """One rank of the job: where it runs (to tell which one is gone) and on what device."""

    host: str
    pid: int
    device: str  # describe_device's name: the GPU model or the CPU's


@dataclass(frozen=True)
class Group:
    """This process's place in the job: rank 0 of 1 outside torchrun."""

    rank: int = 0
    world_size: int = 1
    backend: str = ""
    members: tuple[Member, ...] = field(default=())  # every rank, in rank order
    active: bool = False  # in torchrun's process group (also with one process)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over all ranks (each rank holds its own)."""
        if not self.active:
            return values
        total = values.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.world_size

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when it is true on any (a stop asked of one stops all together)."""
        if not self.active:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """DistributedDataParallel around the model in a group; the model itself otherwise."""
        if not self.active:
            return model
        ids = [device.index] if device.type == "cuda" else None
        standard_strides(model)
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)


SINGLE = Group()


def adopt_cluster_tasks() -> None:
    """A SLURM (or submitit_local) job of several tasks, as hydra-submitit-launcher starts
    with `tasks_per_node`: submitit's own helper exports torchrun's variables (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from the job's, so its tasks train as
    one data-parallel job. Nothing to do outside submitit or where they are set already."""
    if "SUBMITIT_EXECUTOR" not in os.environ or all(name in os.environ for name in ENV):
        return
    from submitit.helpers import JobEnvironment, TorchDistributedEnvironment  # submitit jobs only

    if JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def under_torchrun() -> bool:
    """Started by torchrun (or anything that sets its RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(name in os.environ for name in ENV)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if under_torchrun() else 0


def choose_backend(requested: str, device: torch.device) -> str:
    """auto: nccl on CUDA, gloo on the CPU. nccl needs CUDA devices."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"train.backend=nccl but the device is {device.type}; allowed: nccl on CUDA devices "
            "only, gloo on any",
            hint="use train.backend=auto (gloo on the CPU) or device=cuda",
        )
    return requested


def join(requested_backend: str, timeout_s: float, device: torch.device) -> Group:
    """Join torchrun's process group (a no-op outside torchrun) and learn every rank's host,
    pid and device in one exchange."""
    if not under_torchrun():
        return SINGLE
    backend = choose_backend(requested_backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    members: list[Any] = [None] * dist.get_world_size()
    here = Member(socket.gethostname(), os.getpid(), describe_device(device).name)
    dist.all_gather_object(members, here)
    return Group(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=backend,
        members=tuple(members),
        active=True,
    )


def check_devices() -> None:
    """Each rank on its own GPU: LOCAL_RANK must name a visible one."""
    count, rank = torch.cuda.device_count(), local_rank()
    if rank >= count:
        raise DeviceError(
            f"torchrun started local rank {rank} but only {count} CUDA device(s) are visible; "
            f"allowed: --nproc_per_node up to {count}",
            hint=f"use torchrun --nproc_per_node={count} (or gpu), or check CUDA_VISIBLE_DEVICES",
        )


def standard_strides(model: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers through one flat copy, which torch refuses for a buffer
    whose size-1 dimension has an odd stride (PyTorch's word-language-model example registers
    its positional encoding as a transposed view): such a buffer gets the standard strides of
    its shape, the same values."""
    for buffer in model.buffers():
        if buffer.stride() != torch.empty(buffer.shape, device="meta").stride():
            buffer.data = buffer.clone(memory_format=torch.contiguous_format)


def leave(group: Group) -> None:
    if group.active and dist.is_initialized():
        dist.destroy_process_group()


def lost_rank(group: Group, error: BaseException) -> RankLost:
    """What a failed collective means: which rank is gone, where that can be seen."""
    here = socket.gethostname()
    peers = [
        (rank, member)
        for rank, member in enumerate(group.members)
        if rank != group.rank and member.host == here
    ]
    # A killed process's sockets close before it has exited (the peer's reset can arrive
    # first, on a loaded machine by tens of ms): give a peer on this host a moment to be gone.
    deadline = time.monotonic() + LOST_RANK_WAIT_S
    while True:
        missing = [f"rank {rank} (pid {member.pid})" for rank, member in peers if gone(member.pid)]
        if missing or not peers or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    who = ", ".join(missing) if missing else "another rank"
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())  # gloo's "[source:line] "
    first = text.splitlines()[0].split(". ")[0][:200] if text else type(error).__name__
    return RankLost(
        f"{who} of the {group.world_size}-process job stopped answering ({first})",
        hint="see that rank's own error in torchrun's output; resume with "
        "train.resume=<run id> once it is fixed",
    )


def collective_failed(error: BaseException) -> bool:
    """A collective that failed because a peer is gone or silent (not a bug in the step)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(s in text for s in ("Connection closed by peer", "Connection reset", "Timed out"))


def gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
