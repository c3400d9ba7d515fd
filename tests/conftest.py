"""Shared fixtures: a real sqlite MLflow store in a temporary folder, and a helper that runs
`python -m reprotrain.train` as a real child process, the way a user does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _capability_skip(reason: str) -> None:
    """Skip, unless CI asked for every capability it installed (then a missing one fails)."""
    if os.environ.get("REPROTRAIN_REQUIRE_ALL") == "1":
        pytest.fail(f"required capability missing: {reason}")
    pytest.skip(reason)


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: none is visible to torch here")


def require_chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        _capability_skip("needs Debian's chromium package (apt-get install chromium)")
    return path


class Store:
    """A sqlite MLflow store read back through MlflowClient."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "mlflow.db"
        self.uri = f"sqlite:///{self.path}"

    @property
    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)

    def runs(self, experiment: str = "reprotrain") -> list:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        return self.client.search_runs([exp.experiment_id], max_results=1000)

    def only_run(self):
        runs = self.runs()
        assert len(runs) == 1, [r.info.run_name for r in runs]
        return runs[0]

    def losses(self, run_id: str) -> list[tuple[int, float]]:
        history = self.client.get_metric_history(run_id, "train/loss")
        return sorted((m.step, m.value) for m in history)

    def statuses(self) -> list[str]:
        return [r.info.status for r in self.runs()]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "HYDRA_"))}
    env.pop("REPROTRAIN_RUN_ID", None)
    env.update(extra)
    return env


def train(
    tmp_path: Path,
    store: Store,
    *overrides: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the Hydra app in tmp_path with its own store and output folder."""
    args = [
        PYTHON,
        "-m",
        "reprotrain.train",
        "runtime=local",
        f"tracking.uri={store.uri}",
        f"train.output_dir={tmp_path / 'results'}",
        *overrides,
    ]
    result = subprocess.run(
        args, cwd=tmp_path, env=env or child_env(), capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result
