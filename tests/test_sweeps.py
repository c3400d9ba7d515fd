"""Sweeps with Hydra's real plugins: the Optuna sweeper, the joblib and submitit_local
launchers. Every job is an MLflow child run under one parent run per --multirun, and a bad
sweep is one line before any job starts. Sweeps whose jobs run in this process run the
training script's main() here (conftest.InProcess); a launcher that starts processes of its
own runs under a real `python -m reprotrain.train` (e2e)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import InProcess, Store, run_app

# The MLflow Model (torch.export) is left out: these tests are about runs and sweeps.
SMOKE = ("runtime=local", "experiment=smoke", "tracking.log_model=false")


def sweep(tmp_path: Path, store: Store, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m reprotrain.train --multirun` in tmp_path; its sweep folder is tmp_path/sweep."""
    return run_app(
        tmp_path,
        "--multirun",
        *SMOKE,
        f"tracking.uri={store.uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *overrides,
        timeout=300,
    )


def parent_and_children(store: Store, jobs: int) -> tuple:
    """The sweep's one parent run and its `jobs` children, all ended FINISHED."""
    runs = store.runs()
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == jobs, [r.info.run_name for r in runs]
    (parent,) = parents
    assert {r.info.status for r in runs} == {"FINISHED"}, [r.info.status for r in runs]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.data.tags["sweep.id"] for r in children} == {parent.data.tags["sweep.id"]}
    return parent, children


