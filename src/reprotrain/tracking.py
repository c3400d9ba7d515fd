"""The MLflow record of a run.

    check_store(uri, timeout_s)                  # before training: reachable? writable?
    with TrackedRun(uri, "reprotrain", "mlp-adamw-cpu", tags, params) as run:
        run.log_metric("train/loss", 0.7, step=1)   # buffered, sent with log_batch
        run.log_artifact(path)
    # FINISHED on success, FAILED on an exception (message as a tag), KILLED on Ctrl-C/SIGTERM

A synchronous `log_metric` costs ~10 ms on sqlite. `MetricBuffer` collects points and sends
them in batches (every tracking.flush_every_s, and at the end); a sqlite store gets a batch in
one executemany (`sqlite_metric_writer`), a server gets `log_batch` calls of up to 1000 points.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from reprotrain.errors import TrackingError, UserError
from reprotrain.replay import Spool, is_unreachable

RUN_ID_ENV = "REPROTRAIN_RUN_ID"  # a launcher that created the run hands it to the container
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
SQLITE_BATCH = 50_000  # points held at most for a sqlite store (~5 MB), which has no such limit

Point = tuple[str, float, int, int]  # a metric point: key, value, timestamp (ms), step


class Interrupted(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class GracefulStop:
    """SIGINT/SIGTERM during the training loop stop it at the next step boundary (so the
    losses so far are sent and a checkpoint is written); anywhere else, or a second
    signal, they stop the process at once. Either way the run ends KILLED."""

    def __init__(self) -> None:
        self.in_loop = False
        self.requested: int | None = None

    def install(self) -> GracefulStop:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.in_loop and self.requested is None:
            self.requested = signum
            return
        raise Interrupted(signum)

    def check(self) -> None:
        """Called between steps: raise if a stop was asked for."""
        if self.requested is not None:
            raise Interrupted(self.requested)


def check_store(uri: str, timeout_s: float) -> None:
    """Fail fast with a clear line: MLflow's own retries take minutes to give up."""
    if uri.startswith(("http://", "https://")):
        _check_server(uri, timeout_s)
    elif uri.startswith("sqlite:///"):
        _check_sqlite(Path(uri.removeprefix("sqlite:///")))
    elif uri.startswith("file:") or "://" not in uri:
        raise TrackingError(
            f"tracking.uri={uri!r}: plain file stores are not supported by MLflow 3.13+",
            hint="use sqlite:////abs/path/mlflow.db or an http://host:port server",
        )


def _check_server(uri: str, timeout_s: float) -> None:
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        problem = f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        problem = str(getattr(error, "reason", error))
    raise TrackingError(
        f"tracking server {uri} did not answer within {timeout_s:g}s ({problem})",
        hint="start it (mlflow server --host 127.0.0.1 --port PORT), fix tracking.uri / "
        "MLFLOW_TRACKING_URI, or run with tracking.enabled=false",
    )


def _check_sqlite(db: Path) -> None:
    folder = db.parent
    if not folder.is_dir():
        raise TrackingError(
            f"tracking store folder {str(folder)!r} does not exist (tracking.uri=sqlite:///{db})",
            hint="create the folder or point tracking.uri at a writable place",
        )
    try:  # try for real: access() says yes to root even on a read-only file system
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mlflow-write-check-"):
            pass
        if db.exists():
            with open(db, "ab"):
                pass
    except OSError as error:
        raise TrackingError(
            f"tracking store {str(db)!r} is not writable ({error.strerror})",
            hint="fix the permissions or point tracking.uri / MLFLOW_TRACKING_URI at a writable place",
        ) from None


def prepare_store(uri: str) -> None:
    """Create a fresh sqlite store's schema once, under a file lock.

    Several processes creating the same fresh DB at once break during schema creation;
    on an existing DB, parallel writers are fine.
    """
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).search_experiments(max_results=1)


class MetricBuffer:
    """Collects metric points (cheap tuples) and hands them to `send` every `max_points`
    points, every `max_age_s` seconds, and on `flush()`."""

    def __init__(self, send: Any, max_points: int = MAX_BATCH, max_age_s: float = 5.0) -> None:
        self.send, self.max_points, self.max_age_s = send, max_points, max_age_s
        self.points: list[Point] = []
        self.last_flush = time.monotonic()
        self.sent = 0

    def add(self, key: str, value: float, step: int) -> None:
        self.points.append((key, float(value), int(time.time() * 1000), int(step)))
        if (
            len(self.points) >= self.max_points
            or time.monotonic() - self.last_flush > self.max_age_s
        ):
            self.flush()

    def flush(self) -> None:
        if self.points:
            points, self.points = self.points, []
            self.send(points)
            self.sent += len(points)
        self.last_flush = time.monotonic()


