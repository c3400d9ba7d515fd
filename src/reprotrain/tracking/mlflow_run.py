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
the `mlflow-points` thread (points.py) sends them with `MlflowClient.log_batch` (at most 1000
a call) every `tracking.flush_every_s`, and `flush()` / the run's end send the rest. MLflow's own
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from reprotrain.errors import TrackingError
from reprotrain.tracking.credentials import hide_run_links, redact
from reprotrain.tracking.failures import failure_reason, is_store_failure, quiet_mlflow_logs
from reprotrain.tracking.mlflow_model import log_pytorch_model, logged_model_of
from reprotrain.tracking.orphans import (
    CHECKPOINT_TAG,
    SPOOL_TAG,
    checkpoint_file,
    clear_sweep_marks,
    owner_tags,
    sweep,
    what_next,
)
from reprotrain.tracking.points import PointSender
from reprotrain.tracking.recorder import MAX_BATCH, Point, describe_error, end_status
from reprotrain.tracking.spool import Spool
from reprotrain.tracking.store import ensure_experiment, prepare_store, where_to_look

RUN_ID_ENV = "REPROTRAIN_RUN_ID"  # a launcher that created the run hands it to the container
MAX_PARAMS = 100  # MLflow's limit of params per log_batch call
MAX_TEXT = 5000  # MLflow's limit of a tag value's length
MAX_PARAM_TEXT = 6000  # MLflow's limit of a param value's length
OPEN_WAIT_S = 60.0  # how long opening the run waits for a locked or restarting store
# After a failed write, records go straight to the spool for twice as long as it took, within
# these bounds: a refused connection is tried again in a second, a sqlite store locked past
# its 20 s busy timeout (or a server that timed out) is left alone for 30 s.
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
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

    With `spool_dir`, what the store does not take while it fails (failures.py: a server or
    database that is away or restarting, a sqlite store locked past its busy timeout, deleted
    or full) goes to a spool file (spool.py) and is sent first once it answers again: training
    never stops for it. Each outage is one line on stderr when it begins and one when it ends;
    MLflow's own reports of it are kept off the terminal.

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
        hide_run_links(uri)  # MLflow prints run links with the URI as given
        self.uri, self.spec, self.spool_dir = uri, spec, spool_dir
        self.system_metrics = system_metrics
        self.client: Any = None  # made by open(): MlflowClient opens (and may create) the store
        self.run_id = self.experiment_id = ""
        self.spool: Spool | None = None
        self.present: set[tuple[str, int]] = set()  # (key, step) the store has (resumed runs)
        self.points = PointSender(self._send, flush_every_s)
        self._retry_at = 0.0  # after a failure, the store is tried again from then (_resting)
        self._outage = False  # the store failed and has not answered since (one line each way)
        self._model_failed = False  # a failed MLflow Model may have left an unfinished entry
        self._previous_uri: str | None = None

    def __enter__(self) -> TrackedRun:
        self.open()
        return self

    def open(self) -> None:
        """Open (or continue) the run, make it MLflow's active run, start sending points."""
        quiet_mlflow_logs()
        # The system-metrics monitor says at INFO that it starts and stops: not worth a line.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        # The fluent API (the user's own calls) uses this store until the run ends.
        self._previous_uri = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        deadline = time.monotonic() + OPEN_WAIT_S
        while True:  # a store locked by another process, or restarting, gets a while
            try:
                prepare_store(self.uri)  # a fresh sqlite store's schema, made by one process
                self.client = self.client or MlflowClient(self.uri)
                self._open_once()
                mlflow.set_tracking_uri(self.uri)
                # Inside a caller's own active run (reprotrain.train from a notebook that
                # has one): this run goes on top of MLflow's stack and comes off at the end.
                nested = mlflow.active_run() is not None
                mlflow.start_run(
                    run_id=self.run_id, nested=nested, log_system_metrics=self.system_metrics
                )
                break
            except Exception as error:
                failed = is_store_failure(error)
                if not failed or time.monotonic() > deadline:
                    # As it was (no run is open); None unsets it: MLflow's code takes None,
                    # its annotation (str | Path) leaves it out.
                    mlflow.set_tracking_uri(self._previous_uri)  # type: ignore[arg-type]
                if not failed:
                    raise
                if time.monotonic() > deadline:
                    raise TrackingError(
                        f"tracking store {redact(self.uri)} could not be opened within "
                        f"{OPEN_WAIT_S:g}s ({failure_reason(error)})",
                        hint="stop what holds it locked or start the server, or run with "
                        "tracking.enabled=false",
                    ) from None
                time.sleep(1.0)
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
                clear_sweep_marks(client, run)  # it was found gone: this try goes on with it
                params = {}  # logged when it started; MLflow params cannot change
        if self.spool_dir is not None:
            self.spool = Spool(self.spool_dir / f"{run_id}.jsonl", self.uri, run_id)
        # Where its checkpoint and spool go, so that `reprotrain.runs --clean` can tell a run
        # killed before its first checkpoint to start again rather than to resume, and leave
        # a run whose record waits in its spool to `replay`.
        folder = spec.checkpoint_dir
        where = {CHECKPOINT_TAG: str(folder)} if folder else {}
        if self.spool_dir is not None:
            where[SPOOL_TAG] = str(self.spool_dir.resolve())
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
        texts = {key: redact(str(value))[:MAX_TEXT] for key, value in tags.items()}
        tagged = [RunTag(key, value) for key, value in texts.items()]
        self._write(lambda: self.client.log_batch(self.run_id, tags=tagged), {"tags": texts})

    def log_inputs(self, datasets: list[tuple[Any, str]]) -> None:
        """Record each (MLflow Dataset, context) as an input of the run: the Datasets box."""
        for dataset, context in datasets:
            began = time.monotonic()
            try:
                mlflow.log_input(dataset, context=context)
            except Exception as error:
                if self.spool is None or not is_store_failure(error):
                    raise
                # A dataset's record is a convenience: said, not spooled.
                self._store_failed(error, time.monotonic() - began)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        record = {"artifact": str(Path(path).resolve())}
        self._write(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path), record)

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
            self._model_failed = True  # its unfinished entry is removed when the run ends
            unreachable = is_store_failure(error)
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
            metrics = [Metric(*point) for point in chunk]

            def log_chunk(metrics: list[Metric] = metrics) -> None:
                self.client.log_batch(self.run_id, metrics=metrics)

            self._write(log_chunk, {"metrics": [list(point) for point in chunk]})

    def _write(self, write: Callable[[], Any], record: dict[str, Any]) -> None:
        """Call `write` (one write to the store) after what the spool holds, or spool `record`
        instead: while the store is left alone after a failure, or when it fails now."""
        if self.spool is not None and self._resting():  # _resting: only with a spool
            self.spool.append(record)
            return
        began = time.monotonic()
        try:
            self._send_spooled()  # what waited goes first: the order is kept
            write()
        except Exception as error:
            self._keep_for_later(error, record, time.monotonic() - began)

    def _send_spooled(self) -> None:
        """Send what the spool holds, if anything; an outage that was said is over."""
        points = 0
        if self.spool is not None and self.spool.pending():
            # A status in it is an earlier try's (a resumed run): this process ends the run.
            points = self.spool.send(self.client, with_status=False)
        if self._outage:
            self._outage = False
            print(
                f"reprotrain: tracking store {redact(self.uri)} answers again; the record kept "
                f"meanwhile ({points} metric points) is sent",
                file=sys.stderr,
                flush=True,
            )

    def _resting(self) -> bool:
        """True while the store is left alone after a failure: a locked sqlite store makes
        each write wait MLflow's busy timeout (20 s), so training would crawl if every flush
        tried again. Records go straight to the spool until then."""
        return self.spool is not None and time.monotonic() < self._retry_at

    def _keep_for_later(self, error: Exception, record: dict[str, Any], took_s: float) -> None:
        """Spool the record if the store failed; a record it refused is a real error."""
        if self.spool is None or not is_store_failure(error):
            raise error
        self.spool.append(record)
        self._store_failed(error, took_s)

    def _store_failed(self, error: BaseException, took_s: float) -> None:
        """Leave the store alone a while; the first failure of an outage is said, once."""
        rest = min(RETRY_MAX_S, max(RETRY_MIN_S, 2 * took_s))
        self._retry_at = time.monotonic() + rest
        if self._outage or self.spool is None:
            return
        self._outage = True
        print(
            f"reprotrain: warning: tracking store {redact(self.uri)} cannot take the run's "
            f"record now ({failure_reason(error)}); training goes on, the record is kept in "
            f"{self.spool.path} and sent when the store answers",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        message = redact(describe_error(error))[:MAX_TEXT] if error is not None else ""
        self.close(end_status(error), message)

    def close(self, status: str, message: str = "") -> None:
        """End the run `status` (an `error` tag says `message`), after sending every point."""
        try:
            self.points.close()  # every point logged before the end is kept
        finally:
            self._end(status, message)

    def _end(self, status: str, message: str) -> None:
        try:
            self._send_spooled()
            if self._model_failed:  # a PENDING or FAILED entry the failure left: not a model
                logged_model_of(self.client, self.run_id)
            if message:
                self.client.set_tag(self.run_id, "error", message)
            mlflow.end_run(status)  # also stops MLflow's system-metrics monitor
        except Exception as failure:
            self._keep_for_later(failure, {"status": status, "error": message}, 0.0)
        finally:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:  # end_run was not
                with contextlib.suppress(Exception):  # reached: take the run off MLflow's
                    mlflow.end_run(status)  # stack (the spool has its end), not a caller's
            # None unsets it, as it was (MLflow's annotation, str | Path, leaves None out).
            mlflow.set_tracking_uri(self._previous_uri)  # type: ignore[arg-type]
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


def recorded_steps(client: Any, run: Any) -> set[tuple[str, int]]:
    """Every (metric key, step) `run` (an MLflow Run) holds: what a resume must not send."""
    history = client.get_metric_history
    return {(k, m.step) for k in run.data.metrics for m in history(run.info.run_id, k)}


def _param_text(value: Any) -> str:
    text = "null" if value is None else redact(str(value))  # no password in the store
    return text[:MAX_PARAM_TEXT]


class MlflowRecorder:
    """A `Trainer`'s points to an MLflow run, through MLflow's public client: the run
    `run_id`, else the active run (`mlflow.start_run()` first; one is started if there is
    none, as `mlflow.log_metric` does). Points are sent in batches: when 1000 are waiting and
    when the Trainer flushes (each checkpoint, the end of fit())."""

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None) -> None:
        self.client = MlflowClient(tracking_uri)
        self._run_id = run_id
        self.pending: list[Metric] = []

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            self._run_id = (mlflow.active_run() or mlflow.start_run()).info.run_id
        return self._run_id

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.pending.append(Metric(key, float(value), int(time.time() * 1000), int(step)))
        if len(self.pending) >= MAX_BATCH:
            self.flush()

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.log_metric(key, value, step)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for i in range(0, len(pending), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + MAX_BATCH])
