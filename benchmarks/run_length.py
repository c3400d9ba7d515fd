"""Do the figures a run records depend on how long it ran? (They must not.)

    python benchmarks/run_length.py                         # 300 against 3000 steps, 3 pairs
    python benchmarks/run_length.py --steps 300,3000 --pairs 5 --json run_length.json
    python benchmarks/run_length.py --steps 30,60 --pairs 1  # a quick look (the test runs this)

Each pair trains the same config (`device=cpu train.batch_size=64 tracking.log_model=false`,
a store in a temporary folder) once at the short and once at the long length, one after the
other, each in a process of its own as a user runs it. From each run's run.json it prints, side
by side:

- throughput per speed: the recorded samples/s over the rate the run's median step gives. A
  shared machine runs the same config faster or slower from one process to the next, which no
  run can help; the median step, which a few slow steps do not move, says how fast it ran.
  Work of reprotrain's inside the timing window (MLflow's import, a flush, a checkpoint)
  lowers samples/s and not the median step. The pair's ratio, short over long, is ~1.0 when
  the window holds only training.
- the phase share: the mean of data_to_device + forward + backward + optimizer over the mean
  step that samples/s gives. Both are means over the same steps; the share falls short of 1.0
  by what the loop does between the timed phases (fetching the next batch, the clock's marks).
- the checkpoint share: time/checkpoint_s over the training time.

Nothing is asserted: the figures depend on the machine. The medians over pairs are printed,
and written with every run's figures to --json when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("data_to_device", "forward", "backward", "optimizer")
CONFIG = ("runtime=local", "device=cpu", "train.batch_size=64", "tracking.log_model=false")


def lengths(text: str) -> tuple[int, int]:
    try:
        short, long = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steps {text!r}: two step counts are needed, short then long; try --steps 300,3000"
        ) from None
    if not 0 < short < long:
        raise argparse.ArgumentTypeError(
            f"--steps {text!r}: the short length must be above 0 and below the long one; "
            "try --steps 300,3000"
        )
    return short, long


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: at least 1 pair; try --pairs 3")
    return int(text)


def run_once(folder: Path, steps: int, extra: list[str]) -> dict:
    """One `python -m reprotrain.train` run of `steps` steps; its run.json."""
    out = folder / f"run-{steps}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            *CONFIG,
            f"train.steps={steps}",
            f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
            f"train.output_dir={out}",
            f"train.checkpoint_dir={folder / 'checkpoints'}",
            *extra,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"run_length: a {steps}-step run failed: {tail[0]}")
    return json.loads((out / "run.json").read_text())


def figures(run: dict) -> dict[str, float]:
    """What this benchmark reads off one run.json."""
    step_ms = run["batch_size"] * 1e3 / run["samples_per_s"]  # the mean step samples/s gives
    median_rate = run["batch_size"] / (run["step_ms_median"] / 1e3)
    return {
        "samples_per_s": run["samples_per_s"],
        "per_speed": run["samples_per_s"] / median_rate,
        "phase_share": sum(run[f"{phase}_ms_mean"] for phase in PHASES) / step_ms,
        "checkpoint_share": run["checkpoint_s"] / (run["steps"] * step_ms / 1e3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=lengths, default=(300, 3000), help="short,long")
    parser.add_argument("--pairs", type=at_least_one, default=3)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("overrides", nargs="*", help="more overrides for every run")
    args = parser.parse_args(argv)
    short, long = args.steps
    pairs = []
    with tempfile.TemporaryDirectory(prefix="reprotrain-run-length-") as scratch:
        for _ in range(args.pairs):
            pairs.append(
                {
                    str(steps): figures(run_once(Path(scratch), steps, args.overrides))
                    for steps in (short, long)
                }
            )
    ratios = [pair[str(short)]["per_speed"] / pair[str(long)]["per_speed"] for pair in pairs]
    print(f"run length: {short} against {long} steps, {args.pairs} pair(s), {' '.join(CONFIG)}")
    print(
        f"{'pair':>4}  {'steps':>6}  {'samples/s':>10}  {'per speed':>9}  {'phases':>6}  {'ckpt':>6}"
    )
    for number, pair in enumerate(pairs, 1):
        for steps in (short, long):
            f = pair[str(steps)]
            print(
                f"{number:>4}  {steps:>6}  {f['samples_per_s']:>10.0f}  {f['per_speed']:>9.3f}  "
                f"{f['phase_share']:>6.3f}  {f['checkpoint_share']:>6.4f}"
            )
    median = {
        str(steps): {
            key: statistics.median(pair[str(steps)][key] for pair in pairs)
            for key in ("per_speed", "phase_share", "checkpoint_share")
        }
        for steps in (short, long)
    }
    summary = {
        "steps": [short, long],
        "pairs": pairs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "median": median,
    }
    print(
        f"throughput per speed, {short} over {long} steps: {summary['median_ratio']:.3f} "
        f"(median of {', '.join(f'{r:.3f}' for r in ratios)}; ~1.0: the window holds training only)"
    )
    for steps in (short, long):
        m = median[str(steps)]
        print(
            f"{steps} steps: phases cover {m['phase_share']:.3f} of the mean step, "
            f"checkpoints {m['checkpoint_share']:.4f} of the training time (medians)"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
