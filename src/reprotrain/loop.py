"""The training loop, as the course writes it, with timing, tracking and checkpoints hanging
off small calls.

    fitted = fit(model, batches, loss_fn, optimizer, device=device, train=cfg.train,
                 recorder=tracked, scheduler=scheduler)

Each step: move the batch to the device (inside the loop), then forward, loss, zero_grad,
backward, step (`step.train_step`, or its compiled / CUDA-graph form: fastpaths.py), then the
scheduler. Losses stay on the device and are read every `train.log_every` steps: one sync
per window, not one per step.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from reprotrain import fastpaths
from reprotrain.devices import synchronize
from reprotrain.errors import UserError
from reprotrain.progress import Progress
from reprotrain.schema import TrainConfig
from reprotrain.step import move_batch_to_device
from reprotrain.stopping import GracefulStop
from reprotrain.timing import PHASES, PhaseClock, TimingSummary

# The figures fit() measures (Fitted.timings), as a last step's checkpoint keeps them.
TIMING_KEYS = (
    "samples_per_s",
    "step_ms_median",
    "tracking_s",
    "tracking_wait_s",
    "checkpoint_s",
    *(f"{phase}_ms_mean" for phase in PHASES),
)


@dataclass
class Fitted:
    """What fit() leaves: every step's loss, the timings, and how many losses were not finite."""

    steps: list[int]
    losses: list[float]
    timings: dict[str, float]
    nonfinite_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def fit(
    model: nn.Module,
    batches: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    train: TrainConfig,
    recorder: Any,
    scheduler: Any = None,
    scheduler_interval: str = "step",
    total: int,
    start: int = 0,
    losses: list[float] | None = None,
    save: Callable[[int, list[float], list[float]], None] | None = None,
    stop: GracefulStop | None = None,
    loss_every: int = 1,
    window_values: list[float] | None = None,
    group: Any = None,
) -> Fitted:
    """Train from step `start` (a resumed run: `losses` holds the earlier steps', and
    `window_values` those of a `loss_every` window not yet logged) to `total`.
    `save(step, losses, window_values)` writes a checkpoint; `recorder` gets `train/loss`
    (each step, or the mean of every `loss_every` steps), `train/lr` with a scheduler,
    `time/step_ms`. Under torchrun `group` (runtime.distributed.Group) averages each window's
    losses over the ranks, and a stop is agreed on at window boundaries, so every rank stops
    at the same step."""
    step_fn = fastpaths.step_function(train, device, model, loss_fn, optimizer)
    losses = list(losses or [])
    steps = list(range(1, start + 1))
    warmup_end = start + train.warmup_steps
    clock, summary = PhaseClock(device), TimingSummary(warmup_end)
    window = LossWindow(recorder, loss_every, total, window_values)
    world = group.world_size if group is not None else 1
    progress = Progress(total, train.progress if group is None or group.main else "off")
    stop = stop or GracefulStop()
    pending: list[torch.Tensor] = []
    nonfinite: list[int] = []
    per_epoch = batches.batches_per_epoch
    measure_from = None
    cadence = CheckpointCadence(train.checkpoint_every, train.checkpoint_every_s, start)
    bookkeeping_s = {"tracking": 0.0, "checkpoint": 0.0}  # inside the loop, not training
    waited_s = 0.0  # for the MLflow run to open (time/tracking_wait_s), before the window

    def record_window(step: int) -> None:
        """Read the window's losses off the device and hand them to the recorder."""
        began = time.perf_counter()
        stacked = torch.stack(pending).float()
        if group is not None:
            stacked = group.mean(stacked)  # every rank's loss: the global batch's mean
        values = stacked.cpu().tolist()  # sync point: one read per window
        first = step - len(pending) + 1
        pending.clear()
        bad = check_finite(values, first, losses, train.nonfinite)
        if bad and not nonfinite:
            print(
                f"reprotrain: warning: the loss became {values[bad[0] - first]} at step {bad[0]}; "
                "training goes on (train.nonfinite=warn)",
                file=sys.stderr,
                flush=True,
            )
        nonfinite.extend(bad)
        window.add(first, values)
        timed = clock.drain()
        for timed_step, phases in timed:
            summary.add(timed_step, phases)
        # One point per window (its mean): the end-of-run medians give the rest.
        recorder.log_metric("time/step_ms", float(np.mean([p["step"] for _, p in timed])), step)
        if scheduler is not None:
            recorder.log_metric("train/lr", optimizer.param_groups[0]["lr"], step)
        steps.extend(range(first, step + 1))
        losses.extend(values)
        rate = (
            world * train.batch_size / (summary.median("step") / 1e3)
            if summary.measured_steps
            else 0.0
        )
        progress.update(step, values[-1], rate)
        bookkeeping_s["tracking"] += time.perf_counter() - began

    def checkpoint(step: int) -> None:
        began = time.perf_counter()
        if save is not None:
            save(step, losses, window.values)
        took = time.perf_counter() - began
        bookkeeping_s["checkpoint"] += took
        cadence.saved(step, took)

    def begin_measuring() -> float:
        """The throughput clock starts once the warm-up is done and the run is open, its
        tracking worker idle (tracking/worker.py): MLflow's imports and set-up never share
        the CPU with a timed step, whatever the run's length. How long the loop waited for
        that is recorded on its own (time/tracking_wait_s)."""
        nonlocal waited_s
        began = time.perf_counter()
        recorder.ready()
        waited_s = time.perf_counter() - began
        synchronize(device)  # sync point: the clock starts with the device idle
        for key in bookkeeping_s:
            bookkeeping_s[key] = 0.0
        return time.perf_counter()

    step = start
    recorder.start()  # the MLflow run opens in the tracking worker beside the warm-up steps
    if warmup_end == start:  # no warm-up: measure from the first step
        measure_from = begin_measuring()
    stop.in_loop = True
    try:
        for step, batch in enumerate(batches.take(total, start=start), start=start + 1):
            clock.start_step()
            inputs, targets = move_batch_to_device(batch, device)  # every batch, inside the loop
            clock.mark("data_to_device")
            loss = step_fn(inputs, targets, clock.mark)  # forward, loss, zero_grad, backward, step
            clock.end_step(step)
            if scheduler is not None and (scheduler_interval == "step" or step % per_epoch == 0):
                scheduler.step()
            pending.append(loss)
            if step == warmup_end:
                measure_from = begin_measuring()
            at_window = step % train.log_every == 0 or step == total
            if at_window:
                record_window(step)
                # The last step's checkpoint is written after the loop, with the timings.
                if step < total and cadence.due(step):
                    checkpoint(step)
            stopping = stop.requested is not None  # a signal arrived: stop at this boundary
            if group is not None and group.active:  # all ranks at the same window boundary
                stopping = at_window and group.any(stopping, device)
                stop.requested = stop.requested or (signal.SIGTERM if stopping else None)
            if stopping:
                if pending:
                    record_window(step)
                window.flush(step)
                checkpoint(step)
                stop.check()
    finally:
        stop.in_loop = False
        progress.close()
    synchronize(device)  # sync point: all queued work is done before the clock stops
    loop_end = time.perf_counter()
    measured = total - warmup_end if measure_from is not None else 0
    # Throughput counts training only: time spent reading losses, sending them and writing
    # checkpoints inside the window is reported on its own (time/tracking_s, time/checkpoint_s).
    elapsed = (loop_end - measure_from - sum(bookkeeping_s.values())) if measure_from else 0.0
    timings = {  # samples/s of the whole job: every rank's samples
        "samples_per_s": world * measured * train.batch_size / elapsed
        if elapsed > 0
        else float("nan"),
        "step_ms_median": summary.median("step"),
        "tracking_s": bookkeeping_s["tracking"],
        "tracking_wait_s": waited_s,
        "checkpoint_s": bookkeeping_s["checkpoint"],
        **{f"{phase}_ms_mean": summary.mean(phase) for phase in PHASES},
    }
    return Fitted(steps, losses, timings, len(nonfinite))


