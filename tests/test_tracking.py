"""The MLflow record of a run, on real sqlite stores: every metric point read back once and in
order, batches within MLflow's limit, how a run ends, the experiment's kind, and an MLflow
Model that a fresh process loads and that predicts what the trained model predicts (e2e, as
is what `import reprotrain` sets in a new process). (More of TrackedRun: test_core_tracking.)"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PYTHON, Store, child_env, empty_store_file
from reprotrain.stopping import Interrupted
from reprotrain.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MAX_BATCH,
    NoRun,
    RunSpec,
    Spool,
    TrackedRun,
    ensure_experiment,
)

MAX_FLOAT = sys.float_info.max  # MLflow's sqlite store keeps +-inf as +-the largest float


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A real sqlite store of this test's own, in tmp_path, with MLflow's schema."""
    return Store(tmp_path).create_from(empty_store_file())


def _run(store: Store, flush_every_s: float = 3600.0) -> TrackedRun:
    spec = RunSpec("tracking", "test", {"t": "1"}, {"p": 1})
    return TrackedRun(store.uri, spec, flush_every_s=flush_every_s)


def _history(store: Store, run_id: str, key: str) -> list[tuple[int, float | str]]:
    """(step, value) as MLflow returns them, NaN as "nan" so that lists compare."""
    return [
        (m.step, "nan" if math.isnan(m.value) else m.value)
        for m in store.client.get_metric_history(run_id, key)
    ]


def test_every_point_is_read_back_once_in_order(store: Store) -> None:
    """Points sent at the end in batches of 1000; NaN and both infinities kept as MLflow keeps
    them; a second key alongside."""
    specials = {7: float("nan"), 8: float("inf"), 9: float("-inf")}
    steps = 2 * MAX_BATCH + 17
    with _run(store) as run:
        for step in range(1, steps + 1):
            run.log_metric("train/loss", specials.get(step, 1.0 / step), step)
            if step % 100 == 0:
                run.log_metrics({"time/step_ms": step / 10}, step)
    expected = [(step, 1.0 / step) for step in range(1, steps + 1)]
    expected[6:9] = [(7, "nan"), (8, MAX_FLOAT), (9, -MAX_FLOAT)]
    assert _history(store, run.run_id, "train/loss") == expected
    assert _history(store, run.run_id, "time/step_ms") == [
        (s, s / 10) for s in range(100, steps, 100)
    ]
    finished = store.client.get_run(run.run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.metrics["train/loss"] == 1.0 / steps


def test_points_leave_on_their_thread_while_the_run_goes_on(store: Store) -> None:
    """The loop only appends: the sending thread delivers points every flush_every_s without
    a flush from the loop; the run is MLflow's active run meanwhile, and none after its end."""
    import mlflow

    with _run(store, flush_every_s=0.05) as run:
        assert mlflow.active_run().info.run_id == run.run_id
        mlflow.log_metric("user/metric", 3.0, step=1)  # a user's own call: the same run
        for step in range(1, 11):
            run.log_metric("train/loss", float(step), step)
        deadline = time.monotonic() + 30
        while len(_history(store, run.run_id, "train/loss")) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _history(store, run.run_id, "train/loss") == [(s, float(s)) for s in range(1, 11)]
    assert mlflow.active_run() is None
    assert _history(store, run.run_id, "user/metric") == [(1, 3.0)]


def test_a_flush_of_more_than_1000_points_goes_in_batches_of_1000(store: Store) -> None:
    with _run(store) as run:
        sizes: list[int] = []
        log_batch = run.client.log_batch

        def counted(run_id: str, **batch: list) -> None:
            sizes.append(len(batch.get("metrics", [])))
            log_batch(run_id, **batch)

        run.client.log_batch = counted
        for step in range(1, 2501):
            run.log_metric("train/loss", float(step), step)
        assert sizes == []
    assert sizes == [1000, 1000, 500]
    assert _history(store, run.run_id, "train/loss") == [(s, float(s)) for s in range(1, 2501)]


def test_points_for_a_deleted_run_are_refused_with_mlflows_error(store: Store) -> None:
    from mlflow.exceptions import MlflowException

    refused = pytest.raises(MlflowException, match="must be in the 'active' state")
    with refused, _run(store) as run:
        store.client.delete_run(run.run_id)
        run.log_metric("train/loss", 1.0, 1)
    assert store.client.get_metric_history(run.run_id, "train/loss") == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (None, "FINISHED"),
        (ValueError("boom"), "FAILED"),
        (KeyboardInterrupt(), "KILLED"),
        (Interrupted(signal.SIGTERM), "KILLED"),
    ],
    ids=["success", "exception", "ctrl-c", "sigterm"],
)
def test_run_ends_with_the_status_of_how_it_ended(
    store: Store, error: BaseException | None, status: str
) -> None:
    expected = pytest.raises(type(error)) if error else contextlib.nullcontext()
    with expected, _run(store) as run:
        run.log_metric("train/loss", 1.0, 1)
        if error is not None:
            raise error
    ended = store.client.get_run(run.run_id)
    assert ended.info.status == status
    reason = ended.data.tags.get("error")  # what stopped it, for FAILED and KILLED alike
    assert reason == (f"{type(error).__name__}: {error}" if error else None)
    assert _history(store, run.run_id, "train/loss") == [(1, 1.0)]


