"""The tracking worker's start (tracking/worker.py): what it does before it is asked, how it
sees a waiting message, and when it is not started at all."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from conftest import Store, child_env, imported_modules, train
from reprotrain.tracking.worker import DISMISSED, Channel, TrackingWorker


def test_a_message_read_off_the_pipe_with_another_is_seen_waiting() -> None:
    """Two messages written at once reach the reader in one read: after the first is taken,
    the second waits in the channel's own buffer, not in the pipe, and `readable` must say
    so (the worker works ahead only when nothing waits)."""
    to_read, to_write = os.pipe()
    back_read, back_write = os.pipe()
    receiver, sender = Channel(to_read, back_write), Channel(back_read, to_write)
    try:
        assert not receiver.readable()
        sender.send(("prepare", "sqlite:///x.db"))
        sender.send(("call", "run_status", ("x",), {}))
        assert receiver.recv() == ("prepare", "sqlite:///x.db")
        assert receiver.readable()
        assert receiver.recv() == ("call", "run_status", ("x",), {})
        assert not receiver.readable()
        sender.close()
        assert receiver.readable()  # the close waits to be read: recv raises EOFError
        with pytest.raises(EOFError):
            receiver.recv()
    finally:
        receiver.close()
        sender.close()


def test_an_early_worker_imports_model_logging_only_where_a_model_is_likely() -> None:
    """Started before the store is named, the worker imports what logs an MLflow Model
    (torch, mlflow.pytorch) while it waits, unless the command line turned tracking.log_model
    off; then it waits with MLflow alone."""
    likely, unlikely = TrackingWorker(model_likely=True), TrackingWorker(model_likely=False)
    try:
        for worker in (likely, unlikely):
            wait_until_idle(worker.process.pid)
        assert maps_torch(likely.process.pid)
        assert not maps_torch(unlikely.process.pid)
    finally:
        likely.close()
        unlikely.close()


@pytest.mark.parametrize("phase", ["import", "export"])
def test_a_run_never_opened_stops_the_work_ahead(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """A training process that ends before opening its run (a bad model config, say) does not
    wait for the worker's work ahead: closed while the worker imports torch, or while it
    exports the warm-up's stand-in model into its scratch folder, the worker stops at once,
    removes that folder, and leaves the store it was given whole."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the worker's scratch folder goes here
    worker = TrackingWorker(model_likely=True).prepare(store.uri, log_model=True)
    pid = worker.process.pid
    under_way = {"import": lambda: maps_torch(pid), "export": lambda: any(scratch.iterdir())}
    deadline = time.monotonic() + 120
    while not under_way[phase]():
        assert time.monotonic() < deadline and worker.process.poll() is None
        time.sleep(0.01)
    worker.close()
    assert worker.process.returncode == DISMISSED
    assert list(scratch.iterdir()) == []
    assert [e.name for e in store.client.search_experiments()] == ["Default"]


def test_tracking_off_on_the_command_line_starts_no_worker(tmp_path: Path, store: Store) -> None:
    """tracking.enabled=false on the command line: no tracking worker is started, so nothing
    imports MLflow beside the run. PYTHONPROFILEIMPORTTIME reaches the worker too (it writes
    to this process's stderr): the run with tracking on shows the worker's MLflow imports."""
    env = child_env(PYTHONPROFILEIMPORTTIME="1")
    tracked = train(tmp_path, store, "experiment=smoke", env=env)
    assert "mlflow" in imported_top_level(tracked.stderr)
    waited = json.loads((tmp_path / "results" / "run.json").read_text())["tracking_wait_s"]
    untracked = train(tmp_path, store, "experiment=smoke", "tracking.enabled=false", env=env)
    assert "torch" in imported_top_level(untracked.stderr)
    assert "mlflow" not in imported_top_level(untracked.stderr)
    # Nothing to wait for: the loop's wait for the MLflow run (time/tracking_wait_s) is nil.
    unwaited = json.loads((tmp_path / "results" / "run.json").read_text())["tracking_wait_s"]
    assert waited >= 0 and unwaited < 0.01, (waited, unwaited)


def imported_top_level(stderr: str) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(stderr)}


def wait_until_idle(pid: int, timeout: float = 120) -> None:
    """Until the process has used no CPU for a second (the worker waits for a message)."""
    process = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    last = sum(process.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = sum(process.cpu_times()[:2])
        if now == last:
            return
        last = now
    raise AssertionError(f"process {pid} was still busy after {timeout} s")


def maps_torch(pid: int) -> bool:
    return any("libtorch" in Path(m.path).name for m in psutil.Process(pid).memory_maps())
