"""The Trainer: the lesson's training loop as one small class, on plain torch objects.

    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), train_ds, val_data=val_ds,
                      device="auto", batch_size=64, val_every=50)
    trainer.fit(steps=500)                  # or epochs=3; continues from trainer.step
    trainer.validate()                      # {"val/loss": ..., "val/<metric>": ...}
    state = trainer.state_dict()            # what resuming needs; load_state_dict(state)

`train_step(batch)` is one step as the course writes it: move the batch to the device (inside
the loop), then forward, loss, zero_grad, backward, step (step.train_step, or its compiled /
CUDA-graph form: fastpaths.py), then the scheduler. `fit()` runs steps and hangs the rest off
them through small calls: losses stay on the device and are read every `log_every` steps (one
sync per window, not one per step), handed to the recorder, checkpointed by `save(trainer)`
on the cadence, and a Ctrl-C / SIGTERM (a `GracefulStop` the caller installed) stops at the
next step boundary. `state_dict()` holds exactly what resuming needs and nothing of tracking:
the recorder is flushed before every checkpoint, so what the run still owed the store is in
the store (or its spool), never in the checkpoint.

The keyword arguments beyond the pieces are the `train` config section's keys (conf/train/,
their defaults there): `batch_size`, `seed`, `log_every`, `val_every`, `clip_grad_norm`,
`accumulate_grad_batches`, `early_stopping`, `keep_best`, `precision`, ... The Trainer changes
nothing process-wide (threads, seeds, deterministic algorithms, signal handlers): that is the
`Run`'s job (run.py), which builds the pieces from a config and hands them to a Trainer.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from reprotrain import fastpaths
from reprotrain.callbacks import Callback, EarlyStopping, improved
from reprotrain.data.batches import (
    Batches,
    Reading,
    make_batches,
    val_batches,
    validation_batch_size,
)
from reprotrain.data.splits import MapDataset
from reprotrain.devices import resolve_device, synchronize
from reprotrain.errors import ConfigError, UserError
from reprotrain.metrics import MISFIT_ERRORS, Metric, higher_is_better, misfit
from reprotrain.metrics import compute as compute_metrics
from reprotrain.progress import Progress
from reprotrain.schema import TrainConfig, train_config
from reprotrain.seeding import VALIDATION_STREAM, restore_rng_states, rng_states, seeded
from reprotrain.step import LossFn, Scheduler, evaluate, move_batch_to_device
from reprotrain.stopping import GracefulStop, Interrupted
from reprotrain.tasks import Classification, Task
from reprotrain.timing import PHASES, PhaseClock, TimingSummary
from reprotrain.tracking.recorder import NoRun, Recorder

# The figures fit() measures (Fitted.timings).
TIMING_KEYS = ("samples_per_s", "step_ms_median", "checkpoint_s", *(f"{p}_ms_mean" for p in PHASES))

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Scheduler]
Data = MapDataset | DataLoader


class Ranks(Protocol):
    """This process's place in a torchrun job (distributed.Group), read only."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def main(self) -> bool: ...
    @property
    def active(self) -> bool: ...

    def mean(self, values: torch.Tensor) -> torch.Tensor: ...
    def any(self, flag: bool, device: torch.device) -> bool: ...
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module: ...


class OneProcess:
    """Training in one process: the mean over ranks is the value itself."""

    rank, world_size, main, active = 0, 1, True, False

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def any(self, flag: bool, device: torch.device) -> bool:
        return flag

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model


