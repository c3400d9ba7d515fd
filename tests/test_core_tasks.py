"""Every built-in task through the lesson's step (`step.train_step`) and validation
(`step.evaluate`) on tiny real torch models: how a batch reaches the model, becomes a loss and
a count, what the metrics compare, and, for a recurrent language model, the hidden state
carried from batch to batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reprotrain.step import evaluate, train_step
from reprotrain.tasks import Classification, LanguageModel, Regression, Task, logits_of, model_loss

CPU = torch.device("cpu")


class Collected:
    """A metric that keeps what evaluate() gives it (step.Updatable)."""

    def __init__(self) -> None:
        self.predictions: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        self.predictions.append(predictions)
        self.targets.append(targets)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def classification_batches(count: int = 4, size: int = 8) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        x = torch.randn(size, 4, generator=generator)
        batches.append((x, (x[:, 0] > 0).long()))
    return batches


def test_classification_steps_on_the_lessons_loss_and_its_loss_falls() -> None:
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    task = Classification().bind(model)
    optimizer = sgd(model)
    batches = classification_batches()
    x, y = batches[0]
    expected = loss_fn(model(x), y)
    loss = train_step(model, [batches[0]], task, loss_fn, optimizer)
    assert loss.shape == () and loss.requires_grad is False  # detached, still a tensor
    assert torch.allclose(loss, expected.detach())  # the loss before this step's update
    first = evaluate(model, batches, task, loss_fn, CPU)
    for _ in range(30):
        for batch in batches:
            train_step(model, [batch], task, loss_fn, optimizer)
    last = evaluate(model, batches, task, loss_fn, CPU)
    assert first[1] == last[1] == 32  # samples counted
    assert last[0] / last[1] < 0.5 * first[0] / first[1]


def test_evaluate_sums_loss_times_count_leaves_the_mode_and_gradients_alone() -> None:
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    task = Classification().bind(model)
    batches = classification_batches(count=2, size=5) + [classification_batches(1, 3)[0]]
    metric = Collected()
    model.train()
    totals = evaluate(model, batches, task, loss_fn, CPU, metrics={"acc": metric})
    with torch.no_grad():
        expected = sum(loss_fn(model(x), y) * len(y) for x, y in batches)
    assert totals[1] == 13 and torch.allclose(totals[0], expected)
    assert model.training  # put back as it was
    assert all(p.grad is None for p in model.parameters())  # no_grad
    assert [p.shape for p in metric.predictions] == [(5, 2), (5, 2), (3, 2)]
    assert torch.equal(torch.cat(metric.targets), torch.cat([y for _, y in batches]))
    model.eval()
    evaluate(model, batches, task, loss_fn, CPU)
    assert not model.training


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(3, 2), nn.Linear(5, 2)

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return self.left(left) + self.right(right)


def test_a_longer_tuple_gives_the_model_every_input_before_the_targets() -> None:
    model, loss_fn = TwoInputs(), nn.CrossEntropyLoss()
    task = Classification().bind(model)
    batch = (torch.randn(6, 3), torch.randn(6, 5), torch.randint(0, 2, (6,)))
    assert task.model_inputs(batch) == ((batch[0], batch[1]), {})
    loss = train_step(model, [batch], task, loss_fn, sgd(model))
    assert torch.isfinite(loss)
    assert task.count(batch) == 6


class OwnLoss(nn.Module):
    """A Hugging Face-style model: dict batches, and its own loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)
        self.calls: list[set[str]] = []

    def forward(self, input_ids, attention_mask, labels=None):
        self.calls.append({"labels"} if labels is not None else set())
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.head(pooled)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels) + 100.0  # its own
        return out


def test_dict_batches_pass_the_labels_to_a_model_that_takes_them_and_train_on_its_loss() -> None:
    model = OwnLoss()
    task = Classification().bind(model)
    assert task.passes_targets
    batch = {
        "input_ids": torch.randint(0, 10, (4, 7)),
        "attention_mask": torch.ones(4, 7, dtype=torch.long),
        "labels": torch.tensor([0, 1, 1, 0]),
    }
    unused = nn.MSELoss()  # the config's loss is not used when the model returns one
    loss = train_step(model, [batch], task, unused, sgd(model))
    assert model.calls == [{"labels"}] and loss.item() > 100.0  # the model's own loss
    predictions, targets = task.predictions(model(**batch), batch)
    assert predictions.shape == (4, 2) and torch.equal(targets, batch["labels"])
    args, kwargs = task.model_inputs(batch)  # the MLflow Model's input example: no labels
    assert args == () and set(kwargs) == {"input_ids", "attention_mask"}
    with pytest.raises(KeyError, match="the batch has no 'labels'"):
        task.targets({"input_ids": batch["input_ids"]})


def test_every_output_shape_a_model_returns_gives_its_predictions_and_own_loss() -> None:
    logits, own = torch.randn(3, 2), torch.tensor(0.5)

    class WithLogits:
        def __init__(self) -> None:
            self.logits = logits

    assert logits_of(logits) is logits
    assert logits_of((logits, torch.zeros(3))) is logits  # the first element
    assert logits_of((own, logits)) is logits  # a scalar loss first, as return_dict=False
    assert logits_of({"loss": own, "logits": logits}) is logits
    assert logits_of({"loss": own, "scores": logits}) is logits  # the first other tensor
    assert logits_of(WithLogits()) is logits
    assert model_loss((own, logits)) is own and model_loss({"loss": own}) is own
    assert model_loss(logits) is None and model_loss({"logits": logits}) is None
    with pytest.raises(TypeError, match="no tensor of predictions"):
        logits_of("text")


