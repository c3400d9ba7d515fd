"""The tracking store: checked before training, prepared once, an experiment made ready.

    check_store(uri, timeout_s)              # fail in seconds, not after MLflow's retries
    prepare_store(uri)                       # a fresh sqlite DB's schema, created once
    experiment_id = ensure_experiment(client, "reprotrain")
    run_status(uri, run_id)                  # "RUNNING", "FINISHED", ...; None if not there
    redact("http://user:secret@host")        # "http://user:***@host": for every message

MLflow is imported only where a function needs it (~2 s here): a launcher that only checks
the store, and a disabled tracking run, never pay for it.
"""

from __future__ import annotations

import base64
import fcntl
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from reprotrain.errors import TrackingError

# MLflow 3's UI picks an experiment's view from this tag; without it an experiment can open
# in the GenAI view (traces), with training runs listed under "Evaluation runs".
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


CREDENTIALS = re.compile(r"(?<=://)([^/@:\s]*):([^/@\s]*)@")


def redact(text: str) -> str:
    """Replace the password in any `scheme://user:password@host` inside `text`."""
    return CREDENTIALS.sub(r"\1:***@", text)


def check_store(uri: str, timeout_s: float) -> None:
    """Fail fast with a clear line: MLflow's own retries take minutes to give up."""
    if uri.startswith(("http://", "https://")):
        _check_server(uri, timeout_s)
    elif uri.startswith("sqlite:///"):
        _check_sqlite(Path(uri.removeprefix("sqlite:///")))
    elif uri.startswith("file:") or "://" not in uri:
        raise TrackingError(
            f"tracking.uri={redact(uri)!r}: plain file stores are not supported by MLflow 3.13+",
            hint="use sqlite:////abs/path/mlflow.db or an http://host:port server",
        )


def _check_server(uri: str, timeout_s: float) -> None:
    parts = urllib.parse.urlsplit(uri)
    request = urllib.request.Request(  # noqa: S310 - http(s) only, checked by the caller
        urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])).rstrip("/")
        + "/health"
    )
    if parts.username is not None:  # user:password@ in the URI, sent as MLflow sends it
        token = f"{parts.username}:{parts.password or ''}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(token).decode()}")
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
