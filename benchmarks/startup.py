"""How long reprotrain's commands take to answer: --help, Tab completion, and a run's start-up
(process start to its first step, the MLflow run open), each a whole process as a user runs it.

    python benchmarks/startup.py                           # 5 rounds, this checkout
    python benchmarks/startup.py --rounds 3 --json benchmarks/results/DATE-startup-cpu.json
    python benchmarks/startup.py --tree before=/tmp/old/src --tree after=src   # side by side

Rows, for each source tree (`--tree NAME=SRC`: reprotrain imported from SRC through
PYTHONPATH; default: the installed one):
    help        python -m reprotrain.train --help
    script      reprotrain-train --help (the console script)
    completion  reprotrain-train -sc query=bash, as bash's Tab asks it (COMP_LINE set)
    run         python -m reprotrain.train with its defaults, runtime=local: wall time of the
                whole process, and the start-up its run.json records (time/startup_s)
    floor       the least any tracked PyTorch step starts in: import torch and MLflow, an MLP
                and AdamW, an MLflow run open on the same sqlite store (start-up as `run`'s;
                measured once a round, as tree "-")

Each round runs every row of every tree once, the order turned by one row a round, so that a
drift of the machine lands on every row alike; the median over the rounds is reported, with
the targets. Every process runs in a scratch folder, so that a tree reads its own conf/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import (
    child_env,
    cpu_model,
    create_store,
    git_state,
    measure,
    median,
    publish,
    run_json,
    say,
    table,
    train_command,
)

SCRIPT = Path(sys.executable).parent / "reprotrain-train"
# The floor row: its start-up measured as reprotrain's timing.process_age_s measures it (Linux:
# the kernel's start time of the process against CLOCK_BOOTTIME), written to floor.json.
FLOOR = r"""
import json, os, sys, time
import mlflow
import torch
from torch import nn
model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment("floor")
with mlflow.start_run():
    with open("/proc/self/stat", "rb") as stat:
        started = int(stat.read().rpartition(b")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started  # timing boundary: the first step
    inputs, labels = torch.randn(64, 784), torch.randint(0, 10, (64,))
    loss = nn.functional.cross_entropy(model(inputs), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with open(sys.argv[2], "w") as out:
    json.dump({"startup_s": age}, out)
"""
COMPLETED = "reprotrain-train optimizer="  # what bash sends for `reprotrain-train optimizer=<Tab>`
# (row, figure, target in seconds): the figures the issue sets a limit on.
TARGETS = (
    ("help", "wall_s", 1.5),
    ("script", "wall_s", 1.5),
    ("completion", "wall_s", 1.5),
    ("run", "startup_s", 4.0),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=at_least_one, default=5)
    parser.add_argument("--steps", type=at_least_one, default=20, help="steps of the run row")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="measure reprotrain imported from SRC (a src/ folder), named NAME; repeatable",
    )
    parser.add_argument("--json", type=Path, help="write every figure of every round here")
    args = parser.parse_args(argv)
    args.trees = dict(tree_arg(text) for text in args.tree) or {"installed": None}
    return args


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return int(text)


def tree_arg(text: str) -> tuple[str, Path]:
    name, _, src = text.partition("=")
    if not name or not (Path(src) / "reprotrain" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {text!r}: give NAME=SRC, SRC holding reprotrain/")
    return name, Path(src).resolve()


def commands(folder: Path, steps: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each row's command and the variables it adds to the environment."""
    return {
        "help": ([sys.executable, "-m", "reprotrain.train", "--help"], {}),
        "script": ([str(SCRIPT), "--help"], {}),
        "completion": ([str(SCRIPT), "-sc", "query=bash"], {"COMP_LINE": COMPLETED}),
        "run": (train_command(folder, "run", steps, 64, "cpu", []), {}),
        "floor": ([sys.executable, "-c", FLOOR, store_uri(folder), str(folder / "floor.json")], {}),
    }


def store_uri(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def environment(src: Path | None, extra: dict[str, str]) -> dict[str, str]:
    env = {**child_env(), **extra}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    return env


def run_rounds(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    rows = commands(folder, args.steps)
    order = [(tree, row) for row in rows if row != "floor" for tree in args.trees]
    order.append(("-", "floor"))
    rounds = []
    for number in range(args.rounds):
        turn = number % len(order)
        figures: dict[str, dict[str, dict[str, Any]]] = {tree: {} for tree, _ in order}
        for tree, row in order[turn:] + order[:turn]:
            command, extra = rows[row]
            if row == "run":
                (folder / "outputs" / "run" / "run.json").unlink(missing_ok=True)
            env = environment(args.trees.get(tree), extra)
            figures[tree][row] = measure(command, folder, env)
            if row == "run":
                figures[tree][row]["startup_s"] = run_json(folder, "run")["startup_s"]
            if row == "floor":
                figures[tree][row].update(json.loads((folder / "floor.json").read_text()))
        rounds.append(figures)
        say(f"round {number + 1}/{args.rounds}: " + summary(figures))
    return rounds


def summary(figures: dict[str, dict[str, dict[str, Any]]]) -> str:
    return "; ".join(
        f"{tree}: " + ", ".join(f"{row} {entry['wall_s']:.2f} s" for row, entry in rows.items())
        for tree, rows in figures.items()
    )


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    first = rounds[0]
    return {
        tree: {
            row: {key: median([r[tree][row][key] for r in rounds]) for key in entry}
            for row, entry in rows.items()
        }
        for tree, rows in first.items()
    }


def report(result: dict[str, Any]) -> str:
    machine = result["machine"]
    out = [
        f"startup: median of {result['settings']['rounds']} alternating round(s); "
        f"{machine['cpu']}, {machine['cpus']} CPUs; load average {machine['load_before']:.1f} "
        f"before, {machine['load_after']:.1f} after",
        "",
    ]
    lines = []
    for tree, rows in result["median"].items():
        for row, entry in rows.items():
            per_round = " ".join(f"{r[tree][row]['wall_s']:.2f}" for r in result["rounds"])
            startup = f"{entry['startup_s']:.2f}" if "startup_s" in entry else "-"
            lines.append(
                [tree, row, f"{entry['wall_s']:.2f}", startup, f"{entry['cpu_s']:.2f}", per_round]
            )
    out.append(table(["tree", "row", "wall s", "start-up s", "CPU s", "wall s per round"], lines))
    out += ["", "targets (median of the rounds)"]
    lines = []
    for tree, rows in result["median"].items():
        for row, key, limit in (target for target in TARGETS if target[0] in rows):
            value = rows[row][key]
            met = "met" if value <= limit else "MISSED"
            lines.append([f"{tree}: {row} {key}", f"{value:.2f}", f"<= {limit:g}", met])
    out.append(table(["figure", "value", "target", "result"], lines))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="reprotrain-startup-") as scratch:
        folder = Path(scratch)
        create_store(folder)
        rounds = run_rounds(args, folder)
    result = {
        "schema": 1,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        },
        "git": git_state(),
        "settings": {
            "rounds": args.rounds,
            "steps": args.steps,
            "trees": {k: str(v) if v else "installed" for k, v in args.trees.items()},
        },
        "rounds": rounds,
        "median": medians(rounds),
    }
    publish(result, report(result), args.json)
    return result


if __name__ == "__main__":
    main()