class TrackedRun:
    """One MLflow run whose end status always matches how the process ended.

    The run is opened on a background thread started as the first step starts (`start()`,
    or the first metric): importing MLflow and opening a sqlite store take ~2 s here, and
    this way they overlap the first steps (torch releases the GIL while it computes) instead
    of delaying them; the warm-up steps, left out of the timing, absorb most of it. Metrics
    wait in the buffer until the run is open. `ready()` joins the thread and re-raises
    anything it hit.
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
    ) -> None:
        self.resume_run_id = resume_run_id
        self.spool_dir = spool_dir
        self.spool: Spool | None = None
        if uri.startswith(("http://", "https://")):
            # MLflow retries a dead server for minutes per call; fail fast and spool instead.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.tags, self.params, self.flush_every_s = tags, params, flush_every_s
        self._run_id = ""
        self._insert: Any = None
        self._error: BaseException | None = None

    def __enter__(self) -> TrackedRun:
        # A sqlite store takes a batch of any size in one statement (sqlite_metric_writer), so
        # points wait for flush_every_s there; MLflow's log_batch takes 1000 at most.
        batch = SQLITE_BATCH if self.uri.startswith("sqlite:///") else MAX_BATCH
        self.metrics = MetricBuffer(self._send, batch, self.flush_every_s)
        self._opener = threading.Thread(target=self._open, name="mlflow-open", daemon=True)
        return self

    def start(self) -> None:
        """Begin opening the run (on its thread); fit() calls this as the first step starts."""
        if self._opener.ident is None:
            self._opener.start()

    def _open(self) -> None:
        try:
            from mlflow.entities import Param, RunTag
            from mlflow.tracking import MlflowClient

            prepare_store(self.uri)
            self._client = MlflowClient(self.uri)
            run_id = self.resume_run_id or os.environ.get(RUN_ID_ENV, "")
            if self.resume_run_id:  # a resumed run continues the same MLflow run
                self._client.update_run(run_id, status="RUNNING")
                self.params = {}  # logged when it started; MLflow params cannot change
            elif not run_id:
                experiment_id = ensure_experiment(self._client, self.experiment)
                run_id = self._client.create_run(experiment_id, run_name=self.run_name).info.run_id
            self._run_id = run_id
            self._insert = sqlite_metric_writer(self._client)
            if self.spool_dir is not None and self.uri.startswith(("http://", "https://")):
                self.spool = Spool(self.spool_dir / f"{run_id}.jsonl", self.uri, run_id)
            tags = [RunTag(k, str(v)) for k, v in self.tags.items()]
            params = [Param(k, _param_text(v)) for k, v in self.params.items()]
            for i in range(0, max(len(params), 1), 100):  # MLflow accepts 100 params per call
                self._client.log_batch(
                    run_id, params=params[i : i + 100], tags=tags if i == 0 else []
                )
        except BaseException as error:  # handed to the main thread by ready()
            self._error = error

    def ready(self) -> None:
        self.start()
        self._opener.join()
        if self._error is not None:
            raise self._error

    @property
    def client(self) -> Any:
        self.ready()
        return self._client

    @property
    def run_id(self) -> str:
        self.ready()
        return self._run_id

    def _send(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        self.ready()
        if self._insert is not None:
            self._insert(self._run_id, points)
            return
        for i in range(0, len(points), MAX_BATCH):
            chunk = points[i : i + MAX_BATCH]
            try:
                if self.spool is not None and self.spool.pending():
                    self.spool.send(self.client)  # what waited goes first: the order is kept
                self.client.log_batch(self._run_id, metrics=[Metric(*point) for point in chunk])
            except Exception as error:
                self._keep_for_later(error, {"metrics": [list(point) for point in chunk]})

    def _keep_for_later(self, error: Exception, record: dict[str, Any]) -> None:
        """Spool the record if the server is away; anything else is a real error."""
        if self.spool is None or not is_unreachable(error):
            raise error
        self.spool.append(record)
        self.spool.warn_once(error)

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.start()
        self.metrics.add(key, value, step)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.log_metric(key, value, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value)[:5000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as error:
            self._keep_for_later(error, {"artifact": str(Path(path).resolve())})

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.start()  # a run that failed before its first metric is still recorded
        self._opener.join()
        if self._error is not None:
            if error is None:
                raise self._error  # the run never opened: nothing to end
            return  # the error in flight already says what went wrong
        status = end_status(error)
        message = describe_error(error)[:5000] if error is not None else ""
        try:
            self.metrics.flush()  # every point logged before the end is kept
        finally:
            try:
                if self.spool is not None and self.spool.pending():
                    self.spool.send(self.client)
                if message:
                    self.client.set_tag(self._run_id, "error", message)
                self.client.set_terminated(self._run_id, status)
            except Exception as failure:
                self._keep_for_later(failure, {"status": status, "error": message})
            if self.spool is not None and self.spool.pending():
                print(
                    f"reprotrain: warning: the tracking server is still away; run {self._run_id} "
                    f"ends {status} once you send the rest with: python -m reprotrain.replay "
                    f"{self.spool.path}",
                    file=sys.stderr,
                    flush=True,
                )


def sqlite_metric_writer(client: Any) -> Any:
    """For MLflow's sqlite store, a function that stores metric points as `log_batch` does,
    with one executemany instead of an ORM object per point; None for any other store.

    `log_batch` spends ~0.055 ms of Python per point building and flushing SQLAlchemy ORM
    objects: at one loss per 1.3 ms CPU step that alone is 4% of training. This writes the
    same rows into the same `metrics` table in one statement (~0.01 ms per point) and keeps
    the run's latest values with MLflow's own code, in MLflow's own session: the run must be
    active, NaN is stored as MLflow stores it, and `get_metric_history` and `get_run` read
    back exactly what `log_batch` would have written (tests/test_tracking.py checks it against
    log_batch on the pinned MLflow). A batch MLflow would de-duplicate (the same point twice)
    goes through `log_batch` itself.
    """
    try:
        import sqlalchemy
        from mlflow.store.tracking.dbmodels.models import SqlMetric
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = client._tracking_client.store
    except (ImportError, AttributeError):  # another MLflow layout: log_batch it is
        return None
    if not isinstance(store, SqlAlchemyStore) or store.db_type != "sqlite":
        return None

    def insert(run_id: str, points: list[Point]) -> None:
        rows, latest = [], {}
        for key, value, timestamp, step in points:
            is_nan, stored = store.sanitize_metric_value(value)
            row = {
                "run_uuid": run_id,
                "key": key,
                "value": stored,
                "timestamp": timestamp,
                "step": step,
                "is_nan": is_nan,
            }
            rows.append(row)
            best = latest.get(key)  # MLflow's order for a key's latest value
            if best is None or (step, timestamp, stored) > (
                best["step"],
                best["timestamp"],
                best["value"],
            ):
                latest[key] = row
        try:
            with store.ManagedSessionMaker(read_only=False) as session:
                store._check_run_is_active(store._get_run(run_uuid=run_id, session=session))
                session.execute(SqlMetric.__table__.insert(), rows)
                store._update_latest_metrics_if_necessary(
                    [SqlMetric(**row) for row in latest.values()], session
                )
        except Exception as error:  # MLflow's session wraps the IntegrityError
            if not isinstance(error.__cause__ or error, sqlalchemy.exc.IntegrityError):
                raise
            from mlflow.entities import Metric  # a point stored before: MLflow drops repeats

            client.log_batch(run_id, metrics=[Metric(*point) for point in points])  # it chunks

    return insert


class NoRun:
    """tracking.enabled=false: the same interface, nothing recorded."""

    run_id = ""

    def __enter__(self) -> NoRun:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def start(self) -> None: ...
    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def log_metrics(self, values: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...


def ensure_experiment(client: Any, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(client))
    except Exception:  # another process created it first
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def artifact_location(client: Any) -> str | None:
    """Artifacts of a sqlite store go in mlruns/ beside the .db file, wherever the run starts
    (MLflow's default is ./mlruns under the current folder). Servers choose for themselves."""
    uri = client.tracking_uri
    if uri.startswith("sqlite:///"):
        return str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns")
    return None


def end_status(error: BaseException | None) -> str:
    if error is None:
        return "FINISHED"
    if isinstance(error, KeyboardInterrupt | Interrupted):
        return "KILLED"
    return "FAILED"


def describe_error(error: BaseException) -> str:
    if isinstance(error, UserError):
        return error.one_line()
    return f"{type(error).__name__}: {error}"


def _param_text(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text[:6000]  # MLflow's param value limit
