"""The main comparison: the lesson's script, reprotrain, and the lesson under Lightning, each a
whole process as a user runs it, in alternating rounds, printed side by side.

    python benchmarks/compare.py                  # 5 rounds of 3000 steps at batch 64, on the CPU
    python benchmarks/compare.py --quick          # CI size: 1 round of 200 steps
    python benchmarks/compare.py --json benchmarks/results/DATE-compare-cpu.json
    python benchmarks/compare.py --with tracking.loss_every=10   # one more reprotrain row
    python benchmarks/compare.py --device cuda --with train.cuda_graphs=true

Rows, the same problem in each (benchmarks/lesson.py's: reprotrain's default data and model,
AdamW lr 1e-3):
    lesson      python benchmarks/lesson.py: the course's loop as written
    reprotrain  python -m reprotrain.train with its defaults (MLflow run, Model and system
                metrics, checkpoints, outputs), every step's loss sent (tracking.loss_every=1)
    untracked   the same with tracking.enabled=false
    lightning   python benchmarks/lesson_lightning.py: Lightning with MLFlowLogger, every step
    reprotrain OVERRIDES, one per --with: the reprotrain row with these overrides added

Each round runs every row once, the order turned by one row a round, so that a drift of the
machine lands on every row alike. Of each process: wall time, CPU time and the peak RSS of its
largest process (harness.measure); of each reprotrain run, what its run.json records
(samples/s over the measured steps, start-up from process start to first step, ...). Every
ratio is taken within a round, and the median over the rounds is reported, with the targets.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from harness import (
    HERE,
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

# What each reprotrain row's run.json gives the comparison.
RUN_FIGURES = ("samples_per_s", "step_ms_median", "startup_s", "total_s", "tracking_s")
# (key, what, comparison, threshold, format): the performance targets, each checked on the
# median over the rounds of a figure taken within each round.
TARGETS = (
    ("in_loop", "in the loop: samples/s, tracking on / off (loss_every=1)", ">=", 0.98, ".3f"),
    ("wall_vs_lesson", "whole process: reprotrain / lesson's script, wall time", "<=", 1.15, ".3f"),
    ("wall_vs_lightning", "whole process: reprotrain / Lightning, wall time", "<=", 0.5, ".3f"),
    ("rss_above_lesson_mb", "peak RSS: reprotrain - lesson's script, MB", "<=", 350, ".0f"),
    ("startup_s", "start-up: process start to first step, s", "<=", 4, ".2f"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 200 steps (CI)")
    parser.add_argument("--pairs", type=at_least_one, help="rounds (default 5; quick: 1)")
    parser.add_argument("--steps", type=at_least_one, help="steps a run (default 3000; quick: 200)")
    parser.add_argument("--batch-size", type=at_least_one, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps")
    parser.add_argument(
        "--with",
        dest="extra",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="one more reprotrain row with these overrides (space-separated); repeatable",
    )
    parser.add_argument("--json", type=Path, help="write every figure of every round here")
    args = parser.parse_args(argv)
    args.pairs = args.pairs or (1 if args.quick else 5)
    args.steps = args.steps or (200 if args.quick else 3000)
    return args


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return int(text)


def check_device(device: str) -> None:
    """A device that is not here fails before any run, in one line."""
    if device == "cpu":
        return
    code = (
        "import sys, torch; d = torch.device(sys.argv[1]); sys.exit(0 if "
        "(d.type == 'cuda' and torch.cuda.is_available()) or "
        "(d.type == 'mps' and torch.backends.mps.is_available()) else 3)"
    )
    if subprocess.run([sys.executable, "-c", code, device], capture_output=True).returncode:
        print(
            f"compare: --device {device}: torch sees no such device here; "
            "fix: run on a machine that has one, or use --device cpu",
            file=sys.stderr,
        )
        sys.exit(2)


def rows(args: argparse.Namespace, folder: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each row's command, and the rows left out with why."""
    sizes = ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    sizes += ["--device", args.device]

    def reprotrain(name: str, overrides: list[str]) -> list[str]:
        return train_command(folder, name, args.steps, args.batch_size, args.device, overrides)

    commands = {
        "lesson": [sys.executable, str(HERE / "lesson.py"), *sizes, "--out", str(folder / "a.pt")],
        "reprotrain": reprotrain("reprotrain", ["tracking.loss_every=1"]),
        "untracked": reprotrain("untracked", ["tracking.loss_every=1", "tracking.enabled=false"]),
    }
    skipped = {}
    if importlib.util.find_spec("lightning") is None:
        skipped["lightning"] = "lightning is not installed (pip install -e '.[bench]')"
    else:
        commands["lightning"] = [
            sys.executable,
            str(HERE / "lesson_lightning.py"),
            *sizes,
            "--tracking-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--out",
            str(folder / "d.pt"),
        ]
    for number, overrides in enumerate(args.extra, 1):
        commands[f"reprotrain {overrides}"] = reprotrain(f"with-{number}", overrides.split())
    return commands, skipped