class CheckpointCadence:
    """When the loop writes a checkpoint: every `every` steps (0: no step cadence), and every
    `every_s` seconds (0: none), never sooner than `1 / SHARE` times the last checkpoint's own
    duration after it, so checkpoints by time take at most 1% of the run however large the
    model. Checked at each `train.log_every` window."""

    SHARE = 0.01

    def __init__(self, every: int, every_s: float, start: int) -> None:
        self.every, self.every_s = every, every_s
        self.step, self.at, self.took = start, time.monotonic(), 0.0

    def due(self, step: int) -> bool:
        if self.every and step - self.step >= self.every:
            return True
        wait = max(self.every_s, self.took / self.SHARE)
        return bool(self.every_s) and time.monotonic() - self.at >= wait

    def saved(self, step: int, took_s: float) -> None:
        self.step, self.at, self.took = step, time.monotonic(), took_s


class LossWindow:
    """`train/loss` points: every step (loss_every=1), or the mean of each `loss_every` steps,
    logged at the window's last step. loss.csv keeps every step either way."""

    def __init__(
        self, recorder: Any, loss_every: int, total: int, values: list[float] | None = None
    ) -> None:
        self.recorder, self.every, self.total = recorder, loss_every, total
        self.values: list[float] = list(values or [])  # a resumed run's unlogged window

    def add(self, first: int, values: list[float]) -> None:
        for step, value in enumerate(values, start=first):
            if self.every == 1:
                self.recorder.log_metric("train/loss", value, step)
                continue
            self.values.append(value)
            if step % self.every == 0 or step == self.total:
                self.flush(step)

    def flush(self, step: int) -> None:
        if self.values:
            self.recorder.log_metric("train/loss", float(np.mean(self.values)), step)
            self.values = []


def check_finite(
    values: list[float], first_step: int, history: list[float], mode: str = "stop"
) -> list[int]:
    """The steps whose loss is NaN/inf; under train.nonfinite=stop the first one ends the run."""
    bad = []
    for offset, value in enumerate(values):
        if np.isfinite(value):
            continue
        if mode == "stop":
            finite = [v for v in history + values[:offset] if np.isfinite(v)]
            last = f"{finite[-1]:.6g}" if finite else "none"
            raise UserError(
                f"the loss became {value} at step {first_step + offset} (last finite loss {last})",
                hint="lower optimizer.lr, check the data for NaN/inf, or use a smaller model "
                "(train.nonfinite=warn logs it and goes on)",
            )
        bad.append(first_step + offset)
    return bad
