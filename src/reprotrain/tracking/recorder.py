"""What the training loop records through, whichever store is behind it.

    with recorder:                                   # WorkerRun, TrackedRun (MLflow) or NoRun
        recorder.start()                             # as the first step starts
        recorder.ready()                             # the run is open: the timed steps begin
        recorder.log_metric("train/loss", 0.7, step=1)
        recorder.log_model(model, batch_of_inputs)   # at the end
    # the run ends FINISHED, FAILED (an `error` tag says why) or KILLED (end_status)

`MetricBuffer` keeps points as plain tuples and hands them on in batches, so a step pays
for an append, not for a write to the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from reprotrain.errors import UserError
from reprotrain.stopping import Interrupted

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call

Point = tuple[str, float, int, int]  # a metric point: key, value, timestamp (ms), step


class Recorder(Protocol):
    """The small interface the loop sees: TrackedRun and NoRun both have it."""

    @property
    def run_id(self) -> str: ...
    def start(self) -> None: ...
    def ready(self) -> None: ...
    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def log_model(
        self, model: Any, input_example: Any, registered_name: str | None = None
    ) -> Any: ...
    def unsent(self) -> list[Point]: ...
    def resend(self, points: list[Any]) -> None: ...


class NoRun:
    """tracking.enabled=false: the same interface, nothing recorded."""

    run_id = ""
    waiting = None

    def __enter__(self) -> NoRun:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def start(self) -> None: ...
    def ready(self) -> None: ...
    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def log_model(self, model: Any, input_example: Any, registered_name: str | None = None) -> None:
        return None

    def unsent(self) -> list[Point]:
        return []

    def resend(self, points: list[Any]) -> None: ...


class MetricBuffer:
    """Collects metric points and hands them to `send` every `max_points` points, every
    `max_age_s` seconds (checked as points arrive, and only `when()` says it may), and on
    `flush()`."""

    def __init__(
        self,
        send: Callable[[list[Point]], None],
        max_points: int = MAX_BATCH,
        max_age_s: float = 5.0,
        when: Callable[[], bool] = lambda: True,
    ) -> None:
        self.send, self.max_points, self.max_age_s = send, max_points, max_age_s
        self.when = when
        self.points: list[Point] = []
        self.last_flush = time.monotonic()
        self.sent = 0

    def add(self, key: str, value: float, step: int) -> None:
        self.points.append((key, float(value), int(time.time() * 1000), int(step)))
        if (
            len(self.points) >= self.max_points
            or time.monotonic() - self.last_flush > self.max_age_s
        ) and self.when():
            self.flush()

    def extend(self, points: list[Any]) -> None:
        """Points logged earlier (a stopped try's unsent ones), with their own timestamps."""
        self.points.extend((str(k), float(v), int(t), int(s)) for k, v, t, s in points)

    def flush(self) -> None:
        if self.points:
            points, self.points = self.points, []
            self.send(points)
            self.sent += len(points)
        self.last_flush = time.monotonic()


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
