"""Files a run leaves in its output folder (results/ by default) for DVC and for people.

    metrics.json  the headline figures and the MLflow run id; run.json every figure
    loss.csv      step,loss for every step (a DVC plot)
    model.pt      the model's state_dict and the config that rebuilds it
    loss.svg      the loss curve; config.yaml the resolved config

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
import math
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast
from xml.sax.saxutils import escape

import psutil
import torch

from reprotrain.errors import DiskFullError, OutputError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a full quota on it
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".reprotrain.lock"  # held by the run writing the folder (claim)
TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<ns>\d+)-(?P<pid>\d+)\.[^.]+\.tmp")


def write_atomic(
    path: Path, write: Callable[[IO[bytes]], object], setting: str = "train.output_dir"
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
            write(cast(IO[bytes], handle))  # a proxy: every other attribute is the real file's
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
    """The loss curve as an SVG (the MLflow UI shows it as an image): a few ms of text, not
    seconds of importing a plotting library at the end of every run."""
    return write_text(path, loss_svg(steps, losses, title))


def loss_svg(
    steps: Sequence[int], losses: Sequence[float], title: str, width: int = 700, height: int = 400
) -> str:
    """A line chart of `losses` against `steps`, with axes, ticks and a grid. Above one point
    per pixel column each column keeps its lowest and highest loss, so no spike is lost;
    a non-finite loss breaks the line."""
    left, right, top, bottom = 64, 16, 32, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    finite = [v for v in losses if math.isfinite(v)]
    x0, x1 = (steps[0], steps[-1]) if steps else (0, 1)
    y0, y1 = (min(finite), max(finite)) if finite else (0.0, 1.0)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1.0)

    def xy(step: float, loss: float) -> str:
        x = left + (step - x0) / (x1 - x0) * plot_w
        y = top + (1 - (loss - y0) / (y1 - y0)) * plot_h
        return f"{x:.1f},{y:.1f}"

    lines: list[list[str]] = [[]]
    per_column = max(1, math.ceil(len(steps) / plot_w))
    for i in range(0, len(steps), per_column):
        chunk = list(zip(steps[i : i + per_column], losses[i : i + per_column], strict=True))
        good = [(s, v) for s, v in chunk if math.isfinite(v)]
        if len(good) < len(chunk) and lines[-1]:
            lines.append([])
        if good:
            low, high = min(good, key=lambda p: p[1]), max(good, key=lambda p: p[1])
            lines[-1] += [xy(*p) for p in sorted({low, high})]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for i in range(6):  # grid lines and tick labels
        fx = x0 + (x1 - x0) * i / 5
        fy = y0 + (y1 - y0) * i / 5
        px, py = xy(fx, y0).split(",")[0], xy(x0, fy).split(",")[1]
        out += [
            f'<line x1="{px}" y1="{top}" x2="{px}" y2="{top + plot_h}" stroke="#ddd"/>',
            f'<text x="{px}" y="{top + plot_h + 16}" text-anchor="middle">{fx:.0f}</text>',
            f'<line x1="{left}" y1="{py}" x2="{left + plot_w}" y2="{py}" stroke="#ddd"/>',
            f'<text x="{left - 6}" y="{float(py) + 4:.1f}" text-anchor="end">{fy:.3g}</text>',
        ]
    out += [
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>',
        f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">step</text>',
        f'<text transform="translate(16,{top + plot_h / 2}) rotate(-90)" '
        'text-anchor="middle">train/loss</text>',
        *(
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.2" points="{" ".join(line)}"/>'
            for line in lines
            if line
        ),
        "</svg>",
    ]
    return "\n".join(out) + "\n"
