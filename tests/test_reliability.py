"""Interruption and resume, parallel runs, determinism, reproduction, on sqlite stores. The
scripts' main() runs in this process (conftest.InProcess) unless the process is the point: a
signal's exit code, processes racing for one store, CPU kernels chosen at a process's start, a
server that goes away (e2e)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (
    PYTHON,
    InProcess,
    Store,
    child_env,
    start_training,
    train,
    wait_for_losses,
    with_child_defaults,
)
from teamserver import Gate, free_port, mlflow_server

LONG = [
    "train.steps=1500",
    "train.log_every=10",
    "train.checkpoint_every=500",
    "tracking.flush_every_s=0.2",
    "data.num_samples=2048",
]


@pytest.mark.e2e  # SIGTERM to a training process: its exit code, nothing printed after
def test_sigterm_ends_the_run_killed_and_resume_gives_the_same_losses_bit_for_bit(
    tmp_path: Path, train_here
) -> None:
    """What `docker stop` and dvc send (SIGTERM, to the process alone): exit code 143, no
    traceback, the run KILLED with every step so far sent once and in order, no metrics.json,
    a checkpoint in train.checkpoint_dir; `train.resume=last` continues the same MLflow run to
    the losses of a run never stopped, bit for bit."""
    from reprotrain.tracking import prepare_store

    reference = Store(tmp_path / "ref")
    (tmp_path / "ref").mkdir()
    train_here(tmp_path / "ref", reference, *LONG)
    expected = [value for _, value in reference.losses(reference.only_run().info.run_id)]

    (tmp_path / "b").mkdir()
    store = Store(tmp_path / "b")
    prepare_store(store.uri)  # the schema exists before this test's polling reader opens it
    proc = start_training(tmp_path / "b", store.uri, *LONG)
    try:
        wait_for_losses(store, 100, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr
    stopped = store.only_run()
    assert stopped.info.status == "KILLED"
    steps = [step for step, _ in store.losses(stopped.info.run_id)]
    assert 100 <= len(steps) < 1500 and steps == list(range(1, len(steps) + 1))
    assert not (tmp_path / "b" / "results" / "metrics.json").exists()
    # train.checkpoint_dir (outputs/checkpoints under the working directory), not the results
    checkpoint = tmp_path / "b" / "outputs" / "checkpoints" / f"{stopped.info.run_id}.pt"
    assert checkpoint.is_file()  # written when it stopped: train.resume continues from it
    assert not (tmp_path / "b" / "results" / "checkpoints").exists()

    train_here(tmp_path / "b", store, *LONG, "train.resume=last")
    resumed = store.only_run()  # the same MLflow run, continued
    assert resumed.info.run_id == stopped.info.run_id and resumed.info.status == "FINISHED"
    history = store.losses(resumed.info.run_id)
    assert [step for step, _ in history] == list(range(1, 1501))
    assert [value for _, value in history] == expected


def test_bad_checkpoint_is_a_clear_error(tmp_path: Path, store: Store, train_here) -> None:
    """One trained run, resumed three wrong ways: another config, a run id with no
    checkpoint, then its checkpoint truncated."""
    train_here(tmp_path, store, "experiment=smoke", "train.checkpoint_every=10")
    run_id = store.only_run().info.run_id
    checkpoint = tmp_path / "outputs" / "checkpoints" / f"{run_id}.pt"
    assert checkpoint.is_file()
    resume = ("experiment=smoke", "train.steps=40")
    cases = {
        "was written with another model/optimizer/data/batch config": (
            f"train.resume={run_id}",
            "model.hidden_size=64",
        ),
        "no checkpoint": ("train.resume=0123456789abcdef",),
        "is corrupt or truncated": (f"train.resume={run_id}",),
    }
    for message, overrides in cases.items():
        if message == "is corrupt or truncated":
            checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
        result = train_here(tmp_path, store, *resume, *overrides, check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr, message
        assert message in result.stderr, result.stderr[-2000:]
        assert "RUNNING" not in store.statuses()


def test_resume_without_its_checkpoint_gives_only_advice_that_can_work(tmp_path: Path) -> None:
    """A run id whose checkpoint is not in train.checkpoint_dir: the ids there, if any; where
    there are none, not "give one of those", but where else to look or to start again."""
    from reprotrain.checkpoint import find_checkpoint
    from reprotrain.errors import ConfigError

    for resume in ("0123abcd", "last"):
        with pytest.raises(ConfigError) as empty:
            find_checkpoint(tmp_path / "checkpoints", resume)
        advice = empty.value.one_line()
        assert "one of those" not in advice and "give the run id" not in advice, advice
        assert "set train.checkpoint_dir to the folder that holds" in advice, advice
        assert "start it again without train.resume" in advice, advice
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "feed42.pt").write_bytes(b"")
    with pytest.raises(ConfigError) as other:
        find_checkpoint(tmp_path / "checkpoints", "0123abcd")
    assert "checkpoints in train.checkpoint_dir: feed42; fix: give one of those run ids" in str(
        other.value
    )


@pytest.mark.e2e  # eight processes race to create one store
def test_eight_parallel_runs_on_a_fresh_store(tmp_path: Path) -> None:
    store = Store(tmp_path)  # does not exist yet: the runs race to create it
    procs = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "reprotrain.train",
                *with_child_defaults(
                    [
                        "runtime=local",
                        "experiment=smoke",
                        f"tracking.uri={store.uri}",
                        f"train.output_dir={tmp_path / str(i)}",
                        f"train.seed={i}",
                    ]
                ),
            ],
            cwd=tmp_path,
            env=child_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-2000:]
    runs = store.runs()
    assert len(runs) == 8 and all(r.info.status == "FINISHED" for r in runs)
    assert all(len(store.losses(r.info.run_id)) == 20 for r in runs)


def test_two_cpu_runs_give_identical_losses(tmp_path: Path, train_here) -> None:
    histories = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        store = Store(tmp_path / name)
        train_here(tmp_path / name, store, "device=cpu", "train.steps=100", "data.num_samples=2048")
        run = store.only_run()
        histories.append([value for _, value in store.losses(run.info.run_id)])
        assert run.data.tags["config.hash"] and run.data.tags["data.hash"]
    assert histories[0] == histories[1]


def test_reproduce_reruns_a_past_run_and_reports_a_match(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    here.train(tmp_path, store, "experiment=smoke", "device=cpu")
    run_id = store.only_run().info.run_id
    result = here.module("reproduce", run_id, "--tracking-uri", store.uri)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "losses match bit for bit (20 steps)" in result.stdout
    new = [r for r in store.runs() if r.info.run_id != run_id]
    assert len(new) == 1 and new[0].data.tags["reproduces"] == run_id
    assert new[0].data.tags["reproduced.match"] == "true"


def reproduce(cwd: Path, store: Store, run_id: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "reprotrain.reproduce", run_id, "--tracking-uri", store.uri],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_reproduce_uses_the_thread_count_auto_gave_the_recorded_run(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: the recorded run gets 1, the reproduction could use 2")
    # The recorded run may use one CPU (as under `taskset -c 0`), so train.threads=auto gives
    # it 1 thread; here auto would give 2, and 2 threads sum the smoke run's losses
    # differently from step 4 on.
    os.sched_setaffinity(0, {min(cpus)})
    try:
        here.train(tmp_path, store, "experiment=smoke", "device=cpu", "train.threads=auto")
    finally:
        os.sched_setaffinity(0, cpus)
    recorded = store.only_run()
    assert recorded.data.tags["device.threads"] == "1"
    assert recorded.data.params["train.threads"] == "auto"
    result = here.module("reproduce", recorded.info.run_id, "--tracking-uri", store.uri)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "losses match bit for bit (20 steps)" in result.stdout
    (new,) = [r for r in store.runs() if r.info.run_id != recorded.info.run_id]
    assert new.data.params["train.threads"] == "1" and new.data.tags["device.threads"] == "1"


@pytest.mark.e2e  # ATEN_CPU_CAPABILITY picks torch's CPU kernels as a process starts
def test_reproduce_names_the_cpu_kernels_that_differ_and_the_fix(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    import torch

    # DEFAULT, torch's kernels without vector instructions, runs on every x86 CPU.
    train(
        tmp_path,
        store,
        "experiment=smoke",
        "device=cpu",
        env=child_env(ATEN_CPU_CAPABILITY="default"),
    )
    recorded = store.only_run()
    assert recorded.data.tags["device.cpu_capability"] == "DEFAULT"
    native = torch.backends.cpu.get_cpu_capability()  # this process's kernels
    result = here.module("reproduce", recorded.info.run_id, "--tracking-uri", store.uri)
    if native == "AVX512":  # its sums differ from step 2 (AVX2's may equal DEFAULT's)
        assert result.returncode == 1, result.stdout
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith("reproduce: losses differ from step "), line
        assert "device.cpu_capability ('DEFAULT' recorded, 'AVX512' now)" in line, line
        assert "rerun with ATEN_CPU_CAPABILITY=default" in line, line
        assert "Traceback" not in result.stderr
    fixed = reproduce(tmp_path, store, recorded.info.run_id, ATEN_CPU_CAPABILITY="default")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "losses match bit for bit (20 steps)" in fixed.stdout


def test_machine_differences_say_what_differs_and_skip_what_was_not_recorded() -> None:
    from reprotrain.reproduce import machine_differences

    amd = {"device.type": "cpu", "device.name": "AMD EPYC 7B13", "device.cpu_capability": "AVX2"}
    amd |= {"device.threads": "2", "torch.version": "2.13.0+cpu", "cuda.version": "none"}
    xeon = {**amd, "device.name": "Intel(R) Xeon(R) Processor", "device.cpu_capability": "AVX512"}
    said = machine_differences(amd, xeon)
    assert "device.name ('AMD EPYC 7B13' recorded, 'Intel(R) Xeon(R) Processor' now)" in said
    assert "device.cpu_capability ('AVX2' recorded, 'AVX512' now)" in said
    assert "ATEN_CPU_CAPABILITY=avx2" in said and "torch.version" not in said
    assert machine_differences(amd, amd) == ""
    older = {key: value for key, value in amd.items() if key != "device.cpu_capability"}
    assert machine_differences(older, amd) == ""  # a run from before the tag: nothing to say
    assert "torch.version ('2.12.0' recorded, '2.13.0+cpu' now)" in machine_differences(
        {**amd, "torch.version": "2.12.0"}, amd
    )


def test_reproduce_unknown_run_is_a_clear_error(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    here.train(tmp_path, store, "experiment=smoke")
    result = here.module("reproduce", "0" * 32, "--tracking-uri", store.uri)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "was not found" in result.stderr


@pytest.mark.e2e  # Ctrl-C to a training process's group: its exit code, what it leaves
def test_ctrl_c_ends_the_run_killed_and_writes_no_half_written_outputs(
    tmp_path: Path, store: Store
) -> None:
    """A terminal's Ctrl-C signals the process group: exit code 130, no traceback, the run
    KILLED with every step so far sent once and in order; only finished files in the results
    (no metrics.json, no temporary file) and one checkpoint, this run's."""
    from reprotrain.tracking import prepare_store

    prepare_store(store.uri)  # the schema exists before this test's polling reader opens it
    proc = start_training(
        tmp_path,
        store.uri,
        "train.steps=1000000",
        "train.log_every=10",
        "train.checkpoint_every=500",
        "tracking.flush_every_s=0.2",
        "data.num_samples=2048",
    )
    try:
        wait_for_losses(store, 50, proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    run = store.only_run()
    assert run.info.status == "KILLED"
    steps = [step for step, _ in store.losses(run.info.run_id)]
    assert len(steps) >= 50 and steps == list(range(1, len(steps) + 1))
    results = tmp_path / "results"
    assert not (results / "metrics.json").exists()
    assert not list(results.rglob("*.tmp"))  # only finished files, renamed into place
    checkpoints = tmp_path / "outputs" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [f"{run.info.run_id}.pt"]


# Small steps, frequent flushes: many sends fall inside the outage.
OUTAGE_RUN = (
    "train.log_every=50",
    "tracking.flush_every_s=0.5",
    "data.num_samples=2048",
    "train.checkpoint_every=0",
)


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 over a sqlite store, in its own process group,
    reached through a Gate (teamserver.py): `cut()` is an outage as a crash looks to the
    client, `restore()` ends it at once."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.store = folder, Store(folder)
        self.server_port = free_port()
        self.gate = Gate(self.server_port)
        self.uri = f"http://127.0.0.1:{self.gate.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = mlflow_server(self.server_port, self.store.uri, cwd=self.folder)
        self.gate.open()

    def cut(self) -> None:
        self.gate.close()

    def restore(self) -> None:
        self.gate.open()

    def stop(self) -> None:
        self.gate.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path):
    folder = tmp_path / "server"
    folder.mkdir()
    server = MlflowServer(folder)
    server.start()
    yield server
    server.stop()


