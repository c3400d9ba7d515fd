"""The training step as a Hydra app, recorded in MLflow (real torch, real sqlite store). The
app's main() runs in this process (conftest.InProcess); what only a process shows (its age
at start-up) starts one (e2e). Stopping by a signal: test_reliability."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from conftest import PYTHON, ROOT, InProcess, Store, child_env, require_cuda
from reprotrain.outputs import loss_svg
from reprotrain.timing import PHASES, PhaseClock, TimingSummary
from reprotrain.trainer import CheckpointCadence

SMOKE_STEPS = 20  # conf/experiment/smoke.yaml
MLP_PARAMETERS = 784 * 512 + 512 + 512 * 10 + 10  # conf/model/mlp.yaml on the synthetic data


def logged_models(store: Store, run_id: str) -> list:
    """The MLflow Models (MLflow 3 LoggedModels) a run logged."""
    experiment = store.client.get_experiment_by_name("reprotrain")
    found = store.client.search_logged_models([experiment.experiment_id])
    return [m for m in found if m.source_run_id == run_id]


def test_smoke_run_records_every_key(tmp_path: Path, store: Store, train_here) -> None:
    train_here(tmp_path, store, "experiment=smoke", "device=cpu", "tracking.log_model=true")
    run = store.only_run()
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    for key in (
        "device.type",
        "device.name",
        "torch.version",
        "cuda.version",
        "runtime",
        "git.commit",
        "git.dirty",
        "data.hash",
        "config.hash",
        "model.class",
        "optimizer.class",
        "loss.class",
        "model.parameters",
    ):
        assert tags.get(key), key
    assert tags["device.type"] == "cpu" and tags["runtime"] == "local"
    assert tags["device.cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert int(tags["device.threads"]) >= 1
    assert tags["model.class"] == "reprotrain.models.mlp.MLP"
    assert tags["optimizer.class"] == "torch.optim.adamw.AdamW"
    assert tags["loss.class"] == "torch.nn.modules.loss.CrossEntropyLoss"
    assert tags["model.parameters"] == str(MLP_PARAMETERS)
    assert "scheduler.class" not in tags  # scheduler: null by default
    assert run.info.run_name == "mlp-adamw-cpu"
    assert tags["cuda.version"] == "none" or tags["cuda.version"][0].isdigit()
    assert [step for step, _ in store.losses(run.info.run_id)] == list(range(1, SMOKE_STEPS + 1))
    step_ms = store.client.get_metric_history(run.info.run_id, "train/step_ms")
    assert sorted(m.step for m in step_ms) == list(range(5, SMOKE_STEPS + 1, 5))  # per log window
    for key in (
        "time.data_to_device_ms",
        "time.forward_ms",
        "time.backward_ms",
        "time.optimizer_ms",
        "time.total_s",
        "time.startup_s",
        "throughput.samples_per_s",
        "val/loss",
        "val/accuracy",
        "memory.peak_rss_mb",
        "time.tracking_s",
        "time.checkpoint_s",
        "time.outputs_s",
        "train.final_loss",
        "model.parameters",
    ):
        assert key in run.data.metrics, key
    assert run.data.metrics["model.parameters"] == MLP_PARAMETERS
    assert run.data.metrics["train.final_loss"] == store.losses(run.info.run_id)[-1][1]
    params = run.data.params  # the resolved config, flattened
    assert params["optimizer._target_"] == "torch.optim.AdamW"
    assert float(params["optimizer.lr"]) == 1e-3
    assert params["model._target_"] == "reprotrain.models.MLP"
    assert params["model.hidden_size"] == "512" and params["train.steps"] == "20"
    assert params["loss._target_"] == "torch.nn.CrossEntropyLoss"
    assert params["data._target_"] == "reprotrain.data.synthetic"
    artifacts = {a.path for a in store.client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "loss.svg", "model.pt", "loss.csv"} <= artifacts
    assert [m.name for m in logged_models(store, run.info.run_id)] == ["model"]  # MLflow Model
    saved = torch.load(tmp_path / "results" / "model.pt", weights_only=True)
    assert saved["format"] == 3 and saved["num_classes"] == 10
    assert saved["model"] == {
        "_target_": "reprotrain.models.MLP",
        "hidden_size": 512,
        "depth": 1,
        "dropout": 0.0,
        "in_features": 784,  # the data sizes, filled in
        "num_classes": 10,
    }
    assert saved["loss"]["_target_"] == "torch.nn.CrossEntropyLoss"
    assert sum(t.numel() for t in saved["state_dict"].values()) == MLP_PARAMETERS
    headline = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert set(headline) == {
        "run_id",
        "tracking_uri",
        "final_loss",
        "val_loss",
        "val_accuracy",
        "samples_per_s",
        "total_s",
    }
    assert headline["run_id"] == run.info.run_id and headline["tracking_uri"] == store.uri
    metrics = json.loads((tmp_path / "results" / "run.json").read_text())
    assert {k: metrics[k] for k in headline} == headline
    assert metrics["model_class"] == "reprotrain.models.mlp.MLP"
    assert metrics["parameters"] == MLP_PARAMETERS
    for key in ("tracking_s", "checkpoint_s", "outputs_s"):
        assert isinstance(metrics[key], float) and metrics[key] >= 0, key
    assert metrics["startup_s"] < metrics["total_s"], metrics
    # The data are the run's inputs (the run page's Datasets), with MLflow's digests.
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"synthetic-train", "synthetic-val"}
    contexts = {
        n: {t.key: t.value for t in d.tags}["mlflow.data.context"] for n, d in inputs.items()
    }
    assert contexts == {"synthetic-train": "training", "synthetic-val": "validation"}
    assert all(d.dataset.digest for d in inputs.values())
    lines = (tmp_path / "results" / "loss.csv").read_text().splitlines()
    assert lines[0] == "step,loss" and len(lines) == SMOKE_STEPS + 1
    # Every metric and tag of reprotrain's that the run recorded is one the README explains.
    readme = (ROOT / "README.md").read_text()
    recorded = [*run.data.metrics, *(k for k in tags if not k.startswith("mlflow."))]
    undocumented = [key for key in recorded if f"`{key}`" not in readme]
    assert not undocumented, f"recorded but not in the README: {undocumented}"


@pytest.mark.parametrize("data", ["synthetic", "digits"])
def test_loss_falls(tmp_path: Path, store: Store, train_here, data: str) -> None:
    train_here(tmp_path, store, f"data={data}", "train.steps=150", "train.log_every=10")
    losses = [value for _, value in store.losses(store.only_run().info.run_id)]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    metrics = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert metrics["val_accuracy"] > 0.8


def test_overrides_reach_the_run(tmp_path: Path, store: Store, train_here) -> None:
    train_here(
        tmp_path,
        store,
        "experiment=smoke",
        "device=cpu",
        "optimizer=sgd",
        "optimizer.lr=3e-4",
        "model=mlp_wide",
    )
    run = store.only_run()
    params = run.data.params
    assert (
        params["optimizer._target_"] == "torch.optim.SGD" and float(params["optimizer.lr"]) == 3e-4
    )
    assert params["optimizer.momentum"] == "0.9" and params["model.hidden_size"] == "2048"
    assert run.data.tags["optimizer.class"] == "torch.optim.sgd.SGD"
    assert run.data.tags["model.parameters"] == str(784 * 2048 + 2048 + 2048 * 10 + 10)
    assert run.info.run_name == "mlp-sgd-cpu"


def test_cfg_job_prints_the_composed_config(here: InProcess) -> None:
    result = here.app("--cfg", "job", "optimizer=sgd", defaults=False)
    assert result.returncode == 0, result.stderr
    assert "_target_: torch.optim.SGD" in result.stdout and "hidden_size: 512" in result.stdout
    assert "_target_: reprotrain.models.MLP" in result.stdout


def test_tracking_uri_from_environment(
    tmp_path: Path, store: Store, here: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", here.prepare(store).uri)
    result = here.app(
        "runtime=local", "experiment=smoke", f"train.output_dir={tmp_path / 'results'}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert store.only_run().info.status == "FINISHED"


def test_default_store_is_sqlite_at_the_project_root(tmp_path: Path) -> None:
    from reprotrain.project import default_tracking_uri

    project = tmp_path / "proj"
    (project / "conf").mkdir(parents=True)
    (project / "conf" / "config.yaml").write_text("{}\n")
    (project / "sub").mkdir()
    uri = default_tracking_uri(project / "sub")
    assert uri == f"sqlite:///{project.resolve()}/mlflow.db"
    exp_copy = project / ".dvc" / "tmp" / "exps" / "tmpabc"
    (exp_copy / "conf").mkdir(parents=True)
    (exp_copy / "conf" / "config.yaml").write_text("{}\n")
    assert default_tracking_uri(exp_copy) == f"sqlite:///{project.resolve()}/mlflow.db"


def test_progress_lines_when_not_a_terminal(tmp_path: Path, store: Store, train_here) -> None:
    result = train_here(tmp_path, store, "experiment=smoke")
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert lines and lines[-1].startswith(f"step {SMOKE_STEPS}/{SMOKE_STEPS}")
    assert "samples/s" in lines[-1] and "loss" in lines[-1]


def test_outputs_default_to_the_hydra_run_folder(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    """train.output_dir=null: the run's Hydra folder; checkpoints go to train.checkpoint_dir
    (outputs/checkpoints under the working directory), one <run id>.pt per run."""
    result = here.app(
        "runtime=local",
        "experiment=smoke",
        f"tracking.uri={here.prepare(store).uri}",
        "train.checkpoint_every=10",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_id = store.only_run().info.run_id
    written = list((tmp_path / "outputs" / "runs").glob("*/*/metrics.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["run_id"] == run_id
    assert {"model.pt", "loss.csv", "loss.svg", "config.yaml"} <= {
        p.name for p in written[0].parent.iterdir()
    }
    assert f"outputs in {written[0].parent}" in result.stderr
    # The end names the status, run id, the UI command and the run's page.
    experiment_id = store.only_run().info.experiment_id
    assert f"run {run_id} FINISHED in experiment 'reprotrain'" in result.stderr
    assert f"mlflow ui --backend-store-uri {store.uri}" in result.stderr
    link = f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}"
    assert f"{link}?workflowType=machine_learning" in result.stderr
    checkpoints = list((tmp_path / "outputs" / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == [f"{run_id}.pt"]
    state = torch.load(checkpoints[0], weights_only=True)
    assert state["format"] == 4 and state["trainer"]["step"] == SMOKE_STEPS
    assert (
        state["model_class"] == "reprotrain.models.mlp.MLP"
        and state["trainer"]["scheduler"] is None
    )
    assert set(state["trainer"]) == {  # the Trainer's state_dict: nothing of tracking
        "step",
        "epoch",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "python_rng",
        "numpy_rng",
        "torch_rng",
        "cuda_rng",
        "task",
        "callbacks",
        "best",
        "validation",
        "stopped_early",
        "losses",
        "timings",
    }


def test_multirun_groups_runs_under_a_parent(tmp_path: Path, store: Store, here: InProcess) -> None:
    result = here.app(
        "runtime=local",
        f"tracking.uri={here.prepare(store).uri}",
        "--multirun",
        "experiment=smoke",
        "optimizer=adamw,sgd",
        "train.batch_size=16,32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = store.runs()
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.data.tags["sweep.id"] for r in children} == {parent.data.tags["sweep.id"]}
    combos = {
        (r.data.params["optimizer._target_"], r.data.params["train.batch_size"]) for r in children
    }
    assert combos == {
        ("torch.optim.AdamW", "16"),
        ("torch.optim.AdamW", "32"),
        ("torch.optim.SGD", "16"),
        ("torch.optim.SGD", "32"),
    }
    assert all(r.info.status == "FINISHED" for r in children)
    for r in children:  # the class names, then what this job varies
        optimizer = r.data.tags["optimizer.class"].rsplit(".", 1)[1].lower()
        words = r.info.run_name.split()
        assert words[0] == f"mlp-{optimizer}-cpu", r.info.run_name
        assert f"optimizer={optimizer}" in words, r.info.run_name
        assert f"train.batch_size={r.data.params['train.batch_size']}" in words, r.info.run_name
        assert not any(w.startswith(("tracking.", "runtime")) for w in words), r.info.run_name
        assert not any(w.startswith("experiment=") for w in words), r.info.run_name  # not swept
    # train.output_dir=null: each job writes into its own Hydra folder
    written = list((tmp_path / "outputs" / "multirun").glob("*/*/*/metrics.json"))
    assert sorted(json.loads(p.read_text())["run_id"] for p in written) == sorted(
        r.info.run_id for r in children
    )


def test_diverging_loss_ends_failed_with_the_step(tmp_path: Path, store: Store, train_here) -> None:
    result = train_here(
        tmp_path, store, "experiment=smoke", "optimizer=sgd", "optimizer.lr=1e12", check=False
    )
    assert result.returncode != 0
    assert "the loss became" in result.stderr and "Traceback" not in result.stderr
    run = store.only_run()
    assert run.info.status == "FAILED"
    assert "the loss became" in run.data.tags["error"]


def test_nonfinite_warn_records_the_nan_steps_and_finishes(
    tmp_path: Path, store: Store, train_here
) -> None:
    result = train_here(
        tmp_path,
        store,
        "experiment=smoke",
        "optimizer=sgd",
        "optimizer.lr=1e12",
        "train.nonfinite=warn",
    )
    warnings = [line for line in result.stderr.splitlines() if "reprotrain: warning:" in line]
    assert len(warnings) == 1 and "training goes on (train.nonfinite=warn)" in warnings[0]
    run = store.only_run()
    assert run.info.status == "FINISHED"
    losses = [value for _, value in store.losses(run.info.run_id)]
    assert len(losses) == SMOKE_STEPS  # every step logged, the NaN ones included
    nan_steps = sum(value != value for value in losses)
    assert nan_steps > 0 and run.data.metrics["train.nonfinite_steps"] == nan_steps
    metrics = json.loads((tmp_path / "results" / "run.json").read_text())  # strict JSON
    assert metrics["nonfinite_steps"] == nan_steps and metrics["final_loss"] is None


def test_runtime_docker_without_an_engine_is_a_clear_error(
    tmp_path: Path, store: Store, here: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    result = here.app(
        "runtime=docker", "experiment=smoke", f"tracking.uri={store.uri}", defaults=False
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "runtime=docker but Docker is not usable" in result.stderr


def test_runtime_auto_without_an_engine_warns_once_and_trains_here(
    tmp_path: Path, store: Store, here: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    result = here.app(
        "experiment=smoke",
        f"tracking.uri={here.prepare(store).uri}",
        f"train.output_dir={tmp_path / 'results'}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("reprotrain: warning:") == 1
    assert store.only_run().data.tags["runtime"] == "local"


@pytest.mark.gpu
def test_cuda_run_names_the_gpu(tmp_path: Path, store: Store, train_here) -> None:
    require_cuda()
    train_here(tmp_path, store, "experiment=smoke", "device=cuda")
    tags = store.only_run().data.tags
    assert tags["device.type"] == "cuda"
    assert tags["device.name"] == torch.cuda.get_device_name(0)


@pytest.mark.gpu
def test_cuda_out_of_memory_names_batch_and_model(tmp_path: Path, store: Store, train_here) -> None:
    require_cuda()
    result = train_here(
        tmp_path,
        store,
        "experiment=smoke",
        "device=cuda",
        "model.hidden_size=60000000",
        check=False,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "out of memory on cuda:0 at train.batch_size=32" in result.stderr
    assert store.only_run().info.status == "FAILED"


AGE_PROBE = """
import ctypes, os, sys, time
began = time.monotonic()
ctypes.CDLL(None).prctl(15, "tr\u00f6) x (y".encode(), 0, 0, 0)  # PR_SET_NAME: a comm to parse
from reprotrain.timing import process_age_s
time.sleep(0.2)
ran, age = time.monotonic() - began, process_age_s()
sys.stdout.write(f"{ran} {age}\\n")
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.e2e  # a process's age from its own start: a process of its own
def test_process_age_counts_from_the_process_start() -> None:
    """`time.startup_s` and `time.total_s` are the process's age: at least what the process has
    run by its own clock, at most the time since it was spawned (one clock tick allowed, the
    kernel's unit for a start time). psutil's create_time() against the wall clock breaks the
    upper bound by the fraction of a second it drops from the boot time. The probe names
    itself with non-ASCII bytes, ")" and spaces, which /proc/self/stat shows as they are."""
    for _ in range(3):
        spawned = time.monotonic()
        out = subprocess.run(
            [PYTHON, "-c", AGE_PROBE], env=child_env(), capture_output=True, text=True, check=True
        ).stdout
        waited = time.monotonic() - spawned
        ran, age = map(float, out.split())
        assert ran <= age <= waited + 1 / os.sysconf("SC_CLK_TCK"), (ran, age, waited)


