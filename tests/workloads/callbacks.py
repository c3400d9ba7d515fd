"""A user's callback, as the README's "Callbacks" describes: stop the run once, at a step,
the way a Ctrl-C or a scheduler's SIGTERM would, and log to the run's MLflow run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import mlflow

from reprotrain.callbacks import Callback


class SigtermOnce(Callback):
    """SIGTERM this process after step `step`, once: `marker` records that it happened, so
    the resumed run (and a reproduction) goes on."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_step_end(self, trainer) -> None:
        if trainer.step == self.step and not self.marker.exists():
            self.marker.write_text(str(self.step))
            mlflow.log_metric("callback/sigterm_at", self.step, step=self.step)
            os.kill(os.getpid(), signal.SIGTERM)
