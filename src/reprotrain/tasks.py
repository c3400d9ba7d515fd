"""Tasks: how a batch reaches the model and becomes a loss, and what validation compares.

    task = Classification()                                   # task=classification (conf/task/)
    task.bind(model)                                          # once: what the model's forward takes
    outputs = task.forward(model, batch)                      # 1. forward
    loss = task.loss(outputs, batch, loss_fn)                 # 2. loss
    predictions, targets = task.predictions(outputs, batch)   # what the metrics compare
    count = task.count(batch)                                 # what the loss averaged over

Built in: `Classification` (the lesson's `loss_fn(model(inputs), targets)`), `Regression` (a
`[batch, 1]` output against `[batch]` targets), `LanguageModel` (token outputs `[batch, seq,
vocab]`, or sequence first, against next-token targets, with an ignore index; optionally a
recurrent model's hidden state carried from batch to batch). A task of your own is a subclass
of `Task` named by `task._target_` (the README's "Tasks").

**Batches** (what the DataLoader, or the resident split, yields):
- a pair `(inputs, targets)`: `model(inputs)`;
- a longer tuple `(*inputs, targets)`: `model(*inputs)`;
- a dict (`{"input_ids": ..., "attention_mask": ..., "labels": ...}`): `model(**batch)`, the
  targets under `task.target_key` (`labels`), passed to the model too when its forward takes
  that argument (a Hugging Face model does, and then computes its own loss).

**Outputs.** The model may return a tensor, a tuple (its first element; a scalar first element
followed by more is the model's own loss, as a Hugging Face model's `return_dict=False`
gives), a dict, or an object with `logits`. A model that returns its own `loss` trains on
it and the `loss` config is not used.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from reprotrain.data.structure import batch_size, describe, map_tensors
from reprotrain.errors import ConfigError


def logits_of(outputs: Any) -> torch.Tensor:
    """The per-sample (or per-token) predictions of any output a model returns."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        if outputs.get("logits") is not None:
            return outputs["logits"]
        found = [v for k, v in outputs.items() if k != "loss" and isinstance(v, torch.Tensor)]
        if found:
            return found[0]
    elif isinstance(getattr(outputs, "logits", None), torch.Tensor):
        return outputs.logits
    elif isinstance(outputs, tuple | list) and outputs:
        first = outputs[0]
        if _is_loss(first) and len(outputs) > 1:
            return logits_of(outputs[1])
        return logits_of(first)
    raise TypeError(f"the model returned {describe(outputs)}, with no tensor of predictions")


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss the model computed itself, if it returned one (Hugging Face, given labels)."""
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, tuple | list) and len(outputs) > 1:
        loss = outputs[0]
    else:
        loss = getattr(outputs, "loss", None)
    return loss if _is_loss(loss) else None


def _is_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


class Task:
    """Classification's behaviour; a subclass changes what it needs, usually `align` (how the
    outputs and targets are shaped for the loss and the metrics).

    `target_key`: where a dict batch keeps its targets.
    """

    carry_state = False

    def __init__(self, target_key: str = "labels") -> None:
        self.target_key = target_key
        self.passes_targets = False  # does the model's forward take `target_key`?

    def bind(self, model: nn.Module) -> Task:
        """Read once what the model's forward takes (a dict batch's targets go in if so)."""
        parameters: Mapping[str, inspect.Parameter]
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        self.passes_targets = self.target_key in parameters
        return self

    # -- the step
    def forward(self, model: nn.Module, batch: Any) -> Any:
        """Call the model on the batch's inputs."""
        args, kwargs = self.model_inputs(batch, targets=self.passes_targets)
        return model(*args, **kwargs)

    def model_inputs(self, batch: Any, targets: bool = False) -> tuple[tuple, dict[str, Any]]:
        """The positional and keyword arguments the model takes from `batch` (with a dict
        batch's targets when `targets`): also the MLflow Model's input example."""
        if isinstance(batch, Mapping):
            if targets:
                return (), dict(batch)
            return (), {k: v for k, v in batch.items() if k != self.target_key}
        if isinstance(batch, tuple | list):
            return (tuple(batch[:-1]) if len(batch) > 1 else (batch[0],)), {}
        return (batch,), {}

    def loss(self, outputs: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
        own = model_loss(outputs)
        if own is not None:
            return own
        predictions, targets = self.align(logits_of(outputs), self.targets(batch))
        return loss_fn(predictions, targets)

    # -- validation
    def predictions(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions, targets) as the metrics take them."""
        return self.align(logits_of(outputs), self.targets(batch))

    def count(self, batch: Any) -> int | torch.Tensor:
        """How many targets the batch's (mean) loss averaged over."""
        return batch_size(self.targets(batch))

    # -- what a subclass changes
    def targets(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            if self.target_key not in batch:
                raise KeyError(
                    f"the batch has no {self.target_key!r} (keys: {', '.join(map(str, batch))})"
                )
            return batch[self.target_key]
        if isinstance(batch, tuple | list) and len(batch) > 1:
            return batch[-1]
        raise TypeError(f"the batch {describe(batch)} holds no targets")

    def align(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs, targets

    # -- state kept from batch to batch (a recurrent model's), checkpointed
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def to(self, device: torch.device) -> None:
        """Move the kept state (if any) to the device, after a resume."""

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Validation starts from a fresh state and leaves the training state as it was."""
        yield

    @property
    def name(self) -> str:
        return type(self).__name__


class Classification(Task):
    """Class logits `[batch, classes]` against integer labels `[batch]` (CrossEntropyLoss)."""


class Regression(Task):
    """Values against float targets: a `[batch, 1]` output is compared with `[batch]`
    targets as `[batch]` (MSELoss would otherwise broadcast them to `[batch, batch]`)."""

    def align(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if outputs.ndim == targets.ndim + 1 and outputs.shape[-1] == 1:
            outputs = outputs.squeeze(-1)
        if not targets.is_floating_point():
            targets = targets.to(outputs.dtype)
        return outputs, targets


class LanguageModel(Task):
    """Token outputs `[batch, seq, vocab]` against next-token targets `[batch, seq]`, flattened
    to `[tokens, vocab]` and `[tokens]` for the loss (CrossEntropyLoss, or NLLLoss for a model
    that returns log-probabilities); targets equal to `ignore_index` count nowhere.

    `batch_first=false`: the model takes and returns sequence-first tensors (`[seq, batch]`,
    as PyTorch's nn.Transformer and RNN examples do): the batch's `[batch, seq]` tensors are
    transposed on their way in. `carry_state=true`: the model's forward takes a hidden state
    after its input and returns `(output, state)`; the state is carried from batch to batch
    (detached, so backward stops at the batch: truncated backpropagation through time),
    starts from `model.init_hidden(batch)` when the model has it (else None), is part of the
    checkpoint, and validation starts its own. Use it with `data.shuffle=false`.
    """

    def __init__(
        self,
        target_key: str = "labels",
        ignore_index: int = -100,
        batch_first: bool = True,
        carry_state: bool = False,
    ) -> None:
        super().__init__(target_key)
        self.ignore_index, self.batch_first = ignore_index, batch_first
        self.carry_state = carry_state
        self.state: Any = None
        self.init_hidden: Any = None

    def bind(self, model: nn.Module) -> Task:
        super().bind(model)
        self.init_hidden = getattr(model, "init_hidden", None)
        return self

    def model_inputs(self, batch: Any, targets: bool = False) -> tuple[tuple, dict[str, Any]]:
        if not self.batch_first:
            batch = map_tensors(_sequence_first, batch)
        return super().model_inputs(batch, targets)

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if not self.carry_state:
            return super().forward(model, batch)
        args, kwargs = self.model_inputs(batch, targets=self.passes_targets)
        size = batch_size(args[0]) if self.batch_first else int(args[0].shape[1])
        if self.state is None or _state_batch(self.state) != size:
            self.state = self.init_hidden(size) if self.init_hidden is not None else None
        outputs, state = model(*args, self.state, **kwargs)
        self.state = map_tensors(torch.Tensor.detach, state)  # backward stops at this batch
        return outputs

    def targets(self, batch: Any) -> torch.Tensor:
        targets = super().targets(batch)
        return targets if self.batch_first else _sequence_first(targets)

    def align(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)

    def predictions(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        predictions, targets = super().predictions(outputs, batch)
        kept = targets != self.ignore_index
        return predictions[kept], targets[kept]

    def count(self, batch: Any) -> torch.Tensor:
        return (self.targets(batch) != self.ignore_index).sum()

    def state_dict(self) -> dict[str, Any]:
        if self.state is None:
            return {"state": None}
        return {"state": map_tensors(lambda t: t.detach().cpu(), self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state.get("state")

    def to(self, device: torch.device) -> None:
        if self.state is not None:
            self.state = map_tensors(lambda t: t.to(device), self.state)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        kept, self.state = self.state, None
        try:
            yield
        finally:
            self.state = kept


def _sequence_first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(0, 1) if tensor.ndim >= 2 else tensor


def _state_batch(state: Any) -> int:
    """The batch size a hidden state was made for ([layers, batch, hidden] for torch's RNNs)."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, state)
    if not found:
        return -1
    first = found[0]
    return int(first.shape[1]) if first.ndim >= 3 else int(first.shape[0])


def check_task(task: Any, target: str) -> Any:
    """A task object must have the methods the loop calls."""
    missing = [
        name
        for name in ("bind", "forward", "loss", "predictions", "count", "state_dict")
        if not callable(getattr(task, name, None))
    ]
    if missing:
        raise ConfigError(
            f"task._target_={target!r} built a {type(task).__name__}, which lacks "
            f"{', '.join(missing)}",
            hint="subclass reprotrain.tasks.Task and override what differs (usually align)",
        )
    return task
