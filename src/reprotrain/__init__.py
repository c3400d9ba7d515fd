"""reprotrain: reproducible, device-agnostic PyTorch training runs recorded in MLflow.

From Python (README: "From Python"):

    import reprotrain
    result = reprotrain.train(["model=cnn", "data=digits_images"])   # one whole run, as the CLI
    trainer = reprotrain.Trainer(model, optimizer, train_ds, val_data=val_ds, batch_size=64)
    trainer.fit(steps=500)                                            # plain torch objects

The public names are the ones below; every module is reprotrain's own business and may change.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# MLflow 3 sends usage telemetry to its maintainers from every process that uses it
# (background threads fetch a config and post events about its API calls). A reprotrain run
# talks to its tracking store and nothing else; set MLFLOW_DISABLE_TELEMETRY=false before a
# run to let MLflow's through.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# Each public name and the module it lives in. They are imported on first use, not here:
# `python -m reprotrain.train --help` and Tab completion import this package and need
# neither torch nor MLflow (seconds of start-up).
_EXPORTS = {
    "train": "reprotrain.api",
    "Result": "reprotrain.api",
    "Trainer": "reprotrain.trainer",
    "Fitted": "reprotrain.trainer",
    "Task": "reprotrain.tasks",
    "Classification": "reprotrain.tasks",
    "Binary": "reprotrain.tasks",
    "Regression": "reprotrain.tasks",
    "LanguageModel": "reprotrain.tasks",
    "WholeOutput": "reprotrain.tasks",
    "Callback": "reprotrain.callbacks",
    "EarlyStopping": "reprotrain.callbacks",
    "MlflowRecorder": "reprotrain.tracking.mlflow_run",
    "Recorder": "reprotrain.tracking.recorder",
    "ConfigError": "reprotrain.errors",
    "UserError": "reprotrain.errors",
}
__all__ = [
    "Binary",
    "Callback",
    "Classification",
    "ConfigError",
    "EarlyStopping",
    "Fitted",
    "LanguageModel",
    "MlflowRecorder",
    "Recorder",
    "Regression",
    "Result",
    "Task",
    "Trainer",
    "UserError",
    "WholeOutput",
    "__version__",
    "train",
]

if TYPE_CHECKING:
    from reprotrain.api import Result, train
    from reprotrain.callbacks import Callback, EarlyStopping
    from reprotrain.errors import ConfigError, UserError
    from reprotrain.tasks import (
        Binary,
        Classification,
        LanguageModel,
        Regression,
        Task,
        WholeOutput,
    )
    from reprotrain.tracking.mlflow_run import MlflowRecorder
    from reprotrain.tracking.recorder import Recorder
    from reprotrain.trainer import Fitted, Trainer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reprotrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
