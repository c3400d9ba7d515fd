"""What MLflow tracking costs a training loop (target: under 3% of training time).

    python benchmarks/tracking_overhead.py              # 15 rounds of 1000 steps, batch 64, CPU
    python benchmarks/tracking_overhead.py --quick      # CI: 3 rounds of 60 steps
    python benchmarks/tracking_overhead.py --rounds 9 --steps 2000 --loss-every 1,5,50

A plain training loop (the reference MLP 784-512-10, fused AdamW, cross-entropy, synthetic
data resident in memory) runs untracked and tracked: a TrackedRun on a real sqlite store in a
temporary folder receiving one `train/loss` point every N steps (the mean of the N losses
since the last point; N=1 is every step's loss), for each N of --loss-every. Each round runs
every variant once, in a rotating order, in one process, so a change in machine load hits
them alike; a variant's cost in a round is its extra time over that round's untracked run, as
a share of the untracked time, and the figure is the median over rounds.

Both variants read the losses off the device the same way (every step here: the CPU has no
sync to save), so the difference is the tracking alone. The tracked window includes the last
send of buffered points; opening the MLflow run happens once per run, before the window, and
is printed on its own. Also printed: the time spent inside tracking calls (the direct cost,
measured around each call), and what one point costs to send with log_batch. Timings depend
on the machine: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from reprotrain.tracking import Point, TrackedRun, prepare_store

TARGET = 0.03  # tracking should cost under 3% of training time
SEED = 0
SAMPLES = 8192  # synthetic MNIST-sized inputs, resident in memory


@dataclass
class Timing:
    """One run: the measured window, and for a tracked run what its tracking took."""

    window_s: float
    in_tracking_s: float = 0.0  # inside log_metric and the last flush
    open_s: float = 0.0  # opening the MLflow run (before the window)
    last_send_s: float = 0.0
    sends: list[tuple[int, float]] = field(default_factory=list)  # (points, seconds)


def reference_setup(batch_size: int) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    """The same weights, optimizer and batches for every run."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(SAMPLES, 784, generator=generator)
    targets = torch.randint(0, 10, (SAMPLES,), generator=generator)
    order = torch.randperm(SAMPLES, generator=generator)
    batches = [
        (inputs[order[i : i + batch_size]], targets[order[i : i + batch_size]])
        for i in range(0, SAMPLES - batch_size + 1, batch_size)
    ]
    return model, optimizer, batches


def train(
    batch_size: int, steps: int, warmup: int, run: TrackedRun | None, loss_every: int
) -> Timing:
    """The five steps per batch; with `run`, one train/loss point every `loss_every` steps."""
    model, optimizer, batches = reference_setup(batch_size)
    loss_fn = nn.CrossEntropyLoss()
    timing = Timing(window_s=0.0)
    window: list[float] = []
    began = 0.0
    for step in range(1, steps + 1):
        if step == warmup + 1:
            began = time.perf_counter()  # timing boundary: warm-up steps are left out
            timing.in_tracking_s = 0.0
        inputs, targets = batches[(step - 1) % len(batches)]
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        window.append(loss.item())  # both variants read every loss (a CPU tensor: no sync)
        if run is not None and len(window) == loss_every:
            called = time.perf_counter()
            run.log_metric("train/loss", sum(window) / loss_every, step)
            timing.in_tracking_s += time.perf_counter() - called
        if len(window) == loss_every:
            window = []
    if run is not None:  # the points still buffered are part of the tracked run's cost
        called = time.perf_counter()
        run.metrics.flush()
        timing.last_send_s = time.perf_counter() - called
        timing.in_tracking_s += timing.last_send_s
    timing.window_s = time.perf_counter() - began
    return timing