@pytest.mark.e2e  # a real `mlflow server`, cut off mid-run
def test_server_gone_mid_run_loses_nothing(tmp_path: Path, server: MlflowServer) -> None:
    steps = 8000  # a run that goes on well past the outage, also on a loaded machine
    proc = start_training(
        tmp_path,
        server.uri,
        f"train.steps={steps}",
        "tracking.log_model=true",
        *OUTAGE_RUN,
    )
    try:
        wait_for_losses(server.store, 200, proc)
        server.cut()
        time.sleep(3)  # flushes fail meanwhile: their points go to the spool
        assert proc.poll() is None, "the run ended during the outage"
        server.restore()
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    run = server.store.only_run()
    assert run.info.status == "FINISHED"
    assert [step for step, _ in server.store.losses(run.info.run_id)] == list(range(1, steps + 1))
    assert "cannot take the run's record now" in stderr  # it said so, once
    assert not list((tmp_path / "results" / "spool").glob("*.jsonl"))
    client = server.store.client  # the MLflow Model, logged once the server was back
    experiment = client.get_experiment_by_name("reprotrain")
    models = client.search_logged_models([experiment.experiment_id])
    assert [m.name for m in models if m.source_run_id == run.info.run_id] == ["model"]


@pytest.mark.e2e  # a real `mlflow server`, away until the run has ended
def test_server_still_away_at_the_end_then_replay(
    tmp_path: Path, server: MlflowServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run ends with its record in the spool. It is not an orphan to kill: `runs --clean`
    leaves it RUNNING and names the replay. The replay sends the rest, ends the run FINISHED,
    removes what a sweep marked on it (here: an earlier reprotrain's sweep, which ended such
    runs KILLED) and the MLflow Model entry a failed attempt left PENDING."""
    from reprotrain import runs

    steps = 3000
    proc = start_training(
        tmp_path,
        server.uri,
        f"train.steps={steps}",
        "tracking.log_model=true",
        *OUTAGE_RUN,
    )
    try:
        wait_for_losses(server.store, 100, proc)
        server.cut()
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "python -m reprotrain.replay" in stderr
    assert "was not logged: the tracking store" in stderr  # the MLflow Model: said, not spooled
    spooled = list((tmp_path / "results" / "spool").glob("*.jsonl"))
    assert len(spooled) == 1
    server.restore()
    runs.main(["--clean", "--tracking-uri", server.uri])
    assert f"left RUNNING; its record waits in {spooled[0]}" in capsys.readouterr().out
    client, run_id = server.store.client, server.store.only_run().info.run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    client.set_tag(run_id, "reprotrain.ended_by", "reprotrain: its process 1 on h is gone")
    client.set_terminated(run_id, "KILLED")
    experiment_id = client.get_run(run_id).info.experiment_id
    client.create_logged_model(experiment_id, source_run_id=run_id, name="model")  # PENDING
    replay = subprocess.run(
        [PYTHON, "-m", "reprotrain.replay", str(spooled[0])],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replay.returncode == 0, replay.stderr[-2000:]
    run = server.store.only_run()
    assert run.info.status == "FINISHED" and "reprotrain.ended_by" not in run.data.tags
    assert [step for step, _ in server.store.losses(run.info.run_id)] == list(range(1, steps + 1))
    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(server.uri).list_artifacts(run.info.run_id)}
    assert {"model.pt", "loss.svg", "config.yaml", "loss.csv"} <= artifacts
    assert not spooled[0].exists()
    assert client.search_logged_models([experiment_id]) == []
