"""This process's MLflow run, opened through MLflow's public API and active for the whole
training: code of the user's own (model, data, loss, a callback) can call `mlflow.log_metric`,
`mlflow.log_artifact`, `mlflow.log_text`, ... and it lands in the same run.

    spec = RunSpec("reprotrain", "mlp-adamw-cpu", tags, params)
    with TrackedRun(uri, spec, spool_dir=out / "spool") as run:   # mlflow.active_run() is it
        run.log_metric("train/loss", 0.7, step=1)   # an append: a thread sends the points
        run.flush()                                 # before a checkpoint: every point is sent
        run.log_model(model, inputs)                # an MLflow Model under `model`
    # FINISHED on success, FAILED on an exception (an `error` tag says why), KILLED on Ctrl-C/SIGTERM

A synchronous `log_metric` costs milliseconds on sqlite, so the loop only appends points;
the `mlflow-points` thread sends them with `MlflowClient.log_batch` (at most 1000 a call)
every `tracking.flush_every_s`, and `flush()` / the run's end send the rest. MLflow's own
asynchronous logging (`log_batch(..., synchronous=False)`) was the other candidate: it
reports a failed batch only when its queue is flushed, so which points a store that went
away took could not be known, and the spool (spool.py) could not keep each point exactly
once. MLflow's system-metrics monitor (`log_system_metrics=True`) records `system/*` on its
own thread; the datasets are logged as the run's inputs (`mlflow.log_input`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from reprotrain.errors import TrackingError
from reprotrain.tracking.mlflow_model import log_pytorch_model, logged_model_of
from reprotrain.tracking.orphans import (
    CHECKPOINT_TAG,
    checkpoint_file,
    owner_tags,
    sweep,
    what_next,
)
from reprotrain.tracking.recorder import MAX_BATCH, Point, describe_error, end_status
from reprotrain.tracking.spool import Spool, is_unreachable, quiet_store_errors, unavailable_reason
from reprotrain.tracking.store import ensure_experiment, prepare_store, redact, where_to_look

RUN_ID_ENV = "REPROTRAIN_RUN_ID"  # a launcher that created the run hands it to the container
MAX_PARAMS = 100  # MLflow's limit of params per log_batch call
MAX_TEXT = 5000  # MLflow's limit of a tag value's length
MAX_PARAM_TEXT = 6000  # MLflow's limit of a param value's length
OPEN_WAIT_S = 60.0  # how long opening the run waits for a locked or restarting store
RETRY_AFTER_S = 10.0  # after a failed write, records go straight to the spool this long
MODEL_ERROR_TAG = "reprotrain.model_error"  # why the run has no MLflow Model


@dataclass
class RunSpec:
    """What the run is: its experiment, name, tags and params; `resume_run_id` continues a
    run (train.resume); `checkpoint_dir` is where its checkpoint goes (train.checkpoint_dir)."""

    experiment: str
    name: str
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    resume_run_id: str = ""
    checkpoint_dir: Path | None = None


class TrackedRun:
    """One MLflow run, this process's active run, whose end status matches how it ended.

    With `spool_dir`, what the store does not take while it is away (a server that does not
    answer, a sqlite store locked past its busy timeout, deleted or full) goes to a spool
    file (spool.py) and is sent first once it answers again: training never stops for it.

    A resumed run first reads which (key, step) points the store has and sends only the
    others: the steps a killed try sent after its last checkpoint are not sent twice.
    """

    def __init__(
        self,
        uri: str,
        spec: RunSpec,
        *,
        flush_every_s: float = 5.0,
        spool_dir: Path | None = None,
        system_metrics: bool = False,
    ) -> None:
        if uri.startswith(("http://", "https://")):
            # MLflow retries a dead server for minutes per call; fail fast and spool instead.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if redact(uri) != uri:  # MLflow prints run links with the URI as given: not this one
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.uri, self.spec, self.spool_dir = uri, spec, spool_dir
        self.system_metrics = system_metrics
        self.client: Any = None  # made by open(): MlflowClient opens (and may create) the store
        self.run_id = self.experiment_id = ""
        self.spool: Spool | None = None
        self.present: set[tuple[str, int]] = set()  # (key, step) the store has (resumed runs)
        self.points = PointSender(self._send, flush_every_s)
        self._retry_at = 0.0  # after a failure, the store is tried again from then (_resting)
        self._previous_uri: str | None = None

    def __enter__(self) -> TrackedRun:
        self.open()
        return self

    def open(self) -> None:
        """Open (or continue) the run, make it MLflow's active run, start sending points."""
        quiet_store_errors()
        # The system-metrics monitor says at INFO that it starts and stops: not worth a line.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        deadline = time.monotonic() + OPEN_WAIT_S
        while True:  # a store locked by another process, or restarting, gets a while
            try:
                prepare_store(self.uri)  # a fresh sqlite store's schema, made by one process
                self.client = self.client or MlflowClient(self.uri)
                self._open_once()
                break
            except Exception as error:
                if not is_unreachable(error):
                    raise
                if time.monotonic() > deadline:
                    raise TrackingError(
                        f"tracking store {redact(self.uri)} could not be opened within "
                        f"{OPEN_WAIT_S:g}s ({unavailable_reason(error)})",
                        hint="stop what holds it locked or start the server, or run with "
                        "tracking.enabled=false",
                    ) from None
                time.sleep(1.0)
        # The fluent API (the user's own calls) uses this store until the run ends.
        self._previous_uri = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        mlflow.set_tracking_uri(self.uri)
        mlflow.start_run(run_id=self.run_id, log_system_metrics=self.system_metrics)
        # Runs of this experiment left RUNNING by a process that is gone end KILLED now.
        sweep(self.client, [self.experiment_id], exclude=self.run_id)
        self.points.start()

    def _open_once(self) -> None:
        """Create (or find) the run and record its tags and params; safe to call again after
        a failure part-way (the run is created once)."""
        spec, client = self.spec, self.client
        run_id = spec.resume_run_id or os.environ.get(RUN_ID_ENV, "") or self.run_id
        params = spec.params
        if not run_id:
            self.experiment_id = ensure_experiment(client, spec.experiment)
            run_id = client.create_run(self.experiment_id, run_name=spec.name).info.run_id
            self.run_id = run_id
        else:  # resumed, handed in by a launcher, or created by a try that failed part-way
            run = client.get_run(run_id)
            self.experiment_id = run.info.experiment_id
            if spec.resume_run_id:  # a resumed run continues the same MLflow run
                self.present = recorded_steps(client, run)
                if "error" in run.data.tags:  # the stopped try's reason
                    client.delete_tag(run_id, "error")
                params = {}  # logged when it started; MLflow params cannot change
        if self.spool_dir is not None:
            self.spool = Spool(self.spool_dir / f"{run_id}.jsonl", self.uri, run_id)
        # Where its checkpoint goes, so that `reprotrain.runs --clean` can tell a run killed
        # before its first checkpoint to start again rather than to resume.
        folder = spec.checkpoint_dir
        where = {CHECKPOINT_TAG: str(folder)} if folder else {}
        tags = [
            RunTag(k, redact(str(v))[:MAX_TEXT])
            for k, v in {**owner_tags(), **where, **spec.tags}.items()
        ]
        values = [Param(k, _param_text(v)) for k, v in params.items()]
        for i in range(0, max(len(values), 1), MAX_PARAMS):
            client.log_batch(run_id, params=values[i : i + MAX_PARAMS], tags=tags if i == 0 else [])
        self.run_id = run_id

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.points.add(key, value, step)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.points.add(key, value, step)

    def flush(self) -> None:
        """Send every point logged so far (or spool it): a checkpoint written after this has
        nothing of the run's record that is not in the store or the spool."""
        self.points.flush()

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value)[:MAX_TEXT])

    def log_inputs(self, datasets: list[tuple[Any, str]]) -> None:
        """Record each (MLflow Dataset, context) as an input of the run: the Datasets box."""
        for dataset, context in datasets:
            try:
                mlflow.log_input(dataset, context=context)
            except Exception as error:
                if self.spool is None or not is_unreachable(error):
                    raise
                self.spool.warn_once(error)  # a dataset's record is a convenience: not spooled

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._resting():
            self.spool.append({"artifact": str(Path(path).resolve())})  # type: ignore[union-attr]
            return
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as error:
            self._keep_for_later(error, {"artifact": str(Path(path).resolve())})

    def log_model(self, model: Any, input_example: Any, registered_name: str | None = None) -> Any:
        """Log `model` as the run's MLflow Model under `model` (mlflow_model.py), registered as
        a new version of `registered_name` if given. Returns MLflow's ModelInfo, or None: a
        model that could not be logged is a warning and a tag (`reprotrain.model_error`),
        never a lost run; a resumed run's earlier try may already have logged it."""
        try:
            if self._resting():
                raise ConnectionError(f"the tracking store {redact(self.uri)} failed just now")
            if self.spec.resume_run_id and logged_model_of(self.client, self.run_id) is not None:
                return None  # a try killed in its final phase logged it: once per run
            return log_pytorch_model(model, input_example, registered_name)
        except Exception as error:
            unreachable = is_unreachable(error)
            reason = redact(describe_error(error).splitlines()[0][:300])
            print(
                f"reprotrain: warning: the MLflow Model of run {self.run_id} was not logged: "
                + (
                    f"the tracking store {redact(self.uri)} is unavailable"
                    if unreachable
                    else reason
                )
                + "; the run, its metrics and model.pt are kept",
                file=sys.stderr,
                flush=True,
            )
            if not unreachable:
                self.set_tags({MODEL_ERROR_TAG: reason})
            return None

    @property
    def tracking_s(self) -> float:
        """Seconds spent sending points (time/tracking_s), mostly on the sending thread."""
        return self.points.busy_s

    @property
    def waiting(self) -> Path | None:
        """The spool file still holding part of the run's record, if any (replay sends it)."""
        return self.spool.path if self.spool is not None and self.spool.pending() else None

    def _send(self, points: list[Point]) -> None:
        if self.present:  # a resumed run: what the stopped try already sent is not sent again
            points = [p for p in points if (p[0], p[3]) not in self.present]
        # Chunks of MLflow's limit, each sent or spooled whole: a failure part-way through
        # one log_batch call of more would leave part stored and all of it spooled.
        for i in range(0, len(points), MAX_BATCH):
            chunk = points[i : i + MAX_BATCH]
            record = {"metrics": [list(point) for point in chunk]}
            if self._resting():
                self.spool.append(record)  # type: ignore[union-attr]
                continue
            try:
                if self.spool is not None and self.spool.pending():
                    self.spool.send(self.client)  # what waited goes first: the order is kept
                self.client.log_batch(self.run_id, metrics=[Metric(*point) for point in chunk])
            except Exception as error:
                self._keep_for_later(error, record)

    def _resting(self) -> bool:
        """True while the store is left alone after a failure: a locked sqlite store makes
        each write wait MLflow's busy timeout (20 s), so training would crawl if every flush
        tried again. Records go straight to the spool until then."""
        return self.spool is not None and time.monotonic() < self._retry_at

    def _keep_for_later(self, error: Exception, record: dict[str, Any]) -> None:
        """Spool the record if the store is unavailable; anything else is a real error."""
        if self.spool is None or not is_unreachable(error):
            raise error
        self.spool.append(record)
        self.spool.warn_once(error)
        self._retry_at = time.monotonic() + RETRY_AFTER_S

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        message = describe_error(error)[:MAX_TEXT] if error is not None else ""
        self.close(end_status(error), message)

    def close(self, status: str, message: str = "") -> None:
        """End the run `status` (an `error` tag says `message`), after sending every point."""
        try:
            self.points.close()  # every point logged before the end is kept
        finally:
            self._end(status, message)

    def _end(self, status: str, message: str) -> None:
        try:
            if self.spool is not None and self.spool.pending():
                self.spool.send(self.client)
            if message:
                self.client.set_tag(self.run_id, "error", message)
            mlflow.end_run(status)  # also stops MLflow's system-metrics monitor
        except Exception as failure:
            self._keep_for_later(failure, {"status": status, "error": message})
        finally:
            if mlflow.active_run() is not None:  # end_run was not reached: take the run off
                with contextlib.suppress(Exception):  # MLflow's stack; the spool has its end
                    mlflow.end_run(status)
            mlflow.set_tracking_uri(self._previous_uri)  # None unsets it, as it was
        if self.spool is not None and self.spool.pending():
            print(
                f"reprotrain: warning: the tracking store {redact(self.uri)} is still "
                f"unavailable; run {self.run_id} ends {status} once you send the rest with: "
                f"python -m reprotrain.replay {self.spool.path}",
                file=sys.stderr,
                flush=True,
            )
        elif status == "KILLED":
            folder = self.spec.checkpoint_dir
            checkpoint = checkpoint_file(folder, self.run_id) if folder else None
            print(
                f"reprotrain: run {self.run_id} KILLED; {what_next(self.run_id, checkpoint)}; "
                f"{where_to_look(self.uri, self.experiment_id, self.run_id)}",
                file=sys.stderr,
                flush=True,
            )


