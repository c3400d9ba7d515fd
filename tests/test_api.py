"""The library API, in process: reprotrain.train(...) as the command line runs it, and the
Trainer on plain torch objects (README: "From Python")."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import random
import re
import signal
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import reprotrain
from conftest import library_args
from reprotrain.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


def process_state() -> dict[str, object]:
    """What a run may change for the whole process."""
    return {
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "handlers": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "sys.path": list(sys.path),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].tolist(),
        "random": random.getstate(),
        "active_run": mlflow.active_run(),
        "tracking_uri_set": mlflow.is_tracking_uri_set(),
        "root_level": logging.root.level,
    }


def same_state(before: dict[str, object], after: dict[str, object]) -> list[str]:
    differ = []
    for key, value in before.items():
        other = after[key]
        equal = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        if not equal:
            differ.append(key)
    return differ


def test_train_runs_twice_in_one_process_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = process_state()
    first = reprotrain.train(library_args(tmp_path, "train.steps=20", "train.val_every=10"))
    second = reprotrain.train(library_args(tmp_path, "train.steps=20", "optimizer=sgd"))
    assert same_state(before, process_state()) == []
    assert first.status == second.status == "FINISHED"
    assert first.run_id != second.run_id
    client = MlflowClient(first.tracking_uri)
    for result in (first, second):
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        losses = client.get_metric_history(result.run_id, "train/loss")
        assert [m.step for m in losses] == list(range(1, 21))
        assert result.metrics["train/loss"] == pytest.approx(losses[-1].value)
        assert (result.output_dir / "metrics.json").is_file()
        assert result.output_dir.is_relative_to(tmp_path / "outputs" / "runs")
    # val/* at the validations and at the end, as the CLI records them
    assert [m.step for m in client.get_metric_history(first.run_id, "val/loss")] == [10, 20]
    assert first.metrics["val/accuracy"] == pytest.approx(
        client.get_run(first.run_id).data.metrics["val/accuracy"]
    )
    assert client.get_run(second.run_id).data.tags["optimizer.class"].endswith("SGD")


def test_train_inside_a_callers_active_run_leaves_it_active(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        with mlflow.start_run() as outer:
            result = reprotrain.train(library_args(tmp_path, "train.steps=5"))
            assert mlflow.active_run().info.run_id == outer.info.run_id
        assert result.run_id != outer.info.run_id
        assert MlflowClient().get_run(outer.info.run_id).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri(None)


def test_bad_config_raises_one_line_config_error_not_exit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = process_state()
    with pytest.raises(reprotrain.ConfigError) as raised:
        reprotrain.train(library_args(tmp_path, "train.batch_size=0"))
    message = str(raised.value)
    assert "\n" not in message
    assert "train.batch_size=0" in message and "fix:" in message
    with pytest.raises(reprotrain.ConfigError, match="optimizer"):
        reprotrain.train(library_args(tmp_path, "optimizer=nonexistent"))
    assert same_state(before, process_state()) == []
    assert not (tmp_path / "mlflow.db").exists()  # nothing was opened


def toy_data(n: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 8, generator=generator)
    targets = (inputs[:, 0] + inputs[:, 1] > 0).long()
    return TensorDataset(inputs, targets)


def toy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))


def make_trainer(**knobs: object) -> reprotrain.Trainer:
    model = toy_model()
    return reprotrain.Trainer(
        model,
        functools.partial(torch.optim.AdamW, lr=1e-2),
        toy_data(),
        val_data=toy_data(64, seed=1),
        device="cpu",
        **{"batch_size": 32, "progress": "off", **knobs},
    )


def test_trainer_on_plain_objects_fits_validates_and_resumes_bit_for_bit():
    whole = make_trainer()
    whole.fit(steps=16)

    first = make_trainer()
    first.fit(steps=8)
    state = first.state_dict()
    resumed = make_trainer()
    resumed.load_state_dict(state)
    assert resumed.step == 8
    fitted = resumed.fit(steps=16)

    assert fitted.steps == list(range(1, 17))
    assert fitted.losses == whole.losses  # every step's loss, bit for bit
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    values = whole.validate()
    assert set(values) == {"val/loss"}
    assert values["val/loss"] == pytest.approx(fitted.validation["val/loss"])


def test_trainer_takes_a_dataloader_metrics_and_callbacks():
    seen: list[int] = []

    class Steps(Callback):
        def on_step_end(self, trainer: reprotrain.Trainer) -> None:
            seen.append(trainer.step)

    class Accuracy:
        """A metric with torchmetrics' three methods, without torchmetrics."""

        higher_is_better = True

        def __init__(self) -> None:
            self.right = self.total = 0

        def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
            self.right += int((predictions.argmax(1) == targets).sum())
            self.total += len(targets)

        def compute(self) -> float:
            return self.right / self.total

        def reset(self) -> None:
            self.right = self.total = 0

    model = toy_model()
    loader = DataLoader(toy_data(), batch_size=16, shuffle=True)
    trainer = reprotrain.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        val_data=DataLoader(toy_data(64, seed=1), batch_size=8),
        metrics={"accuracy": Accuracy()},
        callbacks=[Steps()],
        progress="off",
        val_every=4,
        keep_best=True,
        objective="val/accuracy",
    )
    assert trainer.train.batch_size == 16  # the loader's
    fitted = trainer.fit(epochs=1)
    assert fitted.steps == list(range(1, 17)) and seen == fitted.steps
    assert 0.0 <= fitted.validation["val/accuracy"] <= 1.0
    assert trainer.best.step in (4, 8, 12, 16)
    assert fitted.validation == trainer.best.values  # keep_best: the best one's figures