class FakeClock:
    """A clock a test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


def test_phase_times_add_up_to_the_step_and_the_warm_up_is_left_out() -> None:
    """Each step's phases are the spans between its marks and add up to the step; steps up to
    the warm-up end are not in the summary, the rest are, whichever length the run has. (The
    run-length comparison on real runs is a benchmark: benchmarks/run_length.py.)"""
    clock = FakeClock()
    phase_clock, summary = PhaseClock(torch.device("cpu"), now=clock), TimingSummary(2)
    spans = {"data_to_device": 1.0, "forward": 2.0, "backward": 3.0, "optimizer": 4.0}
    for step in range(1, 7):
        phase_clock.start_step()
        for phase, ms in spans.items():
            clock.advance(ms * step)  # step k: each phase k times as long
            phase_clock.mark(phase)
        phase_clock.end_step(step)
        clock.advance(50.0)  # between steps (the next batch, a flush): in no phase
        if step % 3 == 0:  # drained once per log window
            for timed_step, phases in phase_clock.drain():
                assert phases["step"] == pytest.approx(sum(phases[p] for p in PHASES))
                assert phases["forward"] == pytest.approx(2.0 * timed_step)
                summary.add(timed_step, phases)
    assert phase_clock.drain() == []
    assert summary.measured_steps == 4  # steps 3-6
    assert summary.mean("step") == pytest.approx(10.0 * (3 + 4 + 5 + 6) / 4)
    assert summary.median("optimizer") == pytest.approx(4.0 * 4.5)
    assert TimingSummary(10).measured_steps == 0  # a run shorter than its warm-up: no figure


def test_system_metrics_are_recorded_by_mlflows_monitor(
    tmp_path: Path, store: Store, train_here
) -> None:
    """tracking.system_metrics (on by default): MLflow's own monitor samples CPU and memory
    into system/* beside training (every 10 s unless MLflow's own variable says otherwise)."""
    env = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"}
    train_here(tmp_path, store, "train.steps=400", "data.num_samples=2048", env=env)
    metrics = store.only_run().data.metrics
    assert "system/cpu_utilization_percentage" in metrics, sorted(metrics)
    assert metrics["system/system_memory_usage_megabytes"] > 0
    first = store.only_run().info.run_id
    train_here(tmp_path, store, "experiment=smoke", "tracking.system_metrics=false", env=env)
    (off,) = [run for run in store.runs() if run.info.run_id != first]
    assert off.data.metrics and not [k for k in off.data.metrics if k.startswith("system/")]


def test_checkpoints_by_steps_and_by_time_within_one_percent() -> None:
    """train.checkpoint_every (steps) is kept as given; train.checkpoint_every_s waits at
    least 100x the last checkpoint's own duration."""
    by_steps = CheckpointCadence(every=10, every_s=0)
    assert not by_steps.due(9) and by_steps.due(10)
    by_steps.saved(10, took_s=5.0)
    assert not by_steps.due(19) and by_steps.due(20)
    by_time = CheckpointCadence(every=0, every_s=0.05)
    assert not by_time.due(1)
    time.sleep(0.06)
    assert by_time.due(2)
    by_time.saved(2, took_s=0.002)  # 100x = 0.2 s, longer than every_s
    time.sleep(0.06)
    assert not by_time.due(3)
    time.sleep(0.16)
    assert by_time.due(4)
    never = CheckpointCadence(every=0, every_s=0)
    time.sleep(0.01)
    assert not never.due(10**6)


def test_loss_svg_keeps_spikes_and_breaks_at_nonfinite_losses() -> None:
    steps = list(range(1, 10_001))
    losses = [1.0 / step for step in steps]
    losses[5000] = 7.5  # one spike among 10,000 points
    losses[7000] = float("nan")
    root = ElementTree.fromstring(loss_svg(steps, losses, "mlp <adamw>"))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2  # broken at the NaN
    points = [p for line in lines for p in line.get("points").split()]
    assert len(points) <= 2 * 700  # at most a low and a high point per pixel column
    assert min(float(p.split(",")[1]) for p in points) == pytest.approx(32.0)  # the spike: top
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "mlp <adamw>" in texts and "7.5" in texts
