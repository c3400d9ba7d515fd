"""The MLflow record of a run, through MLflow's public API only.

recorder.py     the interface the loop records through (Recorder), NoRun, MetricBuffer,
                end_status / describe_error (how a run's end maps to its MLflow status)
mlflow_run.py   TrackedRun: one MLflow run, metrics sent in batches with log_batch
worker.py       TrackingWorker / WorkerRun: the TrackedRun kept by a process of its own
                (start_early, take_worker, discard_early)
mlflow_model.py the run's MLflow Model (mlflow.pytorch.log_model), with its code
store.py        check_store, prepare_store, ensure_experiment, run_status, redact
spool.py        what a store that is away, locked or gone did not take, kept to send later
orphans.py      who owns a run (host, PID, container); runs left RUNNING by a gone process
"""

from reprotrain.tracking.mlflow_model import log_pytorch_model
from reprotrain.tracking.mlflow_run import RUN_ID_ENV, TrackedRun
from reprotrain.tracking.orphans import Orphan, end_orphans, owner_tags, sweep
from reprotrain.tracking.recorder import (
    MAX_BATCH,
    MetricBuffer,
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
    redact,
    run_status,
    where_to_look,
)
from reprotrain.tracking.worker import (
    TrackingWorker,
    WorkerRun,
    discard_early,
    start_early,
    take_worker,
)

__all__ = [
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "MAX_BATCH",
    "RUN_ID_ENV",
    "MetricBuffer",
    "NoRun",
    "Orphan",
    "Point",
    "Recorder",
    "Spool",
    "TrackedRun",
    "TrackingWorker",
    "WorkerRun",
    "artifact_location",
    "check_store",
    "describe_error",
    "discard_early",
    "end_orphans",
    "end_status",
    "ensure_experiment",
    "is_unreachable",
    "log_pytorch_model",
    "owner_tags",
    "prepare_store",
    "redact",
    "run_status",
    "start_early",
    "sweep",
    "take_worker",
    "where_to_look",
]
