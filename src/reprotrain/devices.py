"""Choosing the device, and saying which one it is.

    resolve_device("auto")    # cuda if a CUDA device is visible, else mps, else cpu
    resolve_device("cuda", 1) # cuda:1, or a DeviceError saying why not
    describe_device(device)   # type, name (GPU model or CPU model string), memory, versions
                              # and, on the CPU, torch's kernel set (AVX512, AVX2) and threads

An explicit request that cannot be met is an error, never a silent fallback: a run that
asked for a GPU and quietly trained on the CPU would record misleading timings.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from reprotrain.errors import DeviceError
from reprotrain.host import in_container


def resolve_device(kind: str, index: int | None = None) -> torch.device:
    """Turn a requested device ("auto", "cpu", "cuda", "mps") into a usable torch.device."""
    if kind == "auto":
        # Order matters: a CUDA GPU is the fastest choice where present, then Apple's GPU.
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return _cuda_device(index)
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(
                "device=mps was requested but the MPS backend is not available here",
                hint="MPS needs an Apple-silicon Mac with a torch build for macOS; use device=auto or device=cpu",
            )
        return torch.device("mps")
    raise DeviceError(
        f"device={kind!r} is not a device reprotrain knows; allowed: auto, cpu, cuda, cuda:N, mps",
        hint="e.g. device=cpu",
    )


def _cuda_device(index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        asked = "cuda" if index is None else f"cuda:{index}"
        raise DeviceError(
            f"device={asked} was requested but no CUDA device is visible to torch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})",
            hint=_no_cuda_hint(),
        )
    count = torch.cuda.device_count()
    index = 0 if index is None else index
    if index >= count:
        raise DeviceError(
            f"device=cuda:{index} was requested but only {count} CUDA device(s) are visible "
            f"(cuda:0..cuda:{count - 1})",
            hint="pick an index below the count with device.index=N, or check CUDA_VISIBLE_DEVICES",
        )
    return torch.device("cuda", index)


def _no_cuda_hint() -> str:
    if in_container() and torch.version.cuda is None:
        return (
            "this container's torch is CPU-only (the CPU image): run the CUDA image with "
            "`docker run --gpus all ...` (needs the NVIDIA Container Toolkit), or use device=cpu"
        )
    if in_container():
        return (
            "inside a container: start it with `docker run --gpus all ...` on a host with the "
            "NVIDIA Container Toolkit installed, or use device=cpu"
        )
    if torch.version.cuda is None:
        return "this torch build is CPU-only: install a CUDA build of torch, or use device=cpu / device=auto"
    return "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use device=cpu / device=auto"


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or on the host what
    the kernel can give without swapping (within a container's memory limit)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    free = psutil.virtual_memory().available
    limit = _cgroup_memory_left()
    return int(min(free, limit) if limit is not None else free)


def _cgroup_memory_left() -> int | None:
    """What a cgroup v2 memory limit (docker run --memory) leaves; None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


@dataclass(frozen=True)
class DeviceInfo:
    type: str
    name: str
    memory_gb: float | None
    torch_version: str
    cuda_version: str
    # On the CPU: the instruction set of the kernels torch picked for this processor (AVX512,
    # AVX2, DEFAULT; ATEN_CPU_CAPABILITY lowers it). Kernels for different sets sum floats in a
    # different order, so losses match bit for bit only between runs with the same one.
    cpu_capability: str | None = None
    # On the CPU: torch's intra-op threads (train.threads, `auto` resolved on this machine). A
    # sum split among another number of threads is added up in another order.
    threads: int | None = None

    def as_tags(self) -> dict[str, str]:
        tags = {
            "device.type": self.type,
            "device.name": self.name,
            "torch.version": self.torch_version,
            "cuda.version": self.cuda_version,
        }
        if self.cpu_capability is not None:
            tags["device.cpu_capability"] = self.cpu_capability
        if self.threads is not None:
            tags["device.threads"] = str(self.threads)
        return tags


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, props.total_memory / 2**30
    elif device.type == "mps":
        name, memory = f"Apple MPS ({platform.machine()})", None
    else:
        name, memory = cpu_model_name(), _host_memory_gb()
    return DeviceInfo(
        type=device.type,
        name=name,
        memory_gb=None if memory is None else round(memory, 1),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda or "none",
        cpu_capability=torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        threads=torch.get_num_threads() if device.type == "cpu" else None,
    )


def cpu_model_name() -> str:
    """The CPU model string, e.g. 'AMD EPYC 7B13' (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def available_cpus() -> int:
    """CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

    torch sizes its thread pool from the host's cores, so in a container limited with
    --cpus=2 on a 64-core host it would start 64 threads that fight over 2 CPUs.
    """
    count = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, int(quota + 0.5)))
    return max(1, count)


def _cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def set_threads(threads: str | int) -> None:
    """torch sizes its pool from the host's cores, not a container's CPU quota: use the CPUs
    this process may use (train.threads=auto), shared among the processes torchrun started on
    this machine (LOCAL_WORLD_SIZE), or the number given."""
    if threads == "auto":
        sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, available_cpus() // sharing))
    else:
        torch.set_num_threads(int(threads))


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work; a no-op on CPU. Call before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