class PointSender:
    """Metric points: `add` appends (all the loop pays); the `mlflow-points` thread hands what
    is there to `send` every `every_s` seconds, and `flush` does it now, in order. A sending
    error that is not spooled is raised by the next `flush` or `close`. `busy_s` is the time
    spent sending (time/tracking_s)."""

    def __init__(self, send: Any, every_s: float) -> None:
        self.send, self.every_s = send, every_s
        self.points: list[Point] = []
        self.busy_s = 0.0
        self._taking = threading.Lock()  # the list's swap against appends
        self._sending = threading.Lock()  # one send at a time: points stay in order
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-points", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def add(self, key: str, value: float, step: int) -> None:
        point = (key, float(value), int(time.time() * 1000), int(step))
        with self._taking:
            self.points.append(point)

    def flush(self) -> None:
        self._send_now()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._stopped.set()
        if self._thread.ident is not None:
            self._thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                self._send_now()
            except BaseException as error:  # raised in the training thread by flush()
                self._error = error
                return

    def _send_now(self) -> None:
        with self._sending:
            with self._taking:
                points, self.points = self.points, []
            if points:
                began = time.perf_counter()
                try:
                    self.send(points)
                finally:
                    self.busy_s += time.perf_counter() - began


def recorded_steps(client: Any, run: Any) -> set[tuple[str, int]]:
    """Every (metric key, step) `run` (an MLflow Run) holds: what a resume must not send."""
    history = client.get_metric_history
    return {(k, m.step) for k in run.data.metrics for m in history(run.info.run_id, k)}


def _param_text(value: Any) -> str:
    text = "null" if value is None else redact(str(value))  # no password in the store
    return text[:MAX_PARAM_TEXT]