def test_experiment_is_marked_as_model_training(store: Store) -> None:
    """MLflow 3's UI opens it in its model-training view: new experiments get the tag, and an
    existing one that lacks it gets it too."""
    client = store.client
    new = ensure_experiment(client, "made-here")
    older = client.create_experiment("made-before")
    assert ensure_experiment(client, "made-before") == older
    for experiment_id in (new, older):
        tags = client.get_experiment(experiment_id).tags
        assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    with _run(store) as run:
        pass
    experiment = client.get_experiment(client.get_run(run.run_id).info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_spooled_points_and_status_are_sent_in_order_each_once(
    store: Store, tmp_path: Path
) -> None:
    """Sent oldest first, in batches of 1000, skipping a point the store already holds (a write
    whose reply an outage cut off); the file is the owner's alone and names its store without
    the password."""
    from mlflow.entities import Metric

    client = store.client
    run_id = client.create_run(ensure_experiment(client, "spool")).info.run_id
    client.log_batch(run_id, metrics=[Metric("train/loss", 1.0 / 7, 1_007, 7)])
    team_store = "postgresql://team:pw-4411@db.example:5432/mlflow"
    spool = Spool(tmp_path / "spool" / f"{run_id}.jsonl", team_store, run_id)
    spool.append({"metrics": [["train/loss", 1.0 / s, 1_000 + s, s] for s in range(1, 1501)]})
    spool.append({"metrics": [["train/loss", 0.5, 3_000, 1501]]})
    spool.append({"status": "FINISHED", "error": ""})
    assert spool.path.stat().st_mode & 0o777 == 0o600
    text = spool.path.read_text()
    assert "pw-4411" not in text and "postgresql://team:***@db.example" in text
    assert Spool.open(spool.path).send(client) == 1500
    assert not spool.path.exists()
    history = _history(store, run_id, "train/loss")
    assert history == [(s, 1.0 / s) for s in range(1, 1501)] + [(1501, 0.5)]
    assert client.get_run(run_id).info.status == "FINISHED"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_store_failures_are_told_from_refusals_and_mlflows_reports_of_them_quieted(
    store: Store,
) -> None:
    """A server that does not answer is a failure (spooled); a write to a deleted run is a
    refusal (raised). MLflow's log records of a failure are dropped; the password in any
    record is replaced."""
    import io
    import logging

    from mlflow.tracking import MlflowClient

    from reprotrain.tracking.credentials import RedactSecrets
    from reprotrain.tracking.failures import QuietStoreFailures, failure_reason, is_store_failure

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    away = MlflowClient(f"http://ci:pw-0b7e@127.0.0.1:{closed_port()}")
    with pytest.raises(Exception) as unreachable:
        away.get_experiment_by_name("x")
    client = store.client
    run_id = client.create_run(ensure_experiment(client, "refusals")).info.run_id
    client.delete_run(run_id)
    with pytest.raises(Exception) as refused:
        client.set_tag(run_id, "a", "b")
    assert is_store_failure(unreachable.value) and not is_store_failure(refused.value)
    assert "ci:***@127.0.0.1" in failure_reason(unreachable.value)
    assert "pw-0b7e" not in failure_reason(unreachable.value)

    printed = io.StringIO()
    handler = logging.StreamHandler(printed)
    handler.addFilter(QuietStoreFailures())
    handler.addFilter(RedactSecrets())
    mlflows, users = logging.getLogger("mlflow.reprotrain_test"), logging.getLogger("user_code")
    for logger in (mlflows, users):
        logger.addHandler(handler)
        logger.propagate = False
    try:
        for error in (unreachable.value, refused.value):
            mlflows.error("a write failed", exc_info=error)
        mlflows.warning("Failed to log system metrics: %s", unreachable.value)
        mlflows.warning("a run at http://ci:pw-0b7e@host:5000 said hello")
        users.error("my callback could not reach its server", exc_info=unreachable.value)
    finally:
        for logger in (mlflows, users):
            logger.removeHandler(handler)
            logger.propagate = True
    text = printed.getvalue()
    assert text.count("a write failed") == 1 and "must be in the 'active' state" in text
    assert "Failed to log system metrics" not in text  # the failures: MLflow's reports dropped
    assert "my callback could not reach its server" in text  # a user's own record is kept
    assert "http://ci:***@host:5000 said hello" in text and "pw-0b7e" not in text


def test_no_run_records_nothing(tmp_path: Path) -> None:
    with NoRun() as run:
        run.log_metric("train/loss", 1.0, 1)
        run.log_metrics({"a": 1.0}, 1)
        run.set_tags({"a": "b"})
        run.log_artifact(tmp_path)
        assert run.log_model(torch.nn.Linear(2, 2), np.zeros((2, 2), np.float32)) is None
    assert run.run_id == "" and not list(tmp_path.iterdir())


# --- The run's MLflow Model -----------------------------------------------------------------

MODEL_CODE = {
    "__init__.py": "",
    "blocks.py": """
        from torch import nn

        def block(width_in, width_out):
            return nn.Sequential(nn.Linear(width_in, width_out), nn.ReLU())
    """,
    "nets.py": """
        from torch import nn

        from {package}.blocks import block

        class TwoLayer(nn.Module):
            def __init__(self):
                super().__init__()
                self.hidden = block(784, 512)
                self.out = nn.Linear(512, 10)

            def forward(self, x):
                return self.out(self.hidden(x))

        class Branchy(TwoLayer):
            # a Python `if` on a tensor's value: torch.export cannot trace it
            def forward(self, x):
                hidden = self.hidden(x)
                if hidden.sum() > 0:
                    return self.out(hidden)
                return -self.out(hidden)
    """,
    "weights.bin": "not code: left out of the MLflow Model",
}


def _user_model(tmp_path: Path, package: str, name: str, monkeypatch: pytest.MonkeyPatch):
    """A model whose class lives in a package of the user's project folder (not installed)."""
    folder = tmp_path / "project" / package
    folder.mkdir(parents=True)
    for file, code in MODEL_CODE.items():
        (folder / file).write_text(textwrap.dedent(code).format(package=package))
    monkeypatch.syspath_prepend(str(folder.parent))
    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, module)
    torch.manual_seed(0)
    return getattr(importlib.import_module(f"{package}.nets"), name)()


