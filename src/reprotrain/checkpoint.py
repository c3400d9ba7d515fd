"""Checkpoints: everything needed to continue a run exactly where it stopped.

    save_checkpoint(path, trainer.state_dict(), run_id=..., fingerprint=..., model_class=...)
    python -m reprotrain.train train.resume=last          # or train.resume=<MLflow run id>

A checkpoint is the Trainer's state_dict (trainer.py: the model, optimizer and scheduler
state, the step, the RNG states and the losses so far; the batch order is re-derived from
the seed, so on CPU the continued losses equal an uninterrupted run's bit for bit) with the
run it belongs to and a fingerprint of the config that must match to continue. It is
written every `train.checkpoint_every_s` seconds (and `train.checkpoint_every` steps when
set; trainer.CheckpointCadence), when the run is stopped (Ctrl-C, SIGTERM, docker stop) and
after the last step, always atomically. Nothing of tracking is in it: the MLflow run is
flushed before each checkpoint. The last step's checkpoint carries the run's timings, so a
run killed during its final phase (outputs, artifacts, the MLflow Model) is finished by
`train.resume` without training again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import socket
import zipfile
from pathlib import Path
from typing import Any

import torch

from reprotrain.errors import ConfigError, DataError
from reprotrain.outputs import write_atomic
from reprotrain.schema import Config, as_dict

FORMAT = 4  # 4: the Trainer's state_dict under "trainer", nothing of tracking
# What can work when the checkpoint asked for is not there: it is elsewhere, or there is none.
NO_CHECKPOINT_HINT = (
    "set train.checkpoint_dir to the folder that holds the run's <run id>.pt, or, if it has "
    "none (deleted, or killed before its first one), start it again without train.resume"
)


def checkpoint_path(folder: str | Path, run_id: str) -> Path:
    """<train.checkpoint_dir>/<run id>.pt: one folder for all runs, so train.resume finds them."""
    return Path(folder) / f"{run_id or 'untracked'}.pt"


def fingerprint(config: Config) -> str:
    """What must match to continue: model, data, loss, optimizer, scheduler, batch size, seed
    (not the step count)."""
    tree = as_dict(config)
    kept = {k: tree[k] for k in ("model", "optimizer", "data", "loss", "scheduler")}
    # precision and tf32 change the arithmetic; compile and cuda_graphs do not.
    same_math = ("batch_size", "seed", "deterministic", "precision", "tf32")
    kept["train"] = {k: tree["train"][k] for k in same_math}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(
    path: Path, trainer_state: dict[str, Any], *, run_id: str, fingerprint: str, model_class: str
) -> Path:
    """Write `trainer_state` (Trainer.state_dict()) for run `run_id`, atomically."""
    state = {
        "format": FORMAT,
        "run_id": run_id,
        "fingerprint": fingerprint,
        "model_class": model_class,
        "trainer": trainer_state,
    }
    return write_atomic(path, lambda handle: torch.save(state, handle), "train.checkpoint_dir")


class RunLock:
    """One process at a time trains a run: an exclusive lock on
    <train.checkpoint_dir>/.<run id>.lock, taken by the run that opens it (rank 0) and by a
    `train.resume` of it before its record is touched, held until the process lets go (the
    file goes with it) or ends (the kernel drops the lock after a kill -9 too; the file left
    is taken over by the next one). Two terminals resuming one run: the second is refused in
    one line, so no step is recorded twice."""

    def __init__(self, folder: str | Path, run_id: str) -> None:
        self.path = Path(folder) / f".{run_id}.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            handle = open(self.path, "a+")  # noqa: SIM115  (held until release())
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise ConfigError(
                    f"run {run_id} is being trained by {holder} right now (it holds "
                    f"{str(self.path)!r}); allowed: one process per run",
                    hint="wait for it to end (or stop it), then train.resume it again",
                ) from None
            if self._still_ours(handle):
                break
            handle.close()  # its holder let go and removed it meanwhile: take a new one
        self.handle = handle
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} on {socket.gethostname()}")
        handle.flush()

    def _still_ours(self, handle: Any) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.handle.closed:
            return
        self.path.unlink(missing_ok=True)  # while still held: no one takes a file that goes
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def find_checkpoint(checkpoint_dir: str | Path, resume: str) -> Path:
    folder = Path(checkpoint_dir)
    if resume == "last":
        found = (
            sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        )
        if not found:
            raise ConfigError(
                f"train.resume=last but train.checkpoint_dir={str(folder)!r} holds no checkpoint",
                hint=NO_CHECKPOINT_HINT,
            )
        return found[-1]
    path = folder / f"{resume}.pt"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.pt")) if folder.is_dir() else []
        raise ConfigError(
            f"train.resume={resume!r}: no checkpoint {str(path)!r}; checkpoints in "
            f"train.checkpoint_dir: {', '.join(known) or 'none'}",
            hint="give one of those run ids, or train.resume=last; " + NO_CHECKPOINT_HINT
            if known
            else NO_CHECKPOINT_HINT,
        )
    return path


def load_checkpoint(path: Path, expected_fingerprint: str, model_class: str = "") -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError) as error:
        raise DataError(
            f"checkpoint {str(path)!r} is corrupt or truncated ({type(error).__name__})",
            hint="delete it and start again, or resume another run",
        ) from None
    keys = ("run_id", "fingerprint", "trainer")
    if (
        not isinstance(state, dict)
        or state.get("format") != FORMAT
        or not all(k in state for k in keys)
        or not isinstance(state["trainer"], dict)
        or not {"step", "model", "optimizer", "torch_rng", "losses"} <= set(state["trainer"])
    ):
        raise DataError(
            f"checkpoint {str(path)!r} is not a reprotrain checkpoint (format {FORMAT}, with "
            f"{', '.join(keys)})",
            hint="delete it and start again, or resume another run",
        )
    if state["fingerprint"] != expected_fingerprint:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written with another model/optimizer/data/batch config "
            f"(model {state.get('model_class', '?')}, fingerprint {state['fingerprint']}; this "
            f"config {model_class or '?'}, fingerprint {expected_fingerprint})",
            hint="resume with the same config as the stopped run (only train.steps may grow)",
        )
    return state


def load_resume_point(config: Config) -> dict[str, Any] | None:
    """The checkpoint train.resume names, checked against this config; None when not resuming."""
    if not config.train.resume:
        return None
    path = find_checkpoint(config.train.checkpoint_dir, config.train.resume)
    state = load_checkpoint(path, fingerprint(config), config.model.get("_target_", ""))
    step = state["trainer"]["step"]
    if config.train.steps is not None and step > config.train.steps:
        raise ConfigError(
            f"train.resume={config.train.resume!r}: the checkpoint is at step {step}, "
            f"past train.steps={config.train.steps}",
            hint=f"set train.steps to {step} or more",
        )
    return state


def already_finished(config: Config, state: dict[str, Any], status: str | None) -> ConfigError:
    """The error for resuming a run that has nothing left to do."""
    return ConfigError(
        f"train.resume={config.train.resume!r}: run {state['run_id']} is {status} and its "
        f"checkpoint is at step {state['trainer']['step']}, which already reaches the steps "
        "asked for",
        hint=f"raise train.steps above {state['trainer']['step']} to train further",
    )
