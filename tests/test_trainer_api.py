"""The Trainer on plain torch objects, in process: every built-in task and one of your own,
the step's knobs, validation and what it drives, callbacks, resume bit for bit."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import reprotrain
from reprotrain.callbacks import Callback


def classes(n: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 6, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long())


def values(n: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 6, generator=generator)
    return TensorDataset(inputs, inputs[:, :2].sum(dim=1))


def tokens(n: int = 64, length: int = 12, vocab: int = 11, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, vocab, (n, length + 1), generator=generator)
    return TensorDataset(sequences[:, :-1], sequences[:, 1:])  # next-token targets


def mlp(outputs: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, outputs))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class TinyRNN(nn.Module):
    """forward(input, hidden) -> (output, hidden), as PyTorch's word-language-model example."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights each time one is built
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor | None) -> Any:
        output, hidden = self.rnn(self.embed(ids), hidden)
        return self.head(output), hidden


def trainer(model: nn.Module, data: TensorDataset, val: TensorDataset, **kwargs: Any):
    knobs = {"batch_size": 16, "progress": "off", "device": "cpu", **kwargs}
    optimizer = knobs.pop("optimizer", functools.partial(torch.optim.AdamW, lr=1e-2))
    return reprotrain.Trainer(model, optimizer, data, val_data=val, **knobs)


def test_classification_regression_and_language_models_learn():
    fitted = {
        "classification": trainer(mlp(), classes(), classes(64, 1)).fit(steps=40),
        "regression": trainer(
            mlp(1), values(), values(64, 1), task=reprotrain.Regression(), loss_fn=nn.MSELoss()
        ).fit(steps=40),
        "language_model": trainer(
            TinyLM(), tokens(), tokens(16, seed=1), task=reprotrain.LanguageModel()
        ).fit(steps=40),
    }
    for name, result in fitted.items():
        first, last = result.losses[0], result.losses[-1]
        assert last < first, name  # it learns
        assert set(result.validation) == {"val/loss"}, name


def test_a_recurrent_models_state_is_carried_and_checkpointed():
    task = reprotrain.LanguageModel(carry_state=True)
    whole = trainer(TinyRNN(), tokens(), tokens(16, seed=1), task=task, shuffle=False)
    whole.fit(steps=6)
    assert whole.task.state is not None and whole.task.state.shape == (1, 16, 8)

    first = trainer(
        TinyRNN(),
        tokens(),
        tokens(16, seed=1),
        task=reprotrain.LanguageModel(carry_state=True),
        shuffle=False,
    )
    first.fit(steps=3)
    resumed = trainer(
        TinyRNN(),
        tokens(),
        tokens(16, seed=1),
        task=reprotrain.LanguageModel(carry_state=True),
        shuffle=False,
    )
    resumed.load_state_dict(first.state_dict())
    assert resumed.fit(steps=6).losses == whole.losses


def test_a_task_of_your_own_changes_what_it_needs():
    class Sigmoid(reprotrain.Task):
        """Binary targets as floats against one logit per sample."""

        def align(self, outputs: torch.Tensor, targets: torch.Tensor):
            return outputs.squeeze(-1), targets.float()

    result = trainer(
        mlp(1), classes(), classes(64, 1), task=Sigmoid(), loss_fn=nn.BCEWithLogitsLoss()
    ).fit(steps=30)
    assert result.losses[-1] < result.losses[0]


def test_gradient_accumulation_matches_the_larger_batch():
    """k micro-batches of b items: one step whose gradient is that of the k*b batch."""
    data, val = classes(), classes(64, 1)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    large = trainer(mlp(), data, val, batch_size=32, optimizer=sgd, shuffle=False)
    large.fit(steps=4)
    micro = trainer(
        mlp(), data, val, batch_size=16, accumulate_grad_batches=2, optimizer=sgd, shuffle=False
    )
    micro.fit(steps=4)
    for name, value in large.model.state_dict().items():
        torch.testing.assert_close(value, micro.model.state_dict()[name])
    assert micro.samples_per_step == 32


