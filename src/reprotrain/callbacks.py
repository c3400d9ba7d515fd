"""Callbacks: your code at the loop's four moments, named by the `callbacks` config.

    callbacks:
      lr_log:
        _target_: my_project.callbacks.LogLearningRate
        every: 100

A callback is any object with some of these methods (the `Callback` base class has them all,
doing nothing); the Trainer calls those it has:

    on_train_start(trainer)                 before the first step (also of a resumed run)
    on_step_end(trainer)                    after each optimizer step: trainer.step is its number
    on_validation_end(trainer, metrics)     metrics: {"val/loss": ..., "val/<name>": ...}
    on_train_end(trainer)                   after the last step
    state_dict() / load_state_dict(state)   what it must keep across a resume (checkpointed)

It may log to the run with `mlflow.log_metric(...)` (the run is the process's active MLflow
run; rank 0 only under torchrun), and stop training with `trainer.stop_early(reason)`: the run
then ends FINISHED at that step with the tag `reprotrain.stopped_early` giving the reason.
`on_step_end` runs every step: keep it cheap (reading a loss off a GPU waits for the GPU).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the Trainer calls its callbacks: a type only, no import at run time
    from reprotrain.trainer import Trainer


class Callback:
    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer) -> None:
        pass

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience`
    validations in a row (train.early_stopping builds one on train.objective)."""

    def __init__(
        self, monitor: str, patience: int, min_delta: float = 0.0, higher_is_better: bool = False
    ) -> None:
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.higher = higher_is_better
        self.best, self.best_step, self.waited = math.nan, 0, 0

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        value = metrics[self.monitor]
        if improved(value, self.best, self.higher, self.min_delta):
            self.best, self.best_step, self.waited = value, trainer.step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.stop_early(
                f"{self.monitor} did not improve by more than {self.min_delta:g} for "
                f"{self.patience} validations (best {self.best:.6g} at step {self.best_step})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = float(state["best"]), int(state["best_step"])
        self.waited = int(state["waited"])


def improved(value: float, best: float, higher: bool, min_delta: float = 0.0) -> bool:
    """Is `value` better than `best` (NaN: nothing yet) by more than `min_delta`?"""
    if not math.isfinite(value):
        return False
    if math.isnan(best):
        return True
    return value > best + min_delta if higher else value < best - min_delta
