"""Files a run leaves in its output folder (results/ by default) for DVC and for people.

    metrics.json  final and validation metrics, throughput, step time, MLflow run id
    loss.csv      step,loss for every step (a DVC plot)
    model.pt      the model's state_dict and the config that rebuilds it
    loss.png      the loss curve; config.yaml the resolved config

Every file is written to a temporary name in the same folder, flushed to disk (fsync) and
renamed, so an interrupted run never leaves a half-written file that DVC would cache as
good. A kill during a write can leave the temporary file (`.<name>.<owner>.<random>.tmp`);
the next run that checks the folder removes those whose writing process is gone. A full disk is one error line
naming the file and the setting that moves it (`DiskFullError`); so is a folder that cannot
be written (`OutputError`); the temporary file is removed.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import psutil
import torch

from reprotrain.errors import DiskFullError, OutputError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a full quota on it
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".reprotrain.lock"  # held by the run writing the folder (claim)
TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<ns>\d+)-(?P<pid>\d+)\.[^.]+\.tmp")


def write_atomic(
    path: Path, write: Callable[[IO[bytes]], None], setting: str = "train.output_dir"
) -> Path:
    """Write through a temporary file in the same folder, then rename it into place.
    `setting` is the config key that chooses the folder, named in the error line."""
    tmp = ""
    handle: _WriteErrors | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.{_owner()}.", suffix=TEMP_SUFFIX
        )
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        with os.fdopen(fd, "wb") as raw:
            handle = _WriteErrors(raw)
            write(handle)
            raw.flush()
            os.fsync(raw.fileno())  # on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException as error:
        if tmp:
            Path(tmp).unlink(missing_ok=True)  # no half-written file, not even a hidden one
        if _no_space(error) or (handle is not None and _no_space(handle.error)):
            raise disk_full(path, setting) from None
        if isinstance(error, OSError) and error.errno is not None:
            raise OutputError(
                f"cannot write {str(path)!r} ({error.strerror})",
                hint=f"point {setting} at a writable folder, or fix its permissions",
            ) from None
        raise
    return path


def check_writable(folder: Path, setting: str) -> Path:
    """Fail before training, not at the first save, when `folder` cannot be written; remove
    the temporary files a killed run left there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        raise OutputError(
            f"{setting}={str(folder)!r} cannot be written ({error.strerror})",
            hint=f"point {setting} at a writable folder",
        ) from None
    remove_stale_temp_files(folder)
    return folder


@contextmanager
def claim(folder: Path, setting: str) -> Iterator[None]:
    """Hold `folder` for this run: an advisory lock on `.reprotrain.lock` in it, released when
    the process ends however it ends (the file is removed on the way out). If another live
    run holds it, say so once: the two runs' outputs would overwrite each other."""
    path = folder / LOCK_NAME
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            print(
                f"reprotrain: warning: {setting}={str(folder)!r} is in use by another run "
                f"({handle.read().strip() or 'another process'}); the two runs' outputs "
                "overwrite each other: give each its own folder",
                file=sys.stderr,
                flush=True,
            )
            yield
            return
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def _owner() -> str:
    """This process, as a temporary file's name records it: PID namespace and PID."""
    return f"{_pid_namespace()}-{os.getpid()}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Remove `folder`'s temporary files whose writer is gone: same PID namespace as this
    process (so the PID means the same process) and no such process. Others are left alone:
    another container's writer may be alive."""
    removed = []
    namespace = _pid_namespace()
    for path in folder.glob(f".*{TEMP_SUFFIX}"):
        match = TEMP_NAME.fullmatch(path.name)
        if match is None or match["ns"] != namespace or psutil.pid_exists(int(match["pid"])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class _WriteErrors:
    """A file handle that remembers the OSError a write raised. torch.save reports a failed
    write as a bare `RuntimeError: [enforce fail ...] unexpected pos`, losing ENOSPC."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name: str) -> Any:  # flush, seek, tell, ... as the real handle
        return getattr(self.handle, name)


def _no_space(error: BaseException | None) -> bool:
    """True when this error, or one it was raised while handling, is a full disk."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full(path: Path, setting: str = "train.output_dir") -> DiskFullError:
    """Name the file, and how full its file system is (after the partial file is gone)."""
    try:
        usage = shutil.disk_usage(path.parent)
        room = f" (its file system has {_size(usage.free)} free of {_size(usage.total)})"
    except OSError:
        room = ""
    return DiskFullError(
        f"no space left on device while writing {str(path)!r}{room}",
        hint=f"free space on that file system, or set {setting}=<a folder with room>",
    )


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> Path:
    return write_atomic(path, lambda handle: handle.write(text.encode()))


def write_json(path: Path, data: dict[str, Any]) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_loss_csv(path: Path, steps: Sequence[int], losses: Sequence[float]) -> Path:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "loss"])
    writer.writerows((step, f"{loss:.6g}") for step, loss in zip(steps, losses, strict=True))
    return write_text(path, buffer.getvalue())


def write_model(path: Path, model: torch.nn.Module, meta: dict[str, Any]) -> Path:
    """{"state_dict": ..., **meta}: weights on the CPU (loadable without a GPU) and what
    rebuilds the model (torch.load(path, weights_only=True) reads it back)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return write_atomic(path, lambda handle: torch.save({"state_dict": state, **meta}, handle))


def read_model(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def write_loss_plot(path: Path, steps: Sequence[int], losses: Sequence[float], title: str) -> Path:
    import logging

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font-cache chatter
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(steps, losses, linewidth=1)
    axes.set(xlabel="step", ylabel="train/loss", title=title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    write_atomic(path, lambda handle: figure.savefig(handle, format="png"))
    plt.close(figure)
    return path