def _predict_in_fresh_process(store: Store, run_ids: list[str], inputs: np.ndarray, folder: Path):
    """mlflow.pytorch.load_model in a new Python started in `folder`, where the user's project
    is not importable: what each MLflow Model carries is all it has."""
    folder.mkdir()
    np.save(folder / "inputs.npy", inputs)
    code = (
        "import sys, numpy as np, torch, mlflow.pytorch\n"
        "for run_id in sys.argv[1:]:\n"
        "    model = mlflow.pytorch.load_model(f'runs:/{run_id}/model')\n"
        "    with torch.no_grad():\n"
        "        out = model(torch.from_numpy(np.load('inputs.npy')))\n"
        "    np.save(f'{run_id}.npy', out.numpy())\n"
    )
    env = child_env(MLFLOW_TRACKING_URI=store.uri, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
    env["PYTHONPATH"] = ""  # nothing of the project's folder on the path
    result = subprocess.run(
        [PYTHON, "-c", code, *run_ids],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [np.load(folder / f"{run_id}.npy") for run_id in run_ids]


def _model_files(store: Store, model_id: str) -> tuple[set[str], list[str]]:
    """The saved model's data files, and the code it carries."""
    import mlflow

    location = store.client.get_logged_model(model_id).artifact_location
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=location))
    code = sorted(p.relative_to(local / "code").as_posix() for p in (local / "code").rglob("*"))
    return {p.name for p in (local / "data").iterdir()}, code