def output_name(row: str, extra: list[str]) -> str | None:
    """The outputs/ folder of a reprotrain row (None: the row is not reprotrain)."""
    if row in ("reprotrain", "untracked"):
        return row
    if row.startswith("reprotrain "):
        return f"with-{extra.index(row.removeprefix('reprotrain ')) + 1}"
    return None


def run_rounds(args: argparse.Namespace, commands: dict[str, list[str]], folder: Path) -> list:
    rounds = []
    names = list(commands)
    for number in range(args.pairs):
        order = names[number % len(names) :] + names[: number % len(names)]
        figures: dict[str, dict[str, Any]] = {}
        for row in order:
            name = output_name(row, args.extra)
            if name:  # each round reads its own run's figures
                (folder / "outputs" / name / "run.json").unlink(missing_ok=True)
            figures[row] = measure(commands[row], folder)
            if name:
                recorded = run_json(folder, name)
                figures[row].update({key: recorded.get(key) for key in RUN_FIGURES})
                figures[row]["run_peak_rss_mb"] = recorded.get("peak_rss_mb")
        rounds.append({"order": order, "rows": figures, "ratios": ratios(figures)})
        say(
            f"round {number + 1}/{args.pairs}: "
            + ", ".join(f"{row} {figures[row]['wall_s']:.2f} s" for row in order)
        )
    return rounds


