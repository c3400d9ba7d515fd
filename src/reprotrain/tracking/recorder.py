"""What the Trainer records through, whichever store is behind it.

with TrackedRun(uri, spec) as run:               # MLflow (mlflow_run.py), or NoRun()
    run.log_metric("train/loss", 0.7, step=1)    # cheap: points are sent off the loop
    run.flush()                                  # before a checkpoint
# the run ends FINISHED, FAILED (an `error` tag says why) or KILLED (end_status)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from reprotrain.errors import UserError
from reprotrain.stopping import Interrupted

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call

Point = tuple[str, float, int, int]  # a metric point: key, value, timestamp (ms), step


class Recorder(Protocol):
    """The small interface the Trainer sees: TrackedRun and NoRun both have it."""

    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...


class NoRun:
    """tracking.enabled=false (and ranks other than 0): the same interface, nothing recorded."""

    run_id = ""
    experiment_id = ""
    waiting = None
    tracking_s = 0.0

    def __enter__(self) -> NoRun:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_inputs(self, datasets: list[tuple[Any, str]]) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def log_model(self, model: Any, input_example: Any, registered_name: str | None = None) -> None:
        return None


def end_status(error: BaseException | None) -> str:
    """The MLflow status a run ends with, from what ended it."""
    if error is None:
        return "FINISHED"
    if isinstance(error, KeyboardInterrupt | Interrupted):
        return "KILLED"
    return "FAILED"


def describe_error(error: BaseException) -> str:
    """The run's `error` tag: a user error's one line, or the exception's type and message."""
    if isinstance(error, UserError):
        return error.one_line()
    return f"{type(error).__name__}: {error}"
