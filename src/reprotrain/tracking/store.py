"""The tracking store: checked before training, prepared once, an experiment made ready.

    check_store(uri, timeout_s)              # fail in seconds, not after MLflow's retries
    prepare_store(uri)                       # a fresh sqlite DB's schema, created once
    experiment_id = ensure_experiment(client, "reprotrain")
    run_status(uri, run_id)                  # "RUNNING", "FINISHED", ...; None if not there

`check_store` opens the store as the run will, through MLflow's public client: what MLflow
refuses (a scheme it has no store for, missing credentials, a file that is no MLflow store)
is one line before any step, not a traceback when the run starts.
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from reprotrain.errors import TrackingError
from reprotrain.tracking.credentials import redact

# MLflow 3's UI picks an experiment's view from this tag; without it an experiment can open
# in the GenAI view (traces), with training runs listed under "Evaluation runs".
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def where_to_look(uri: str, experiment_id: str, run_id: str) -> str:
    """How to see a run: the UI command for a local store (nothing for a server, which is the
    UI) and the run's page."""
    # MLflow 3.17's UI opens in its GenAI view in a fresh browser, whatever the experiment's
    # kind tag says; the parameter (after the #) opens the run in its model-training view.
    path = f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):  # a link to click: no user information
        parts = urllib.parse.urlsplit(uri)
        bare = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        return f"open {redact(bare).rstrip('/')}/{path}"
    return f"see it with: mlflow ui --backend-store-uri {redact(uri)}, then open {UI_URL}/{path}"


DATABASES = ("postgresql", "mysql", "mssql")  # SQLAlchemy URIs MLflow takes as a backend store
ARTIFACT_PROBE_S = 30.0
ALLOWED_URIS = (
    "sqlite:////abs/path/mlflow.db, http(s)://host:port, "
    "postgresql|mysql|mssql://user:password@host:port/db, databricks[://profile]"
)
BARE_URIS = ("databricks", "databricks-uc", "uc")  # MLflow's URIs without a `scheme:`
DATABRICKS_HINT = (
    "set DATABRICKS_HOST and DATABRICKS_TOKEN (or keep them in a ~/.databrickscfg profile and "
    "give tracking.uri=databricks://PROFILE), or run with tracking.enabled=false"
)


def check_store(uri: str, timeout_s: float) -> None:
    """One clear line, before any step, for a store MLflow cannot use: MLflow's own retries
    take minutes to give up, and a URI it refuses would fail only when the run opens it."""
    scheme = _scheme(uri)
    if scheme in ("http", "https"):
        _check_server(uri, timeout_s)
        _check_served_artifacts(uri, timeout_s)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme in DATABASES:
        _check_database(uri, timeout_s)
        _open_with_mlflow(uri, hint="fix tracking.uri / MLFLOW_TRACKING_URI, or the database")
    elif scheme in ("", "file"):
        _refuse_file_store(uri)
    else:  # databricks, or a scheme an MLflow plugin may register: MLflow decides
        hint = DATABRICKS_HINT if scheme == "databricks" else "give one of those in tracking.uri"
        _open_within(uri, timeout_s, hint=hint)


def _scheme(uri: str) -> str:
    """`postgresql+psycopg://...` -> `postgresql`; `databricks` -> `databricks`; a path -> ``."""
    if uri in BARE_URIS:
        return uri
    return urllib.parse.urlsplit(uri).scheme.split("+", 1)[0]


def _refuse_file_store(uri: str) -> None:
    """A path (or file: URI) is MLflow's old folder-of-runs store, which MLflow 3.13+ no
    longer opens; the fix names a sqlite file at that place."""
    if not uri.strip():
        raise TrackingError(
            f"tracking.uri={uri!r} names no store; allowed: {ALLOWED_URIS}",
            hint="leave tracking.uri null ($MLFLOW_TRACKING_URI, else the project's "
            "mlflow.db) or give one of those",
        )
    path = Path(urllib.parse.urlsplit(uri).path if uri.startswith("file:") else uri).absolute()
    if path.suffix != ".db":
        path = (path if path.is_dir() else path.parent) / "mlflow.db"
    raise TrackingError(
        f"tracking.uri={redact(uri)!r}: plain file stores are not supported by MLflow 3.13+; "
        f"allowed: {ALLOWED_URIS}",
        hint=f"use a sqlite file there (tracking.uri=sqlite:///{path}) or an http://host:port "
        "server",
    )