def quotient(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The targets' figures in one round, and each row's wall time over the lesson's and each
    reprotrain row's samples/s over the untracked row's."""
    ours, lesson = figures["reprotrain"], figures["lesson"]
    out = {
        "in_loop": quotient(ours["samples_per_s"], figures["untracked"]["samples_per_s"]),
        "wall_vs_lesson": quotient(ours["wall_s"], lesson["wall_s"]),
        "wall_vs_lightning": quotient(ours["wall_s"], figures.get("lightning", {}).get("wall_s")),
        "rss_above_lesson_mb": ours["peak_rss_mb"] - lesson["peak_rss_mb"],
        "startup_s": ours["startup_s"],
    }
    for row, entry in figures.items():
        out[f"{row} / lesson wall"] = quotient(entry["wall_s"], lesson["wall_s"])
        if "samples_per_s" in entry:
            out[f"{row} / untracked samples/s"] = quotient(
                entry["samples_per_s"], figures["untracked"]["samples_per_s"]
            )
    return out


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every figure of every row, and of every ratio, over the rounds."""

    def of(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return median(present) if len(present) == len(values) else None

    first = rounds[0]
    return {
        "rows": {
            row: {key: of([r["rows"][row][key] for r in rounds]) for key in entry}
            for row, entry in first["rows"].items()
        },
        "ratios": {key: of([r["ratios"][key] for r in rounds]) for key in first["ratios"]},
    }


def check_targets(rounds: list[dict[str, Any]], middle: dict[str, Any]) -> list[dict[str, Any]]:
    checked = []
    for key, what, op, threshold, spec in TARGETS:
        value = middle["ratios"][key]
        met = None if value is None else value >= threshold if op == ">=" else value <= threshold
        checked.append(
            {
                "key": key,
                "what": what,
                "target": f"{op} {threshold:g}",
                "value": value,
                "per_round": [r["ratios"][key] for r in rounds],
                "met": met,
                "format": spec,
            }
        )
    return checked


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    out = [
        f"compare: {s['steps']} steps at batch {s['batch_size']} on {s['device']}, "
        f"median of {s['pairs']} alternating round(s); {result['machine']['cpu']}, "
        f"{result['machine']['cpus']} CPUs, torch {result['machine']['torch']}; load average "
        f"{result['machine']['load_before']:.1f} before, {result['machine']['load_after']:.1f} after",
        "",
    ]
    middle = result["median"]
    lines = []
    for row, command in result["commands"].items():
        m, r = middle["rows"][row], middle["ratios"]
        lines.append(
            [
                row,
                cell(m["wall_s"], ".2f"),
                cell(r[f"{row} / lesson wall"], ".3f"),
                cell(m["cpu_s"], ".2f"),
                cell(m["peak_rss_mb"], ".0f"),
                cell(m.get("samples_per_s"), ",.0f"),
                cell(r.get(f"{row} / untracked samples/s"), ".3f"),
                cell(m.get("startup_s"), ".2f"),
                cell(m.get("tracking_s"), ".3f"),
                command,
            ]
        )
    headers = ["row", "wall s", "/ lesson", "CPU s", "peak RSS MB", "samples/s"]
    headers += ["/ untracked", "start-up s", "tracking s", "command"]
    out.append(table(headers, lines))
    for row, why in result["skipped"].items():
        out.append(f"{row}: not measured: {why}")
    out += ["", "targets (median of the rounds)"]
    lines = [
        [
            t["what"],
            cell(t["value"], t["format"]),
            t["target"],
            {True: "met", False: "MISSED", None: "not measured"}[t["met"]],
            " ".join(cell(v, t["format"]) for v in t["per_round"]),
        ]
        for t in result["targets"]
    ]
    out.append(table(["figure", "value", "target", "result", "rounds"], lines))
    git = result["git"]
    out.append(
        f"reprotrain imported from {result['reprotrain_from']}; this checkout at commit "
        f"{git['commit']}" + (" with uncommitted changes" if git["dirty"] else "")
    )
    return "\n".join(out)


def shown(command: list[str], folder: Path) -> str:
    """A command as a user would type it, the scratch folder written as <workdir>."""
    text = " ".join(["python", *command[1:]]).replace(str(folder), "<workdir>")
    return text.replace(str(HERE.parent) + os.sep, "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    check_device(args.device)
    load_before, git_before = os.getloadavg()[0], git_state()
    with tempfile.TemporaryDirectory(prefix="reprotrain-compare-") as scratch:
        folder = Path(scratch)
        commands, skipped = rows(args, folder)
        create_store(folder)
        rounds = run_rounds(args, commands, folder)
        texts = {row: shown(command, folder) for row, command in commands.items()}
    middle = medians(rounds)
    result = {
        "schema": 1,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": version("torch"),
            "mlflow": version("mlflow"),
            # Other work on the machine moves every figure: the 1-minute load average.
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        },
        "git": git_before,
        "git_after": git_state(),  # the working tree may change while the rounds run
        # Where the runs imported reprotrain from (PYTHONPATH may point away from this checkout).
        "reprotrain_from": str(Path(importlib.util.find_spec("reprotrain").origin).parent),
        "settings": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "pairs": args.pairs,
            "device": args.device,
            "with": args.extra,
        },
        "commands": texts,
        "skipped": skipped,
        "rounds": rounds,
        "median": middle,
        "targets": check_targets(rounds, middle),
    }
    publish(result, report(result), args.json)
    return result


if __name__ == "__main__":
    main()