@dataclass
class Fitted:
    """What fit() leaves: every step's loss, the timings, how many losses were not finite, and
    the final validation's figures ({"val/loss": ..., "val/<metric>": ...})."""

    steps: list[int]
    losses: list[float]
    timings: dict[str, float]
    nonfinite_steps: int = 0
    validation: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Trains `model` with `optimizer` on `train_data`, on `device`.

    - `model`: any `nn.Module`; moved to the device once, here.
    - `optimizer`: an optimizer over the model's parameters, or a factory taking them
      (`functools.partial(torch.optim.AdamW, lr=1e-3)`).
    - `train_data`, `val_data`: map-style `Dataset`s whose items are `(input, target)`, longer
      tuples or dicts, or `DataLoader`s (their dataset, batch size, collate function and
      workers are used; the order of each epoch comes from `seed` and the epoch, so a resumed
      fit sees the batches an uninterrupted one does).
    - `task`: how a batch reaches the model and becomes a loss (tasks.py; `Classification()`).
    - `loss_fn`: the loss (`nn.CrossEntropyLoss()` when left out; unused when the model
      returns its own loss).
    - `scheduler`: an LR scheduler (or a factory taking the optimizer), stepped every step
      (`scheduler_interval="epoch"`: every epoch); a `ReduceLROnPlateau` is stepped with the
      validation figure `monitor` (default `val/loss`).
    - `metrics`: `{name: torchmetrics metric}`, logged as `val/<name>`.
    - `callbacks`: objects with some of `Callback`'s methods (callbacks.py).
    - `recorder`: where the points go (`MlflowRecorder()` for the active MLflow run); none by
      default.
    - `**knobs`: the `train` section's keys (see the module's docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        train_data: Data,
        *,
        val_data: Data | None = None,
        task: Task | None = None,
        loss_fn: LossFn | None = None,
        scheduler: Scheduler | SchedulerFactory | None = None,
        metrics: Mapping[str, Metric] | None = None,
        callbacks: Iterable[Callback] | Mapping[str, Callback] = (),
        device: str | torch.device = "auto",
        recorder: Recorder | None = None,
        scheduler_interval: str = "step",
        monitor: str | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        loss_every: int = 1,
        ranks: Ranks | None = None,
        **knobs: Any,
    ) -> None:
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        train_data, val_data, collate_fn, knobs = _from_loaders(
            train_data, val_data, collate_fn, knobs
        )
        self.train: TrainConfig = train_config(**knobs)
        self.group: Ranks = ranks or OneProcess()
        self.model = model.to(self.device)  # once, before the loop
        self.module = self.group.wrap(self.model, self.device)  # what the step calls (DDP)
        self.optimizer = (
            optimizer
            if isinstance(optimizer, torch.optim.Optimizer)
            else optimizer(self.model.parameters())
        )
        self.task: Task = (task or Classification()).bind(self.model)
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.loss_fn = loss_fn.to(self.device) if isinstance(loss_fn, nn.Module) else loss_fn
        self.scheduler: Scheduler | None = (
            scheduler
            if scheduler is None or isinstance(scheduler, Scheduler)
            else scheduler(self.optimizer)  # a factory taking the optimizer
        )
        plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.scheduler_interval = "validation" if plateau or monitor else scheduler_interval
        self.monitor = monitor or ("val/loss" if plateau else None)
        self.metrics: dict[str, Metric] = {
            name: metric.to(self.device) if hasattr(metric, "to") else metric
            for name, metric in (metrics or {}).items()
        }
        self.callbacks = _named(callbacks)
        self.recorder: Recorder = recorder or NoRun()
        self.reading = Reading(shuffle=shuffle, collate_fn=collate_fn)
        self.train_data, self.val_data, self.loss_every = train_data, val_data, loss_every
        self.batches: Batches = make_batches(
            train_data,
            self.train,
            self.device,
            self.reading,
            self.group.rank,
            self.group.world_size,
        )
        self._check_plan()
        self.knobs = fastpaths.knobs(self.train, self.device)
        self.step_fn = fastpaths.step_function(
            self.train,
            self.device,
            self.module,
            self.task,
            self.loss_fn,
            self.optimizer,
            self.knobs,
        )
        self.clock = PhaseClock(self.device)
        self.step = 0
        self.losses: list[float] = []  # every step's loss: loss.csv and the loss window
        self.timings: dict[str, float] | None = None  # set when fit() reaches the last step
        self.nonfinite: list[int] = []
        self.validation: tuple[int, dict[str, float]] | None = None  # the last: (step, values)
        objective = self.train.objective
        self.best = Best(objective, higher_is_better(self._metric(objective)))
        stopping = self.train.early_stopping
        if stopping is not None:
            self.callbacks["early_stopping"] = EarlyStopping(
                objective, stopping.patience, stopping.min_delta, self.best.higher
            )
        self.stopped_early: str | None = None  # why a callback stopped the run, once it has
        self.metrics_checked = not self.metrics  # check_metrics has run (after step 1)
        self.progress: Progress | None = None  # fit()'s, for the lines validation prints
        self.stop = GracefulStop()  # fit()'s: what a Ctrl-C / SIGTERM asked for

    def _check_plan(self) -> None:
        """What cannot work with these pieces, said before the first step."""
        micro = self.train.accumulate_grad_batches
        if self.batches.batches_per_epoch < micro:
            raise ConfigError(
                f"train.accumulate_grad_batches={micro} is more batches than an epoch "
                f"holds ({self.batches.batches_per_epoch} of train.batch_size="
                f"{self.train.batch_size})",
                hint="lower train.accumulate_grad_batches or train.batch_size",
            )
        if self.val_data is None:
            needs = [
                f"{key}={getattr(self.train, key)!r}"
                for key in ("val_every", "keep_best", "early_stopping")
                if getattr(self.train, key)
            ] + (
                ["a ReduceLROnPlateau scheduler"] if self.scheduler_interval == "validation" else []
            )
            if needs:
                raise ConfigError(
                    f"{', '.join(needs)} validates during training, but no val_data was given",
                    hint="pass val_data=<a Dataset or DataLoader> to the Trainer, or drop "
                    + " and ".join(needs),
                )

    def _metric(self, figure: str) -> Metric | None:
        return self.metrics.get(figure.removeprefix("val/")) if figure != "val/loss" else None

    def train_step(self, *batches: Any) -> torch.Tensor:
        """One step of the lesson on `batch` (k micro-batches under gradient accumulation);
        returns its loss, still on the device."""
        self.clock.start_step()
        batches = tuple(move_batch_to_device(b, self.device) for b in batches)  # in the loop
        self.clock.mark("data_to_device")
        loss = self.step_fn(batches, self.clock.mark)  # forward, loss, zero_grad, backward,
        self.step += 1  # step
        self.clock.end_step(self.step)
        interval = self.scheduler_interval
        if self.scheduler is not None and (
            interval == "step" or (interval == "epoch" and self.step % self.epoch_length == 0)
        ):
            self.scheduler.step()  # not a plateau (that one is stepped on validation)
        return loss

    def fit(
        self,
        steps: int | None = None,
        epochs: int | None = None,
        *,
        save: Callable[[Trainer], None] | None = None,
        stop: GracefulStop | None = None,
    ) -> Fitted:
        """Train until the Trainer's own step count reaches `steps` (or `epochs` whole epochs;
        the `steps`/`epochs` knobs when neither is given), or until a callback stops it early.
        A Trainer given a state_dict from step 30 continues to 60 with `fit(steps=60)`.
        `save(self)` writes a checkpoint on the `checkpoint_every(_s)` cadence and when a
        `stop` (a GracefulStop the caller installed) asks; the last step is validated."""
        total = self.total_steps(steps, epochs)
        stop = self.stop = stop or GracefulStop()
        recorder = self.recorder
        window = Window(self, recorder, total, self.loss_every)
        self.progress = window.progress
        cadence = CheckpointCadence(self.train.checkpoint_every, self.train.checkpoint_every_s)
        cadence.saved(self.step, 0.0)
        self.call("on_train_start")
        stop.in_loop = True
        try:
            for batches in self.steps(total):
                window.pending.append(self.train_step(*batches))
                if not self.metrics_checked:
                    window.paused(self.check_metrics, batches[0])
                window.after_step()
                self.call("on_step_end")
                at_window = self.step % self.train.log_every == 0 or self.step == total
                validating = self.validation_due() and self.step < total
                if at_window or validating:
                    window.record()
                if validating:
                    self.validate_now()
                if self.early_stop_agreed(at_window or validating):
                    window.record()
                    break
                if at_window and self.step < total and cadence.due(self.step):
                    cadence.saved(self.step, self.checkpoint(save, window))
                if self.stopping(stop, at_window):
                    window.record()
                    self.checkpoint(save, window)
                    stop.check()  # raises: the run ends KILLED
        finally:
            stop.in_loop = False
            window.progress.close()
        self.timings = window.timings(self.step)
        self.finish_validation()
        self.call("on_train_end")
        if self.group.main:
            recorder.flush()
        return self.fitted()

    def total_steps(self, steps: int | None = None, epochs: int | None = None) -> int:
        """The step count fit() trains to: `steps`, else `epochs` whole epochs, else the
        `steps` / `epochs` knobs."""
        if steps is None and epochs is None:
            steps, epochs = self.train.steps, self.train.epochs
        if steps is not None:
            if steps < 1:
                raise ConfigError(f"fit(steps={steps}): allowed: 1 or more", hint="give steps >= 1")
            return steps
        if epochs is None or epochs < 1:
            raise ConfigError(
                f"fit(epochs={epochs}): allowed: 1 or more", hint="give steps= or epochs= >= 1"
            )
        return epochs * self.epoch_length

    def finish_from_state(self) -> Fitted:
        """What fit() left, from the last step's checkpoint (a run killed after training):
        the timings it saved (NaN where a stop's checkpoint had none) and the final
        validation."""
        timings = self.timings or {}
        self.timings = {key: float(timings.get(key, float("nan"))) for key in TIMING_KEYS}
        self.finish_validation()
        return self.fitted()

    def steps(self, total: int) -> Iterator[tuple[Any, ...]]:
        """The batches of steps step+1..total, `train.accumulate_grad_batches` at a time."""
        micro = self.train.accumulate_grad_batches
        taken = self.batches.take(total * micro, start=self.step * micro)
        return zip(*[iter(taken)] * micro, strict=False)

    def fitted(self) -> Fitted:
        return Fitted(
            list(range(1, self.step + 1)),
            self.losses,
            self.timings or {},
            len(self.nonfinite),
            dict(self.validation[1]) if self.validation else {},
        )

    # -- validation and what it drives
    def validation_due(self) -> bool:
        every = self.train.val_every
        if every == "epoch":
            return self.step % self.epoch_length == 0
        return bool(every) and self.step % every == 0

    def validate_now(self) -> dict[str, float]:
        """Validate at this step (every rank): log val/*, keep the best weights, step a
        metric-driven scheduler, tell the callbacks, and agree whether to stop early."""
        values = self.validate()
        self.validation = (self.step, values)
        if self.group.main:
            self.recorder.log_metrics(values, self.step)
        best = self.best.update(values, self.step)
        if self.train.keep_best and best:
            self.best.keep(self.model)
        self.say(validation_line(self.step, values, self.train.objective, best))
        if self.scheduler_interval == "validation" and self.scheduler is not None:
            figure = self.monitor or "val/loss"
            # A metric-driven scheduler's step takes the figure: torch's ReduceLROnPlateau
            # overrides LRScheduler.step(epoch) with step(metrics) (type: ignore[override] there).
            self.scheduler.step(values[figure])  # type: ignore[arg-type]
        self.call("on_validation_end", values)
        return values

    def early_stop_agreed(self, at_boundary: bool) -> bool:
        """A callback asked to stop (rank 0's, at any step): stop here. Under torchrun the
        ranks agree at window and validation boundaries, so that every rank stops together."""
        if not self.group.active:
            return self.stopped_early is not None
        if not at_boundary:
            return False
        agreed = self.group.any(self.stopped_early is not None, self.device)
        if agreed and self.stopped_early is None:  # the other ranks: their callbacks do not run
            self.stopped_early = "stopped by a callback on rank 0"
        return agreed

    def finish_validation(self) -> None:
        """The last step's validation (unless it was just taken, or there is no validation
        data); with keep_best, the model then holds the best validation's weights and its
        figures are the run's."""
        if self.val_data is None:
            return
        if self.validation is None or self.validation[0] != self.step:
            self.validate_now()
        if self.train.keep_best and self.best.weights is not None:
            self.model.load_state_dict(self.best.weights)
            self.validation = (self.best.step, dict(self.best.values))

    def check_metrics(self, batch: Any) -> None:
        """Each metric takes the task's predictions on the first validation batch (as
        validation reads it; `batch`, a training batch, without validation data): eval mode,
        no grad, nothing kept. A metric that does not fit the task is one line after the
        first step, not at the first validation. After it, not before it, so that the
        metrics' library is imported when the run first uses it (torchmetrics: ~2 s of
        start-up)."""
        self.metrics_checked = True
        # With its own seeds: training's streams go on as if it had not run (a resumed run
        # checks after its first step, an uninterrupted one after step 1; a model may draw
        # in eval mode too).
        with seeded(self.train.seed, self.group.rank, 0, VALIDATION_STREAM):
            self._check_metrics(batch)

    def _check_metrics(self, batch: Any) -> None:
        if self.val_data is not None and len(self.val_data):
            batch = next(val_batches(self.val_data, self.device, 2, self.reading.collate_fn))
        batch = move_batch_to_device(batch, self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.task.evaluating():
                predictions, targets = (
                    t.contiguous()
                    for t in self.task.predictions(self.task.forward(self.model, batch), batch)
                )
                for name, metric in self.metrics.items():
                    try:
                        metric.update(predictions, targets)
                    except MISFIT_ERRORS as error:
                        raise misfit(name, metric, predictions, targets, error) from None
                    finally:
                        metric.reset()
        finally:
            self.model.train(was_training)

    def validate(self) -> dict[str, float]:
        """`val/loss` and `val/<metric>` on the validation data (this rank's share of it,
        reduced over every rank)."""
        if self.val_data is None:
            raise ConfigError(
                "validate() needs validation data, but the Trainer has no val_data",
                hint="pass val_data=<a Dataset or DataLoader> to the Trainer",
            )
        group = self.group
        val = val_batches(
            self.val_data,
            self.device,
            self.val_batch_size,
            self.reading.collate_fn,
            group.rank,
            group.world_size,
        )
        # Read with its own seeds: what the data draws is the same at every validation, and
        # training's streams go on after it as if it had not run.
        with seeded(self.train.seed, group.rank, self.step, VALIDATION_STREAM):
            totals = evaluate(self.model, val, self.task, self.loss_fn, self.device, self.metrics)
        loss_sum, count = group.mean(totals).cpu().tolist()  # sync point: once per validation
        values = {"val/loss": loss_sum / count if count else float("nan")}
        values.update({f"val/{k}": v for k, v in compute_metrics(self.metrics).items()})
        return values

    @property
    def val_batch_size(self) -> int:
        return validation_batch_size(self.train.batch_size, self.train.val_batch_size)

    def stop_early(self, reason: str) -> None:
        """Stop after this step; the run ends FINISHED, tagged with the reason."""
        self.stopped_early = reason
        self.say(f"stopped early at step {self.step}: {reason}")

    def say(self, line: str) -> None:
        """A line of its own on the terminal (rank 0): above the bar, or among the lines."""
        if self.group.main:
            quiet = "off" if self.train.progress == "off" else "lines"  # no bar of its own
            (self.progress or Progress(0, quiet)).note(line)

    def call(self, hook: str, *args: Any) -> None:
        """Each callback's `hook` (those it has), on rank 0. A callback that fails is named
        with its moment before its traceback; one that calls sys.exit is one line (a callback
        stops a run with trainer.stop_early); a Ctrl-C / SIGTERM while one blocks in the loop
        interrupts it (the step is done), and the loop stops there with a checkpoint."""
        if not self.group.main:
            return
        stop = self.stop
        for name, callback in self.callbacks.items():
            method = getattr(callback, hook, None)
            if method is None:
                continue
            where = f"callbacks.{name}.{hook} at step {self.step}"
            stop.in_callback = True
            try:
                method(self, *args)
            except Interrupted:
                if not stop.in_loop:
                    raise
                return  # stop.requested is set: the loop checkpoints and stops
            except SystemExit as exit:
                raise ConfigError(
                    f"{where} called sys.exit({exit.code!r}); a callback does not end the process",
                    hint="stop the run from a callback with trainer.stop_early(reason): it "
                    "ends FINISHED, tagged with the reason",
                ) from None
            except Exception:
                print(f"reprotrain: {where} failed:", file=sys.stderr, flush=True)
                raise
            finally:
                stop.in_callback = False

    # -- stopping and checkpoints
    def stopping(self, stop: GracefulStop, at_window: bool) -> bool:
        """A Ctrl-C / SIGTERM arrived: stop here. Under torchrun the ranks agree at window
        boundaries, so that every rank stops at the same step."""
        stopping = stop.requested is not None
        if self.group.active:
            stopping = at_window and self.group.any(stopping, self.device)
            stop.requested = stop.requested or (signal.SIGTERM if stopping else None)
        return stopping

    def checkpoint(self, save: Callable[[Trainer], None] | None, window: Window) -> float:
        """Send what the run owes the store, then save: seconds it took (time.checkpoint_s)."""
        if save is None or not self.group.main:
            return 0.0
        began = time.perf_counter()
        self.recorder.flush()
        save(self)
        took = time.perf_counter() - began
        window.checkpoint_s += took
        return took

    @property
    def samples_per_step(self) -> int:
        """Every rank's micro-batches of one optimizer step (the global batch)."""
        micro = self.train.accumulate_grad_batches
        return self.group.world_size * self.train.batch_size * micro

    @property
    def epoch_length(self) -> int:
        """Optimizer steps per epoch."""
        return self.batches.batches_per_epoch // self.train.accumulate_grad_batches

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the model, optimizer and scheduler (and fp16's scaler), the
        RNG states, the step (the batch order is derived from train.seed and the step), the
        task's state (a recurrent model's hidden state), the callbacks' states, the best
        validation, the losses so far, and once fit() has ended, its timings (a run killed
        after training finishes from them). The RNG states are the process's (Python's,
        NumPy's, torch's) at the call: take it where the run stops, before anything else
        draws or seeds."""
        scheduler, scaler = self.scheduler, self.knobs.scaler
        return {
            "step": self.step,
            "epoch": self.step // self.epoch_length,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            **rng_states(),  # Python's, NumPy's, torch's (CPU and CUDA)
            "task": self.task.state_dict(),
            "callbacks": {
                name: callback.state_dict()
                for name, callback in self.callbacks.items()
                if hasattr(callback, "state_dict")
            },
            "best": self.best.state_dict(),
            "validation": self.validation,
            "stopped_early": self.stopped_early,
            "losses": list(self.losses),
            "timings": self.timings,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.knobs.scaler is not None and state.get("scaler") is not None:
            self.knobs.scaler.load_state_dict(state["scaler"])
        restore_rng_states(state)
        self.task.load_state_dict(state.get("task") or {})
        self.task.to(self.device)
        for name, kept in (state.get("callbacks") or {}).items():
            callback = self.callbacks.get(name)
            if callback is not None and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(kept)
        self.best.load_state_dict(state.get("best"))
        self.validation = state.get("validation")
        self.stopped_early = state.get("stopped_early")
        self.step, self.losses = int(state["step"]), list(state["losses"])
        self.timings = state.get("timings")
        self.nonfinite = [i + 1 for i, v in enumerate(self.losses) if not np.isfinite(v)]


def _named(callbacks: Iterable[Callback] | Mapping[str, Callback]) -> dict[str, Callback]:
    """Callbacks by name: a mapping's keys, else each one's class name (numbered if repeated)."""
    if isinstance(callbacks, Mapping):
        return dict(callbacks)
    named: dict[str, Callback] = {}
    for callback in callbacks:
        name = base = type(callback).__name__
        number = 1
        while name in named:
            number += 1
            name = f"{base}_{number}"
        named[name] = callback
    return named


def _from_loaders(
    train_data: Data,
    val_data: Data | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    knobs: dict[str, Any],
) -> tuple[MapDataset, MapDataset | None, Callable[[list[Any]], Any] | None, dict[str, Any]]:
    """A DataLoader's dataset, and its batch size, workers and collate function as the
    knobs (those given as keyword arguments win)."""
    if isinstance(train_data, DataLoader):
        loader = train_data
        if loader.batch_size is not None:
            knobs.setdefault("batch_size", loader.batch_size)
        knobs.setdefault("num_workers", loader.num_workers)
        if collate_fn is None and loader.collate_fn is not torch.utils.data.default_collate:
            collate_fn = loader.collate_fn
        # A map-style dataset's loader (torch types `.dataset` as a Dataset, with no __len__)
        train_data = cast(MapDataset, loader.dataset)
    if isinstance(val_data, DataLoader):
        val_data = cast(MapDataset, val_data.dataset)
    return train_data, val_data, collate_fn, knobs


def validation_line(step: int, values: dict[str, float], objective: str, best: bool) -> str:
    """`validation at step 200: val/loss 0.4123, val/accuracy 0.8812 (best so far)`: the
    figures, the objective's first, and whether the objective is the best yet."""
    order = sorted(values, key=lambda name: (name != objective, name != "val/loss", name))
    shown = ", ".join(f"{name} {values[name]:.4f}" for name in order)
    return f"validation at step {step}: {shown}" + (f" (best {objective} so far)" if best else "")


