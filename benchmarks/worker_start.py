"""What the run's tracking worker does before the loop can start, link by link, against the
training process's own start-up: why the MLflow Model costs wall time on a 2-core machine.

    python benchmarks/worker_start.py                 # 3 rounds, each link in a fresh process
    python benchmarks/worker_start.py --rounds 1      # CI

The worker (src/reprotrain/tracking/worker.py) starts on `python -m reprotrain.train`'s
first line and, while the training process imports torch, composes and builds, does what the
run needs, one link after the other (Python imports one module at a time in a process):
import MLflow, open the store, then for the MLflow Model import torch and mlflow.pytorch and
make a first export (torch.export's machinery, torch._dynamo among it, and MLflow's check of
the pinned requirements against the environment). Each round runs those links in a fresh
process, in that order, timing each one; then a whole `python -m reprotrain.train` with
tracking off, whose run.json gives the training process's start-up alone (process start to
first step). Where the worker's links add up to more than that start-up, the loop waits for
the difference (`time/tracking_wait_s`), or, were the model's links put after the loop, the
end would. Timings depend on the machine: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from reprotrain.bench.startup import child_env

# The worker's links, in its order, as one fresh process runs them (printed as JSON).
LINKS = r"""
import time
began = time.perf_counter()
import contextlib, json, sys, tempfile
from pathlib import Path
from reprotrain.heap import long_lived
from reprotrain.tracking import worker
from reprotrain.tracking.mlflow_model import stand_in_export
seconds = {"import reprotrain's tracking modules": time.perf_counter() - began}
def timed(name, work, kept=True):
    start = time.perf_counter()
    with long_lived() if kept else contextlib.nullcontext():  # as the worker imports
        work()
    seconds[name] = time.perf_counter() - start
timed("import MLflow", worker.import_mlflow)
timed("open the store", lambda: worker.open_store(sys.argv[1]))
timed("import torch", lambda: __import__("torch"))
timed("import mlflow.pytorch", worker.import_model_logging)
scratch = tempfile.mkdtemp(dir=sys.argv[2])
timed("first export (torch.export, MLflow's requirements check)",
      lambda: stand_in_export(Path(scratch) / "model"), kept=False)
print(json.dumps(seconds))
"""


def fresh_process(args: list[str], workdir: Path) -> str:
    """Run `python ARGS` in `workdir` as a user's fresh command would; its standard output.
    A failure ends this script with the process's last line."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=workdir,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"worker_start: `python {' '.join(args[:2])}` exited {done.returncode}: {last}"
        )
    return done.stdout


def worker_links(uri: str, workdir: Path) -> dict[str, float]:
    """Seconds each of the worker's links took, in one fresh process."""
    return json.loads(fresh_process(["-c", LINKS, uri, str(workdir)], workdir).splitlines()[-1])


def training_startup(uri: str, workdir: Path) -> float:
    """The training process's start-up alone: tracking off, so no worker shares the CPU."""
    out = workdir / "train"
    fresh_process(
        [
            "-m",
            "reprotrain.train",
            "device=cpu",
            "runtime=local",
            "train.steps=20",
            "train.batch_size=64",
            "tracking.enabled=false",
            f"tracking.uri={uri}",
            f"train.output_dir={out}",
            f"train.checkpoint_dir={workdir / 'checkpoints'}",
        ],
        workdir,
    )
    return json.loads((out / "run.json").read_text())["startup_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per figure")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1 round is needed; try --rounds 3")
    with tempfile.TemporaryDirectory(prefix="reprotrain-worker-start-") as folder:
        workdir = Path(folder)
        uri = f"sqlite:///{workdir / 'mlflow.db'}"
        worker_links(uri, workdir)  # creates the store: a user's exists already
        rounds, startups = [], []
        for _ in range(args.rounds):
            rounds.append(worker_links(uri, workdir))
            startups.append(training_startup(uri, workdir))
    links = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print(f"the tracking worker's links before the loop (median of {args.rounds}, seconds):")
    width = max(map(len, links))
    total = 0.0
    for name, seconds in links.items():
        total += seconds
        print(f"  {name:<{width}}  {seconds:6.2f}  {total:6.2f}")
    startup = statistics.median(startups)
    print(f"worker ready after: {total:.2f} s")
    print(f"training process start-up alone (process start to first step): {startup:.2f} s")
    print(
        f"left over for the loop to wait, or the end, on a machine whose cores the loop "
        f"fills: {max(total - startup, 0.0):.2f} s"
    )


if __name__ == "__main__":
    main()
