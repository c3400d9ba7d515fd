"""Files a run leaves in its output folder (results/ by default) for DVC and for people.

    metrics.json  final and validation metrics, throughput, step time, MLflow run id
    loss.csv      step,loss for every step (a DVC plot)
    model.pt      the model's state_dict (+ what is needed to rebuild it)
    loss.png      the loss curve; config.yaml the resolved config

Every file is written to a temporary name and renamed, so an interrupted run never
leaves a half-written file that DVC would cache as good.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write through a temporary file in the same folder, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # loadable without a GPU
    return write_atomic(
        path, lambda handle: torch.save({"state_dict": state, "meta": meta}, handle)
    )


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