class Best:
    """The best validation by `objective` so far, and (train.keep_best) the model's weights
    then, on the CPU."""

    def __init__(self, objective: str, higher: bool) -> None:
        self.objective, self.higher = objective, higher
        self.value, self.step = float("nan"), 0
        self.values: dict[str, float] = {}
        self.weights: dict[str, torch.Tensor] | None = None

    def update(self, values: dict[str, float], step: int) -> bool:
        value = values.get(self.objective, float("nan"))
        if not improved(value, self.value, self.higher):
            return False
        self.value, self.step, self.values = value, step, dict(values)
        return True

    def keep(self, model: nn.Module) -> None:
        self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "step": self.step,
            "values": self.values,
            "weights": self.weights,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.value, self.step = float(state["value"]), int(state["step"])
            self.values, self.weights = dict(state["values"]), state["weights"]


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
        self.excluded_s = 0.0  # one-off checks inside the measured window (paused)
        self.loss_every = loss_every
        group = trainer.group
        self.progress = Progress(total, trainer.train.progress if group.main else "off")
        if self.warmup_end == trainer.step:  # no warm-up: measure from the first step
            self.begin_measuring()

    def paused(self, work: Callable[..., None], *args: Any) -> None:
        """Run `work` outside the measured time (a one-off check inside a step's window)."""
        device = self.trainer.device
        synchronize(device)  # sync point, once: the step's queued work counts as the step's
        began = time.perf_counter()
        try:
            work(*args)
            synchronize(device)  # sync point: the check's own work is done
        finally:
            self.excluded_s += time.perf_counter() - began

    def after_step(self) -> None:
        if self.trainer.step == self.warmup_end:
            self.begin_measuring()

    def begin_measuring(self) -> None:
        synchronize(self.trainer.device)  # sync point: the clock starts with the device idle
        self.checkpoint_s = self.excluded_s = 0.0
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
        if trainer.scheduler is not None:
            self.recorder.log_metric("train/lr", trainer.optimizer.param_groups[0]["lr"], step)
        self.progress.update(step, values[-1], self.throughput_so_far())

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

    def throughput_so_far(self) -> float | None:
        """Samples per second since the warm-up, as timings() measures it at the end (wall
        clock, checkpoints and one-off checks left out); None before it has begun. The queued
        steps count once the window's losses have been read (a sync point already)."""
        if self.measure_from is None:
            return None
        trainer = self.trainer
        measured = trainer.step - self.warmup_end
        took = time.perf_counter() - self.measure_from - self.checkpoint_s - self.excluded_s
        return measured * trainer.samples_per_step / took if measured > 0 and took > 0 else None

    def timings(self, total: int) -> dict[str, float]:
        """Throughput over the measured steps, wall clock: it counts reading the losses and
        handing them to the recorder, not the checkpoints (time.checkpoint_s)."""
        synchronize(self.trainer.device)  # sync point: all queued work is done
        began = self.measure_from or 0.0
        elapsed = time.perf_counter() - began - self.checkpoint_s - self.excluded_s
        measured = total - self.warmup_end if self.measure_from is not None else 0
        batch = self.trainer.samples_per_step
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
