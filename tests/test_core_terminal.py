"""What the terminal says while a run trains: a line per validation (the objective first, the
best so far marked), the early stop with its step and reason, the resume with its step, and a
rate that is the one the run records (none during the warm-up); and what a callback that
exits, fails or blocks does to a run."""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import reprotrain
from conftest import library_args
from reprotrain.stopping import GracefulStop, Interrupted


def test_validation_early_stopping_and_resume_each_say_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    result = reprotrain.train(
        library_args(
            tmp_path,
            "experiment=smoke",
            "train.steps=40",
            "train.val_every=10",
            "train.objective=val/accuracy",
            "train.early_stopping={patience:1,min_delta:0.5}",  # no gain of 0.5: stops at 20
            "train.warmup_steps=5",
            "train.log_every=5",
            progress="lines",
        )
    )
    err = capfd.readouterr().err
    lines = err.splitlines()
    validations = [line for line in lines if line.startswith("validation at step")]
    assert validations[0].startswith("validation at step 10: val/accuracy ")
    assert validations[0].endswith("(best val/accuracy so far)")
    assert ", val/loss " in validations[0]
    assert any(line.startswith("stopped early at step 20: ") for line in lines), err
    assert result.status == "FINISHED"
    # The rate: none during the warm-up (5 steps), then the run's own throughput so far.
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0].startswith("step 5/40") and steps[0].endswith("warming up"), steps
    assert re.fullmatch(r"step 10/40  loss \d+\.\d{4}  [\d,]+ samples/s", steps[1]), steps

    first = reprotrain.train(
        library_args(tmp_path, "experiment=smoke", "train.steps=8", progress="lines")
    )
    capfd.readouterr()
    resumed = reprotrain.train(
        library_args(
            tmp_path,
            "experiment=smoke",
            "train.steps=12",
            f"train.resume={first.run_id}",
            progress="lines",
        )
    )
    assert resumed.status == "FINISHED"
    assert f"reprotrain: resuming run {first.run_id} from step 8" in capfd.readouterr().err


# -- callbacks that exit, fail or block --------------------------------------------------------


def tiny_trainer(*callbacks: reprotrain.Callback) -> reprotrain.Trainer:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    data = TensorDataset(inputs, (inputs[:, 0] > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return reprotrain.Trainer(
        model, functools.partial(torch.optim.SGD, lr=0.1), data, callbacks=callbacks,
        batch_size=8, progress="off",
    )  # fmt: skip


class ExitsAtStep2(reprotrain.Callback):
    def on_step_end(self, trainer: reprotrain.Trainer) -> None:
        if trainer.step == 2:
            sys.exit(0)


class FailsAtStep2(reprotrain.Callback):
    def on_step_end(self, trainer: reprotrain.Trainer) -> None:
        if trainer.step == 2:
            raise ValueError("the callback's own bug")


class BlocksAtStep3(reprotrain.Callback):
    """Waits (on a server, a lock, ...) for longer than anyone waits for a stop."""

    def __init__(self) -> None:
        self.woke = False

    def on_step_end(self, trainer: reprotrain.Trainer) -> None:
        if trainer.step == 3:
            threading.Event().wait(timeout=60)
            self.woke = True  # only if nothing interrupted the wait


def test_a_callback_that_exits_is_one_line_and_one_that_fails_is_named(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(reprotrain.ConfigError) as exited:
        tiny_trainer(ExitsAtStep2()).fit(steps=5)
    assert "callbacks.ExitsAtStep2.on_step_end at step 2 called sys.exit(0)" in str(exited.value)
    assert "trainer.stop_early(reason)" in exited.value.hint
    with pytest.raises(ValueError, match="the callback's own bug"):
        tiny_trainer(FailsAtStep2()).fit(steps=5)
    assert "reprotrain: callbacks.FailsAtStep2.on_step_end at step 2 failed:" in (
        capfd.readouterr().err
    )


def test_sigterm_while_a_callback_blocks_stops_there_with_a_checkpoint() -> None:
    blocking = BlocksAtStep3()
    trainer = tiny_trainer(blocking)
    saved: list[int] = []
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    stop = GracefulStop().install()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Interrupted):
            trainer.fit(steps=20, save=lambda t: saved.append(t.step), stop=stop)
    finally:
        timer.cancel()
        for signum, handler in kept.items():
            signal.signal(signum, handler)
    assert not blocking.woke  # the wait was interrupted, not waited out
    assert trainer.step == 3 and saved == [3]  # the step it had done, checkpointed
