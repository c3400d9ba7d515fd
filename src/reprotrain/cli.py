"""The training script's Hydra app: validate the composed config, hand it to a runtime, and
return the objective a sweeper optimises. `python -m reprotrain.train` runs `main`.

    python -m reprotrain.train                                   # conf/config.yaml defaults
    python -m reprotrain.train model=cnn data=digits_images      # another model and dataset
    python -m reprotrain.train optimizer=sgd optimizer.lr=3e-4 scheduler=cosine
    python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256
    python -m reprotrain.train --multirun hydra/sweeper=optuna 'optimizer.lr=interval(1e-4,1e-1)'
    python -m reprotrain.train --cfg job                         # print the composed config
    python -m reprotrain.train --config-dir . --config-name params   # a composed params.yaml (DVC)
    reprotrain-train --help                      # the same app by name (console script); bash
    eval "$(reprotrain-train -sc install=bash)"  # completion of groups, options and keys
"""

from __future__ import annotations

import atexit
import gc
import signal
import sys
from pathlib import Path

import hydra
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from reprotrain import overrides, sweep
from reprotrain.errors import ConfigError, UserError, report_and_exit
from reprotrain.outputs import write_text
from reprotrain.project import conf_digest, conf_folder, find_root, put_project_on_path
from reprotrain.results import objective
from reprotrain.runtime import launch
from reprotrain.schema import Config, as_dict, validate
from reprotrain.stopping import Interrupted
from reprotrain.tracking import redact
from reprotrain.usercode import check_stage_code

# Overrides that say where or how a job runs, not what it trains: left out of run names.
NOT_IN_NAMES = ("tracking.", "runtime", "train.output_dir", "train.progress", "hydra")


@hydra.main(config_path=str(conf_folder()), config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> float | None:
    try:
        hydra_config = HydraConfig.get()
        redact_hydra_record(hydra_config)
        config = validate(cfg)
        if hydra_config.job.config_name != "config":  # a composed params file
            check_conf_digest(config)
        check_stage_code(as_dict(config), config.code, find_root())  # in a DVC stage
        if config.train.output_dir is None:  # Hydra's run folder: each sweep job its own
            config.train.output_dir = hydra_config.runtime.output_dir
        varied = []
        if hydra_config.mode == RunMode.MULTIRUN:
            named = [o for o in hydra_config.overrides.task if not o.startswith(NOT_IN_NAMES)]
            varied = sweep.varied(named)
        result = launch(config, varied)
        return objective(result, config.train.objective)  # what hydra/sweeper=optuna minimises
    except UserError as error:
        report_and_exit(error)
    return None


def redact_hydra_record(hydra_config: HydraConf) -> None:
    """Hydra records the job's config and overrides in <run folder>/.hydra/ before the job
    starts; a password given in a URI (tracking.uri=http://user:pass@host) is taken out."""
    if hydra_config.output_subdir is None:
        return
    folder = Path(hydra_config.runtime.output_dir) / hydra_config.output_subdir
    for path in folder.glob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        if redact(text) != text:
            write_text(path, redact(text))


def check_conf_digest(config: Config) -> None:
    """A composed params.yaml must come from today's conf/, or training would use stale values."""
    if config.conf_digest is None:
        return
    current = conf_digest()
    if config.conf_digest != current:
        raise ConfigError(
            f"conf/ changed since params.yaml was composed (params.yaml conf_digest="
            f"{config.conf_digest}, conf/ is now {current})",
            hint="run `dvc exp run` to compose params.yaml from conf/ and train with the new values",
        )


def main() -> None:
    # The interpreter's last full collection at exit walks every object torch, Hydra and
    # MLflow made: 1.8 s of each run's end here (a smoke run ended at 5.7 s and exited at
    # 7.6-8.0 s without this, 5.8-6.2 s with it). Objects frozen are left to the operating
    # system. Registered first, so it runs after every other exit handler.
    atexit.register(gc.freeze)
    put_project_on_path()
    argv = overrides.normalise(sys.argv[1:])
    try:
        # Hydra's own composition errors as one line: a single run composed once (the app
        # validates it), a sweep's every job composed and validated before the first starts.
        overrides.check(argv)
    except UserError as error:
        report_and_exit(error)
    sys.argv = [sys.argv[0], *argv]
    try:
        hydra_app()
    except KeyboardInterrupt:
        stopped(signal.SIGINT)
    except Interrupted as stop:
        stopped(stop.signum)


def stopped(signum: int) -> None:
    """Ctrl-C / SIGTERM: the run was already ended KILLED with its metrics flushed."""
    print(f"reprotrain: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
