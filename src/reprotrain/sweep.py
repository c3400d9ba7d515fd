"""Groups the jobs of a Hydra --multirun under one MLflow parent run.

Registered in conf/config.yaml as a Hydra callback. Each job is its own run, tagged with
`sweep.id` and `mlflow.parentRunId`, so the MLflow UI nests and compares them:

    python -m reprotrain.train --multirun optimizer=adamw,sgd
    python -m reprotrain.train --multirun hydra/launcher=joblib train.seed=0,1,2,3
    python -m reprotrain.train --multirun hydra/launcher=submitit_local train.seed=0,1
    python -m reprotrain.train --multirun hydra/sweeper=optuna hydra.sweeper.n_trials=20 \
        'optimizer.lr=tag(log,interval(1e-4,1e-1))'

The parent run is created in the process that runs the sweep. Jobs learn its id from the
environment (`REPROTRAIN_PARENT_RUN_ID`, `REPROTRAIN_SWEEP_ID`), which the basic launcher's
jobs share and joblib's workers and submitit's job processes inherit; a launcher that starts
jobs elsewhere gets it from this callback, which Hydra ships with each job (on_job_start).
With the Optuna sweeper the parent run also records the sweep's result: Optuna's best value
(metric `sweep/best_value`) and best parameters (tags `sweep.best.<key>`), read from the
`optimization_results.yaml` it writes into the sweep folder, which is logged as an artifact.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from reprotrain.project import default_tracking_uri
from reprotrain.tracking import check_store, ensure_experiment, prepare_store

SWEEP_ID_ENV = "REPROTRAIN_SWEEP_ID"
PARENT_RUN_ENV = "REPROTRAIN_PARENT_RUN_ID"
SWEPT_ENV = "REPROTRAIN_SWEPT_KEYS"  # what differs between the jobs: their run names
RESULTS_FILE = "optimization_results.yaml"  # what Hydra's Optuna sweeper writes


class SweepParentRun(Callback):
    """One MLflow parent run per --multirun. Holds only strings, so it pickles into workers."""

    def __init__(self) -> None:
        self.uri = ""
        self.run_id = ""
        self.sweep_id = ""
        self.swept = ""
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **_kwargs: Any) -> None:
        self.started = time.time()
        self.sweep_id = time.strftime("sweep-%Y%m%d-%H%M%S")
        os.environ[SWEEP_ID_ENV] = self.sweep_id
        self.swept = ",".join(swept_keys(config))
        os.environ[SWEPT_ENV] = self.swept
        if not config.tracking.enabled:
            return
        self.uri = config.tracking.uri or default_tracking_uri()
        check_store(self.uri, config.tracking.connect_timeout_s)
        prepare_store(self.uri)  # the schema exists before parallel jobs open the store
        client = _client(self.uri)
        experiment_id = ensure_experiment(client, config.tracking.experiment)
        tags = {
            "sweep.id": self.sweep_id,
            "sweep.overrides": " ".join(config.hydra.overrides.task),
            "sweep.sweeper": _plugin_name(config, "sweeper"),
            "sweep.launcher": _plugin_name(config, "launcher"),
        }
        run = client.create_run(experiment_id, run_name=self.sweep_id, tags=tags)
        self.run_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self.run_id
        atexit.register(self._end, "FAILED")  # a sweep that stops early still ends its run

    def on_job_start(self, config: DictConfig, **_kwargs: Any) -> None:
        # Jobs in the sweep's own process (basic launcher) or in processes started from it
        # (joblib, submitit_local) inherit the variables; Hydra ships this callback, ids
        # included, with every job, so a job started anywhere else gets them too.
        if self.sweep_id:
            os.environ[SWEEP_ID_ENV] = self.sweep_id
            os.environ[SWEPT_ENV] = self.swept
        if self.run_id:
            os.environ[PARENT_RUN_ENV] = self.run_id

    def on_multirun_end(self, config: DictConfig, **_kwargs: Any) -> None:
        try:
            if self.run_id:
                self._record_result(Path(str(config.hydra.sweep.dir)) / RESULTS_FILE, config)
        finally:
            self._end("FINISHED")  # every job ran; the record of the result is extra

    def _record_result(self, results: Path, config: DictConfig) -> None:
        """Optuna's best value and parameters on the parent run (nothing for other sweepers)."""
        if not results.is_file() or results.stat().st_mtime < self.started:
            return  # no optimising sweeper, or a file left by an earlier sweep in this folder
        found = OmegaConf.to_container(OmegaConf.load(results))
        if not isinstance(found, dict):  # the sweeper writes a mapping; nothing to read else
            return
        client = _client(self.uri)
        tags = {"sweep.objective": str(OmegaConf.select(config, "train.objective") or "")}
        if "best_value" in found:
            client.log_metric(self.run_id, "sweep/best_value", float(found["best_value"]))
            tags["sweep.best_value"] = repr(found["best_value"])
            for key, value in (found.get("best_params") or {}).items():
                tags[f"sweep.best.{key}"] = str(value)
        else:  # several objectives: the Pareto front's size here, its members in the artifact
            tags["sweep.pareto_solutions"] = str(len(found.get("solutions") or []))
        for key, value in tags.items():
            if value:
                client.set_tag(self.run_id, key, value)
        client.log_artifact(self.run_id, str(results))

    def _end(self, status: str) -> None:
        if self.run_id:
            run_id, self.run_id = self.run_id, ""
            _client(self.uri).set_terminated(run_id, status)


def swept_keys(config: DictConfig) -> list[str]:
    """The keys a sweep varies: command-line overrides with several values (`a=1,2`,
    `range(...)`, `interval(...)`) and the sweeper's own search space (hydra.sweeper.params)."""
    task = list(config.hydra.overrides.task)
    space = OmegaConf.select(config, "hydra.sweeper.params") or {}
    task += [f"{key}={value}" for key, value in space.items()]
    parsed = OverridesParser.create().parse_overrides(task)
    return sorted({o.key_or_group for o in parsed if o.is_sweep_override()})


def varied(overrides: list[str]) -> list[str]:
    """A sweep job's overrides that its sweep varies, for its run name (all of them when the
    sweep did not say, as with a job started outside this callback)."""
    swept = os.environ.get(SWEPT_ENV)
    if swept is None:
        return overrides
    keys = set(swept.split(","))
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys]


def _client(uri: str) -> Any:
    # Imported here, not at the top: Hydra builds this callback for every run (single runs,
    # `--cfg job`), and importing mlflow takes ~1.7 s here; only a sweep needs it.
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _plugin_name(config: DictConfig, kind: str) -> str:
    """`optuna`, `joblib`, `submitit_local`, `basic`: the option chosen in hydra/<kind>."""
    return str(OmegaConf.select(config, f"hydra.runtime.choices.hydra/{kind}") or "")
