"""The MLflow record of a run, through MLflow's public API only.

recorder.py     the interface the Trainer records through (Recorder), NoRun,
                end_status / describe_error (how a run's end maps to its MLflow status)
mlflow_run.py   TrackedRun: this process's active MLflow run; points sent off the loop,
                system metrics, dataset inputs; MlflowRecorder: a Trainer's points to a run
points.py       PointSender: the loop appends metric points, a thread sends them
mlflow_model.py the run's MLflow Model (mlflow.pytorch.log_model), with its code
datasets.py     the training and validation data as MLflow datasets (mlflow.log_input)
store.py        check_store, prepare_store, ensure_experiment, run_status
failures.py     what counts as the store failing (vs refusing a record); MLflow's noise about it
credentials.py  redact (no password in any line or file), the password back for a replay
spool.py        what a failing store did not take, kept to send later
orphans.py      who owns a run (host, PID, container); runs left RUNNING by a gone process
"""

from reprotrain.tracking.credentials import redact
from reprotrain.tracking.datasets import as_mlflow_datasets
from reprotrain.tracking.failures import is_store_failure
from reprotrain.tracking.mlflow_model import log_pytorch_model
from reprotrain.tracking.mlflow_run import RUN_ID_ENV, MlflowRecorder, RunSpec, TrackedRun
from reprotrain.tracking.orphans import Orphan, end_orphans, owner_tags, sweep
from reprotrain.tracking.recorder import (
    MAX_BATCH,
    NoRun,
    Point,
    Recorder,
    describe_error,
    end_status,
)
from reprotrain.tracking.spool import Spool, is_unreachable
from reprotrain.tracking.store import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    artifact_location,
    check_store,
    ensure_experiment,
    prepare_store,
    run_status,
    where_to_look,
)

__all__ = [
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "MAX_BATCH",
    "MlflowRecorder",
    "RUN_ID_ENV",
    "NoRun",
    "Orphan",
    "Point",
    "Recorder",
    "RunSpec",
    "Spool",
    "TrackedRun",
    "artifact_location",
    "as_mlflow_datasets",
    "check_store",
    "describe_error",
    "end_orphans",
    "end_status",
    "ensure_experiment",
    "is_store_failure",
    "is_unreachable",
    "log_pytorch_model",
    "owner_tags",
    "prepare_store",
    "redact",
    "run_status",
    "sweep",
    "where_to_look",
]
