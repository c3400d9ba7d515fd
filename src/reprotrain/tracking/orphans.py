"""Runs left `RUNNING` by processes that are gone (the training process killed outright:
kill -9, the OOM killer, a power cut, a container killed).

    owner_tags()                                  # who trains this run: tagged when it opens
    found = end_orphans(client, [experiment_id])  # mark the gone ones KILLED; returns them
    sweep(client, [experiment_id], exclude=run_id)  # the same, said on stderr; never raises
    clear_sweep_marks(client, run)                # what the sweep tagged, once a replay ends it

Each run records who owns it, its training process: `reprotrain.host`, `reprotrain.pid` and
the process's start time (`reprotrain.pid_started`, so a reused PID is not taken for the
owner), and, for a container run, the container's name (`reprotrain.container`) and the host
whose launcher started it (`reprotrain.launcher_host`), both tagged by the launcher when it
creates the run. A run is an orphan only when that can be proved from here: a process on this
host whose PID is gone or belongs to another process, or a container this host launched that
has stopped, or that the local Docker engine does not have while its launcher is gone too (a
launcher creates the run before it starts the container). Runs owned by another machine, or
whose owner cannot be checked (another PID namespace, no Docker engine), are left alone: a
teammate's live run on a shared server is never ended. So is a run whose record waits in its
spool file (`reprotrain.spool_dir`: the store failed before the run ended, or while it was
killed): it is not killed, it is not finished yet; `python -m reprotrain.replay` ends it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from reprotrain.host import in_container
from reprotrain.tracking.failures import failure_reason

HOST_TAG = "reprotrain.host"
PID_TAG = "reprotrain.pid"
STARTED_TAG = "reprotrain.pid_started"
CONTAINER_TAG = "reprotrain.container"
LAUNCHER_HOST_TAG = "reprotrain.launcher_host"  # the host whose launcher started the container
CHECKPOINT_TAG = "reprotrain.checkpoint_dir"  # where the run's <run id>.pt is written
SPOOL_TAG = "reprotrain.spool_dir"  # where its <run id>.jsonl goes while the store fails
# What to do with a run killed before its first checkpoint: there is nothing to resume.
START_AGAIN = (
    "it was killed before its first checkpoint (train.checkpoint_every_s, "
    "train.checkpoint_every), so start it again with the same command, without train.resume"
)
ENDED_TAG = "reprotrain.ended_by"
CONTAINER_NAME_ENV = "REPROTRAIN_CONTAINER_NAME"  # the launcher names the container it starts
LAUNCHER_HOST_ENV = "REPROTRAIN_LAUNCHER_HOST"  # and says which host it runs on


@dataclass(frozen=True)
class Orphan:
    run_id: str
    run_name: str
    experiment_id: str
    why: str
    checkpoint: Path | None = None  # its <run id>.pt, where it can be checked from here
    spool: Path | None = None  # its record waits there: left RUNNING for `replay`

    def what_next(self) -> str:
        if self.spool is not None:
            return f"its record waits in {self.spool}: {REPLAY} {self.spool}"
        return what_next(self.run_id, self.checkpoint)

    def outcome(self) -> str:
        """What was done with it: left for the replay, or marked KILLED."""
        done = "left RUNNING" if self.spool is not None else "marked KILLED"
        return f"{done}; {self.what_next()}"


REPLAY = "send it, and end the run as it ended, with: python -m reprotrain.replay"


def what_next(run_id: str, checkpoint: Path | None) -> str:
    """How to go on with a KILLED run: its own command again with train.resume (the command's
    overrides, train.steps say, are not restored from the checkpoint), or, where it provably
    has no checkpoint (killed before its first one: a resume would fail), start it again."""
    if checkpoint is not None and not checkpoint.exists():
        return START_AGAIN
    return f"continue it with the same command and train.resume={run_id}"


def owner_tags() -> dict[str, str]:
    """Tags naming this process as the run's owner."""
    tags = {
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        STARTED_TAG: f"{psutil.Process().create_time():.2f}",
    }
    if in_container() and os.environ.get(CONTAINER_NAME_ENV):
        tags[CONTAINER_TAG] = os.environ[CONTAINER_NAME_ENV]
        tags[LAUNCHER_HOST_TAG] = os.environ.get(LAUNCHER_HOST_ENV, "")
    return tags