def test_regression_compares_a_column_output_with_flat_targets_as_floats() -> None:
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(3, 1), nn.MSELoss()
    task = Regression().bind(model)
    x = torch.randn(8, 3)
    y = torch.arange(8)  # integer targets: compared as floats
    with torch.no_grad():
        expected = ((model(x).squeeze(1) - y.float()) ** 2).mean()  # not broadcast to 8x8
    loss = train_step(model, [(x, y)], task, loss_fn, sgd(model))
    assert torch.allclose(loss, expected)
    metric = Collected()
    totals = evaluate(model, [(x, y)], task, loss_fn, CPU, metrics={"mae": metric})
    assert totals[1] == 8
    assert metric.predictions[0].shape == (8,) and metric.targets[0].dtype == torch.float32


class TokenModel(nn.Module):
    """Tokens in, [batch, seq, vocab] (or [seq, batch, vocab]) scores out."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 6), nn.Linear(6, vocab)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(tokens.shape))
        return self.head(self.embed(tokens))


def token_batch(batch: int = 3, seq: int = 5, vocab: int = 11) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[0, :2] = -100  # padding: counted nowhere
    return tokens[:, :-1], targets


def test_language_model_flattens_tokens_and_leaves_ignored_targets_out() -> None:
    torch.manual_seed(0)
    model, loss_fn = TokenModel(), nn.CrossEntropyLoss(ignore_index=-100)
    task = LanguageModel().bind(model)
    inputs, targets = token_batch()
    with torch.no_grad():
        expected = nn.functional.cross_entropy(
            model(inputs).reshape(-1, 11), targets.reshape(-1), ignore_index=-100
        )
    loss = train_step(model, [(inputs, targets)], task, loss_fn, sgd(model))
    assert torch.allclose(loss, expected)
    assert task.count((inputs, targets)) == 3 * 5 - 2
    metric = Collected()
    totals = evaluate(model, [(inputs, targets)], task, loss_fn, CPU, metrics={"acc": metric})
    assert totals[1] == 13
    assert metric.predictions[0].shape == (13, 11) and (metric.targets[0] != -100).all()


def test_language_model_sequence_first_transposes_the_batch_on_its_way_in() -> None:
    model, loss_fn = TokenModel(), nn.CrossEntropyLoss()
    task = LanguageModel(batch_first=False).bind(model)
    inputs, targets = token_batch(batch=3, seq=5)
    train_step(model, [(inputs, targets)], task, loss_fn, sgd(model))
    assert model.seen == [(5, 3)]  # [seq, batch]
    assert torch.equal(task.targets((inputs, targets)), targets.T)


class TinyRNN(nn.Module):
    """PyTorch's word-language-model shape: forward(input, hidden) -> (output, hidden)."""

    def __init__(self, vocab: int = 11, hidden: int = 6) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, hidden), nn.RNN(hidden, hidden)
        self.head, self.hidden_size = nn.Linear(hidden, vocab), hidden
        self.states_in: list[torch.Tensor] = []

    def init_hidden(self, batch: int) -> torch.Tensor:
        return torch.zeros(1, batch, self.hidden_size)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor):
        self.states_in.append(hidden)
        output, hidden = self.rnn(self.embed(tokens), hidden)
        return self.head(output), hidden


def test_carry_state_passes_the_detached_hidden_state_from_batch_to_batch() -> None:
    torch.manual_seed(0)
    model, loss_fn = TinyRNN(), nn.CrossEntropyLoss()
    task = LanguageModel(batch_first=False, carry_state=True).bind(model)
    optimizer = sgd(model)
    first, second = token_batch(batch=3), token_batch(batch=3)
    train_step(model, [first], task, loss_fn, optimizer)
    assert torch.equal(model.states_in[0], torch.zeros(1, 3, 6))  # model.init_hidden
    after_first = task.state
    assert after_first.shape == (1, 3, 6) and not after_first.requires_grad
    train_step(model, [second], task, loss_fn, optimizer)  # backward stops at the batch
    assert model.states_in[1] is after_first  # carried
    train_step(model, [token_batch(batch=2)], task, loss_fn, optimizer)
    assert torch.equal(model.states_in[2], torch.zeros(1, 2, 6))  # another batch size: afresh

    kept = task.state
    totals = evaluate(model, [first], task, loss_fn, CPU)
    assert totals[1] == 13
    assert torch.equal(model.states_in[3], torch.zeros(1, 3, 6))  # validation starts its own
    assert task.state is kept  # and leaves the training state as it was

    saved = task.state_dict()
    assert saved["state"].device.type == "cpu" and torch.equal(saved["state"], kept)
    resumed = LanguageModel(batch_first=False, carry_state=True).bind(model)
    resumed.load_state_dict(saved)
    resumed.to(CPU)
    assert torch.equal(resumed.state, kept)
    assert LanguageModel().state_dict() == {"state": None}


def test_a_task_of_your_own_changes_only_what_differs() -> None:
    class Doubled(Task):
        def align(self, outputs, targets):
            return outputs * 2, targets

    model, loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    task = Doubled().bind(model)
    x, y = classification_batches(1)[0]
    with torch.no_grad():
        expected = loss_fn(model(x) * 2, y)
    assert torch.allclose(train_step(model, [(x, y)], task, loss_fn, sgd(model)), expected)
    assert task.name == "Doubled" and task.state_dict() == {}


def test_train_step_without_a_batch_says_how_to_call_it() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"train_step got batches=\[\]; give one batch"):
        train_step(model, [], Classification(), nn.CrossEntropyLoss(), sgd(model))
