"""The Trainer: the lesson's training loop as one small class.

    trainer = Trainer(model, pieces, batches, device, cfg.train)
    trainer.load_state_dict(checkpoint["trainer"])    # a resumed run (optional)
    fitted = trainer.fit(total, recorder=run, save=write_checkpoint, stop=GracefulStop())
    # run: tracking.TrackedRun or NoRun; write_checkpoint(trainer) saves trainer.state_dict()
    val_loss, val_accuracy = trainer.validate()

`train_step(batch)` is one step as the course writes it: move the batch to the device (inside
the loop), then forward, loss, zero_grad, backward, step (step.train_step, or its compiled /
CUDA-graph form: fastpaths.py), then the scheduler. `fit()` runs steps and hangs the rest off
them through small calls: losses stay on the device and are read every `train.log_every`
steps (one sync per window, not one per step), handed to the recorder, checkpointed by
`save(trainer)` on the cadence, and a Ctrl-C / SIGTERM stops at the next step boundary.
`state_dict()` holds exactly what resuming needs and nothing of tracking: the recorder is
flushed before every checkpoint, so what the run still owed the store is in the store (or
its spool), never in the checkpoint.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from reprotrain import fastpaths
from reprotrain.build import Pieces
from reprotrain.data.batches import val_batches
from reprotrain.devices import synchronize
from reprotrain.errors import UserError
from reprotrain.progress import Progress
from reprotrain.schema import TrainConfig
from reprotrain.step import evaluate, move_batch_to_device
from reprotrain.stopping import GracefulStop
from reprotrain.timing import PHASES, PhaseClock, TimingSummary

# The figures fit() measures (Fitted.timings).
TIMING_KEYS = ("samples_per_s", "step_ms_median", "checkpoint_s", *(f"{p}_ms_mean" for p in PHASES))


class Recorder(Protocol):
    """Where fit() sends its points (tracking.TrackedRun, tracking.NoRun)."""

    def log_metric(self, key: str, value: float, step: int) -> None: ...
    def flush(self) -> None: ...


class Batches(Protocol):
    """The training batches (data.make_batches): `take` yields steps start+1 .. total."""

    batches_per_epoch: int

    def take(self, total: int, start: int = 0) -> Iterator[Any]: ...


class Ranks(Protocol):
    """This process's place in a torchrun job (runtime.distributed.Group)."""

    world_size: int
    main: bool
    active: bool

    def mean(self, values: torch.Tensor) -> torch.Tensor: ...
    def any(self, flag: bool, device: torch.device) -> bool: ...


class OneProcess:
    """Training in one process: the mean over ranks is the value itself."""

    world_size, main, active = 1, True, False

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        return flag


@dataclass
class Fitted:
    """What fit() leaves: every step's loss, the timings, and how many losses were not finite."""

    steps: list[int]
    losses: list[float]
    timings: dict[str, float]
    nonfinite_steps: int = 0