@pytest.mark.e2e  # loaded in a fresh Python, outside the project folder
def test_logged_models_predict_the_same_in_a_fresh_process(
    store: Store,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A model torch.export can trace is saved as its graph; one it cannot is saved with
    pickle. Both carry their code, load in a fresh process outside the project folder,
    predict what the trained model predicts, and are registered as version 1. The run stays
    RUNNING while its model is logged, and MLflow's global state is left as it was."""
    import mlflow

    inputs = torch.randn(64, 784)
    uri_before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    runs, expected = [], []
    for name, saved_as in [("TwoLayer", "model.pt2"), ("Branchy", "model.pth")]:
        package = f"userproj_{name.lower()}"
        model = _user_model(tmp_path, package, name, monkeypatch)
        with torch.no_grad():
            expected.append(model(inputs).numpy())
        with _run(store) as run:
            info = run.log_model(model, inputs, registered_name=f"user-{name}")
            assert store.client.get_run(run.run_id).info.status == "RUNNING"
            assert mlflow.active_run().info.run_id == run.run_id
        assert store.client.get_run(run.run_id).info.status == "FINISHED"
        assert mlflow.active_run() is None
        assert ("saved with pickle" in capfd.readouterr().err) == (name == "Branchy")
        data, code = _model_files(store, info.model_id)
        assert saved_as in data
        assert code == [
            package,
            *(f"{package}/{f}" for f in ("__init__.py", "blocks.py", "nets.py")),
        ]
        experiment_id = store.client.get_run(run.run_id).info.experiment_id
        models = store.client.search_logged_models(
            [experiment_id], filter_string=f"source_run_id = '{run.run_id}'"
        )
        assert [(m.name, m.status) for m in models] == [("model", "READY")]  # no failed try left
        versions = store.client.search_model_versions(f"name = 'user-{name}'")
        assert [(str(v.version), v.run_id) for v in versions] == [("1", run.run_id)]
        runs.append(run.run_id)
    assert (mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None) == uri_before
    assert os.environ.get("MLFLOW_TRACKING_URI") == uri_before

    predicted = _predict_in_fresh_process(store, runs, inputs.numpy(), tmp_path / "elsewhere")
    for outputs, wanted in zip(predicted, expected, strict=True):
        np.testing.assert_allclose(outputs, wanted, rtol=1e-6, atol=1e-6)


@pytest.mark.e2e  # what `import reprotrain` sets as a process starts
@pytest.mark.parametrize(
    ("given", "expected"), [(None, "true"), ("false", "false")], ids=["default", "asked-for"]
)
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
