"""One MLflow run, through MLflow's public client API.

    check_store(uri, timeout_s)                  # before training: reachable? writable?
    with TrackedRun(uri, "reprotrain", "mlp-adamw-cpu", tags, params) as run:
        run.log_metric("train/loss", 0.7, step=1)   # buffered, sent with log_batch
        run.log_artifact(path)
        run.log_model(model, inputs)                # an MLflow Model under `model`
    # FINISHED on success, FAILED on an exception (message as a tag), KILLED on Ctrl-C/SIGTERM

A synchronous `log_metric` costs ~10 ms on sqlite. The run's `MetricBuffer` collects points
and sends them with `MlflowClient.log_batch`, at most 1000 a call: every
tracking.flush_every_s, every 1000 points, and at the end.

A training run keeps its TrackedRun in its tracking worker (worker.py), a process of its own,
so that MLflow's import and the store's opening never stall the training process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from reprotrain.errors import TrackingError
from reprotrain.tracking.mlflow_model import log_pytorch_model, logged_model_of
from reprotrain.tracking.orphans import (
    CHECKPOINT_TAG,
    checkpoint_file,
    owner_tags,
    sweep,
    what_next,
)
from reprotrain.tracking.recorder import (
    MAX_BATCH,
    MetricBuffer,
    Point,
    describe_error,
    end_status,
)
from reprotrain.tracking.spool import (
    Spool,
    is_unreachable,
    quiet_store_errors,
    unavailable_reason,
)
from reprotrain.tracking.store import ensure_experiment, prepare_store, redact, where_to_look

RUN_ID_ENV = "REPROTRAIN_RUN_ID"  # a launcher that created the run hands it to the container
MAX_PARAMS = 100  # MLflow's limit of params per log_batch call
MAX_TEXT = 5000  # MLflow's limit of a tag value's length
MAX_PARAM_TEXT = 6000  # MLflow's limit of a param value's length
OPEN_WAIT_S = 60.0  # how long opening the run waits for a locked or restarting store
RETRY_AFTER_S = 10.0  # after a failed write, records go straight to the spool this long


class TrackedRun:
    """One MLflow run whose end status always matches how the process ended.

    The run is opened on a background thread started by `start()` (or the first metric), so
    that a store that is locked or restarting can be waited for while the caller goes on.
    Metrics wait in the buffer until the run is open. `ready()` joins the thread and
    re-raises anything it hit.

    With `spool_dir`, what the store does not take while it is away (a server that does not
    answer, a sqlite store locked past its busy timeout, deleted or full) goes to a spool
    file (spool.py) and is sent first once it answers again: training never stops for it.

    A resumed run (`resume_run_id`) first reads which (key, step) points the store has, and
    sends only the others: what the stopped try sent after its last checkpoint is not sent
    twice, and what it had not sent yet (the checkpoint keeps `unsent()`) is sent once.
    """

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        tags: dict[str, str],
        params: dict[str, Any],
        flush_every_s: float = 5.0,
        resume_run_id: str = "",
        spool_dir: Path | None = None,
        checkpoint_dir: Path | None = None,
    ) -> None:
        if uri.startswith(("http://", "https://")):
            # MLflow retries a dead server for minutes per call; fail fast and spool instead.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if redact(uri) != uri:  # MLflow prints run links with the URI as given: not this one
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.tags, self.params, self.flush_every_s = tags, params, flush_every_s
        self.resume_run_id, self.spool_dir = resume_run_id, spool_dir
        self.checkpoint_dir = checkpoint_dir  # where <run id>.pt is written (train.resume)
        self.spool: Spool | None = None
        self.metrics = MetricBuffer(self._send, MAX_BATCH, flush_every_s)
        self._opener = threading.Thread(target=self._open, name="mlflow-open", daemon=True)
        self._client: Any = None
        self._run_id = ""
        self._error: BaseException | None = None
        self.present: set[tuple[str, int]] = set()  # (key, step) the store has (resumed runs)
        self._created = ""  # the run _open_once created, kept across its retries
        self._experiment_id = ""
        self._retry_at = 0.0  # after a failure, the store is tried again from then (_resting)

    def __enter__(self) -> TrackedRun:
        return self

    def start(self) -> None:
        """Begin opening the run (on its thread); the loop calls this as the first step starts."""
        if self._opener.ident is None:
            self._opener.start()

    def _open(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            quiet_store_errors()
            deadline = time.monotonic() + OPEN_WAIT_S
            while True:  # a store locked by another process, or restarting, gets a while
                try:
                    prepare_store(self.uri)
                    self._open_once(MlflowClient(self.uri))
                    break
                except Exception as error:
                    if not is_unreachable(error) or time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
        except Exception as error:  # handed to the main thread by ready()
            self._error = (
                TrackingError(
                    f"tracking store {redact(self.uri)} could not be opened within "
                    f"{OPEN_WAIT_S:g}s ({unavailable_reason(error)})",
                    hint="stop what holds it locked or start the server, or run with "
                    "tracking.enabled=false",
                )
                if is_unreachable(error)
                else error
            )
            return
        except BaseException as error:
            self._error = error
            return
        client, run_id = self._client, self._run_id
        # Runs of this experiment left RUNNING by a process that is gone end KILLED now.
        sweep(client, [self._experiment_id], exclude=run_id)

    def _open_once(self, client: Any) -> None:
        """Open (or continue) the run and record its tags and params; safe to call again
        after a failure part-way (the run is created once)."""
        from mlflow.entities import Param, RunTag

        run_id = self.resume_run_id or os.environ.get(RUN_ID_ENV, "") or self._created
        if not run_id:
            self._experiment_id = ensure_experiment(client, self.experiment)
            run_id = client.create_run(self._experiment_id, run_name=self.run_name).info.run_id
            self._created = run_id
        else:  # resumed, handed in by a launcher, or created by a try that failed part-way
            run = client.get_run(run_id)
            self._experiment_id = run.info.experiment_id
            if self.resume_run_id:  # a resumed run continues the same MLflow run
                self.present = recorded_steps(client, run)
                if "error" in run.data.tags:  # the stopped try's reason
                    client.delete_tag(run_id, "error")
                client.update_run(run_id, status="RUNNING")
                self.params = {}  # logged when it started; MLflow params cannot change
        if self.spool_dir is not None:
            self.spool = Spool(self.spool_dir / f"{run_id}.jsonl", self.uri, run_id)
        # Where its checkpoint goes, so that `reprotrain.runs --clean` can tell a run killed
        # before its first checkpoint to start again rather than to resume.
        where = {CHECKPOINT_TAG: str(self.checkpoint_dir)} if self.checkpoint_dir else {}
        # The owner is this process unless the tags name another (the training process, for
        # a run its tracking worker keeps).
        tags = [
            RunTag(k, redact(str(v))[:MAX_TEXT])
            for k, v in {**owner_tags(), **where, **self.tags}.items()
        ]
        params = [Param(k, _param_text(v)) for k, v in self.params.items()]
        for i in range(0, max(len(params), 1), MAX_PARAMS):
            client.log_batch(run_id, params=params[i : i + MAX_PARAMS], tags=tags if i == 0 else [])
        self._client, self._run_id = client, run_id

    def ready(self) -> None:
        """Wait until the run is open; raise what opening it hit."""
        self.start()
        self._opener.join()
        if self._error is not None:
            raise self._error

    @property
    def client(self) -> Any:
        """The run's MlflowClient (on the run's tracking URI)."""
        self.ready()
        return self._client

    @property
    def run_id(self) -> str:
        self.ready()
        return self._run_id

    @property
    def experiment_id(self) -> str:
        self.ready()
        return self._experiment_id

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.start()
        self.metrics.add(key, value, step)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.log_metric(key, value, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value)[:MAX_TEXT])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._resting():
            self.spool.append({"artifact": str(Path(path).resolve())})  # type: ignore[union-attr]
            return
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as error:
            self._keep_for_later(error, {"artifact": str(Path(path).resolve())})

    def log_model(self, model: Any, input_example: Any, registered_name: str | None = None) -> Any:
        """Log `model` as this run's MLflow Model under `model` (see mlflow_model.py), with
        `input_example` (a batch of inputs; a few rows are kept), registered as a new version
        of `registered_name` if given. Returns MLflow's ModelInfo; None if the tracking
        server is away (the run's other artifacts are spooled; the model is not), or if a
        resumed run's earlier try already logged it."""
        try:
            if self._resting():
                raise ConnectionError(f"the tracking store {redact(self.uri)} failed just now")
            if self.resume_run_id and logged_model_of(self.client, self.run_id) is not None:
                return None  # a try killed in its final phase logged it: once per run
            return log_pytorch_model(
                self.client.tracking_uri, self.run_id, model, input_example, registered_name
            )
        except Exception as error:
            if self.spool is None or not is_unreachable(error):
                raise
            print(
                f"reprotrain: warning: the MLflow Model of run {self._run_id} was not logged: "
                f"the tracking store {redact(self.uri)} is unavailable",
                file=sys.stderr,
                flush=True,
            )
            return None

    @property
    def waiting(self) -> Path | None:
        """The spool file still holding part of the run's record, if any (replay sends it)."""
        return self.spool.path if self.spool is not None and self.spool.pending() else None

    def unsent(self) -> list[Point]:
        """Points logged but not yet sent (or spooled): a checkpoint keeps them, so a resume
        after a hard kill sends them (recorded_steps keeps them from being sent twice)."""
        return list(self.metrics.points)

    def resend(self, points: list[Any]) -> None:
        """Queue points a stopped try logged but had not sent (its checkpoint's `unsent`)."""
        self.metrics.extend(points)

    def _send(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        self.ready()
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
                    self.spool.send(self._client)  # what waited goes first: the order is kept
                self._client.log_batch(self._run_id, metrics=[Metric(*point) for point in chunk])
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
        self.close(end_status(error), message, failing=error is not None)

    def close(self, status: str, message: str = "", failing: bool = False) -> None:
        """End the run `status` (an `error` tag says `message`), after flushing every point
        logged. A run that never opened raises why, unless the run is `failing` anyway (the
        error in flight already says what went wrong)."""
        self.start()  # a run that failed before its first metric is still recorded
        self._opener.join()
        if self._error is not None:
            if not failing:
                raise self._error  # the run never opened: nothing to end
            return
        try:
            self.metrics.flush()  # every point logged before the end is kept
        finally:
            self._end(status, message)

    def _end(self, status: str, message: str) -> None:
        try:
            if self.spool is not None and self.spool.pending():
                self.spool.send(self._client)
            if message:
                self._client.set_tag(self._run_id, "error", message)
            self._client.set_terminated(self._run_id, status)
        except Exception as failure:
            self._keep_for_later(failure, {"status": status, "error": message})
        if self.spool is not None and self.spool.pending():
            print(
                f"reprotrain: warning: the tracking store {redact(self.uri)} is still "
                f"unavailable; run {self._run_id} ends {status} once you send the rest with: "
                f"python -m reprotrain.replay {self.spool.path}",
                file=sys.stderr,
                flush=True,
            )
        elif status == "KILLED":
            print(
                f"reprotrain: run {self._run_id} KILLED; {self._what_next()}; "
                f"{where_to_look(self.uri, self._experiment_id, self._run_id)}",
                file=sys.stderr,
                flush=True,
            )

    def _what_next(self) -> str:
        """A KILLED run continues from its checkpoint; one killed before its first checkpoint
        has none to continue from (checkpoint.checkpoint_path names the file)."""
        folder = self.checkpoint_dir
        return what_next(self._run_id, checkpoint_file(folder, self._run_id) if folder else None)


def recorded_steps(client: Any, run: Any) -> set[tuple[str, int]]:
    """Every (metric key, step) `run` (an MLflow Run) holds: what a resume must not send."""
    history = client.get_metric_history
    return {(k, m.step) for k in run.data.metrics for m in history(run.info.run_id, k)}


def _param_text(value: Any) -> str:
    text = "null" if value is None else redact(str(value))  # no password in the store
    return text[:MAX_PARAM_TEXT]