class Trainer:
    """Trains `model` (the module the step calls: `pieces.model`, or its DDP wrapper) with
    `pieces`' loss, optimizer and scheduler on `batches`, on `device`, as `train` says."""

    def __init__(
        self,
        model: nn.Module,
        pieces: Pieces,
        batches: Batches,
        device: torch.device,
        train: TrainConfig,
        group: Ranks | None = None,
    ) -> None:
        self.model, self.pieces, self.batches = model, pieces, batches
        self.device, self.train, self.group = device, train, group or OneProcess()
        self.step_fn = fastpaths.step_function(
            train, device, model, pieces.loss_fn, pieces.optimizer
        )
        self.clock = PhaseClock(device)
        self.step = 0
        self.losses: list[float] = []  # every step's loss: loss.csv and the loss window
        self.timings: dict[str, float] | None = None  # set when fit() reaches the last step
        self.nonfinite: list[int] = []

    def train_step(self, batch: Any) -> torch.Tensor:
        """One step of the lesson on `batch`; returns its loss, still on the device."""
        self.clock.start_step()
        inputs, targets = move_batch_to_device(batch, self.device)  # every batch, in the loop
        self.clock.mark("data_to_device")
        loss = self.step_fn(inputs, targets, self.clock.mark)  # forward, loss, zero_grad,
        self.step += 1  # backward, step
        self.clock.end_step(self.step)
        scheduler = self.pieces.scheduler
        per_epoch = self.pieces.scheduler_interval == "epoch"
        if scheduler is not None and (not per_epoch or self.step % self.epoch_length == 0):
            scheduler.step()
        return loss

    def fit(
        self,
        total: int,
        recorder: Recorder,
        save: Callable[[Trainer], None] | None = None,
        stop: GracefulStop | None = None,
        loss_every: int = 1,
    ) -> Fitted:
        """Train from the current step to `total`; `save(self)` writes a checkpoint;
        `loss_every` > 1 logs each window of that many steps' mean loss (tracking.loss_every)."""
        stop = stop or GracefulStop()
        window = Window(self, recorder, total, loss_every)
        cadence = CheckpointCadence(self.train.checkpoint_every, self.train.checkpoint_every_s)
        cadence.saved(self.step, 0.0)
        stop.in_loop = True
        try:
            for batch in self.batches.take(total, start=self.step):
                window.pending.append(self.train_step(batch))
                window.after_step()
                at_window = self.step % self.train.log_every == 0 or self.step == total
                if at_window:
                    window.record()
                    if self.step < total and cadence.due(self.step):
                        cadence.saved(self.step, self.checkpoint(recorder, save, window))
                if self.stopping(stop, at_window):
                    window.record()
                    self.checkpoint(recorder, save, window)
                    stop.check()  # raises: the run ends KILLED
        finally:
            stop.in_loop = False
            window.progress.close()
        self.timings = window.timings(total)
        return Fitted(list(range(1, total + 1)), self.losses, self.timings, len(self.nonfinite))

    def stopping(self, stop: GracefulStop, at_window: bool) -> bool:
        """A Ctrl-C / SIGTERM arrived: stop here. Under torchrun the ranks agree at window
        boundaries, so that every rank stops at the same step."""
        stopping = stop.requested is not None
        if self.group.active:
            stopping = at_window and self.group.any(stopping, self.device)
            stop.requested = stop.requested or (signal.SIGTERM if stopping else None)
        return stopping

    def checkpoint(
        self, recorder: Recorder, save: Callable[[Trainer], None] | None, window: Window
    ) -> float:
        """Send what the run owes the store, then save: seconds it took (time.checkpoint_s)."""
        if save is None or not self.group.main:
            return 0.0
        began = time.perf_counter()
        recorder.flush()
        save(self)
        took = time.perf_counter() - began
        window.checkpoint_s += took
        return took

    def validate(self) -> tuple[float, float]:
        """Mean loss and accuracy on the validation split (accuracy NaN for non-class targets)."""
        val = val_batches(self.pieces.splits.val, self.device)
        loss, accuracy, _ = evaluate(self.pieces.model, val, self.pieces.loss_fn, self.device)
        return loss, accuracy

    @property
    def epoch_length(self) -> int:
        return self.batches.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the model, optimizer and scheduler, the RNG states, the step
        (the batch order is derived from train.seed and the step), the losses so far, and
        once fit() has ended, its timings (a run killed after training finishes from them)."""
        scheduler = self.pieces.scheduler
        return {
            "step": self.step,
            "epoch": self.step // self.epoch_length,
            "model": self.pieces.model.state_dict(),
            "optimizer": self.pieces.optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "losses": list(self.losses),
            "timings": self.timings,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pieces.model.load_state_dict(state["model"])
        self.pieces.optimizer.load_state_dict(state["optimizer"])
        if self.pieces.scheduler is not None and state.get("scheduler") is not None:
            self.pieces.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.step, self.losses = int(state["step"]), list(state["losses"])
        self.timings = state.get("timings")
        self.nonfinite = [i + 1 for i, v in enumerate(self.losses) if not np.isfinite(v)]


class Window:
    """The bookkeeping of fit(): the losses of the steps since the last read, the phase times,
    the throughput clock (from the end of the warm-up) and the points each window logs:
    `train/loss` every step (or the mean of each `tracking.loss_every` steps), `train/step_ms`
    and `train/lr` once per window."""

    def __init__(self, trainer: Trainer, recorder: Recorder, total: int, loss_every: int) -> None:
        self.trainer, self.recorder, self.total = trainer, recorder, total
        self.pending: list[torch.Tensor] = []
        self.warmup_end = trainer.step + trainer.train.warmup_steps
        self.summary = TimingSummary(self.warmup_end)
        self.measure_from: float | None = None
        self.checkpoint_s = 0.0  # inside the measured window, reported on its own
        self.loss_every = loss_every
        group = trainer.group
        self.progress = Progress(total, trainer.train.progress if group.main else "off")
        if self.warmup_end == trainer.step:  # no warm-up: measure from the first step
            self.begin_measuring()

    def after_step(self) -> None:
        if self.trainer.step == self.warmup_end:
            self.begin_measuring()

    def begin_measuring(self) -> None:
        synchronize(self.trainer.device)  # sync point: the clock starts with the device idle
        self.checkpoint_s = 0.0
        self.measure_from = time.perf_counter()

    def record(self) -> None:
        """Read the window's losses off the device and hand them on."""
        if not self.pending:
            return
        trainer, step = self.trainer, self.trainer.step
        stacked = trainer.group.mean(torch.stack(self.pending).float())  # the global batch's
        values = stacked.cpu().tolist()  # sync point: one read per window
        first = step - len(self.pending) + 1
        self.pending.clear()
        check_finite(values, first, trainer.losses, trainer.train.nonfinite, trainer.nonfinite)
        trainer.losses.extend(values)
        self.log_losses(first, step)
        timed = trainer.clock.drain()
        for timed_step, phases in timed:
            self.summary.add(timed_step, phases)
        # One point per window (its mean): the end-of-run medians give the rest.
        self.recorder.log_metric(
            "train/step_ms", float(np.mean([p["step"] for _, p in timed])), step
        )
        if trainer.pieces.scheduler is not None:
            self.recorder.log_metric(
                "train/lr", trainer.pieces.optimizer.param_groups[0]["lr"], step
            )
        self.progress.update(step, values[-1], self.samples_per_s(self.summary.median("step")))

    def log_losses(self, first: int, last: int) -> None:
        """`train/loss` for steps first..last: each step, or each window's mean at its end
        (the window's losses come from the Trainer's history, so a resumed run needs none)."""
        losses, every = self.trainer.losses, self.loss_every
        for step in range(first, last + 1):
            if every == 1:
                self.recorder.log_metric("train/loss", losses[step - 1], step)
            elif step % every == 0 or step == self.total:
                begin = step - (step - 1) % every  # the window's first step
                self.recorder.log_metric(
                    "train/loss", float(np.mean(losses[begin - 1 : step])), step
                )

    def samples_per_s(self, step_ms: float) -> float:
        """Samples per second of the whole job (every rank's) at `step_ms` a step."""
        batch = self.trainer.group.world_size * self.trainer.train.batch_size
        return batch / (step_ms / 1e3) if np.isfinite(step_ms) and step_ms > 0 else 0.0

    def timings(self, total: int) -> dict[str, float]:
        """Throughput over the measured steps, wall clock: it counts reading the losses and
        handing them to the recorder, not the checkpoints (time.checkpoint_s)."""
        synchronize(self.trainer.device)  # sync point: all queued work is done
        elapsed = time.perf_counter() - (self.measure_from or 0.0) - self.checkpoint_s
        measured = total - self.warmup_end if self.measure_from is not None else 0
        batch = self.trainer.group.world_size * self.trainer.train.batch_size
        return {
            "samples_per_s": measured * batch / elapsed if measured and elapsed > 0 else np.nan,
            "step_ms_median": self.summary.median("step"),
            "checkpoint_s": self.checkpoint_s,
            **{f"{phase}_ms_mean": self.summary.mean(phase) for phase in PHASES},
        }


