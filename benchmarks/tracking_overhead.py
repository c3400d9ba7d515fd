"""What MLflow tracking costs reprotrain's training loop (target: under 3% of training time).

    python benchmarks/tracking_overhead.py              # 15 pairs of 1000 steps, batch 64, CPU
    python benchmarks/tracking_overhead.py --quick      # CI: 3 pairs of 60 steps
    python benchmarks/tracking_overhead.py --pairs 9 --steps 1000 --batch-size 256

Runs reprotrain's fit() with tracking on (a TrackedRun on a real sqlite store in a temporary
folder, every step's loss recorded) and off (NoRun), alternating on/off in one process so a
change in machine load hits both alike. Throughput is fit()'s wall-clock samples/s after
warm-up plus the final send of buffered points (see reprotrain.bench.variants.reprotrain_step).
Opening the MLflow run happens once per run, before the timed window: it is printed on its
own, with what it would add to runs this short. Prints the medians, the tracking's share of
training time (median of the pairs) and the time spent inside tracking calls (its direct
cost, measured around each call); it does not assert the target, since timings depend on the
machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from reprotrain.bench.reference import SEED, bench_dataset
from reprotrain.bench.variants import reprotrain_step
from reprotrain.tracking import prepare_store
from reprotrain.train import seed_everything, set_threads

TARGET = 0.03  # tracking should cost under 3% of training time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs of 60 steps (CI)")
    parser.add_argument("--pairs", type=int, default=None, help="on/off pairs (default 15)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 1000)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    pairs = args.pairs or (3 if args.quick else 15)
    steps = args.steps or (60 if args.quick else 1000)
    if steps <= args.warmup:
        parser.error(f"--steps={steps} must be larger than --warmup={args.warmup}")

    device = torch.device("cpu")
    set_threads("auto")
    seed_everything(SEED, True, device)
    dataset = bench_dataset(args.batch_size)
    on, off, opens, sends, windows, inside = [], [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="reprotrain-overhead-") as scratch:
        uri = f"sqlite:///{Path(scratch) / 'mlflow.db'}"
        prepare_store(uri)  # schema creation is not part of any run's time
        for pair in range(1, pairs + 1):
            tracked, _ = reprotrain_step(
                device, dataset, args.batch_size, steps, args.warmup, tracking_uri=uri
            )
            untracked, _ = reprotrain_step(device, dataset, args.batch_size, steps, args.warmup)
            on.append(tracked["samples_per_s"])
            off.append(untracked["samples_per_s"])
            opens.append(tracked["open_run_s"])
            sends.append(tracked["final_flush_s"])
            windows.append(untracked["window_s"])
            inside.append(tracked["in_tracking_s"] / untracked["window_s"])
            print(
                f"pair {pair}/{pairs}: tracking on {on[-1]:>10,.0f}  off {off[-1]:>10,.0f} samples/s",
                flush=True,
            )

    median_on, median_off = statistics.median(on), statistics.median(off)
    # A pair's cost: the tracked run's extra time over the untracked run's, as a share of the
    # untracked (training) time. Alternating pairs share the machine's drift; their median is
    # the figure, as for the fast paths in `python -m reprotrain.bench`.
    pair_costs = sorted(b / a - 1 for a, b in zip(on, off, strict=True))
    cost = statistics.median(pair_costs)
    print(
        f"\nfit() at batch {args.batch_size} on cpu ({torch.get_num_threads()} threads), "
        f"{steps - args.warmup} measured steps per run, {pairs} pairs"
    )
    print(f"tracking on : {median_on:>10,.0f} samples/s (median)")
    print(f"tracking off: {median_off:>10,.0f} samples/s (median)")
    print(f"ratio on/off: {median_on / median_off:.3f} (of the medians)")
    print(
        f"tracking costs {cost:.1%} of training time (median of the pairs; they range "
        f"{pair_costs[0]:.1%} to {pair_costs[-1]:.1%}; target < {TARGET:.0%}: "
        f"{'met' if cost < TARGET else 'not met'})"
    )
    print(
        f"time inside tracking calls (appending points, sending batches, the last send): "
        f"{statistics.median(inside):.1%} of training time (median; {min(inside):.1%} to "
        f"{max(inside):.1%})"
    )
    open_s, send_s = statistics.median(opens), statistics.median(sends)
    short = open_s / statistics.median(windows)
    print(
        f"the last send: {send_s * 1e3:.1f} ms per run (median). Outside the timed window: "
        f"opening the run, {open_s * 1e3:.1f} ms once per run (median); on runs as short as "
        f"these ({statistics.median(windows):.2f} s) that alone would be {short:.1%} more"
    )


if __name__ == "__main__":
    sys.exit(main())
