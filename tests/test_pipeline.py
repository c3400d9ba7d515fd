"""`dvc repro` and `dvc exp run` in a temporary git repository copied from the project
(real dvc, real git, real MLflow store; the training runs locally in these tests): e2e."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, Reproduced, Store, make_project, sh


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A fresh project copy, before any `dvc repro`."""
    return make_project(tmp_path / "project", runtime="local")


@pytest.fixture
def reproduced_copy(reproduced: Reproduced, tmp_path: Path) -> Path:
    """A copy of the shared project after `dvc repro` (conftest.reproduced), with no runs in
    its store yet: for a test that changes it."""
    return reproduced.copy(tmp_path / "project")


def store_of(repo: Path) -> Store:
    return Store(repo)


@pytest.mark.e2e  # dvc
def test_repro_runs_once_then_is_a_no_op(reproduced: Reproduced) -> None:
    repo, first = reproduced.repo, reproduced.repro
    assert "Running stage 'prepare'" in first.stdout and "Running stage 'evaluate'" in first.stdout
    assert (repo / "dvc.lock").is_file()
    store = store_of(repo)
    run = store.only_run()
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    data_md5 = lock["stages"]["prepare"]["outs"][0]["md5"]
    assert tags["dvc.stage"] == "train" and tags["data.hash"] == data_md5
    assert tags["git.commit"] == sh(repo, "git", "rev-parse", "HEAD").stdout.strip()
    assert tags["git.dirty"] == "false"  # dvc.lock and outputs changing during repro don't count
    metrics = json.loads((repo / "results" / "metrics.json").read_text())
    assert metrics["run_id"] == run.info.run_id
    assert "val/eval_accuracy" in store.client.get_run(run.info.run_id).data.metrics

    second = sh(repo, "dvc", "repro")
    assert "Data and pipelines are up to date" in second.stdout
    assert len(store.runs()) == 1


@pytest.mark.e2e  # dvc
def test_conf_edit_is_never_trained_on_silently(reproduced_copy: Path) -> None:
    repo = reproduced_copy
    adamw = repo / "conf" / "optimizer" / "adamw.yaml"
    adamw.write_text(adamw.read_text().replace("lr: 1.0e-3", "lr: 5.0e-4"))
    lock_before = (repo / "dvc.lock").read_bytes()

    stale = sh(repo, "dvc", "repro", check=False)
    assert stale.returncode != 0
    assert "conf/ changed since params.yaml was composed" in stale.stdout + stale.stderr
    assert "dvc exp run" in stale.stdout + stale.stderr
    assert "Running stage 'prepare'" not in stale.stdout
    assert (repo / "dvc.lock").read_bytes() == lock_before
    assert store_of(repo).runs() == []  # no run started

    applied = sh(repo, "dvc", "exp", "run")
    assert "Running stage 'train'" in applied.stdout
    assert "Running stage 'prepare'" not in applied.stdout
    newest = store_of(repo).runs()[0]
    assert float(newest.data.params["optimizer.lr"]) == 5e-4
    assert newest.data.tags.get("dvc.exp_name")


@pytest.mark.e2e  # dvc
def test_exp_run_overrides_reach_the_mlflow_run_and_a_cnn_goes_through_the_whole_pipeline(
    repo: Path,
) -> None:
    """One `dvc exp run -S`, no code changed: a group option, a value in it, a value in another
    group and a fixed section's key reach the MLflow run (each -S composed by DVC's Hydra into
    params.yaml); with model=cnn and data=digits_images, prepare writes the images, train
    builds the CNN from them, evaluate rebuilds it from model.pt."""
    overrides = {
        "model=cnn": ("model._target_", "reprotrain.models.SmallCNN"),
        "model.channels=16": ("model.channels", "16"),
        "optimizer=adam": ("optimizer._target_", "torch.optim.Adam"),
        "optimizer.lr=0.002": ("optimizer.lr", "0.002"),
        "data=digits_images": ("data.images", "True"),
        "device=cpu": ("device.type", "cpu"),
    }
    sh(repo, "dvc", "exp", "run", *(f"-S{o}" for o in overrides))
    store = store_of(repo)
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert {param: run.data.params[param] for param, _ in overrides.values()} == dict(
        overrides.values()
    )
    assert run.data.tags["dvc.exp_name"]
    shown = sh(repo, "dvc", "exp", "show", "--json").stdout
    assert run.data.tags["dvc.exp_name"] in shown
    assert run.data.tags["model.class"] == "reprotrain.models.cnn.SmallCNN"
    losses = [value for _, value in store.losses(run.info.run_id)]
    assert len(losses) == 20 and losses[-1] < losses[0]
    evaluated = json.loads((repo / "results" / "eval.json").read_text())
    trained = json.loads((repo / "results" / "metrics.json").read_text())
    assert evaluated["eval_accuracy"] == pytest.approx(trained["val_accuracy"], abs=1e-9)
    assert run.data.metrics["val/eval_accuracy"] == pytest.approx(trained["val_accuracy"])


