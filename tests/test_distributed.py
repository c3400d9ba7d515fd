"""Data-parallel training under a real torchrun with gloo on the CPU: two processes on one
machine, two "nodes" on 127.0.0.1 through c10d rendezvous, a stop and a resume, a killed
rank, and the bad inputs. Real processes, a real sqlite store (e2e); what needs no torchrun runs
in this process."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir

from conftest import (
    BIN,
    ROOT,
    InProcess,
    Store,
    child_env,
    process_state_kept,
    wait_for_losses,
)
from reprotrain.containers import gpu_count
from reprotrain.distributed import Group, Member, lost_rank
from reprotrain.errors import RuntimeEnvError
from reprotrain.runtime.container import processes
from reprotrain.schema import validate
from reprotrain.tracking import prepare_store

TORCHRUN = str(BIN / "torchrun")
STEPS = 100
# Two ranks of 32 against one process of 64: the same samples in every step; the gradient's
# sum runs in another order, so the losses agree to float rounding, not bit for bit.
LOSS_TOLERANCE = 1e-3  # relative, over STEPS steps (measured: 4e-4 at 100, 7e-4 at 200)
SETTINGS = (
    "device=cpu",
    "runtime=local",
    "train.progress=off",
    "tracking.log_model=false",
    "data.num_samples=4096",
)


def torchrun_args(store: Store, out: Path, *overrides: str, launcher: tuple = ()) -> list[str]:
    return [
        TORCHRUN,
        *(launcher or ("--standalone", "--nproc-per-node=2")),
        "-m",
        "reprotrain.train",
        *SETTINGS,
        f"tracking.uri={store.uri}",
        f"train.output_dir={out}",
        *overrides,
    ]


def torchrun(
    tmp_path: Path, store: Store, out: Path, *overrides: str, launcher: tuple = ()
) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_args(store, out, *overrides, launcher=launcher),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def losses_csv(folder: Path) -> list[float]:
    with (folder / "loss.csv").open() as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=LOSS_TOLERANCE)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The reference: one process with the global batch (64)."""
    folder = tmp_path_factory.mktemp("one")
    store = Store(folder)
    with pytest.MonkeyPatch.context() as monkeypatch, process_state_kept(folder):
        trainer = InProcess(folder, monkeypatch)
        trainer.train(folder, store, *SETTINGS, f"train.steps={STEPS}", "train.batch_size=64")
    return losses_csv(folder / "results")


