"""What a user waits for outside the training loop: start-up of the training app, the whole
`python -m reprotrain.train` process against the course's script as written (lesson_script.py),
and `dvc repro` with nothing to do (DVC's own cost of checking the pipeline)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from reprotrain.tracking import prepare_store


def child_env() -> dict[str, str]:
    """This environment without reprotrain's and Hydra's own variables: each child process
    starts as a user's fresh command would."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("REPROTRAIN_", "HYDRA_"))}


SMOKE_RUN = ("-m", "reprotrain.train", "experiment=smoke", "runtime=local")


def startup_time(repeats: int, workdir: Path) -> dict[str, Any]:
    """Process start to first training step of the smoke run, as run.json reports it."""
    uri = f"sqlite:///{workdir / 'startup.db'}"
    prepare_store(uri)  # a user's store exists already; creating one is not start-up
    env = child_env()
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
        runs.append(json.loads((out_dir / "run.json").read_text())["startup_s"])
    return {
        "command": " ".join(("python", *SMOKE_RUN)),
        "runs_s": runs,
        "median_s": statistics.median(runs),
        "process_wall_s": walls,
    }


LESSON_SCRIPT = Path(__file__).with_name("lesson_script.py")
WHOLE_BATCH = 64
WHOLE_TARGET = 0.8  # the most reprotrain's wall time may be, as a share of the script's


def whole_process(
    steps: int, batch_size: int, pairs: int, workdir: Path, variants: Sequence[str] = ()
) -> dict[str, Any]:
    """Wall time, CPU time and peak RSS of whole processes on the CPU, in alternating rounds:
    the course's script as written (run by its path: torch and nothing of reprotrain) and
    `python -m reprotrain.train` with its defaults on (MLflow run and Model, checkpoints,
    outputs) for the same steps and batch size; then one more reprotrain row per entry of
    `variants` (overrides separated by spaces, "tracking.log_model=false"), named by it.
    Imports are included in all."""
    uri = f"sqlite:///{workdir / 'whole.db'}"
    prepare_store(uri)  # a user's store exists already
    env = child_env()
    commands = {
        "lesson": [
            sys.executable,
            str(LESSON_SCRIPT),
            f"--steps={steps}",
            f"--batch-size={batch_size}",
            "--device=cpu",
            f"--out={workdir / 'lesson_model.pt'}",
        ],
        "reprotrain": [
            sys.executable,
            "-m",
            "reprotrain.train",
            "device=cpu",
            "runtime=local",
            f"train.steps={steps}",
            f"train.batch_size={batch_size}",
            f"tracking.uri={uri}",
            f"train.output_dir={workdir / 'whole'}",
            f"train.checkpoint_dir={workdir / 'checkpoints'}",
        ],
    }
    for overrides in variants:
        commands[f"reprotrain {overrides}"] = [*commands["reprotrain"], *overrides.split()]
    walls: dict[str, list[float]] = {name: [] for name in commands}
    rss: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    phases: dict[str, dict[str, list[float]]] = {
        name: {phase: [] for phase in WHOLE_PHASES} for name in commands if name != "lesson"
    }
    run_json = workdir / "whole" / "run.json"
    for _ in range(pairs):
        for name, command in commands.items():
            run_json.unlink(missing_ok=True)  # each reprotrain row reads its own run's
            timed = timed_process(command, workdir, env)
            if timed.failed:
                return {"error": f"{name} {timed.failed}"}
            walls[name].append(timed.wall_s)
            rss[name].append(timed.peak_rss_mb)
            cpus[name].append(timed.cpu_s)
            if name in phases:
                split = where_the_time_went(json.loads(run_json.read_text()), timed.wall_s)
                for phase, seconds in split.items():
                    phases[name][phase].append(seconds)
    # Each row's wall time as a share of the lesson's in the same round.
    per_round = {
        name: [r / s for r, s in zip(wall, walls["lesson"], strict=True)]
        for name, wall in walls.items()
    }
    ratios = per_round["reprotrain"]
    cores = len(os.sched_getaffinity(0))
    return {
        "steps": steps,
        "batch_size": batch_size,
        "pairs": pairs,
        "commands": {name: " ".join(c[1:]) for name, c in commands.items()},
        "wall_s": walls,
        "median_s": {name: statistics.median(w) for name, w in walls.items()},
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "variants": list(variants),
        "row_ratios": {name: statistics.median(r) for name, r in per_round.items()},
        "peak_rss_mb": {name: max(v) for name, v in rss.items()},
        # CPU time (user + system, the process and every child it waited for: reprotrain's
        # tracking worker); divided by the cores, the least wall time that work could take.
        "cpu_s": cpus,
        "median_cpu_s": {name: statistics.median(c) for name, c in cpus.items()},
        "cores": cores,
        "phases_s": phases,
        "median_phases_s": {
            name: {phase: statistics.median(v) for phase, v in split.items()}
            for name, split in phases.items()
        },
    }


# Where a reprotrain process's wall time goes, in order (where_the_time_went).
WHOLE_PHASES = ("startup", "tracking_wait", "loop", "finish", "after")


def where_the_time_went(run: dict[str, Any], wall_s: float) -> dict[str, float]:
    """Split one `python -m reprotrain.train` process's wall time by what its run.json says:
    start-up (process start to first step), the loop's wait for the tracking worker (its
    MLflow run open and warmed up), the loop (every step, checkpoints, sending points), the
    finish (evaluation, outputs, and waiting for the MLflow Model), and what comes after
    total_s is taken (the last metrics, run.json, ending the run, the exit). The first four
    are the run's own clocks, counted from the kernel's start of the process; the last is the
    rest of the wall time this bench measured around the process, so a run whose clocks
    claimed more than that would show a negative `after`."""
    startup, wait, finish = run["startup_s"], run["tracking_wait_s"], run["outputs_s"]
    return {
        "startup": startup,
        "tracking_wait": wait,
        "loop": run["total_s"] - startup - wait - finish,
        "finish": finish,
        "after": wall_s - run["total_s"],
    }


@dataclass
class Timed:
    """What one whole process cost: wall time, peak memory, CPU time; `failed` says what went
    wrong ("" when it exited 0)."""

    wall_s: float
    peak_rss_mb: float
    cpu_s: float
    failed: str = ""


def timed_process(command: list[str], cwd: Path, env: dict[str, str]) -> Timed:
    """Wall time, peak RSS and CPU time of one process and its children (reprotrain's
    tracking worker). The peak is the sum of each one's kernel high-water mark (VmHWM), read
    every 20 ms while it runs: at most what they held at any one moment, never less.
    getrusage's peak for a child also counts the parent's pages it had before exec. The CPU
    time is the kernel's account of the process and of every child it waited for (wait4)."""
    peak_kb: dict[int, int] = {}
    with tempfile.TemporaryFile() as errors:
        began = time.perf_counter()
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            try:
                family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(True))]
            except psutil.Error:
                family = []  # exiting: the last readings stand
            for member in family:
                try:
                    for line in Path(f"/proc/{member}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak_kb[member] = max(peak_kb.get(member, 0), int(line.split()[1]))
                except (OSError, ValueError):
                    pass  # exiting: the last reading stands
            time.sleep(0.02)
        wall = time.perf_counter() - began
        cpu = usage.ru_utime + usage.ru_stime
        if proc.returncode != 0:
            errors.seek(0)
            last = errors.read().decode(errors="replace").strip().splitlines() or ["no output"]
            return Timed(wall, float("nan"), cpu, f"exited {proc.returncode}: {last[-1]}")
    return Timed(wall, sum(peak_kb.values()) / 1024, cpu)


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