@pytest.mark.e2e  # dvc
def test_queued_sweep_runs_each_point_into_the_project_store(reproduced_copy: Path) -> None:
    repo = reproduced_copy  # the baseline reproduced
    sh(
        repo,
        "dvc",
        "exp",
        "run",
        "-S",
        "optimizer=adamw,sgd",
        "-S",
        "train.batch_size=24",  # two -S as the README's sweep; two points keep it short
        "--queue",
    )
    sh(repo, "dvc", "queue", "start", "-j", "1")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        status = sh(repo, "dvc", "queue", "status").stdout
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(1)
    status = sh(repo, "dvc", "queue", "status").stdout
    assert status.count("Success") == 2, status
    runs = store_of(repo).runs()  # the project's own store, not a temporary copy's
    swept = [r for r in runs if r.data.tags.get("dvc.exp_name")]
    assert len(swept) == 2 and all(r.info.status == "FINISHED" for r in swept)
    combos = {(r.data.tags["optimizer.class"], r.data.params["train.batch_size"]) for r in swept}
    adamw, sgd = "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"
    assert combos == {(adamw, "24"), (sgd, "24")}
    assert not list((repo / ".dvc" / "tmp").rglob("mlflow.db"))


@pytest.mark.e2e  # dvc
def test_direct_run_after_repro_leaves_the_pipeline_clean(reproduced_copy: Path) -> None:
    """`python -m reprotrain.train` writes its own folder; only the DVC stage writes results/."""
    repo = reproduced_copy
    sh(repo, "python", "-m", "reprotrain.train", "train.steps=5")
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout
    assert list((repo / "outputs" / "runs").glob("*/*/metrics.json"))


@pytest.mark.e2e  # dvc
def test_metrics_and_plots_show(reproduced: Reproduced, tmp_path: Path) -> None:
    repo = reproduced.repo
    metrics = sh(repo, "dvc", "metrics", "show").stdout
    assert "results/metrics.json" in metrics and "results/eval.json" in metrics
    assert "val_accuracy" in metrics
    plots = sh(repo, "dvc", "plots", "show", "-o", str(tmp_path / "plots")).stdout
    assert (tmp_path / "plots" / "index.html").is_file(), plots
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "results/loss.csv" in html and "results/confusion.csv" in html
    dag = sh(repo, "dvc", "dag").stdout
    assert "prepare" in dag and "train" in dag and "evaluate" in dag


@pytest.mark.e2e  # dvc
@pytest.mark.parametrize(
    "override,expected",
    [
        ("optimizer=nosuch", "optimizer/nosuch"),
        ("optimizer.lr=-1", "optimizer.lr=-1 is out of range"),
        ("+model.width=3", "model.width=3 is not a parameter of reprotrain.models.MLP"),
        ("nosuchkey=1", "nosuchkey"),
    ],
)
def test_bad_exp_run_changes_nothing(reproduced_copy: Path, override: str, expected: str) -> None:
    repo = reproduced_copy
    lock = (repo / "dvc.lock").read_bytes()
    metrics = (repo / "results" / "metrics.json").read_bytes()
    result = sh(repo, "dvc", "exp", "run", "-S", override, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert expected in output and "Traceback" not in output
    assert (repo / "dvc.lock").read_bytes() == lock
    assert (repo / "results" / "metrics.json").read_bytes() == metrics
    store = store_of(repo)
    assert store.runs() == []  # refused before any run


@pytest.mark.e2e  # dvc
def test_corrupt_prepared_data_is_a_clear_error_from_train(reproduced_copy: Path) -> None:
    repo = reproduced_copy
    data = repo / "data" / "dataset.npz"
    truncated = data.read_bytes()[:4096]
    data.unlink()  # the cache holds the good copy; replace the link with a broken file
    data.write_bytes(truncated)
    result = sh(repo, "dvc", "repro", "--single-item", "train", check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "corrupt or truncated" in output and "Traceback" not in output
    assert "RUNNING" not in store_of(repo).statuses()


@pytest.mark.e2e  # dvc
def test_dockerfile_or_lock_change_reruns_train(reproduced_copy: Path) -> None:
    repo = reproduced_copy
    for name in ("Dockerfile.cpu", "requirements.lock", "requirements-extra.lock"):
        path = repo / name
        original = path.read_text()
        path.write_text(original + "# changed\n")
        status = sh(repo, "dvc", "status").stdout
        assert "train:" in status and name in status and "prepare:" not in status
        path.write_text(original)
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout


def test_committed_params_yaml_matches_conf() -> None:
    """The params.yaml in the repository was composed from today's conf/ (else dvc repro stops)."""
    from reprotrain.project import conf_digest

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params["conf_digest"] == conf_digest(ROOT / "conf")