@pytest.mark.e2e  # torchrun
def test_two_processes_train_one_run_with_the_one_process_losses(
    tmp_path: Path, one_process: list[float]
) -> None:
    store = Store(tmp_path)
    out = tmp_path / "results"
    done = torchrun(tmp_path, store, out, f"train.steps={STEPS}", "train.batch_size=32")
    assert done.returncode == 0, done.stderr[-3000:]
    run = store.only_run()  # one MLflow run for the job, recorded by rank 0
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["dist.world_size"] == "2" and tags["dist.backend"] == "gloo"
    assert tags["dist.global_batch_size"] == "64"
    assert tags["dist.devices"].startswith("0: ") and "; 1: " in tags["dist.devices"]
    recorded = store.losses(run.info.run_id)
    assert [step for step, _ in recorded] == list(range(1, STEPS + 1))
    # The recorded loss is the mean over the ranks: the global batch's loss.
    assert [value for _, value in recorded] == pytest.approx(one_process, rel=LOSS_TOLERANCE)
    assert_same_losses(losses_csv(out), one_process)
    checkpoints = list((tmp_path / "outputs" / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == [f"{run.info.run_id}.pt"]  # written once
    assert done.stderr.count(f"run {run.info.run_id} FINISHED") == 1


@pytest.mark.e2e  # torchrun, two agents
def test_two_nodes_on_localhost_through_c10d_rendezvous(
    tmp_path: Path, one_process: list[float]
) -> None:
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1, as
    two machines would."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = Store(tmp_path)
    out = tmp_path / "results"
    launcher = (
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes",
    )
    args = torchrun_args(
        store, out, f"train.steps={STEPS}", "train.batch_size=32", launcher=launcher
    )
    nodes = [
        subprocess.Popen(args, cwd=tmp_path, env=child_env(), stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-2000:] for e in errors)
    run = store.only_run()
    assert run.info.status == "FINISHED" and run.data.tags["dist.world_size"] == "2"
    assert_same_losses(losses_csv(out), one_process)


@pytest.mark.e2e  # torchrun
def test_sigterm_to_torchrun_ends_killed_with_a_checkpoint_and_resume_finishes(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path)
    prepare_store(store.uri)  # created before the job, not raced by this test's reads
    out = tmp_path / "results"
    steps = ("train.steps=1500", "train.batch_size=32", "tracking.flush_every_s=0.2")
    proc = subprocess.Popen(
        torchrun_args(store, out, *steps),
        cwd=tmp_path,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_losses(store, 100, proc)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it to every rank
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "KILLED", stderr[-3000:]
    assert f"run {run_id} KILLED; continue it with the same command and train.resume={run_id}" in (
        stderr
    )
    assert (tmp_path / "outputs" / "checkpoints" / f"{run_id}.pt").is_file()
    stopped_at = len(store.losses(run_id))
    assert 100 <= stopped_at < 1500

    done = torchrun(tmp_path, store, out, *steps, "train.resume=last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.client.get_run(run_id).info.status == "FINISHED" and len(store.runs()) == 1
    assert [step for step, _ in store.losses(run_id)] == list(range(1, 1501))  # each once


@pytest.mark.e2e  # torchrun, one rank killed
def test_a_killed_rank_fails_the_run_naming_it(tmp_path: Path) -> None:
    store = Store(tmp_path)
    prepare_store(store.uri)  # created before the job, not raced by this test's reads
    proc = subprocess.Popen(
        torchrun_args(store, tmp_path / "results", "train.steps=20000", "train.batch_size=32"),
        cwd=tmp_path,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_losses(store, 50, proc)
    rank1 = next(
        child
        for child in psutil.Process(proc.pid).children(recursive=True)
        if child.environ().get("RANK") == "1"
    )
    rank1.kill()  # SIGKILL: the rank cannot say anything
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    run = store.only_run()
    assert run.info.status == "FAILED", stderr[-3000:]
    error = run.data.tags["error"]
    assert f"rank 1 (pid {rank1.pid}) of the 2-process job stopped answering" in error
    ours = [line for line in stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(ours) == 1 and "rank 1" in ours[0]
    assert 'File "' + str(Path(__file__).parents[1] / "src") not in stderr  # no traceback of ours


def test_a_lost_rank_is_named_once_its_process_has_exited() -> None:
    """The peer's reset can arrive before the killed rank has exited (its sockets close
    first): the rank that saw it waits a moment for a local peer to be gone, and names it."""
    exiting = subprocess.Popen(["sleep", "0.5"])
    here = socket.gethostname()
    group = Group(
        rank=0,
        world_size=2,
        backend="gloo",
        members=(Member(here, os.getpid(), "cpu"), Member(here, exiting.pid, "cpu")),
        active=True,
    )
    try:
        said = lost_rank(group, RuntimeError("[gloo.cc:1] Connection reset by peer")).one_line()
    finally:
        exiting.wait()
    assert said.startswith(f"rank 1 (pid {exiting.pid}) of the 2-process job stopped answering")
    assert "(Connection reset by peer)" in said
    alive = Group(rank=0, world_size=2, members=(group.members[0], group.members[0]))
    assert lost_rank(alive, RuntimeError("Timed out")).one_line().startswith("another rank")


@pytest.mark.e2e  # torchrun
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("train.backend=nccl",),
            "train.backend=nccl but the device is cpu; allowed: nccl on CUDA devices only",
        ),
    ],
)
def test_bad_input_under_torchrun_is_one_line_per_rank(
    tmp_path: Path, overrides: tuple[str, ...], message: str
) -> None:
    """The ranks say the one line and exit 2 before any run exists; torchrun then stops the
    ranks left (one that has not said it yet never will: SIGTERM) and adds its own failure
    summary."""
    store = Store(tmp_path)
    done = torchrun(tmp_path, store, tmp_path / "results", "train.steps=10", *overrides)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert 1 <= len(ours) <= 2 and all(message in line for line in ours), done.stderr[-3000:]
    assert 'File "' + str(Path(__file__).parents[1] / "src") not in done.stderr
    assert not store.path.exists() or not store.runs()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("train.nproc=0",),
            "train.nproc=0",
        ),
        (
            ("train.nproc=2", "runtime=local"),
            "train.nproc=2 but the run trains in this process (runtime=local); allowed: "
            "train.nproc=1 here, any with runtime=docker",
        ),
    ],
)
def test_bad_nproc_is_one_line(
    tmp_path: Path, app_in_process, overrides: tuple[str, ...], message: str
) -> None:
    store = Store(tmp_path)
    done = app_in_process(  # the training script's main() in this process (conftest)
        "runtime=local", f"tracking.uri={store.uri}", "train.steps=10", *overrides
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, lines
    assert not store.path.exists() or not store.runs()


def test_threads_are_shared_among_the_ranks_of_a_machine(
    here: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.threads=auto gives each of torchrun's processes its share of the CPUs (here: a
    rank of two on this machine; the thread count is put back after the test)."""
    import torch

    from reprotrain.devices import available_cpus, set_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    set_threads("auto")
    assert torch.get_num_threads() == max(1, available_cpus() // 2)


def test_more_processes_than_gpus_names_both_numbers() -> None:
    """runtime=docker with the CUDA image: train.nproc beyond the GPUs the host lists is an
    error before any build (this machine lists none)."""
    gpus = gpu_count()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        composed = compose("config", overrides=[f"train.nproc={gpus + 4}", "device=cuda"])
    config = validate(composed)
    with pytest.raises(RuntimeEnvError) as raised:
        processes(config, "cuda")
    line = raised.value.one_line()
    assert f"train.nproc={gpus + 4} but this machine has {gpus} GPU(s)" in line
    assert processes(config, "cpu") == gpus + 4  # the CPU image: as many gloo processes as asked


@pytest.mark.e2e  # torchrun
def test_a_rendezvous_nobody_joins_ends_within_torchruns_join_timeout(tmp_path: Path) -> None:
    """torchrun itself waits `--rdzv-conf join_timeout` for every node, then exits non-zero;
    reprotrain never starts, so no run exists."""
    store = Store(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = (
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=alone",
        "--rdzv-conf=join_timeout=10",
    )
    began = time.monotonic()
    done = torchrun(tmp_path, store, tmp_path / "results", "train.steps=10", launcher=launcher)
    waited = time.monotonic() - began
    assert done.returncode != 0
    assert "RendezvousTimeoutError" in done.stderr, done.stderr[-2000:]
    assert waited < 120, waited
    assert not store.path.exists() or not store.runs()