def gone_because(tags: dict[str, str]) -> str | None:
    """Why the owner of a run with these tags is provably gone; None if alive or unknown."""
    if in_container():
        return None  # another PID namespace and no Docker engine: nothing can be proved here
    container = tags.get(CONTAINER_TAG)
    if container:
        return _container_gone(container, tags)
    return _process_gone(tags)


def _process_gone(tags: dict[str, str]) -> str | None:
    """Why the process the tags name on this host is gone; None if alive or not this host's."""
    if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
        return None
    pid = int(tags[PID_TAG])
    try:
        started = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return f"its process {pid} on {tags[HOST_TAG]} is gone"
    except psutil.AccessDenied:
        return None
    recorded = float(tags.get(STARTED_TAG) or 0)
    if recorded and abs(started - recorded) > 1.0:
        return f"its process {pid} on {tags[HOST_TAG]} is gone (the PID now belongs to another)"
    return None


def checkpoint_file(folder: Path, run_id: str) -> Path:
    """<folder>/<run id>.pt, as checkpoint.checkpoint_path names it (without importing torch)."""
    return folder / f"{run_id}.pt"


def checkpoint_of(run_id: str, tags: dict[str, str]) -> Path | None:
    """The run's checkpoint file where this machine sees the folder its owner wrote to."""
    folder = visible_folder(tags, CHECKPOINT_TAG)
    return checkpoint_file(folder, run_id) if folder is not None else None


def spool_of(run_id: str, tags: dict[str, str]) -> Path | None:
    """The run's spool file (spool.py), where this machine sees the folder its owner wrote to."""
    folder = visible_folder(tags, SPOOL_TAG)
    return folder / f"{run_id}.jsonl" if folder is not None else None


def visible_folder(tags: dict[str, str], tag: str) -> Path | None:
    """The folder `tag` names where this machine sees it as the run's owner did: a process on
    this host, or a container this host's launcher started (it mounts the folder at the same
    path). Not from inside a container, whose folders are not the host's."""
    folder = tags.get(tag)
    if not folder or in_container():
        return None
    owner_host = tags.get(LAUNCHER_HOST_TAG) if CONTAINER_TAG in tags else tags.get(HOST_TAG)
    if owner_host != socket.gethostname():
        return None
    return Path(folder)


def _container_gone(name: str, tags: dict[str, str]) -> str | None:
    """Why a container run's owner is gone. Only this host's engine is asked, and only about a
    container this host launched: another host's engine has its own containers. A container
    the engine does not have, or has created but not started, may be one the launcher is
    about to start: gone only once the launcher is too (the run's owner tags still name it
    until the training process in the container tags itself)."""
    if tags.get(LAUNCHER_HOST_TAG) != socket.gethostname():
        return None
    state = _container_state(name)
    if state in ("exited", "dead"):
        return f"its container {name} has stopped"
    if state not in ("missing", "created"):
        return None  # running, paused, restarting, being removed; or the engine did not answer
    if _launcher_alive(tags):
        return None  # the container is still to start
    if state == "created":
        return f"its container {name} was never started"
    return f"its container {name} is gone"


def _launcher_alive(tags: dict[str, str]) -> bool:
    """The owner tags still name a live process on this host: the launcher, before the
    training process in its container has tagged itself."""
    here = tags.get(HOST_TAG) == socket.gethostname() and tags.get(PID_TAG, "").isdigit()
    return here and _process_gone(tags) is None


