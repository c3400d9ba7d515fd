"""Fixed costs outside the training loop: start-up of the training app, and `dvc repro` with
nothing to do (DVC's own cost of checking the pipeline)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reprotrain.tracking import prepare_store

SMOKE_RUN = ("-m", "reprotrain.train", "experiment=smoke", "runtime=local")


def startup_time(repeats: int, workdir: Path) -> dict[str, Any]:
    """Process start to first training step of the smoke run, as metrics.json reports it."""
    uri = f"sqlite:///{workdir / 'startup.db'}"
    prepare_store(uri)  # a user's store exists already; creating one is not start-up
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPROTRAIN_", "HYDRA_"))}
    runs, walls = [], []
    for i in range(repeats):
        out_dir = workdir / f"startup-{i}"
        command = [
            sys.executable,
            *SMOKE_RUN,
            f"tracking.uri={uri}",
            f"train.output_dir={out_dir}",
        ]
        began = time.perf_counter()
        done = subprocess.run(
            command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        walls.append(time.perf_counter() - began)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"`{' '.join(command[1:4])}` exited {done.returncode}: {last}"}
        runs.append(json.loads((out_dir / "metrics.json").read_text())["startup_s"])
    return {
        "command": " ".join(("python", *SMOKE_RUN)),
        "runs_s": runs,
        "median_s": statistics.median(runs),
        "process_wall_s": walls,
    }


def dvc_repro_time(repeats: int, enabled: bool) -> dict[str, Any]:
    """`dvc repro` with nothing changed, timed only where it would not train."""
    if not enabled:
        return {"skipped": "--no-dvc"}
    dvc = shutil.which("dvc") or shutil.which("dvc", path=str(Path(sys.executable).parent))
    if dvc is None:
        return {"skipped": "dvc is not on PATH"}
    try:
        here = Path.cwd()
    except FileNotFoundError:
        return {"skipped": "the current folder no longer exists"}
    if not (here / ".dvc").is_dir() or not (here / "dvc.lock").is_file():
        return {"skipped": f"{here} is not a DVC repository with a dvc.lock"}
    status = subprocess.run(
        [dvc, "status", "--json"], capture_output=True, text=True, timeout=600, check=False
    )
    if status.returncode != 0 or status.stdout.strip() not in ("", "{}"):
        return {
            "skipped": "the pipeline is not up to date (`dvc status` lists changes), so "
            "`dvc repro` would train; run it once, then benchmark"
        }
    runs = []
    for _ in range(repeats):
        began = time.perf_counter()
        done = subprocess.run([dvc, "repro"], capture_output=True, text=True, timeout=600)
        runs.append(time.perf_counter() - began)
        if done.returncode != 0:
            return {"error": f"dvc repro exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    return {"runs_s": runs, "median_s": statistics.median(runs)}