def test_clipping_bounds_the_update():
    """With plain SGD at lr 1, a step moves the weights by the clipped gradient: its norm."""
    data, val = classes(), classes(64, 1)
    sgd = functools.partial(torch.optim.SGD, lr=1.0)
    clipped = trainer(mlp(), data, val, optimizer=sgd, clip_grad_norm=0.01)
    before = torch.cat([p.detach().flatten().clone() for p in clipped.model.parameters()])
    clipped.fit(steps=1)
    after = torch.cat([p.detach().flatten() for p in clipped.model.parameters()])
    assert torch.linalg.vector_norm(after - before) == pytest.approx(0.01, rel=1e-4)


def test_early_stopping_keep_best_and_a_plateau_scheduler():
    """A loss that cannot improve: the plateau scheduler lowers the rate at each validation
    after the first, early stopping ends the fit after `patience` of them, keep_best keeps
    the first's figures."""

    def flat(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs * 0.0).sum() + 1.0  # no gradient, the same value every time

    stopping = trainer(
        mlp(),
        classes(),
        classes(64, 1),
        loss_fn=flat,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
        val_every=2,
        early_stopping={"patience": 2},
        keep_best=True,
    )
    result = stopping.fit(steps=50)
    assert result.steps[-1] == 6  # validations at 2 (the best), 4 and 6 (no improvement)
    assert stopping.stopped_early is not None and "did not improve" in stopping.stopped_early
    assert stopping.best.step == 2 and result.validation == {"val/loss": 1.0}
    assert stopping.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 * 0.1)


def test_callbacks_see_each_moment_and_their_state_is_resumed():
    class Counting(Callback):
        def __init__(self) -> None:
            self.moments: list[str] = []
            self.steps = 0

        def on_train_start(self, trainer: reprotrain.Trainer) -> None:
            self.moments.append("start")

        def on_step_end(self, trainer: reprotrain.Trainer) -> None:
            self.steps += 1

        def on_validation_end(self, trainer: reprotrain.Trainer, metrics: dict) -> None:
            self.moments.append(f"validation@{trainer.step}:{sorted(metrics)}")

        def on_train_end(self, trainer: reprotrain.Trainer) -> None:
            self.moments.append("end")

        def state_dict(self) -> dict[str, Any]:
            return {"steps": self.steps}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.steps = state["steps"]

    counting = Counting()
    first = trainer(mlp(), classes(), classes(64, 1), callbacks=[counting], val_every=5)
    first.fit(steps=10)
    assert counting.moments == [
        "start",
        "validation@5:['val/loss']",
        "validation@10:['val/loss']",
        "end",
    ]
    again = Counting()
    resumed = trainer(mlp(), classes(), classes(64, 1), callbacks=[again])
    resumed.load_state_dict(first.state_dict())
    assert again.steps == 10
    resumed.fit(steps=12)
    assert again.steps == 12


def test_a_scheduler_and_its_state_resume_bit_for_bit():
    def cosine(optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)

    whole = trainer(mlp(), classes(), classes(64, 1), scheduler=cosine, val_every=5)
    whole.fit(steps=20)
    first = trainer(mlp(), classes(), classes(64, 1), scheduler=cosine, val_every=5)
    first.fit(steps=10)
    resumed = trainer(mlp(), classes(), classes(64, 1), scheduler=cosine, val_every=5)
    resumed.load_state_dict(first.state_dict())
    result = resumed.fit(steps=20)
    assert result.losses == whole.losses
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"]
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_fit_counts_epochs_and_continues_from_its_own_step():
    fit = trainer(mlp(), classes(), classes(64, 1))
    assert fit.epoch_length == 16  # 256 items in batches of 16
    assert fit.fit(epochs=1).steps[-1] == 16
    assert fit.fit(steps=20).steps == list(range(1, 21))  # four more, not twenty
    with pytest.raises(reprotrain.ConfigError, match="steps=0"):
        fit.fit(steps=0)