def _container_state(name: str) -> str | None:
    """The container's state on this host's engine (running, exited, created, ...), "missing"
    if the engine has none of that name, None if no engine answered."""
    try:
        probe = subprocess.run(
            ["docker", "container", "inspect", "--format", "{{.State.Status}}", name],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # no engine to ask: unknown
    if probe.returncode == 0:
        return probe.stdout.strip() or None
    if "no such" in probe.stderr.lower():
        return "missing"
    return None  # the engine did not answer: unknown


def end_orphans(client: Any, experiment_ids: list[str], exclude: str = "") -> list[Orphan]:
    """Every provably orphaned RUNNING run of these experiments: marked KILLED, with an
    `reprotrain.ended_by` tag saying why, unless its record waits in its spool file (then it
    is left RUNNING for `replay`, Orphan.spool says where)."""
    if not experiment_ids:
        return []
    found = []
    for run in client.search_runs(
        experiment_ids, filter_string="attributes.status = 'RUNNING'", max_results=1000
    ):
        if run.info.run_id == exclude:
            continue
        orphan = orphan_of(run)
        if orphan is None:
            continue
        if orphan.spool is None:
            end_orphan(client, orphan)
        found.append(orphan)
    return found


def end_orphan(client: Any, orphan: Orphan) -> None:
    """Mark the orphan's run KILLED, with a `reprotrain.ended_by` tag saying why."""
    client.set_tag(orphan.run_id, ENDED_TAG, f"reprotrain: {orphan.why}; found {_now()}")
    client.set_terminated(orphan.run_id, "KILLED")


def orphan_of(run: Any) -> Orphan | None:
    """The RUNNING run (an MLflow Run) as an Orphan if its owner is provably gone."""
    tags, run_id = run.data.tags, run.info.run_id
    why = gone_because(tags)
    if why is None:
        return None
    spool = spool_of(run_id, tags)
    waiting = spool if spool is not None and spool.is_file() else None
    checkpoint = checkpoint_of(run_id, tags)
    return Orphan(run_id, run.info.run_name, run.info.experiment_id, why, checkpoint, waiting)


def clear_sweep_marks(client: Any, run: Any) -> None:
    """Remove what a sweep tagged on a run (an MLflow Run) that a replay has since ended."""
    if ENDED_TAG in run.data.tags:
        client.delete_tag(run.info.run_id, ENDED_TAG)


def owner_alive(tags: dict[str, str]) -> bool:
    """The run's training process provably still runs: on this host, the same process (PID and
    start time), or a container this host launched that is running."""
    if in_container():
        return False
    container = tags.get(CONTAINER_TAG)
    if container:
        here = tags.get(LAUNCHER_HOST_TAG) == socket.gethostname()
        return here and _container_state(container) == "running"
    here = tags.get(HOST_TAG) == socket.gethostname() and tags.get(PID_TAG, "").isdigit()
    return here and _process_gone(tags) is None


def sweep(client: Any, experiment_ids: list[str], exclude: str = "") -> list[Orphan]:
    """end_orphans as a training run does it on its way in: each one said on stderr with the
    command that continues it (or sends its spool); a store that cannot be searched is a
    warning, not an error."""
    try:
        ended = end_orphans(client, experiment_ids, exclude=exclude)
    except Exception as error:  # housekeeping: never a reason to stop training
        print(
            f"reprotrain: warning: could not look for runs left RUNNING ({failure_reason(error)})",
            file=sys.stderr,
            flush=True,
        )
        return []
    for orphan in ended:
        said = (
            f"is RUNNING and {orphan.why}; {orphan.what_next()}"
            if orphan.spool is not None
            else f"was left RUNNING, but {orphan.why}: {orphan.outcome()}"
        )
        print(
            f"reprotrain: run {orphan.run_id} ({orphan.run_name}) {said}",
            file=sys.stderr,
            flush=True,
        )
    return ended


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
