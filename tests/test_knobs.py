"""The step's knobs and what validation drives, on reprotrain's own MLP: gradient accumulation
and clipping (recorded, resumed bit for bit), validation during training with metrics, early
stopping, the best weights, a metric-driven scheduler, in-order reading; and each new mistake
as one line before any step. The scripts' main() in this process (conftest.InProcess), sqlite
MLflow stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, InProcess, Store

SMOKE = ("experiment=smoke", "device=cpu", "train.warmup_steps=0")


def test_accumulated_micro_batches_step_as_their_whole_batch(tmp_path: Path, train_here) -> None:
    """Two micro-batches of 32 with their gradients added up take the step one batch of 64
    takes: the same samples, the same mean gradient (equal to float rounding)."""
    whole, accumulated = Store(tmp_path / "whole"), Store(tmp_path / "accumulated")
    for store in (whole, accumulated):
        store.path.parent.mkdir()
    train_here(whole.path.parent, whole, *SMOKE, "train.batch_size=64")
    train_here(
        accumulated.path.parent,
        accumulated,
        *SMOKE,
        "train.batch_size=32",
        "train.accumulate_grad_batches=2",
    )
    want = [v for _, v in whole.losses(whole.only_run().info.run_id)]
    run = accumulated.only_run()
    got = [v for _, v in accumulated.losses(run.info.run_id)]
    assert len(got) == len(want) == 20
    assert got == pytest.approx(want, rel=1e-4)
    assert run.data.params["train.accumulate_grad_batches"] == "2"


def test_clipped_accumulated_run_stopped_by_a_callback_resumes_bit_for_bit(
    tmp_path: Path, here: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback's SIGTERM reaches this process's handler: the run stops at the step's end,
    KILLED, exit code 143 (the signal's)."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "tests" / "workloads", project / "workloads")
    store = Store(project)
    settings = [
        *SMOKE,
        "train.steps=30",
        "train.clip_grad_norm=0.5",
        "train.accumulate_grad_batches=2",
        "data.shuffle=false",
        "+callbacks.sigterm._target_=workloads.callbacks.SigtermOnce",
        "+callbacks.sigterm.step=12",
        f"+callbacks.sigterm.marker={tmp_path / 'stopped'}",
    ]
    assert here.train(project, store, *settings, check=False).returncode == 143
    assert store.only_run().info.status == "KILLED"
    here.train(project, store, *settings, "train.resume=last")
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert run.data.params["train.clip_grad_norm"] == "0.5"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    reproduced = here.module("reproduce", run.info.run_id, cwd=project)
    assert reproduced.returncode == 0, reproduced.stdout[-2000:] + reproduced.stderr[-2000:]
    assert "losses match bit for bit (30 steps)" in reproduced.stdout


def test_validation_drives_early_stopping_the_best_weights_and_a_plateau_scheduler(
    tmp_path: Path, store: Store, train_here
) -> None:
    """val/loss and val/accuracy every 5 steps; ReduceLROnPlateau stepped with val/loss; the
    run stops FINISHED once val/accuracy has not improved by more than 1.0 for 2 validations
    (it cannot), and its outputs are the best validation's."""
    train_here(
        tmp_path,
        store,
        *SMOKE,
        "train.steps=200",
        "train.val_every=5",
        "train.objective=val/accuracy",
        "train.early_stopping={patience:2,min_delta:1.0}",
        "train.keep_best=true",
        "scheduler=plateau",
        "scheduler.patience=0",
        "+scheduler.threshold=0.99",  # no validation counts as an improvement
    )
    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags["reprotrain.stopped_early"].startswith(
        "val/accuracy did not improve by more than 1 for 2 validations (best "
    )
    assert len(store.losses(run_id)) == 15  # validations at 5 (best), 10, 15: stop
    accuracy = {m.step: m.value for m in store.client.get_metric_history(run_id, "val/accuracy")}
    assert sorted(accuracy) == [5, 10, 15]
    written = json.loads((tmp_path / "results" / "run.json").read_text())
    best = max(accuracy, key=lambda step: (accuracy[step], -step))
    assert written["best_step"] == best and written["val_accuracy"] == accuracy[best]
    rates = [m.value for m in store.client.get_metric_history(run_id, "train/lr")]
    assert rates[0] == 1e-3 and min(rates) < 1e-3  # lowered after a validation that stalled


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["train.precision=fp16", "train.deterministic=false"],
            "train.precision=fp16 needs a CUDA GPU (its GradScaler), but device=cpu",
        ),
        (["train.accumulate_grad_batches=0"], "train.accumulate_grad_batches=0 is out of range"),
        (["train.objective=val/f1"], "train.objective='val/f1' is not a figure this run measures"),
        (
            ["train.early_stopping={patience:2}"],
            "train.early_stopping needs validation during training, but train.val_every=0",
        ),
        (
            ["scheduler=plateau", "~scheduler.monitor", "train.val_every=5"],
            "is stepped with a validation figure, but scheduler.monitor is not set",
        ),
        (
            # Checked after the first step (torchmetrics is imported when first used), on it.
            ["+metrics.r2._target_=torchmetrics.regression.R2Score"],
            "metrics.r2 (R2Score) cannot take the task's predictions (2x10) and targets (2)",
        ),
        (
            ["task=regression"],
            "does not fit the loss MSELoss under task Regression",
        ),
        (
            ["+data.collate_fn._target_=builtins.len", "+data.collate_fn._partial_=true"],
            "the model MLP cannot take the data's batches under task Classification",
        ),
    ],
)
def test_each_new_mistake_is_one_line_before_any_step(
    app_in_process, overrides: list[str], expected: str
) -> None:
    exited = app_in_process(*SMOKE, "runtime=local", "data=digits", *overrides)
    assert exited.returncode == 2, exited.stderr
    lines = [line for line in exited.stderr.splitlines() if line.startswith("reprotrain: error")]
    assert len(lines) == 1 and expected in lines[0], exited.stderr[-2000:]
    assert "Traceback" not in exited.stderr and "step 1/" not in exited.stderr
