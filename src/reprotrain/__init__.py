"""reprotrain: reproducible, device-agnostic PyTorch training runs recorded in MLflow."""

import os

__version__ = "0.1.0"

# MLflow 3 sends usage telemetry to its maintainers from every process that uses it
# (background threads fetch a config and post events about its API calls). A reprotrain run
# talks to its tracking store and nothing else; set MLFLOW_DISABLE_TELEMETRY=false before a
# run to let MLflow's through.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