class CheckpointCadence:
    """When fit() writes a checkpoint: every `every` steps (0: no step cadence), and every
    `every_s` seconds (0: none), never sooner than `1 / SHARE` times the last checkpoint's own
    duration after it, so checkpoints by time take at most 1% of the run however large the
    model. Checked at each `train.log_every` window."""

    SHARE = 0.01

    def __init__(self, every: int, every_s: float) -> None:
        self.every, self.every_s = every, every_s
        self.step, self.at, self.took = 0, time.monotonic(), 0.0

    def due(self, step: int) -> bool:
        if self.every and step - self.step >= self.every:
            return True
        wait = max(self.every_s, self.took / self.SHARE)
        return bool(self.every_s) and time.monotonic() - self.at >= wait

    def saved(self, step: int, took_s: float) -> None:
        self.step, self.at, self.took = step, time.monotonic(), took_s


def check_finite(
    values: Iterable[float], first_step: int, history: list[float], mode: str, bad: list[int]
) -> None:
    """Add the steps whose loss is NaN/inf to `bad`; under train.nonfinite=stop the first one
    ends the run, under warn the first one is a warning."""
    values = list(values)
    for offset, value in enumerate(values):
        if np.isfinite(value):
            continue
        step = first_step + offset
        if mode == "stop":
            finite = [v for v in history + values[:offset] if np.isfinite(v)]
            last = f"{finite[-1]:.6g}" if finite else "none"
            raise UserError(
                f"the loss became {value} at step {step} (last finite loss {last})",
                hint="lower optimizer.lr, check the data for NaN/inf, or use a smaller model "
                "(train.nonfinite=warn logs it and goes on)",
            )
        if not bad:
            print(
                f"reprotrain: warning: the loss became {value} at step {step}; "
                "training goes on (train.nonfinite=warn)",
                file=sys.stderr,
                flush=True,
            )
        bad.append(step)
