"""Nothing lost: kill -9 at any moment, a store another process holds locked or deletes,
damaged spool files, planted secrets (real processes, signals, sqlite stores and servers). What
follows a kill (`runs --clean`, a resume, a replay) runs its main() in this process
(conftest.InProcess); the killed run, a lock held by another process and the servers are real
(e2e)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import (
    PYTHON,
    ROOT,
    InProcess,
    Store,
    _capability_skip,
    child_env,
    kill_trainer,
    require_docker,
    start_training,
    train,
    train_args,
    wait_for,
    wait_for_losses,
)
from reprotrain.containers import ensure_image
from reprotrain.tracking.orphans import START_AGAIN, checkpoint_of, what_next
from test_reliability import OUTAGE_RUN, MlflowServer

KILLABLE = [
    "train.steps=1500",
    "train.log_every=10",
    "train.checkpoint_every=100",
    "train.progress=lines",
    "tracking.flush_every_s=0.5",
    "data.num_samples=2048",
]


def ready_store(folder: Path) -> Store:
    """A store whose schema exists before a child and this test both open it (the test's
    reads would otherwise race the child's creation of the tables)."""
    from reprotrain.tracking import prepare_store

    store = Store(folder)
    prepare_store(store.uri)
    return store


def module(cwd: Path, name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m reprotrain.<name> ARGS` in cwd."""
    return subprocess.run(
        [PYTHON, "-m", f"reprotrain.{name}", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def steps_recorded(store: Store, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted(m.step for m in store.client.get_metric_history(run_id, key))


def dead_pid() -> int:
    """A PID that belonged to a process that has ended."""
    pid = os.fork()
    if pid == 0:  # the child ends at once, running nothing
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.e2e  # kill -9 of a training process's group
def test_sigkill_then_clean_says_resume_or_start_again_and_resume_records_every_step_once(
    tmp_path: Path, here: InProcess
) -> None:
    """Two runs killed with SIGKILL (to the whole group: docker kill, a cgroup OOM), left
    RUNNING: one past a checkpoint with points sent after it, one before its first
    checkpoint. `reprotrain.runs` lists them as orphaned and changes nothing; `--clean` ends
    both KILLED, saying to continue the first with train.resume=<id> and to start the second
    again (it names its checkpoint folder, `reprotrain.checkpoint_dir`, and has none there).
    The resume then records every step exactly once."""
    store = ready_store(tmp_path)
    killed = {}
    early = ("train.steps=3000", "train.checkpoint_every=0", "train.checkpoint_every_s=3600")
    for name, overrides, losses in [
        ("checkpointed", KILLABLE, 350),  # past a checkpoint, with points sent after it
        # Points sent every 0.5 s: the kill comes long before its last step. An experiment of
        # its own: opening a run of the first one's would find that one gone and end it.
        ("early", (*early, "tracking.flush_every_s=0.5", "tracking.experiment=early"), 100),
    ]:
        experiment = "early" if name == "early" else "reprotrain"
        proc = start_training(
            tmp_path, store.uri, *overrides, f"train.output_dir={tmp_path / name}"
        )
        try:
            wait_for_losses(store, losses, proc, experiment=experiment)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        (run,) = store.runs(experiment)
        killed[name] = run.info.run_id
    run_id, early_id = killed["checkpointed"], killed["early"]

    def statuses() -> list[str]:
        return [store.client.get_run(r).info.status for r in (run_id, early_id)]

    assert statuses() == ["RUNNING", "RUNNING"]  # what kill -9 leaves
    folder = tmp_path / "outputs" / "checkpoints"
    early_run = store.client.get_run(early_id)
    assert early_run.data.tags["reprotrain.checkpoint_dir"] == str(folder.resolve())
    assert not (folder / f"{early_id}.pt").exists()

    listed = here.module("runs", "--tracking-uri", store.uri)
    assert listed.returncode == 0, listed.stderr
    assert f"{run_id}" in listed.stdout and "orphaned" in listed.stdout
    assert statuses() == ["RUNNING", "RUNNING"]  # listing changes nothing
    cleaned = here.module("runs", "--clean", "--tracking-uri", store.uri)
    assert cleaned.returncode == 0, cleaned.stderr
    assert f"continue it with the same command and train.resume={run_id}" in cleaned.stdout
    (line,) = [line for line in cleaned.stdout.splitlines() if line.startswith(early_id)]
    assert "marked KILLED; it was killed before its first checkpoint" in line, line
    assert "train.resume=" not in line, line
    for ended in (run_id, early_id):
        run = store.client.get_run(ended)
        assert run.info.status == "KILLED" and "is gone" in run.data.tags["reprotrain.ended_by"]

    out = f"train.output_dir={tmp_path / 'checkpointed'}"
    resumed = here.train(tmp_path, store, *KILLABLE, out, f"train.resume={run_id}")
    assert "Traceback" not in resumed.stderr
    run = store.client.get_run(run_id)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert steps_recorded(store, run_id) == list(range(1, 1501))  # each step exactly once
    windows = steps_recorded(store, run_id, "train/step_ms")
    assert len(windows) == len(set(windows))  # no window's point twice either
    csv_losses = (tmp_path / "checkpointed" / "loss.csv").read_text().splitlines()[1:]
    assert [float(line.split(",")[1]) for line in csv_losses] == pytest.approx(
        [value for _, value in store.losses(run_id)], rel=1e-5
    )  # loss.csv keeps 6 significant digits


@pytest.mark.e2e  # kill -9 of the training process
def test_the_next_run_ends_a_killed_run_killed_and_resume_records_every_step_once(
    tmp_path: Path, train_here
) -> None:
    """kill -9 of the training process (the OOM killer picks the largest) leaves its run
    RUNNING; the next run of the experiment, as it opens, finds its process gone and ends it
    KILLED saying why; a resume then records every step once."""
    store = ready_store(tmp_path)
    proc = start_training(tmp_path, store.uri, *KILLABLE)
    wait_for_losses(store, 350, proc)
    kill_trainer(proc)
    run_id = store.only_run().info.run_id
    assert store.only_run().info.status == "RUNNING"  # what kill -9 leaves

    train_here(tmp_path, store, "experiment=smoke", f"train.output_dir={tmp_path / 'next'}")
    killed = store.client.get_run(run_id)
    assert killed.info.status == "KILLED"
    assert f"its process {proc.pid} on " in killed.data.tags["reprotrain.ended_by"]
    resumed = train_here(tmp_path, store, *KILLABLE, f"train.resume={run_id}")
    assert "Traceback" not in resumed.stderr
    run = store.client.get_run(run_id)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert steps_recorded(store, run_id) == list(range(1, 1501))


@pytest.mark.e2e  # kill -9 of the training process in its final phase
def test_sigkill_in_the_final_phase_is_finished_by_resume_without_training(
    tmp_path: Path, train_here
) -> None:
    store = ready_store(tmp_path)
    out = tmp_path / "results"
    out.mkdir()
    namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    stale = out / f".model.pt.{namespace}-{dead_pid()}.x1y2z3.tmp"  # a killed write's leftover
    stale.write_bytes(b"half")
    logged = (*KILLABLE, "tracking.log_model=true")  # the final phase logs the MLflow Model
    proc = start_training(tmp_path, store.uri, *logged)
    wait_for(out / "config.yaml", proc)  # the final phase's first output
    kill_trainer(proc)
    assert not (out / "metrics.json").exists()  # killed before the end
    run_id = store.only_run().info.run_id

    finished = train_here(tmp_path, store, *logged, "train.resume=last")
    assert not re.search(r"step \d+/1500", finished.stderr)  # no step trained again
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert steps_recorded(store, run_id) == list(range(1, 1501))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run_id"] == run_id and metrics["samples_per_s"] > 0  # the killed try's
    assert not stale.exists() and not list(out.glob(".*.tmp"))
    experiment = store.client.get_experiment_by_name("reprotrain").experiment_id
    models = store.client.search_logged_models([experiment])
    assert [m.name for m in models if m.source_run_id == run_id] == ["model"]

    again = train_here(tmp_path, store, *logged, "train.resume=last", check=False)
    assert (
        again.returncode == 2 and "is FINISHED" in again.stderr and "Traceback" not in again.stderr
    )


def test_the_checkpoint_is_checked_only_where_this_host_sees_its_folder(tmp_path: Path) -> None:
    """A run's checkpoint is looked for by a process on its host, or for a container that
    this host's launcher started (it mounts the folder at the same path); elsewhere the
    folder is not this host's, and the advice stays "continue it"."""
    here = socket.gethostname()
    folder = {"reprotrain.checkpoint_dir": str(tmp_path)}
    container = {**folder, "reprotrain.host": "0123abcd", "reprotrain.container": "reprotrain-x"}
    seen = {
        "local here": {**folder, "reprotrain.host": here},
        "local elsewhere": {**folder, "reprotrain.host": f"{here}-other"},
        "container launched here": {**container, "reprotrain.launcher_host": here},
        "container launched elsewhere": {**container, "reprotrain.launcher_host": "other"},
        "container, launcher unknown": container,
        "no folder recorded": {"reprotrain.host": here},
    }
    expected = {"local here", "container launched here"}
    for case, tags in seen.items():
        checkpoint = checkpoint_of("r1", tags)
        assert (checkpoint == tmp_path / "r1.pt") == (case in expected), case
        advice = what_next("r1", checkpoint)
        assert (advice == START_AGAIN) == (case in expected), case
    (tmp_path / "r1.pt").write_bytes(b"x")
    assert "train.resume=r1" in what_next("r1", checkpoint_of("r1", seen["local here"]))


def test_live_and_foreign_runs_are_left_running(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    """Only a provably gone owner ends a run: this live process's run and another host's
    stay RUNNING; a dead PID on this host, or a reused one, end KILLED."""
    from reprotrain.tracking import ensure_experiment, owner_tags

    client = store.client
    experiment = ensure_experiment(client, "reprotrain")
    live = owner_tags()
    cases = {
        "live": live,
        "other-host": {**live, "reprotrain.host": "elsewhere.example"},
        "dead": {**live, "reprotrain.pid": str(dead_pid())},
        "reused": {**live, "reprotrain.pid_started": "1000.00"},
        "untagged": {},
    }
    ids = {
        name: client.create_run(experiment, run_name=name, tags=tags).info.run_id
        for name, tags in cases.items()
    }
    result = here.module("runs", "--clean", "--tracking-uri", store.uri)
    assert result.returncode == 0, result.stderr
    status = {name: client.get_run(run_id).info.status for name, run_id in ids.items()}
    assert status == {
        "live": "RUNNING",
        "other-host": "RUNNING",
        "dead": "KILLED",
        "reused": "KILLED",
        "untagged": "RUNNING",
    }
    assert "runs: 5 RUNNING" in result.stdout and "2 marked KILLED" in result.stdout


@pytest.mark.docker
def test_container_runs_are_ended_only_once_launcher_and_container_are_gone(
    tmp_path: Path, store: Store
) -> None:
    """A container run, as its launcher creates it: owned by the launcher until the container
    tags itself, naming the container it is about to start. The cleaner asks this host's
    engine only about containers this host launched, and ends a run whose container the
    engine does not have, or never started, only once the launcher is gone too."""
    require_docker()
    from reprotrain.tracking import ensure_experiment, owner_tags

    image = ensure_image("cpu", ROOT).tag
    here = socket.gethostname()
    token = os.urandom(4).hex()
    running, created, exited = (f"reprotrain-test-{kind}-{token}" for kind in ("r", "c", "e"))

    def docker(*args: str) -> None:
        subprocess.run(["docker", "container", *args], check=True, capture_output=True)

    offline = ("--network", "none")
    try:
        docker("run", "-d", "--rm", *offline, "--name", running, image, "sleep", "300")
        docker("create", *offline, "--name", created, image, "true")
        docker("run", *offline, "--name", exited, image, "true")
        launcher = owner_tags()  # this process plays the launcher
        gone = {**launcher, "reprotrain.pid": str(dead_pid())}
        missing = f"reprotrain-test-m-{token}"

        def run(owner: dict[str, str], name: str, host: str = here) -> dict[str, str]:
            return {**owner, "reprotrain.container": name, "reprotrain.launcher_host": host}

        cases = {
            "starting": run(launcher, missing),  # the launcher has not started it yet
            "launcher gone before the start": run(gone, missing),
            "launched from another host": run(gone, missing, "elsewhere.example"),
            "launcher gone, container training": run(gone, running),
            "launcher gone, container created": run(gone, created),
            "container stopped": run(launcher, exited),
        }
        client = store.client
        experiment = ensure_experiment(client, "reprotrain")
        ids = {
            name: client.create_run(experiment, run_name=name, tags=tags).info.run_id
            for name, tags in cases.items()
        }
        result = module(tmp_path, "runs", "--clean", "--tracking-uri", store.uri)
    finally:
        subprocess.run(["docker", "rm", "-f", running, created, exited], capture_output=True)
    assert result.returncode == 0, result.stderr
    status = {name: client.get_run(run_id).info.status for name, run_id in ids.items()}
    assert status == {
        "starting": "RUNNING",
        "launcher gone before the start": "KILLED",
        "launched from another host": "RUNNING",
        "launcher gone, container training": "RUNNING",
        "launcher gone, container created": "KILLED",
        "container stopped": "KILLED",
    }
    ended_by = {
        name: client.get_run(ids[name]).data.tags["reprotrain.ended_by"]
        for name, value in status.items()
        if value == "KILLED"
    }
    assert (
        f"its container reprotrain-test-m-{token} is gone"
        in ended_by["launcher gone before the start"]
    )
    assert (
        f"its container {created} was never started" in ended_by["launcher gone, container created"]
    )
    assert f"its container {exited} has stopped" in ended_by["container stopped"]


@pytest.mark.e2e  # a second run while another process trains into the same folder
def test_two_runs_sharing_an_output_folder_are_warned(tmp_path: Path, train_here) -> None:
    store = ready_store(tmp_path)
    first = start_training(
        tmp_path, store.uri, "train.steps=1000000", *KILLABLE[1:]
    )  # killed below
    try:
        wait_for_losses(store, 50, first)
        second = train_here(tmp_path, store, "experiment=smoke")  # the same results/ folder
    finally:
        first.kill()
        first.wait(timeout=30)
    assert f"train.output_dir='{tmp_path / 'results'}' is in use by another run" in second.stderr
    assert f"pid {first.pid}" in second.stderr


def hold_write_lock(db: Path, seconds: float, locked: threading.Event) -> None:
    connection = sqlite3.connect(db, isolation_level=None, timeout=60)
    connection.execute("BEGIN EXCLUSIVE")  # what another tool writing to the store does
    locked.set()
    time.sleep(seconds)
    connection.execute("COMMIT")
    connection.close()


@pytest.mark.e2e  # a training process, and a lock held past sqlite's 20 s busy timeout
def test_store_locked_by_another_process_loses_nothing(tmp_path: Path) -> None:
    store = ready_store(tmp_path)
    steps = ["train.steps=6000", *KILLABLE[1:]]
    proc = start_training(tmp_path, store.uri, *steps)
    wait_for_losses(store, 200, proc)
    locked = threading.Event()
    holder = threading.Thread(target=hold_write_lock, args=(store.path, 25, locked))
    holder.start()
    locked.wait(30)
    assert proc.poll() is None, "the run ended before the store was locked"
    holder.join()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-5000:]
    assert stderr.count("database is locked") == 1  # said once
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert steps_recorded(store, run.info.run_id) == list(range(1, 6001))


@pytest.mark.e2e  # the store deleted under a training process
def test_store_deleted_mid_run_keeps_the_record_and_says_how_to_send_it(
    tmp_path: Path, here: InProcess
) -> None:
    store = ready_store(tmp_path)
    steps = ["train.steps=4000", *KILLABLE[1:]]
    proc = start_training(tmp_path, store.uri, *steps)
    wait_for_losses(store, 200, proc)
    run_id = store.only_run().info.run_id
    store.path.unlink()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-5000:]
    spooled = tmp_path / "results" / "spool" / f"{run_id}.jsonl"
    assert f"python -m reprotrain.replay {spooled}" in stderr
    assert spooled.is_file() and (tmp_path / "results" / "metrics.json").is_file()
    replay = here.module("replay", str(spooled))  # the store now lacks the run
    assert replay.returncode == 2 and "Traceback" not in replay.stderr
    assert f"to run {run_id}" in replay.stderr and "fix:" in replay.stderr
    assert spooled.is_file()  # nothing was sent: nothing left the file


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 16 MiB tmpfs to hold a store, filled up mid-run (mounting needs root, as CI has)."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        _capability_skip(f"a full store needs a small tmpfs; mount failed: {mount.stderr.strip()}")
    try:
        yield folder
    finally:  # lazily: this process's MLflow client may still hold the store open
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.mark.e2e  # a training process whose store's disk fills up
def test_store_on_a_full_disk_spools_then_replays_every_step_once(
    tmp_path: Path, small_disk: Path, here: InProcess
) -> None:
    store = ready_store(small_disk)
    steps = ["train.steps=4000", *KILLABLE[1:]]
    proc = start_training(tmp_path, store.uri, *steps)
    wait_for_losses(store, 200, proc)
    run_id = store.only_run().info.run_id
    filler = small_disk / "filler"
    with open(filler, "wb") as handle:  # every byte left, as another writer would take it
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-5000:]
    spooled = tmp_path / "results" / "spool" / f"{run_id}.jsonl"
    assert f"python -m reprotrain.replay {spooled}" in stderr
    filler.unlink()  # room again
    replay = here.module("replay", str(spooled))
    assert replay.returncode == 0, replay.stderr
    run = store.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert steps_recorded(store, run_id) == list(range(1, 4001))


@pytest.mark.parametrize(
    "damage,expected",
    [
        ("cut-last-line", "sent 3 metric points"),
        ("garbage-line", "line 3, is not a spool record"),
        ("bad-header", "has no valid header"),
    ],
)
def test_damaged_spool_file(
    tmp_path: Path, store: Store, here: InProcess, damage: str, expected: str
) -> None:
    from reprotrain.tracking import Spool, ensure_experiment

    client = store.client
    run_id = client.create_run(ensure_experiment(client, "reprotrain")).info.run_id
    spool = Spool(tmp_path / f"{run_id}.jsonl", store.uri, run_id)
    spool.append({"metrics": [["train/loss", 1.0 / s, 1_000 + s, s] for s in (1, 2, 3)]})
    spool.append({"metrics": [["train/loss", 0.2, 2_000, 4]]})
    text = spool.path.read_text()
    lines = text.splitlines(keepends=True)
    if damage == "cut-last-line":  # what a kill during an append leaves
        spool.path.write_text(text[:-9])
    elif damage == "garbage-line":
        spool.path.write_text(lines[0] + lines[1] + "\x00\x01 not json\n" + lines[2])
    else:
        spool.path.write_text("nonsense\n" + "".join(lines[1:]))
    result = here.module("replay", str(spool.path))
    assert "Traceback" not in result.stderr
    if damage == "cut-last-line":
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout and "was cut short" in result.stderr
        assert [s for s, _ in store.losses(run_id)] == [1, 2, 3]
    else:
        assert result.returncode == 2 and expected in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_spool_is_replayed_by_name_and_a_folder_is_one_line_naming_its_spools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from reprotrain import replay

    folder = tmp_path / "spool"
    folder.mkdir()
    for name in ("b.jsonl", "a.jsonl"):
        (folder / name).write_text("{}\n")
    for given, said in [
        (folder, f"{str(folder)!r} is a folder, not a spool file; spool files there: a.jsonl, "),
        (tmp_path, "spool files there: none; fix: a spool is removed once everything in it"),
        (tmp_path / "gone.jsonl", "does not exist; fix: a spool is removed once everything"),
    ]:
        with pytest.raises(SystemExit) as stop:
            replay.main([str(given)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1 and said in lines[0], lines


def test_a_run_killed_while_its_store_was_away_is_left_for_replay_then_marked_killed(
    tmp_path: Path, store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 during an outage leaves a spool without the run's end: `runs --clean` (and the
    next run's sweep) leave the run RUNNING and name the replay; the replay sends its points,
    then marks it KILLED with the advice any orphan gets (here: no checkpoint, start again)."""
    from reprotrain import replay, runs
    from reprotrain.tracking import Spool, ensure_experiment, owner_tags, prepare_store, sweep

    prepare_store(store.uri)
    client = store.client
    spool_folder = tmp_path / "results" / "spool"
    tags = {
        **owner_tags(),
        "reprotrain.pid": str(dead_pid()),
        "reprotrain.spool_dir": str(spool_folder),
        "reprotrain.checkpoint_dir": str(tmp_path / "checkpoints"),
    }
    run_id = client.create_run(ensure_experiment(client, "reprotrain"), tags=tags).info.run_id
    spool = Spool(spool_folder / f"{run_id}.jsonl", store.uri, run_id)
    spool.append({"metrics": [["train/loss", 1.0 / s, 1_000 + s, s] for s in range(1, 51)]})

    runs.main(["--clean", "--tracking-uri", store.uri])
    listed = capsys.readouterr().out
    assert f"left RUNNING; its record waits in {spool.path}: send it" in listed, listed
    assert f"python -m reprotrain.replay {spool.path}" in listed and "0 marked KILLED" in listed
    sweep(client, [client.get_run(run_id).info.experiment_id])  # as the next run opens
    swept = capsys.readouterr().err
    assert f"is RUNNING and its process {tags['reprotrain.pid']} on " in swept, swept
    assert f"python -m reprotrain.replay {spool.path}" in swept
    assert client.get_run(run_id).info.status == "RUNNING"

    replay.main([str(spool.path)])
    said = capsys.readouterr().out
    assert "sent 50 metric points" in said and "marked KILLED; " + START_AGAIN in said, said
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and "is gone" in run.data.tags["reprotrain.ended_by"]
    assert steps_recorded(store, run_id) == list(range(1, 51)) and not spool.path.exists()


def test_resume_of_a_run_not_in_the_store_fails_before_training(tmp_path: Path, train_here) -> None:
    first = Store(tmp_path / "a")
    (tmp_path / "a").mkdir()
    train_here(tmp_path, first, "experiment=smoke", "train.checkpoint_dir=ck")
    other = Store(tmp_path / "b")
    (tmp_path / "b").mkdir()
    result = train_here(
        tmp_path, other, "experiment=smoke", "train.checkpoint_dir=ck", "train.steps=40",
        "train.resume=last", check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not in the tracking store" in result.stderr and "step 1/" not in result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e  # a real `mlflow server`, away mid-run
def test_passwords_reach_no_line_and_no_file_on_any_path(tmp_path: Path, here: InProcess) -> None:
    """A password in tracking.uri and one in MLFLOW_TRACKING_PASSWORD are sent to the server
    and reach no printed line, param, tag or file (spool, logs, .hydra/, artifacts,
    checkpoints, the store), on every path: a server that does not answer at the start, one
    that goes away mid-run and is still away at the end, and the replay, which takes the
    password from the environment (the spool keeps `***`, mode 0600)."""
    folder = tmp_path / "server"
    folder.mkdir()
    server = MlflowServer(folder)
    server.start()
    # Passwords as people write them: an @ and a : raw in the URI (its user information runs
    # to its last @), a / %-encoded (raw, it would end the host); raw in the environment.
    in_uri, in_env = "pl@nted:s3cr3t%2F0b7e", "pl@nted-env:pw/5c1d"
    password = {"MLFLOW_TRACKING_USERNAME": "ci", "MLFLOW_TRACKING_PASSWORD": in_env}
    with_password = child_env(**password)
    uri = server.uri.replace("http://", f"http://ci:{in_uri}@")
    try:
        nowhere = f"tracking.uri=http://ci:{in_uri}@127.0.0.1:{free_port()}"
        bad = here.train(tmp_path, Store(folder), "experiment=smoke", nowhere, check=False,
                         env=password)  # fmt: skip
        for name in password:  # what follows in this process has no password
            here.monkeypatch.delenv(name)
        proc = subprocess.Popen(
            train_args(tmp_path, uri, "train.steps=3000", *OUTAGE_RUN),
            cwd=tmp_path,
            env=with_password,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_losses(server.store, 100, proc)
        server.cut()  # away until the run has ended: its record waits in the spool
        _, away = proc.communicate(timeout=600)
        spooled = list((tmp_path / "results" / "spool").glob("*.jsonl"))
        spool_mode, spool_text = spooled[0].stat().st_mode & 0o777, spooled[0].read_text()
        refused = here.module("replay", str(spooled[0]))  # no password here
        server.restore()
        for name, value in password.items():
            here.monkeypatch.setenv(name, value)
        replayed = here.module("replay", str(spooled[0]))
    finally:
        server.stop()
    assert bad.returncode == 2 and "ci:***@" in bad.stderr
    assert proc.returncode == 0 and "python -m reprotrain.replay" in away, away[-3000:]
    assert spool_mode == 0o600 and '"uri": "http://ci:***@127.0.0.1:' in spool_text
    assert refused.returncode == 2 and "MLFLOW_TRACKING_PASSWORD" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "http://ci:***@" in refused.stderr
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    run = Store(folder).only_run()
    assert run.info.status == "FINISHED" and run.data.params["tracking.uri"].startswith(
        "http://ci:***@"
    )
    printed = [bad.stdout, bad.stderr, away, refused.stdout, refused.stderr]
    printed += [replayed.stdout, replayed.stderr, spool_text]  # the spool is gone once sent
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(p.suffix == ".pt" for p in files) and any(p.parent.name == ".hydra" for p in files)
    forms = {in_uri, in_env, urllib.parse.unquote(in_uri)}
    for planted in forms | {urllib.parse.quote(urllib.parse.unquote(p), safe="") for p in forms}:
        assert not [text for text in printed if planted in text]
        assert [str(path) for path in files if planted.encode() in path.read_bytes()] == []
    assert not [text for text in printed if "nted:s3cr3t" in text or "@nted" in text]


def test_reproduce_does_not_resolve_what_reaches_outside_the_config(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    from reprotrain.tracking import ensure_experiment

    client = store.client
    planted = "planted-secret-4411"
    cases = {
        "leak": "experiment: leak-${oc.env:PLANTED_SECRET}\n",
        # a resolver whose name is itself interpolated
        "nested": "task:\n  _args_: [oc.env]\nexperiment: leak-${${task._args_.0}:PLANTED_SECRET}\n",
        "tag": "train: !!python/object:os.system {}\n",
    }
    for name, text in cases.items():
        run_id = client.create_run(ensure_experiment(client, "reprotrain")).info.run_id
        config = tmp_path / name / "config.yaml"
        config.parent.mkdir()
        config.write_text(text)
        client.log_artifact(run_id, str(config))
        here.monkeypatch.setenv("PLANTED_SECRET", planted)
        result = here.module("reproduce", run_id, "--tracking-uri", store.uri)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert planted not in result.stderr and "fix:" in result.stderr
        if name != "tag":
            assert "the recorded config.yaml reads from outside itself" in result.stderr
    names = [e.name for e in client.search_experiments()]
    assert not any(planted in name for name in names)


def kill_at(phase: str, proc: subprocess.Popen, out: Path, delay: float) -> None:
    """SIGKILL `proc` `delay` seconds into `phase`: "training" (from
    the start), "final" (from the final phase's first output) or "end" (from metrics.json,
    its last, while the process ends its MLflow run)."""
    if phase == "final":
        wait_for(out / "config.yaml", proc)
    elif phase == "end":
        wait_for(out / "metrics.json", proc)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.e2e
@pytest.mark.slow
def test_chaos_kill_9_at_random_moments_then_recover(tmp_path: Path, here: InProcess) -> None:
    """N runs, each killed with SIGKILL at a seeded random moment of training, of the final
    phase, or of its very end, each followed by the documented recovery: `python -m
    reprotrain.runs --clean`, then `train.resume=<run id>` for each run it ended that has a
    checkpoint. At the end no run is RUNNING and every FINISHED one has every step once."""
    runs, steps = 3, 1200  # one kill in each phase: training, the final phase, the very end
    # With the MLflow Model: its export is the longest part of the final phase to kill in.
    overrides = [f"train.steps={steps}", *KILLABLE[1:], "train.progress=off"]
    overrides.append("tracking.log_model=true")
    store = ready_store(tmp_path)
    began = time.monotonic()
    train(tmp_path, store, *overrides, f"train.output_dir={tmp_path / 'clean'}")
    length = time.monotonic() - began
    rng = random.Random(12)
    kills, recovered = [], 0
    for i in range(runs):
        out = tmp_path / f"run{i}"
        phase = ("training", "final", "end")[i % 3]
        delay = rng.uniform(0.3, 0.9) * length if phase == "training" else rng.uniform(0, 1.0)
        kills.append(f"{phase}+{delay:.1f}s")
        proc = start_training(tmp_path, store.uri, *overrides, f"train.output_dir={out}")
        kill_at(phase, proc, out, delay)
        cleaned = here.module("runs", "--clean", "--tracking-uri", store.uri)
        assert cleaned.returncode == 0, cleaned.stderr
        for line in cleaned.stdout.splitlines():
            run_id = line.split()[0]
            checkpoint = tmp_path / "outputs" / "checkpoints" / f"{run_id}.pt"
            if "marked KILLED" in line:  # resume only what has a checkpoint; else start again
                assert ("train.resume=" in line) == checkpoint.is_file(), line
            if "continue it with the same command" in line:
                here.train(tmp_path, store, *overrides, f"train.output_dir={out}",
                           f"train.resume={run_id}")  # fmt: skip
                recovered += 1
    statuses = store.statuses()
    assert "RUNNING" not in statuses and set(statuses) <= {"FINISHED", "KILLED"}
    finished = [r.info.run_id for r in store.runs() if r.info.status == "FINISHED"]
    for run_id in finished:
        assert steps_recorded(store, run_id) == list(range(1, steps + 1)), run_id  # once each
    print(
        f"\nchaos: {runs} runs killed with SIGKILL at {kills} (a clean run takes {length:.1f} s); "
        f"{recovered} recovered by resume; {len(finished)} FINISHED (clean run included), "
        f"{statuses.count('KILLED')} KILLED, 0 RUNNING; points lost or doubled: 0"
    )
