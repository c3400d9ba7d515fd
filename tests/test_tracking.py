"""The sqlite metric writer against MLflow's own log_batch, on real sqlite stores.

reprotrain stores metric points in a sqlite store with one executemany (tracking.py,
`sqlite_metric_writer`) instead of `log_batch`'s ORM object per point. What MLflow reads
back must be the same: every point of the history, the run's latest values, NaN and
infinities, repeats, the refusal to write into a deleted run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PYTHON, child_env
from reprotrain.tracking import MAX_BATCH, TrackedRun, sqlite_metric_writer


def _client(folder: Path):
    from mlflow.tracking import MlflowClient

    folder.mkdir()
    return MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")


def _new_run(client) -> str:
    experiment = client.create_experiment("writer")
    return client.create_run(experiment).info.run_id


# key, value, timestamp (ms), step: out-of-order steps, a step logged twice with different
# values (the later timestamp wins), NaN, both infinities, an exact repeat, two keys.
POINTS = [
    ("train/loss", 2.5, 1_000, 1),
    ("train/loss", 2.25, 1_001, 2),
    ("train/loss", 2.0, 1_002, 4),
    ("train/loss", 2.125, 1_003, 3),
    ("train/loss", float("nan"), 1_004, 5),
    ("train/loss", 1.75, 1_005, 5),
    ("train/loss", float("inf"), 1_006, 6),
    ("train/loss", float("-inf"), 1_007, 7),
    ("time/step_ms", 1.25, 1_008, 7),
    ("time/step_ms", 1.5, 1_008, 7),
]


def _record(client, run_id: str) -> tuple[dict, dict]:
    """Everything MLflow reads back about the run's metrics."""
    history = {
        key: sorted(
            (m.step, m.timestamp, "nan" if math.isnan(m.value) else m.value)
            for m in client.get_metric_history(run_id, key)
        )
        for key in ("train/loss", "time/step_ms")
    }
    latest = {
        key: "nan" if math.isnan(value) else value
        for key, value in client.get_run(run_id).data.metrics.items()
    }
    return history, latest


@pytest.mark.parametrize(
    "batches",
    [[POINTS], [POINTS[:4], POINTS[4:]], [POINTS, POINTS[2:5]]],
    ids=["one-batch", "two-batches", "with-repeats"],
)
def test_writer_stores_what_log_batch_stores(tmp_path: Path, batches: list) -> None:
    from mlflow.entities import Metric

    ours, theirs = _client(tmp_path / "ours"), _client(tmp_path / "theirs")
    writer = sqlite_metric_writer(ours)
    assert writer is not None, "a sqlite store must get the fast writer"
    our_run, their_run = _new_run(ours), _new_run(theirs)
    for points in batches:
        writer(our_run, points)
        theirs.log_batch(their_run, metrics=[Metric(*p) for p in points])
    assert _record(ours, our_run) == _record(theirs, their_run)
    history, latest = _record(ours, our_run)
    assert len(history["train/loss"]) == 8  # repeats dropped, as log_batch drops them
    assert latest["train/loss"] == -sys.float_info.max  # step 7's -inf, as MLflow keeps it


def test_a_large_batch_with_a_repeat_is_stored_once(tmp_path: Path) -> None:
    """A repeat sends the whole batch (here over MLflow's 1000 a call) through log_batch,
    which stores what is new and drops what is stored already."""
    client = _client(tmp_path / "store")
    writer = sqlite_metric_writer(client)
    run_id = _new_run(client)
    points = [("train/loss", 1.0 / step, 1_000 + step, step) for step in range(1, 2501)]
    writer(run_id, points[:10])
    writer(run_id, points)  # the first ten are stored already
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 2501))
    assert client.get_run(run_id).data.metrics["train/loss"] == 1.0 / 2500


def test_writer_refuses_a_deleted_run_as_log_batch_does(tmp_path: Path) -> None:
    from mlflow.exceptions import MlflowException

    client = _client(tmp_path / "store")
    writer = sqlite_metric_writer(client)
    run_id = _new_run(client)
    client.delete_run(run_id)
    with pytest.raises(MlflowException, match="must be in the 'active' state"):
        writer(run_id, POINTS[:1])
    assert client.get_metric_history(run_id, "train/loss") == []


def test_writer_only_for_sqlite() -> None:
    from mlflow.tracking import MlflowClient

    assert sqlite_metric_writer(MlflowClient("http://127.0.0.1:9")) is None


def test_tracked_run_stores_many_points_in_order(tmp_path: Path) -> None:
    """A TrackedRun on sqlite: several batches and the rest at the end, all there, in order."""
    client = _client(tmp_path / "store")
    steps = 2 * MAX_BATCH + 17
    run = TrackedRun(client.tracking_uri, "writer", "many", {"t": "1"}, {"p": 1}, 0.01)
    with run:
        for step in range(1, steps + 1):
            run.log_metric("train/loss", 1.0 / step, step)
            if step % 500 == 0:
                time.sleep(0.02)  # older than flush_every_s: the next point sends a batch
        assert run.metrics.sent >= 2000  # sent in batches before the end
    history = client.get_metric_history(run.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
    assert {m.step: m.value for m in history}[steps] == 1.0 / steps
    finished = client.get_run(run.run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.metrics["train/loss"] == 1.0 / steps


@pytest.mark.parametrize(("given", "expected"), [(None, "true"), ("false", "false")])
def test_mlflow_telemetry_is_off_unless_asked_for(given: str | None, expected: str) -> None:
    """reprotrain's processes send nothing but the run's record; a user's own setting wins."""
    env = child_env()
    env.pop("MLFLOW_DISABLE_TELEMETRY", None)
    if given is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = given
    code = "import os, reprotrain; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
    assert os.environ.get("MLFLOW_DISABLE_TELEMETRY")  # and in this test process too
