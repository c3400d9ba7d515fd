"""reprotrain from Python: one whole run, as `python -m reprotrain.train` does it, in this process.

    import reprotrain
    result = reprotrain.train(["model=cnn", "data=digits_images", "train.steps=200"])
    result.run_id, result.status, result.metrics["val/accuracy"], result.output_dir

`overrides` are the command line's (Hydra's override grammar), composed over the project's
conf/ (the nearest folder at or above the working directory holding conf/config.yaml, or the
package's), or `config_dir`; a composed `DictConfig` is taken as it is. The run trains here
(the local runtime: no container, one process), records in MLflow and writes its outputs
exactly as the command line does, and leaves the caller's process as it found it: signal
handlers, torch's threads, determinism and TF32 flags, the random generators (Python's,
NumPy's, torch's), the environment, the working directory, `sys.path` and MLflow's active
run. A mistake in the config raises `ConfigError` (one line: what was wrong, the value given,
what is allowed, the fix); other mistakes a user can fix raise the `UserError` they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from reprotrain import overrides as command_line
from reprotrain.errors import ConfigError
from reprotrain.project import conf_folder, put_project_on_path, register_resolvers
from reprotrain.results import summary_metrics
from reprotrain.run import Run
from reprotrain.runtime import one_process
from reprotrain.schema import Config, validate
from reprotrain.stopping import Interrupted

# Where a run's outputs go when train.output_dir is not set: the command line's run folder
# (conf/config.yaml: hydra.run.dir).
RUN_FOLDER = "outputs/runs/%Y-%m-%d/%H-%M-%S-%f"


@dataclass(frozen=True)
class Result:
    """How a run ended and what it measured.

    `metrics`: `train/loss` (the last step's), `val/loss` and `val/<metric>` (the final
    validation's, the best one's with train.keep_best), and the one-point summaries the run
    records in MLflow (`throughput.samples_per_s`, `time.total_s`, ...). `figures`: everything
    run.json holds. `run_id` and `tracking_uri` are empty/None with tracking.enabled=false."""

    run_id: str
    status: str
    metrics: dict[str, float]
    output_dir: Path
    tracking_uri: str | None
    figures: dict[str, Any] = field(default_factory=dict, repr=False)


def train(
    overrides: Sequence[str] | DictConfig | None = None, *, config_dir: str | Path | None = None
) -> Result:
    """Train once, here, as `python -m reprotrain.train *overrides` would; see the module."""
    began = time.monotonic()
    with process_restored():
        put_project_on_path()  # your _target_s import from the project folder
        config = compose_config(overrides, config_dir)
        if config.runtime.mode == "docker":
            raise ConfigError(
                "runtime=docker, but reprotrain.train trains in this process; allowed here: "
                "runtime=auto or runtime=local",
                hint="drop runtime=docker, or run `python -m reprotrain.train runtime=docker ...`",
            )
        one_process(config)  # train.nproc > 1 needs torchrun or a container
        if config.train.output_dir is None:
            config.train.output_dir = datetime.now().strftime(RUN_FOLDER)
        try:
            figures = Run(config, "local", began=began).execute()
        except Interrupted as stop:
            if stop.signum == signal.SIGINT:  # Ctrl-C in a notebook or a script
                raise KeyboardInterrupt from None
            raise
    return Result(
        run_id=figures.get("run_id") or "",
        status="FINISHED",
        metrics=final_metrics(figures),
        output_dir=Path(config.train.output_dir).resolve(),
        tracking_uri=figures.get("tracking_uri"),
        figures=figures,
    )


def compose_config(
    overrides: Sequence[str] | DictConfig | None, config_dir: str | Path | None
) -> Config:
    """The validated config: a DictConfig as given, or conf/ composed with the overrides."""
    if isinstance(overrides, DictConfig):
        return validate(overrides)
    if isinstance(overrides, str):
        overrides = [overrides]
    given = list(overrides or [])
    folder = Path(config_dir).resolve() if config_dir is not None else conf_folder()
    if config_dir is not None:
        given = [f"--config-dir={folder}", *given]
    command_line.check(given)  # Hydra's composition errors as one line
    register_resolvers()
    with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
        cfg = compose("config", [o for o in given if not o.startswith("--config-dir")])
    return validate(cfg)


def final_metrics(figures: dict[str, Any]) -> dict[str, float]:
    """The run's final figures by their MLflow names."""
    if not figures:
        return {}
    values: dict[str, float] = {"train/loss": float(figures["final_loss"])}
    for key, value in figures.items():
        if key.startswith("val_") and isinstance(value, int | float):
            values[f"val/{key.removeprefix('val_')}"] = float(value)
    values.update(summary_metrics(figures))
    return values


@contextlib.contextmanager
def process_restored() -> Iterator[None]:
    """What a run sets for the whole process is put back afterwards, whatever happens."""
    handlers = (
        {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    threads = torch.get_num_threads()
    deterministic = torch.get_deterministic_debug_mode()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    generators = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_generators = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    environment, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    levels = {name: logging.getLogger(name).level for name in ("", "mlflow", "alembic")}
    hydra_was_set = GlobalHydra.instance().is_initialized()
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
        if torch.get_deterministic_debug_mode() != deterministic:
            # The public setter that does not import torch's compiler (seeding.py).
            torch.set_deterministic_debug_mode(deterministic)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.set_rng_state(generators[2])
        if cuda_generators is not None:
            torch.cuda.set_rng_state_all(cuda_generators)
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        sys.path[:] = path
        for name, level in levels.items():
            logging.getLogger(name or None).setLevel(level)
        if not hydra_was_set and GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
