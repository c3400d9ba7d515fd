"""What the benchmarks share: running one command as a user would and measuring the whole
process, the training app's command line, a table. Imported by the scripts beside it; nothing
of reprotrain is imported: reprotrain is measured through `python -m reprotrain.train` and the
run.json each run writes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Runs in a fresh small process per measured command: the kernel's account of its children
# then holds the measured process and its descendants alone. ru_maxrss of RUSAGE_CHILDREN is
# the largest single process's peak; a child forked from a big parent would carry the
# parent's pages into its own peak, which this small helper has none of. The helper is made
# a child subreaper, so a descendant that outlives its parent is reaped (and counted) here.
MEASURE = r"""
import ctypes, json, os, resource, subprocess, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
except (AttributeError, OSError):
    pass
began = time.perf_counter()
code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
wall = time.perf_counter() - began  # timing boundary: the command has returned
while True:
    try:
        os.wait()  # descendants left behind: their peak and CPU time count too
    except ChildProcessError:
        break
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"returncode": code, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "peak_rss_mb": usage.ru_maxrss / 1024}))
"""


def child_env() -> dict[str, str]:
    """This environment as a user's fresh shell has it: without reprotrain's and Hydra's own
    variables, and with MLflow's telemetry off for every row alike."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPROTRAIN_", "HYDRA_"))}
    env.pop("MLFLOW_RUN_ID", None)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


def measure(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Wall time, CPU time (user + system) and peak RSS of one whole process and everything it
    started. A failure ends the benchmark with the command's last line of output."""
    with tempfile.TemporaryFile(mode="w+") as errors:
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, *command],
            cwd=cwd,
            env=env or child_env(),
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            check=False,
        )
        figures = json.loads(done.stdout.splitlines()[-1]) if done.stdout.strip() else {}
        if done.returncode != 0 or figures.get("returncode") != 0:
            errors.seek(0)
            last = (errors.read().strip().splitlines() or ["no output"])[-1]
            shown = " ".join(Path(part).name if "/" in part else part for part in command[:4])
            raise SystemExit(f"`{shown} ...` exited {figures.get('returncode')}: {last}")
    del figures["returncode"]
    return figures


def train_command(
    folder: Path, name: str, steps: int, batch_size: int, device: str, overrides: list[str]
) -> list[str]:
    """`python -m reprotrain.train` on `device`, here and now (runtime=local), writing into
    `folder` (its store, its checkpoints, outputs/<name>/run.json)."""
    return [
        sys.executable,
        "-m",
        "reprotrain.train",
        "runtime=local",
        f"device={device}",
        f"train.steps={steps}",
        f"train.batch_size={batch_size}",
        f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
        f"train.output_dir={folder / 'outputs' / name}",
        f"train.checkpoint_dir={folder / 'checkpoints'}",
        *overrides,
    ]


def run_json(folder: Path, name: str) -> dict[str, Any]:
    return json.loads((folder / "outputs" / name / "run.json").read_text())


def create_store(folder: Path) -> None:
    """The sqlite store the runs share, created before any timed run: a user's store exists
    already, and creating its tables is not part of a run."""
    code = "import sys; from mlflow import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    subprocess.run(
        [sys.executable, "-c", code, uri], env=child_env(), capture_output=True, check=True
    )


def git_state() -> dict[str, Any]:
    """The commit measured and whether the working tree differed from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""  # keep status's columns

    changed = git("status", "--porcelain").splitlines()
    return {
        "commit": git("rev-parse", "HEAD").strip() or None,
        "dirty": bool(changed),
        "changed": changed,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def median(values: list[float]) -> float:
    return statistics.median(values)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns right-aligned, except the first and the last (names, commands)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        last = len(cells) - 1
        return "  ".join(
            str(c).ljust(w) if i in (0, last) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


def say(line: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(line, file=sys.stderr, flush=True)


def publish(result: dict[str, Any], report: str, path: Path | None) -> None:
    """The report on stdout; the result as JSON at `path` when one is given."""
    print(report, flush=True)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {path}")