def tracked(uri: str, batch_size: int, steps: int, warmup: int, loss_every: int) -> Timing:
    run = TrackedRun(
        uri, "tracking-overhead", f"every-{loss_every}", {}, {"loss_every": loss_every}
    )
    with run:
        began = time.perf_counter()
        run.ready()  # opened before the window: once per run, not per step
        open_s = time.perf_counter() - began
        sends: list[tuple[int, float]] = []
        send = run.metrics.send

        def timed_send(points: list[Point]) -> None:
            called = time.perf_counter()
            send(points)
            sends.append((len(points), time.perf_counter() - called))

        run.metrics.send = timed_send
        timing = train(batch_size, steps, warmup, run, loss_every)
    timing.open_s, timing.sends = open_s, sends
    return timing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 60 steps (CI)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 1000)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--loss-every", default="1,10,25", help="cadences N to measure (comma-separated)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 15)
    steps = args.steps or (60 if args.quick else 1000)
    cadences = [int(n) for n in args.loss_every.split(",")]
    if steps <= args.warmup:
        parser.error(f"--steps={steps} must be larger than --warmup={args.warmup}")

    load_before = os.getloadavg()[0]
    variants: list[int | None] = [None, *cadences]  # None: untracked
    results: dict[int | None, list[Timing]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="reprotrain-overhead-") as scratch:
        uri = f"sqlite:///{Path(scratch) / 'mlflow.db'}"
        prepare_store(uri)  # schema creation is not part of any run's time
        tracked(uri, args.batch_size, steps, args.warmup, 1)  # warms up MLflow and the store
        for index in range(rounds):
            shift = index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant is None:
                    timing = train(args.batch_size, steps, args.warmup, None, 1)
                else:
                    timing = tracked(uri, args.batch_size, steps, args.warmup, variant)
                results[variant].append(timing)
            print(
                f"round {index + 1}/{rounds}: "
                + "  ".join(
                    f"{'off' if v is None else f'N={v}'} {results[v][-1].window_s:.3f} s"
                    for v in variants
                ),
                flush=True,
            )
    report(results, cadences, args.batch_size, steps - args.warmup, rounds)
    print(
        f"machine load (1-minute average, {os.cpu_count()} CPUs): {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after: other work on the machine moves every figure"
    )


def report(
    results: dict[int | None, list[Timing]],
    cadences: list[int],
    batch_size: int,
    measured: int,
    rounds: int,
) -> None:
    off = results[None]
    off_s = statistics.median(t.window_s for t in off)
    print(
        f"\nplain loop at batch {batch_size} on cpu ({torch.get_num_threads()} threads), "
        f"{measured} measured steps per run, {rounds} rounds"
    )
    print(
        f"untracked: {measured * batch_size / off_s:>9,.0f} samples/s, "
        f"{off_s / measured * 1e3:.3f} ms/step (median)"
    )
    for n in cadences:
        runs = results[n]
        costs = sorted(t.window_s / o.window_s - 1 for t, o in zip(runs, off, strict=True))
        inside = [t.in_tracking_s / o.window_s for t, o in zip(runs, off, strict=True)]
        cost = statistics.median(costs)
        points = sum(p for t in runs for p, _ in t.sends)
        send_s = sum(s for t in runs for _, s in t.sends)
        print(
            f"train/loss every {n:>2} step(s): costs {cost:.1%} of training time (median of "
            f"the rounds; {costs[0]:.1%} to {costs[-1]:.1%}; target < {TARGET:.0%}: "
            f"{'met' if cost < TARGET else 'not met'}); inside tracking calls "
            f"{statistics.median(inside):.1%} (median; {min(inside):.1%} to {max(inside):.1%})"
        )
        print(
            f"    log_batch: {send_s / max(points, 1) * 1e3:.3f} ms per point sent "
            f"({points} points in {sum(len(t.sends) for t in runs)} sends); the last send "
            f"{statistics.median(t.last_send_s for t in runs) * 1e3:.1f} ms per run (median); "
            f"opening the run {statistics.median(t.open_s for t in runs) * 1e3:.1f} ms "
            "per run, outside the window"
        )


if __name__ == "__main__":
    sys.exit(main())