def _open_with_mlflow(uri: str, hint: str, allowed: str = ALLOWED_URIS) -> None:
    """Open the store as the run will and list one experiment: what MLflow refuses is one line."""
    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as error:  # MLflow's and its drivers' own: each says this store is unusable
        if "database is locked" in str(error):
            return  # another process writing, for a moment: the run waits for it
        reason = redact(str(error).strip().splitlines()[0] if str(error).strip() else repr(error))
        raise TrackingError(
            f"tracking.uri={redact(uri)!r}: MLflow cannot use this store "
            f"({reason.split('. ')[0][:300]}); allowed: {allowed}",
            hint=hint,
        ) from None


def _open_within(uri: str, timeout_s: float, hint: str) -> None:
    """_open_with_mlflow, waited on for timeout_s at most: a client retries a host that does not
    answer for minutes (Databricks' SDK: 5). The thread is a daemon: left behind, it ends with
    the process."""
    failures: list[TrackingError] = []

    def attempt() -> None:
        try:
            _open_with_mlflow(uri, hint)
        except TrackingError as error:
            failures.append(error)

    thread = threading.Thread(target=attempt, name="reprotrain-store-check", daemon=True)
    with _mlflow_warnings_off():  # "falling back to legacy authentication": the line says why
        thread.start()
        thread.join(timeout_s)
    if failures:
        raise failures[0]
    if thread.is_alive():
        raise TrackingError(
            f"tracking store {redact(uri)} did not answer within {timeout_s:g}s",
            hint=f"check that its host is reachable from here, or {hint}",
        )


@contextmanager
def _mlflow_warnings_off() -> Iterator[None]:
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _server_request(uri: str, path: str) -> urllib.request.Request:
    """A request to `path` on the server at `uri`, with its user:password@ sent as MLflow
    sends it (basic auth), not in the URL."""
    parts = urllib.parse.urlsplit(uri)
    base = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    request = urllib.request.Request(base.rstrip("/") + path)  # noqa: S310 - http(s) only
    if parts.username is not None:
        token = f"{parts.username}:{parts.password or ''}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(token).decode()}")
    return request


def _check_server(uri: str, timeout_s: float) -> None:
    request = _server_request(uri, "/health")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        problem = f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        problem = str(getattr(error, "reason", error))
    raise TrackingError(
        f"tracking server {redact(uri)} did not answer within {timeout_s:g}s ({problem})",
        hint="start it (mlflow server --host 127.0.0.1 --port PORT), fix tracking.uri / "
        "MLFLOW_TRACKING_URI, or run with tracking.enabled=false",
    )


def _check_served_artifacts(uri: str, timeout_s: float) -> None:
    """A server that proxies artifacts (`mlflow server --artifacts-destination s3://...`)
    lists its root here; a store that refuses the server's credentials would otherwise fail
    the run's artifacts at its very end. A server that serves no artifacts answers 404/503.
    The server's first listing loads its storage client: it gets more time than /health."""
    try:
        with urllib.request.urlopen(  # noqa: S310
            _server_request(uri, "/api/2.0/mlflow-artifacts/artifacts"),
            timeout=max(timeout_s, ARTIFACT_PROBE_S),
        ):
            return
    except urllib.error.HTTPError as error:
        try:
            message = str(json.loads(error.read() or b"{}").get("message", ""))
        except ValueError:
            message = ""
    except (urllib.error.URLError, OSError):
        return  # it answered /health a moment ago: the run's own retries take it from here
    if message.startswith("Failed to list artifacts"):
        raise TrackingError(
            f"tracking server {redact(uri)}: its artifact store refused it ({message[:300]})",
            hint="give the server credentials its artifact store accepts (on the server: "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_S3_ENDPOINT_URL), or start it "
            "with --no-serve-artifacts",
        )


def _check_database(uri: str, timeout_s: float) -> None:
    """A database backend store (postgresql://...): driver, server and credentials, checked
    with one connection through SQLAlchemy (MLflow's own way in)."""
    import sqlalchemy
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

    scheme = uri.split(":", 1)[0]
    fix = f"fix tracking.uri / MLFLOW_TRACKING_URI ({scheme}://user:password@host:port/db)"
    try:
        engine = sqlalchemy.create_engine(
            uri, connect_args={"connect_timeout": max(1, round(timeout_s))}
        )
    except ModuleNotFoundError as error:
        raise TrackingError(
            f"tracking.uri={redact(uri)!r}: the database driver is not installed ({error})",
            hint="install reprotrain's lock (scripts/setup.sh), which has psycopg for "
            "postgresql://; another database needs its own SQLAlchemy driver",
        ) from None
    except (ArgumentError, NoSuchModuleError) as error:
        raise TrackingError(
            f"tracking.uri={redact(uri)!r} is not a database URI SQLAlchemy takes ({error})",
            hint=fix,
        ) from None
    try:
        with engine.connect():
            pass
    except OperationalError as error:
        reason = redact(str(error.orig or error).strip().splitlines()[0])
        refused = "authentication failed" in reason or "Access denied" in reason
        raise TrackingError(
            f"tracking store {redact(uri)} "
            + ("refused the credentials" if refused else f"did not answer within {timeout_s:g}s")
            + f" ({reason[:300]})",
            hint=(
                "give the right user and password in tracking.uri / MLFLOW_TRACKING_URI"
                if refused
                else "start the database or " + fix
            ),
        ) from None
    finally:
        engine.dispose()