def test_trainer_knob_mistakes_are_one_line():
    with pytest.raises(reprotrain.ConfigError, match=r"batch_size=0.*fix:"):
        make_trainer(batch_size=0)
    with pytest.raises(reprotrain.ConfigError, match="no_such_knob"):
        make_trainer(no_such_knob=1)
    trainer = reprotrain.Trainer(toy_model(), torch.optim.SGD, toy_data(), progress="off")
    with pytest.raises(reprotrain.ConfigError, match="val_data"):
        trainer.validate()
    with pytest.raises(reprotrain.ConfigError, match="val_data"):
        reprotrain.Trainer(toy_model(), torch.optim.SGD, toy_data(), val_every=5)


def test_mlflow_recorder_sends_every_step_to_the_active_run(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        with mlflow.start_run() as run:
            trainer = make_trainer(recorder=reprotrain.MlflowRecorder(), log_every=4, val_every=5)
            trainer.fit(steps=10)
        client = MlflowClient()
        losses = client.get_metric_history(run.info.run_id, "train/loss")
        assert [m.step for m in losses] == list(range(1, 11))
        assert [m.value for m in losses] == pytest.approx(trainer.losses)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [5, 10]
    finally:
        mlflow.set_tracking_uri(None)


def readme_python_example() -> str:
    """The README's "From Python" example: its first ```python block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_from_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    before = process_state()
    namespace: dict[str, object] = {}
    exec(compile(readme_python_example(), "README.md", "exec"), namespace)  # noqa: S102
    # The example draws its own data and weights from torch's generator; nothing else changed.
    assert same_state(before, process_state()) == ["torch_rng"]
    result = namespace["result"]
    assert isinstance(result, reprotrain.Result) and result.status == "FINISHED"
    trainer = namespace["trainer"]
    assert isinstance(trainer, reprotrain.Trainer) and trainer.step > 0


def test_reprotrain_train_is_the_call_even_once_the_script_module_is_imported(tmp_path):
    """`python -m reprotrain.train` and the console script import the module of that name,
    which then shadows the package's function attribute: calling it still trains."""
    importlib.import_module("reprotrain.train")
    with pytest.raises(reprotrain.ConfigError, match="train.batch_size=0"):
        reprotrain.train(library_args(tmp_path, "train.batch_size=0"))
