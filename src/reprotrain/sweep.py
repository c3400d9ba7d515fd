"""Groups the jobs of a Hydra --multirun under one MLflow parent run.

Registered in conf/config.yaml as a Hydra callback. Each job is its own run, tagged with
`sweep.id` and `mlflow.parentRunId`, so the MLflow UI nests and compares them.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from reprotrain.project import default_tracking_uri


class SweepParentRun(Callback):
    def __init__(self) -> None:
        self.client: Any = None
        self.run_id = ""

    def on_multirun_start(self, config: DictConfig, **_kwargs: Any) -> None:
        sweep_id = time.strftime("sweep-%Y%m%d-%H%M%S")
        os.environ["REPROTRAIN_SWEEP_ID"] = sweep_id
        if not config.tracking.enabled:
            return
        from mlflow.tracking import MlflowClient

        from reprotrain.tracking import check_store, ensure_experiment, prepare_store

        uri = config.tracking.uri or default_tracking_uri()
        check_store(uri, config.tracking.connect_timeout_s)
        prepare_store(uri)
        self.client = MlflowClient(uri)
        experiment_id = ensure_experiment(self.client, config.tracking.experiment)
        overrides = " ".join(config.hydra.overrides.task)
        run = self.client.create_run(
            experiment_id,
            run_name=sweep_id,
            tags={"sweep.id": sweep_id, "sweep.overrides": overrides},
        )
        self.run_id = run.info.run_id
        os.environ["REPROTRAIN_PARENT_RUN_ID"] = self.run_id
        atexit.register(self._end, "FAILED")  # a job that exits the sweep early still ends it

    def on_multirun_end(self, config: DictConfig, **_kwargs: Any) -> None:
        self._end("FINISHED")

    def _end(self, status: str) -> None:
        if self.run_id:
            run_id, self.run_id = self.run_id, ""
            self.client.set_terminated(run_id, status)
