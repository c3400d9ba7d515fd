"""The tracking adapter (reprotrain.tracking: TrackedRun, NoRun) on a real sqlite MLflow store
in tmp_path, read back with MLflow's own MlflowClient: each metric point lands once however
often the loop flushes, the spec's tags and params, artifacts, how a run ends, and a resumed
run that continues the same MLflow run without sending a point twice. (test_tracking has the
batching, the sending thread, refusals and the spool.)"""

from __future__ import annotations

import inspect
import signal
from pathlib import Path

import pytest

from conftest import Store, empty_store_file
from reprotrain.errors import ConfigError
from reprotrain.stopping import Interrupted
from reprotrain.tracking import NoRun, RunSpec, TrackedRun, describe_error, end_status

LONG = "x" * 7000  # beyond MLflow's 6000 characters of a param and 5000 of a tag


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A real sqlite store of this test's own, with MLflow's schema."""
    return Store(tmp_path).create_from(empty_store_file())


def spec(**changes) -> RunSpec:
    fields = {
        "experiment": "core",
        "name": "mlp-adamw-cpu",
        "tags": {"device.type": "cpu", "model.class": "reprotrain.models.mlp.MLP"},
        "params": {"optimizer.lr": 0.001, "train.steps": 20, "scheduler": None},
    }
    return RunSpec(**{**fields, **changes})


def steps(store: Store, run_id: str, key: str = "train/loss") -> list[int]:
    return [
        m.step for m in sorted(store.client.get_metric_history(run_id, key), key=lambda m: m.step)
    ]


def test_every_point_lands_once_however_often_the_loop_flushes(store: Store) -> None:
    with TrackedRun(store.uri, spec()) as run:
        for step in range(1, 31):
            run.log_metric("train/loss", 1.0 / step, step)
            if step % 5 == 0:
                run.log_metrics({"time/step_ms": 2.0, "train/lr": 1e-3}, step)
            if step % 7 == 0:
                run.flush()  # before a checkpoint
        run.flush()
        run.flush()  # nothing new: nothing sent
    assert steps(store, run.run_id) == list(range(1, 31))
    assert steps(store, run.run_id, "time/step_ms") == list(range(5, 31, 5))
    history = store.client.get_metric_history(run.run_id, "train/lr")
    assert [(m.step, m.value) for m in history] == [(s, 1e-3) for s in range(5, 31, 5)]


def test_the_specs_tags_and_params_are_the_runs_with_its_name_and_experiment(
    store: Store, tmp_path: Path
) -> None:
    tags = {"device.type": "cpu", "note": LONG, "tracking.uri": "http://ci:pw-77ab@host:5000"}
    params = {"optimizer.lr": 0.001, "scheduler": None, "long": LONG}
    with TrackedRun(store.uri, spec(tags=tags, params=params, checkpoint_dir=tmp_path)) as run:
        run.set_tags({"reprotrain.stopped_early": "val/loss did not improve"})
    recorded = store.client.get_run(run.run_id)
    assert recorded.info.run_name == "mlp-adamw-cpu"
    assert store.client.get_experiment(recorded.info.experiment_id).name == "core"
    assert recorded.data.params["optimizer.lr"] == "0.001"
    assert recorded.data.params["scheduler"] == "null"
    assert recorded.data.params["long"] == LONG[:6000]  # MLflow's limit, not a refused run
    got = recorded.data.tags
    assert got["device.type"] == "cpu" and got["note"] == LONG[:5000]
    assert got["tracking.uri"] == "http://ci:***@host:5000"  # no password in the store
    assert got["reprotrain.stopped_early"] == "val/loss did not improve"
    assert got["reprotrain.checkpoint_dir"] == str(tmp_path)
    assert {"reprotrain.host", "reprotrain.pid"} <= set(got)  # who owns it while it runs


def test_artifacts_are_stored_under_the_run_as_given(store: Store, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("optimizer:\n  lr: 0.001\n")
    curve = tmp_path / "loss.csv"
    curve.write_text("step,loss\n1,0.5\n")
    with TrackedRun(store.uri, spec()) as run:
        run.log_artifact(config)
        run.log_artifact(curve, "plots")
    client = store.client
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"config.yaml", "plots"}
    assert [a.path for a in client.list_artifacts(run.run_id, "plots")] == ["plots/loss.csv"]
    fetched = client.download_artifacts(run.run_id, "config.yaml", str(tmp_path / "back"))
    assert Path(fetched).read_text() == config.read_text()


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RuntimeError("CUDA error: an illegal memory access"), "FAILED"),
        (ConfigError("train.steps=0 is out of range", hint="give 1 or more"), "FAILED"),
        (Interrupted(signal.SIGINT), "KILLED"),
    ],
    ids=["bug", "user error", "sigint"],
)
def test_a_run_ended_by_an_error_keeps_its_points_status_and_reason(
    store: Store, error: BaseException, status: str
) -> None:
    with pytest.raises(type(error)), TrackedRun(store.uri, spec()) as run:
        for step in range(1, 4):
            run.log_metric("train/loss", 0.5, step)
        raise error
    ended = store.client.get_run(run.run_id)
    assert ended.info.status == status and ended.info.end_time is not None
    assert ended.data.tags["error"] == describe_error(error)
    assert steps(store, run.run_id) == [1, 2, 3]  # sent before it ended


def test_how_a_run_ended_names_its_status_and_reason() -> None:
    assert end_status(None) == "FINISHED"
    assert end_status(KeyboardInterrupt()) == end_status(Interrupted(signal.SIGTERM)) == "KILLED"
    assert end_status(ValueError("x")) == end_status(ConfigError("x")) == "FAILED"
    assert describe_error(ConfigError("lr=-1 is out of range", hint="give lr > 0")) == (
        "lr=-1 is out of range; fix: give lr > 0"
    )
    assert describe_error(ValueError("boom")) == "ValueError: boom"


def test_a_resumed_run_continues_the_same_run_and_sends_no_point_twice(store: Store) -> None:
    """A try killed after step 8 that checkpointed at 5: its resume trains 6..12 again; the
    store keeps each step once, the stopped try's reason goes, the params stay as logged."""
    with pytest.raises(KeyboardInterrupt), TrackedRun(store.uri, spec()) as first:
        for step in range(1, 9):
            first.log_metric("train/loss", float(step), step)
        raise KeyboardInterrupt
    assert store.client.get_run(first.run_id).info.status == "KILLED"
    changed = {"optimizer.lr": 0.5, "train.steps": 12, "scheduler": None}  # not logged again
    resumed = spec(resume_run_id=first.run_id, params=changed)
    with TrackedRun(store.uri, resumed) as again:
        for step in range(6, 13):
            again.log_metric("train/loss", float(step) + 100, step)
    assert again.run_id == first.run_id and len(store.runs("core")) == 1
    run = store.client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert run.data.params["optimizer.lr"] == "0.001"
    history = sorted(
        store.client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step
    )
    assert [(m.step, m.value) for m in history] == [
        *((s, float(s)) for s in range(1, 9)),  # what the killed try sent is kept
        *((s, float(s) + 100) for s in range(9, 13)),
    ]


def test_no_run_stands_in_for_a_tracked_run_with_the_same_calls() -> None:
    """tracking.enabled=false and ranks other than 0 record through NoRun: every call the
    Trainer makes on a TrackedRun exists on it with the same parameters."""
    calls = [
        name for name in vars(NoRun) if not name.startswith("_") and callable(vars(NoRun)[name])
    ]
    assert {"log_metric", "log_metrics", "flush", "set_tags", "log_artifact", "log_model"} <= set(
        calls
    )
    for name in calls:
        ours, theirs = getattr(NoRun, name), getattr(TrackedRun, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name
    with NoRun() as run:
        run.flush()
    assert run.run_id == "" and run.tracking_s == 0.0
