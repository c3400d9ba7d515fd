"""Data-parallel scaling: the same training job in 1 process and in N processes under torchrun
(gloo on the CPU, nccl on CUDA), at the same per-process batch, samples/s as each run records
it (every rank's samples, training steps only).

    efficiency = samples/s at N processes / (N x samples/s in 1 process)

On a CPU the processes share the machine's cores (train.threads=auto gives each its share),
so the figure there says what the gloo all-reduce and the split cost, not what more hardware
buys; on a machine with N GPUs it is the real scaling.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from reprotrain.bench.startup import child_env
from reprotrain.tracking import prepare_store

SCALING_PROCESSES = 2  # on the CPU; on CUDA, one process per GPU


def scaling_processes(device: torch.device) -> int:
    return max(torch.cuda.device_count(), 1) if device.type == "cuda" else SCALING_PROCESSES


def scaling(
    device: torch.device, processes: int, steps: int, batch_size: int, workdir: Path
) -> dict[str, Any]:
    """samples/s of 1 and of `processes` processes on `device`, and the efficiency."""
    uri = f"sqlite:///{workdir / 'scaling.db'}"
    prepare_store(uri)
    env = child_env()
    common = [
        "-m",
        "reprotrain.train",
        f"device={device.type}",
        "runtime=local",
        f"train.steps={steps}",
        f"train.batch_size={batch_size}",
        "train.progress=off",
        "tracking.log_model=false",
        f"tracking.uri={uri}",
        f"train.checkpoint_dir={workdir / 'checkpoints'}",
    ]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    launchers = {
        1: [sys.executable],
        processes: [torchrun, "--standalone", f"--nproc-per-node={processes}"],
    }
    rates: dict[int, float] = {}
    for count, launcher in launchers.items():
        out = workdir / f"scaling-{count}"
        done = subprocess.run(
            [*launcher, *common, f"train.output_dir={out}"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"{count} process(es) exited {done.returncode}: {last}"}
        rates[count] = json.loads((out / "run.json").read_text())["samples_per_s"]
    return {
        "device": device.type,
        "processes": processes,
        "steps": steps,
        "batch_size_per_process": batch_size,
        "samples_per_s": {str(count): rate for count, rate in rates.items()},
        "efficiency": rates[processes] / (processes * rates[1]),
    }