def test_optuna_sweep_reports_the_best_trial_on_the_parent_run(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    result = here.app(  # its trials run in this process (Hydra's basic launcher)
        "--multirun",
        *SMOKE,
        f"tracking.uri={here.prepare(store).uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=interval(1e-4,1e-1)",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parent, trials = parent_and_children(store, jobs=4)
    lrs = [float(r.data.params["optimizer.lr"]) for r in trials]
    assert all(1e-4 <= lr <= 1e-1 for lr in lrs) and len(set(lrs)) == 4, lrs

    found = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    best = min(trials, key=lambda r: r.data.metrics["val/loss"])
    assert found["best_value"] == pytest.approx(best.data.metrics["val/loss"], rel=1e-9)
    assert found["best_params"]["optimizer.lr"] == pytest.approx(
        float(best.data.params["optimizer.lr"]), rel=1e-9
    )
    assert parent.data.metrics["sweep/best_value"] == pytest.approx(found["best_value"])
    assert float(parent.data.tags["sweep.best.optimizer.lr"]) == pytest.approx(
        found["best_params"]["optimizer.lr"]
    )
    assert parent.data.tags["sweep.sweeper"] == "optuna"
    artifacts = [a.path for a in store.client.list_artifacts(parent.info.run_id)]
    assert "optimization_results.yaml" in artifacts, artifacts


# The sweep syntaxes Hydra's basic sweeper enumerates, each job checked and run: a plain
# list of a group's options, glob over them, and choice, range, sort, shuffle and tag (one
# value each, so that each sweep stays two jobs). interval: the Optuna test.
LAUNCHERS = {
    # jobs in the worker processes of joblib's loky pool
    "joblib": (
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
        [
            "optimizer=adamw,sgd",
            "optimizer.weight_decay=choice(0.0)",
            "train.seed=range(1,2)",
            "train.steps=sort(range(12,13))",
            "data.seed=shuffle(choice(3))",
            "optimizer.lr=tag(small,choice(0.002))",
        ],
        {"optimizer.weight_decay": "0.0", "train.seed": "1", "train.steps": "12", "data.seed": "3"},
    ),
    # one process per job, started by submitit
    "submitit_local": (
        ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"],
        ["optimizer=glob(adam*)"],  # adam, adamw
        {},
    ),
}


@pytest.mark.e2e  # the launchers start processes of their own (loky workers, submitit jobs)
@pytest.mark.parametrize(("launcher", "jobs", "params"), LAUNCHERS.values(), ids=list(LAUNCHERS))
def test_parallel_launcher_jobs_finish_under_one_parent_each_in_its_folder(
    tmp_path: Path, store: Store, launcher: list[str], jobs: list[str], params: dict[str, str]
) -> None:
    result = sweep(tmp_path, store, *launcher, *jobs)
    assert result.returncode == 0, result.stderr[-3000:]
    parent, children = parent_and_children(store, jobs=2)
    assert parent.data.tags["sweep.launcher"] == launcher[0].split("=")[1]
    assert len({optimizer_of(r) for r in children}) == 2, "one job per optimizer"
    for run in children:
        assert {k: run.data.params[k] for k in params} == params
    # train.output_dir defaults to Hydra's job folder: each job writes its own results.
    written = [tmp_path / "sweep" / str(num) / "metrics.json" for num in (0, 1)]
    missing = [str(path) for path in written if not path.is_file()]
    assert not missing, f"no metrics.json in {missing}"


def optimizer_of(run) -> str:
    tags, params = run.data.tags, run.data.params
    return (
        tags.get("optimizer.class") or params.get("optimizer._target_") or params["optimizer.name"]
    )


def write_preset(folder: Path, space: dict[str, str]) -> Path:
    """An experiment preset in a folder of the user's, setting hydra.sweeper.params."""
    preset = folder / "user_conf" / "experiment" / "space.yaml"
    preset.parent.mkdir(parents=True)
    body = yaml.safe_dump({"hydra": {"sweeper": {"params": space}}})
    preset.write_text("# @package _global_\n" + body)
    return preset.parent.parent


BAD_SWEEPS = {
    # overrides: substrings of the one-line message
    "unknown key in interval": (
        ["hydra/sweeper=optuna", "optimizer.lrr=interval(1e-4,1e-2)"],
        ["'optimizer.lrr' is not a config key", "given 'optimizer.lrr=interval(1e-4,1e-2)'"],
    ),
    "unknown key in choice": (
        ["optimizer.lrr=choice(0.1,0.01)"],
        ["'optimizer.lrr' is not a config key", "given 'optimizer.lrr=choice(0.1,0.01)'"],
    ),
    "out of range in a list": (["optimizer.lr=0.1,-1"], ["optimizer.lr=-1", "out of range"]),
    "optuna database storage": (
        ["hydra/sweeper=optuna", "hydra.sweeper.storage=sqlite:///optuna.db"],
        ["hydra.sweeper.storage='sqlite:///optuna.db'", "leave hydra.sweeper.storage null"],
    ),
    "a SLURM sweep without sbatch": (
        ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "optimizer=adamw,sgd"],
        ["hydra/launcher=slurm submits jobs with SLURM's sbatch", "hydra/launcher=submitit_local"],
    ),
    "unknown key in a preset's search space": (
        ["--config-dir", "{user_conf}", "experiment=space"],
        [
            "'optimizer.lrr' is not a config key",
            "given 'optimizer.lrr=interval(0.0001,0.01)' in hydra.sweeper.params",
        ],
    ),
}


@pytest.mark.parametrize(("overrides", "expected"), BAD_SWEEPS.values(), ids=BAD_SWEEPS.keys())
def test_bad_sweep_is_one_line_before_any_run(
    tmp_path: Path, store: Store, app_in_process, overrides: list[str], expected: list[str]
) -> None:
    user_conf = write_preset(tmp_path, {"optimizer.lrr": "interval(0.0001,0.01)"})
    overrides = [o.format(user_conf=user_conf) for o in overrides]
    result = app_in_process(  # the training script's main() in this process (conftest)
        "--multirun",
        *SMOKE,
        f"tracking.uri={store.uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *overrides,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert all(part in errors[0] for part in expected), errors[0]
    assert "Traceback" not in result.stderr
    assert not store.path.exists(), "the check runs before anything opens the MLflow store"


@pytest.mark.e2e  # submitit starts each job's two tasks as processes
def test_a_sweep_job_of_two_tasks_trains_data_parallel_as_one_child_run(
    tmp_path: Path, store: Store
) -> None:
    """hydra-submitit-launcher's tasks_per_node=2 (submitit_local here, a SLURM allocation on
    a cluster): each job's two tasks join one gloo group through submitit's own helper, and
    the job is one child run of the sweep, named by what the sweep varies."""
    result = sweep(
        tmp_path,
        store,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.tasks_per_node=2",
        "optimizer=adamw,sgd",
        "train.batch_size=16",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, children = parent_and_children(store, jobs=2)
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags["dist.world_size"] == "2" and run.data.tags["dist.backend"] == "gloo"
        assert run.data.tags["dist.global_batch_size"] == "32"
        optimizer = optimizer_of(run).rsplit(".", 1)[-1].lower()
        assert run.info.run_name == f"mlp-{optimizer}-cpu optimizer={optimizer}", run.info.run_name


@pytest.mark.skipif(shutil.which("sbatch") is not None, reason="this machine has SLURM")
def test_the_slurm_launcher_config_composes_with_what_a_site_fills_in(here: InProcess) -> None:
    result = here.app(
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.gpus_per_node=4",
        "hydra.launcher.tasks_per_node=4",
        "--cfg",
        "hydra",
        "-p",
        "hydra.launcher",
        defaults=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    launcher = yaml.safe_load(result.stdout)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert launcher["partition"] == "gpu" and launcher["tasks_per_node"] == 4
    assert launcher["gpus_per_node"] == 4 and launcher["timeout_min"] == 60
