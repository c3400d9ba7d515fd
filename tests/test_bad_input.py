"""Every bad input: non-zero exit, one line naming what was wrong, no traceback, no run
left RUNNING, no output written. The training script's main() runs in this process
(conftest.InProcess); one case of each stage that can refuse also ends a real process (e2e)."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Exited, InProcess, Store, child_env, train

CASES = {
    # overrides: a substring the one-line message must contain
    "cuda without a GPU": (["device=cuda"], "device=cuda was requested but no CUDA device"),
    "cuda index beyond the count": (["device=cuda:7"], "device=cuda:7"),
    "unknown device": (["device=tpu"], "device='tpu' is not an option of the 'device' group"),
    "unknown optimizer": (["optimizer=nosuch"], "optimizer='nosuch' is not an option"),
    "unknown model": (["model=nosuch"], "model='nosuch' is not an option"),
    "unknown data": (["data=imagenet"], "data='imagenet' is not an option"),
    "unknown runtime": (["runtime=nosuch"], "runtime='nosuch' is not an option"),
    "negative lr": (["optimizer.lr=-1"], "optimizer.lr=-1 is out of range; allowed: a number > 0"),
    "lr not a number": (["optimizer.lr=abc"], "optimizer.lr='abc' is not a number"),
    "zero batch size": (["train.batch_size=0"], "train.batch_size=0 is out of range"),
    "negative steps": (["train.steps=-5"], "train.steps=-5 is out of range"),
    "zero hidden size": (
        ["model.hidden_size=0"],
        "model._target_='reprotrain.models.MLP' failed to build: ValueError: hidden_size=0 must "
        "be an integer >= 1",
    ),
    "steps and epochs": (["train.epochs=2"], "set exactly one"),
    "batch bigger than data": (["train.batch_size=100000"], "larger than the training split"),
    "momentum for adamw": (["optimizer.momentum=0.9"], "'optimizer.momentum' is not a config key"),
    "momentum added for adamw": (
        ["+optimizer.momentum=0.9"],
        "optimizer.momentum=0.9 is not a parameter of torch.optim.AdamW",
    ),
    "unknown key": (["nosuchkey=1"], "'nosuchkey' is not a config key"),
    "added key that exists": (["+train.steps=5"], "'train.steps' is already a config key"),
    "unknown launcher": (["hydra/launcher=nosuch"], "hydra/launcher='nosuch' is not an option"),
    "hydra setting of the wrong type": (
        ["hydra.job.chdir=maybe"],
        "Error merging override hydra.job.chdir=maybe; Value 'maybe' is not a valid bool",
    ),
    "sweep without multirun": (["optimizer=adamw,sgd"], "add --multirun"),
    "unparsable override": (["train.steps=["], "cannot parse the override"),
    "bad betas": (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] is out of range"),
    # in_features follows the data; a value given by hand that the data does not have
    "features mismatch": (
        ["data=digits", "+model.in_features=784"],
        "the model MLP cannot take the data's batches under task Classification (a batch of (2x64, 2)",
    ),
    "num_features for digits": (
        ["data=digits", "data.num_features=784"],
        "'data.num_features' is not a config key",
    ),
    "server not listening": (["tracking.uri=http://127.0.0.1:9"], "did not answer within"),
    "store folder missing": (
        ["tracking.uri=sqlite:////nonexistent/dir/mlflow.db"],
        "does not exist",
    ),
    "store not writable": (["tracking.uri=sqlite:////proc/mlflow.db"], "is not writable"),
    "plain file store": (
        ["tracking.uri=file:///tmp/mlruns"],
        "plain file stores are not supported",
    ),
    "missing data file": (["data.file=/nonexistent/data.npz"], "does not exist"),
    "model too big for memory": (
        ["model.hidden_size=2000000000"],
        "needs more than 23,365.0 GiB to train (1,568,000,000,000 parameters so far",
    ),
    "model too deep for memory": (["model.depth=1000000"], "GiB free on cpu; fix: make the model"),
    "unknown non-finite mode": (
        ["train.nonfinite=maybe"],
        "train.nonfinite='maybe' is out of range; allowed: stop",
    ),
    "unknown precision": (
        ["train.precision=fp8"],
        "train.precision='fp8' is out of range; allowed: fp32",
    ),
    "tf32 on the cpu": (
        ["device=cpu", "train.tf32=true", "train.deterministic=false"],
        "train.tf32=true needs a CUDA GPU",
    ),
    "bf16 in deterministic mode": (
        ["train.precision=bf16"],
        "train.precision=bf16 change the arithmetic, but train.deterministic=true",
    ),
    "cuda graphs, no gpu": (["train.cuda_graphs=true"], "train.cuda_graphs=true needs a CUDA"),
    "compile and cuda graphs": (
        ["train.compile=true", "train.cuda_graphs=true"],
        "train.compile=true and train.cuda_graphs=true: pick one",
    ),
    # Hydra makes the run folder before the job starts (a traceback there, before)
    "run folder under a file": (
        ["hydra.run.dir=/dev/null/x"],
        "hydra.run.dir='/dev/null/x' cannot be made: /dev/null is not a folder",
    ),
    "sweep folder under a file": (
        ["--multirun", "train.seed=1,2", "hydra.sweep.dir=/dev/null/x"],
        "hydra.sweep.dir='/dev/null/x' cannot be made: /dev/null is not a folder",
    ),
    # checked against the constructor's annotation, not left to `'<' not supported ...`
    "size not a number": (
        ["model.hidden_size=abc"],
        "model.hidden_size='abc' is not an integer; allowed: an integer "
        "(reprotrain.models.MLP takes hidden_size, default 512)",
    ),
    # accepted before, and a NaN loss at step 2
    "infinite lr": (["optimizer.lr=inf"], "optimizer.lr=inf is out of range; allowed: a finite"),
    "loss class of another kind": (
        ["loss._target_=collections.OrderedDict"],
        "loss._target_='collections.OrderedDict' is a collections.OrderedDict, not a torch.nn",
    ),
}


def assert_clean_failure(
    result: Exited | subprocess.CompletedProcess, expected: str, store: Store
) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert expected in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    if store.path.exists():
        assert "RUNNING" not in store.statuses()


def assert_nothing_written(tmp_path: Path) -> None:
    results = tmp_path / "results"
    assert not results.exists() or not any(results.rglob("*"))  # nothing written
    checkpoints = tmp_path / "outputs" / "checkpoints"  # train.checkpoint_dir
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def smoke_here(app_in_process, tmp_path: Path, store: Store, *overrides: str) -> Exited:
    """The training script's main() on the smoke preset, in this process (conftest)."""
    return app_in_process(
        "runtime=local",
        f"tracking.uri={store.uri}",
        f"train.output_dir={tmp_path / 'results'}",
        "experiment=smoke",
        *overrides,
    )