def _check_sqlite(uri: str) -> None:
    db = _sqlite_file(uri)
    folder = db.parent
    if not folder.is_dir():
        raise TrackingError(
            f"tracking store folder {str(folder)!r} does not exist (tracking.uri=sqlite:///{db})",
            hint="create the folder or point tracking.uri at a writable place",
        )
    if db.is_dir():
        raise TrackingError(
            f"tracking store {str(db)!r} is a folder, not a database file "
            f"(tracking.uri={redact(uri)})",
            hint=f"name a file in it: tracking.uri=sqlite:///{db.absolute() / 'mlflow.db'}",
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
    if db.is_file() and db.stat().st_size > 0:  # a new store is made by prepare_store
        with _schema_lock(db):
            _open_with_mlflow(
                uri,
                hint="point tracking.uri at a new file; an older MLflow's store: back it up, "
                f"then run `mlflow db upgrade {redact(uri)}`",
                allowed="a new file, or a store with this MLflow's schema",
            )


def _sqlite_file(uri: str) -> Path:
    """The file of `sqlite:///relative.db` or `sqlite:////abs/x.db`. SQLAlchemy reads what
    follows `sqlite://` as a host (sqlite has none) and an empty path or `:memory:` as a
    database in this process's memory, gone when the run ends."""
    _, sep, rest = uri.partition("://")
    if sep and rest.split("?", 1)[0] in ("", "/", "/:memory:"):
        raise TrackingError(
            f"tracking.uri={redact(uri)!r} is a database in memory, lost when the run ends; "
            "allowed: a sqlite file, sqlite:////abs/path/mlflow.db",
            hint="give a file: tracking.uri=sqlite:////abs/path/mlflow.db",
        )
    if not (sep and rest.startswith("/")):
        suggested = Path(uri.partition(":")[2].lstrip("/").split("?", 1)[0]).absolute()
        raise TrackingError(
            f"tracking.uri={redact(uri)!r} names no sqlite file: after sqlite:// comes a host, "
            "which sqlite has none of; allowed: sqlite:///relative/path.db, "
            "sqlite:////abs/path.db",
            hint=f"write three slashes before the path, e.g. tracking.uri=sqlite:///{suggested}",
        )
    return Path(rest[1:].split("?", 1)[0])


@contextmanager
def _schema_lock(db: Path) -> Iterator[None]:
    """The lock prepare_store makes a new store's schema under: a store another process is
    still making is opened once it is whole."""
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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


def run_status(uri: str, run_id: str) -> str | None:
    """The status of run `run_id` in the store at `uri`; None if the store has no such run."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(uri).get_run(run_id).info.status
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def ensure_experiment(client: Any, name: str) -> str:
    """The id of experiment `name`, created if missing, marked as model training for the UI."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(
                name,
                artifact_location=artifact_location(client),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        except Exception:  # another process created it first
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    served = experiment.artifact_location.startswith("mlflow-artifacts:")
    if served and not client.tracking_uri.startswith(("http://", "https://")):
        raise TrackingError(
            f"experiment {name!r} keeps its artifacts on a tracking server "
            f"({experiment.artifact_location}), which tracking.uri={redact(client.tracking_uri)!r} "
            "does not reach",
            hint="use the server's http:// URI as tracking.uri, or another tracking.experiment",
        )
    if EXPERIMENT_KIND_TAG not in experiment.tags:  # made before the tag, or by someone else
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


def artifact_location(client: Any) -> str | None:
    """Artifacts of a sqlite store go in mlruns/ beside the .db file, wherever the run starts
    (MLflow's default is ./mlruns under the current folder). Servers choose for themselves."""
    uri = client.tracking_uri
    if uri.startswith("sqlite:///"):
        return str(Path(uri.removeprefix("sqlite:///")).parent / "mlruns")
    return None
