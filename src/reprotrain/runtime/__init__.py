"""Where the training step runs: this process, or reprotrain's CPU/CUDA container.

    runtime=auto    Docker when an engine answers, else this process (one warning line)
    runtime=docker  a container, or a clear error when no engine answers
    runtime=local   this process

Both run the same recipe (run.Run) on the same resolved config; the container runtime starts
it inside the image with the project mounted at the same path.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from reprotrain import distributed
from reprotrain.containers import engine_status
from reprotrain.errors import ConfigError, RuntimeEnvError
from reprotrain.host import CONTAINER_ENV
from reprotrain.run import Run
from reprotrain.schema import Config

WARNED_ENV = "REPROTRAIN_WARNED_NO_DOCKER"  # a sweep's jobs share one warning


def launch(config: Config, varied: list[str] | None = None) -> dict[str, Any]:
    """Train where config.runtime says; returns the run's figures (run.json)."""
    if choose_runtime(config) == "local":
        return Run(config, "local", varied).execute()
    # Imported here, not at the top: it loads MLflow's client and the image logic, which a
    # local run (most runs) never needs, and MLflow's import alone takes ~2 s.
    from reprotrain.runtime.container import run_in_docker

    return run_in_docker(config)


def choose_runtime(config: Config) -> str:
    mode = config.runtime.mode
    distributed.adopt_cluster_tasks()
    if os.environ.get(CONTAINER_ENV) == "1" or distributed.under_torchrun():
        return "local"  # already placed (reprotrain's container, or a rank torchrun started)
    if mode == "local":
        return one_process(config)
    status = engine_status()
    if status.available:
        return "docker"
    if mode == "docker":
        raise RuntimeEnvError(
            f"runtime=docker but Docker is not usable: {status.reason}",
            hint="start the Docker engine (or install Docker), or run with runtime=local",
        )
    if os.environ.get(WARNED_ENV) != "1":
        print(
            f"reprotrain: warning: {status.reason}; training in this process "
            "(runtime=local silences this warning)",
            file=sys.stderr,
            flush=True,
        )
        os.environ[WARNED_ENV] = "1"  # once per process, and per sweep (jobs inherit it)
    return one_process(config)


def one_process(config: Config) -> str:
    """This process trains; train.nproc is for the container, where reprotrain starts torchrun."""
    if config.train.nproc != 1:
        raise ConfigError(
            f"train.nproc={config.train.nproc} but the run trains in this process "
            f"(runtime={config.runtime.mode}); allowed: train.nproc=1 here, any with "
            "runtime=docker (torchrun in the container)",
            hint=f"start torchrun --nproc_per_node={config.train.nproc} -m reprotrain.train ... "
            "yourself, or use runtime=docker",
        )
    return "local"