@pytest.mark.parametrize("overrides,expected", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_clear_line(
    tmp_path: Path, store: Store, app_in_process, overrides, expected
) -> None:
    result = smoke_here(app_in_process, tmp_path, store, *overrides)
    assert_clean_failure(result, expected, store)
    assert_nothing_written(tmp_path)


# One case of each stage that can refuse, through a real process: what the exit code, the
# absence of a traceback and the store show only from outside (the rest run in-process above):
# Hydra's composition, the schema, the build, the data, and a store MLflow cannot use.
CHILD_CASES = {
    "negative lr": CASES["negative lr"],
    "unknown optimizer": CASES["unknown optimizer"],
    "features mismatch": CASES["features mismatch"],
    "missing data file": CASES["missing data file"],
    "unknown scheme": (
        ["tracking.uri=foo://x"],
        "tracking.uri='foo://x': MLflow cannot use this store",
    ),
    "databricks without credentials": (
        ["tracking.uri=databricks"],
        "tracking.uri='databricks': MLflow cannot use this store",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("overrides,expected", CHILD_CASES.values(), ids=CHILD_CASES.keys())
def test_bad_input_ends_the_process_with_one_line(
    tmp_path: Path, store: Store, overrides, expected
) -> None:
    result = train(
        tmp_path,
        store,
        "experiment=smoke",
        *overrides,
        check=False,
        timeout=120,
        env=no_databricks_credentials(tmp_path),
    )
    assert_clean_failure(result, expected, store)
    assert not re.search(r"^step \d", result.stderr, re.MULTILINE), result.stderr[-3000:]
    assert_nothing_written(tmp_path)


def test_unreachable_server_is_reported_within_ten_seconds(
    tmp_path: Path, store: Store, app_in_process
) -> None:
    started = time.monotonic()
    result = smoke_here(app_in_process, tmp_path, store, "tracking.uri=http://127.0.0.1:9")
    assert_clean_failure(result, "http://127.0.0.1:9", store)
    assert time.monotonic() - started < 10  # the check itself has a 5 s timeout


def test_full_traceback_on_request(
    tmp_path: Path, store: Store, app_in_process, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.errors import ConfigError

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="optimizer.lr=-1 is out of range"):  # uncaught
        smoke_here(app_in_process, tmp_path, store, "optimizer.lr=-1")


# Every kind of tracking URI MLflow cannot use ({tmp}: the test's folder, with notes.db in it).
URI_CASES = {
    "unknown scheme": ("foo://x", "tracking.uri='foo://x': MLflow cannot use this store"),
    "sqlite with two slashes": ("sqlite://relative.db", "names no sqlite file"),
    "sqlite in memory": ("sqlite:///:memory:", "is a database in memory"),
    "sqlite folder missing": ("sqlite:////nonexistent-dir/x.db", "does not exist"),
    "sqlite file is a folder": ("sqlite:///{tmp}", "is a folder, not a database file"),
    "sqlite file is not a database": ("sqlite:///{tmp}/notes.db", "file is not a database"),
    "nothing listening": ("http://127.0.0.1:1", "did not answer within"),
    "empty": ("''", "tracking.uri='' names no store"),
    "a folder": ("{tmp}", "plain file stores are not supported"),
    "databricks without credentials": ("databricks", "Databricks credential configuration"),
    "database not answering": (
        "postgresql://reprotrain:secret@127.0.0.1:1/mlflow",
        "tracking store postgresql://reprotrain:***@127.0.0.1:1/mlflow did not answer within",
    ),
    "database driver missing": (
        "mysql://reprotrain:secret@127.0.0.1:1/mlflow",
        "the database driver is not installed",
    ),
}


def no_databricks_credentials(home: Path) -> dict[str, str]:
    """The environment of a machine without Databricks credentials (none in env or HOME)."""
    env = {k: v for k, v in child_env().items() if not k.startswith("DATABRICKS_")}
    return {**env, "HOME": str(home), "DATABRICKS_CONFIG_FILE": str(home / "no-databrickscfg")}


def assert_refused_before_any_step(
    result: Exited | subprocess.CompletedProcess, expected: str, store: Store, tmp: Path
) -> None:
    assert_clean_failure(result, expected, store)
    assert not re.search(r"^step \d", result.stderr, re.MULTILINE), result.stderr[-3000:]
    assert "secret" not in result.stderr  # a password in the URI is never shown
    assert_nothing_written(tmp)


@pytest.mark.parametrize("uri,expected", URI_CASES.values(), ids=URI_CASES.keys())
def test_bad_tracking_uri_is_one_line_before_any_step(
    tmp_path: Path, store: Store, app_in_process, monkeypatch, uri: str, expected: str
) -> None:
    for name in [k for k in os.environ if k.startswith("DATABRICKS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", str(tmp_path / "no-databrickscfg"))
    (tmp_path / "notes.db").write_text("not a database\n")
    result = smoke_here(app_in_process, tmp_path, store, f"tracking.uri={uri.format(tmp=tmp_path)}")
    assert_refused_before_any_step(result, expected, store, tmp_path)


def test_store_of_another_mlflow_schema_is_one_line_naming_the_upgrade(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    # A copy of a store of this MLflow (none opened by MLflow in this process, which would
    # keep it cached), marked as an older one's, then given back its own version to read it.
    here.prepare(store)
    with sqlite3.connect(store.path) as db:
        (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
        db.execute("UPDATE alembic_version SET version_num = '451aebb31d03'")
    result = here.train(tmp_path, store, "experiment=smoke", check=False)
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE alembic_version SET version_num = ?", (version,))
    assert_refused_before_any_step(result, "Detected out-of-date database schema", store, tmp_path)
    assert f"mlflow db upgrade {store.uri}" in result.stderr


ENVIRONMENT_CASES = {
    # (overrides, environment, a substring of the one-line message)
    "cuda in a container": (["device=cuda"], {"REPROTRAIN_IN_CONTAINER": "1"}, "--gpus all"),
    "compile without a compiler": (
        ["train.compile=true"],
        {"CXX": "reprotrain-no-such-c++"},
        "'reprotrain-no-such-c++' is not on PATH",
    ),
}


@pytest.mark.parametrize(
    "overrides,environment,expected", ENVIRONMENT_CASES.values(), ids=ENVIRONMENT_CASES.keys()
)
def test_environment_lacking_something_is_one_clear_line(
    tmp_path: Path, store: Store, app_in_process, monkeypatch, overrides, environment, expected
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    result = smoke_here(app_in_process, tmp_path, store, *overrides)
    assert_clean_failure(result, expected, store)


@pytest.mark.parametrize("damage", ["truncated", "nan", "wrong_shape", "labels"])
def test_broken_data_file_is_a_clear_error(
    tmp_path: Path, store: Store, app_in_process, damage: str
) -> None:
    path = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.standard_normal((64, 784), dtype=np.float32),
        "y_train": rng.integers(0, 10, 64),
        "x_val": rng.standard_normal((16, 784), dtype=np.float32),
        "y_val": rng.integers(0, 10, 16),
        "num_classes": np.array(10),  # as `python -m reprotrain.prepare` writes it
    }
    if damage == "nan":
        arrays["x_train"][3, 5] = np.nan
    if damage == "wrong_shape":
        arrays["x_train"] = arrays["x_train"].reshape(64, 28, 28)
    if damage == "labels":
        arrays["y_train"][0] = 42
    np.savez(path, **arrays)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:5000])
    result = smoke_here(app_in_process, tmp_path, store, f"data.file={path}")
    expected = {
        "truncated": "corrupt or truncated",
        "nan": "NaN",
        "wrong_shape": "train samples are (28, 28), validation samples (784,)",
        "labels": "labels span",
    }[damage]
    assert_clean_failure(result, expected, store)


def test_unwritable_output_folder(tmp_path: Path, store: Store, app_in_process) -> None:
    result = app_in_process(
        "runtime=local",
        "experiment=smoke",
        f"tracking.uri={store.uri}",
        "train.output_dir=/proc/reprotrain-results",
    )
    assert_clean_failure(
        result, "train.output_dir='/proc/reprotrain-results' cannot be written", store
    )
    assert not store.path.exists() or store.runs() == []  # checked before any run is created


def test_unwritable_checkpoint_folder(tmp_path: Path, store: Store, app_in_process) -> None:
    result = smoke_here(
        app_in_process,
        tmp_path,
        store,
        "train.checkpoint_every=10",
        "train.checkpoint_dir=/proc/reprotrain-checkpoints",
    )
    assert_clean_failure(
        result, "train.checkpoint_dir='/proc/reprotrain-checkpoints' cannot be written", store
    )
    assert not store.path.exists() or store.runs() == []  # checked before any run is created


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: room for config.yaml and loss.svg, not for model.pt or a checkpoint."""
    folder = tmp_path / "full-disk"
    folder.mkdir()
    try:
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        problem = mount.stderr.strip() if mount.returncode != 0 else ""
    except OSError as error:
        problem = str(error)
    if problem:
        pytest.skip(
            "simulating a full disk needs to mount a small tmpfs (root, or CAP_SYS_ADMIN in a "
            f"container), and mount failed: {problem}"
        )
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize(
    "overrides,failing_file,setting",
    [
        ([], "model.pt", "train.output_dir"),
        (
            ["train.checkpoint_every=10", "train.checkpoint_dir={full_disk}/checkpoints"],
            "checkpoints/",
            "train.checkpoint_dir",
        ),
    ],
    ids=["final outputs", "checkpoint mid-run"],
)
def test_full_disk_is_one_clear_line_and_leaves_no_partial_file(
    tmp_path: Path,
    store: Store,
    here: InProcess,
    full_disk: Path,
    overrides: list[str],
    failing_file: str,
    setting: str,
) -> None:
    result = here.app(
        "runtime=local",
        "experiment=smoke",
        f"tracking.uri={here.prepare(store).uri}",
        f"train.output_dir={full_disk}",
        *(override.format(full_disk=full_disk) for override in overrides),
    )
    assert_clean_failure(result, f"no space left on device while writing '{full_disk}/", store)
    error = result.stderr.split("reprotrain: error: ")[1]
    assert f"{full_disk}/{failing_file}" in error and "fix: free space" in error
    fix = error.split("fix: ", 1)[1]
    assert f"{setting}=" in fix, fix  # the setting that moves this file elsewhere
    run = store.only_run()
    assert run.info.status == "FAILED" and "no space left on device" in run.data.tags["error"]
    left = {str(path.relative_to(full_disk)) for path in full_disk.rglob("*") if path.is_file()}
    assert left <= {"config.yaml", "loss.svg"}, left  # finished files only: no temp, no model.pt
