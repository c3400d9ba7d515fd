"""Tasks: how a batch reaches the model and becomes a loss, and what validation compares.

    task = Classification()                                   # task=classification (conf/task/)
    task.bind(model)                                          # once: what the model's forward takes
    outputs = task.forward(model, batch)                      # 1. forward
    loss = task.loss(outputs, batch, loss_fn)                 # 2. loss
    predictions, targets = task.predictions(outputs, batch)   # what the metrics compare
    count = task.count(batch)                                 # what the loss averaged over

Built in: `Classification` (the lesson's `loss_fn(model(inputs), targets)`), `Regression` (a
`[batch, 1]` output against `[batch]` targets), `Binary` (one logit per sample against 0/1
targets), `LanguageModel` (token outputs `[batch, seq,
vocab]`, or sequence first, against next-token targets, with an ignore index; optionally a
recurrent model's hidden state carried from batch to batch). A task of your own is a subclass
of `Task` named by `task._target_` (the README's "Tasks").

**Batches** (what the DataLoader, or the resident split, yields):
- a pair `(inputs, targets)`: `model(inputs)`;
- a longer tuple `(*inputs, targets)`: `model(*inputs)`;
- a pair `(inputs: dict, targets)`: `model(**inputs)`;
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
from collections.abc import Iterable, Iterator, Mapping
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
            if len(batch) == 2 and isinstance(batch[0], Mapping):  # (inputs: dict, targets)
                return (), dict(batch[0])
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

    def check_batch(self, batch: Any) -> None:
        """Raise a ConfigError for a batch this task would train on wrongly without failing
        (the fit check calls it on a training batch before the first step)."""

    def check_outputs(self, outputs: Any, batch: Any) -> None:
        """Raise a ConfigError for outputs this task would train on wrongly without failing
        (the fit check calls it on the model's outputs for a training batch)."""

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


class Binary(Task):
    """One logit per sample (`[batch]` or `[batch, 1]`) against 0/1 targets (BCEWithLogitsLoss):
    the logit is squeezed to `[batch]` and the targets become floats of its dtype for the loss;
    the binary metrics (accuracy, AUROC) take the probabilities."""

    def align(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if outputs.ndim == targets.ndim + 1 and outputs.shape[-1] == 1:
            outputs = outputs.squeeze(-1)
        return outputs, targets.to(outputs.dtype)

    def predictions(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities (the sigmoid of the logits: a binary metric would read logits that
        happen to lie in [0, 1] as probabilities) against integer 0/1 targets."""
        logits, targets = super().predictions(outputs, batch)
        return torch.sigmoid(logits), targets.long()


class WholeOutput(Task):
    """A loss that takes more than (predictions, targets): the model's whole output and the
    batch, as `loss_fn(*loss_args)`, with no wrapper module. Each of `loss_args` names one
    argument, in order:

    - `output`: what the model returned; `output.N` / `output.KEY`: its N-th element, its
      key or attribute (a Hugging Face output's field);
    - `input`: the batch's (first) input; `input.N` / `input.KEY`: one of several inputs;
    - `target`: the batch's targets; `batch`: the whole batch.

    PyTorch's VAE example, `loss_function(recon_x, x, mu, logvar)` on `model(x) -> (recon, mu,
    logvar)`: `loss_args: [output.0, input, output.1, output.2]`. A batch may hold inputs only
    (unsupervised: a dataset of one tensor, or a pair whose targets the loss does not name);
    validation weighs each batch's loss by its number of samples. The metrics compare the
    output's first tensor with the targets, or with the input where the batch has none (an
    autoencoder's reconstruction against its input)."""

    def __init__(
        self, loss_args: Iterable[str] = ("output", "target"), target_key: str = "labels"
    ) -> None:
        super().__init__(target_key)
        self.loss_args = [_checked_arg(str(name)) for name in loss_args]

    def loss(self, outputs: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
        own = model_loss(outputs)
        if own is not None:
            return own
        return loss_fn(*(self.argument(name, outputs, batch) for name in self.loss_args))

    def argument(self, name: str, outputs: Any, batch: Any) -> Any:
        """The value `name` (one of loss_args) names."""
        root, _, part = name.partition(".")
        if root == "batch":
            return batch
        if root == "target":
            return self.targets(batch)
        if root == "output":
            value = outputs
        else:
            args, kwargs = self.model_inputs(batch)
            value = kwargs if kwargs else (args[0] if len(args) == 1 and not part else args)
        return _part(value, part, name) if part else value

    def predictions(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        compared = (
            self.targets(batch)
            if _has_targets(batch, self.target_key)
            else self.argument("input", outputs, batch)
        )
        return self.align(logits_of(outputs), compared)

    def count(self, batch: Any) -> int | torch.Tensor:
        args, kwargs = self.model_inputs(batch)
        first = args[0] if args else next(iter(kwargs.values()))
        return batch_size(first)

    def model_inputs(self, batch: Any, targets: bool = False) -> tuple[tuple, dict[str, Any]]:
        if isinstance(batch, tuple | list) and len(batch) == 1:  # a dataset of one tensor
            return (batch[0],), {}
        return super().model_inputs(batch, targets)


ARG_ROOTS = ("output", "input", "target", "batch")


def _checked_arg(name: str) -> str:
    root, _, part = name.partition(".")
    if root not in ARG_ROOTS or (root in ("target", "batch") and part) or name.endswith("."):
        raise ConfigError(
            f"task.loss_args has {name!r}, which names nothing the loss can be given; allowed: "
            "output, output.N, output.KEY, input, input.N, input.KEY, target, batch",
            hint="list the loss's arguments in order, e.g. [output.0, input, output.1, output.2]",
        )
    return name


def _part(value: Any, part: str, name: str) -> Any:
    try:
        if isinstance(value, Mapping):
            return value[part]
        if part.isdigit() and isinstance(value, tuple | list):
            return value[int(part)]
        return getattr(value, part)
    except (KeyError, IndexError, AttributeError):
        raise ConfigError(
            f"task.loss_args names {name!r}, but that is {describe(value)}, with no {part!r}",
            hint="name an element the model's output or the batch has (output.0, input.pixels)",
        ) from None


def _has_targets(batch: Any, target_key: str) -> bool:
    if isinstance(batch, Mapping):
        return target_key in batch
    return isinstance(batch, tuple | list) and len(batch) > 1


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

    `shift`: are the labels the inputs themselves, the model predicting each token's next?
    `false`: the labels are already the next tokens (`labels[t] = input_ids[t+1]`), compared
    with the outputs position by position. `true`: the Hugging Face convention (`labels =
    input_ids`): outputs `[:-1]` are compared with labels `[1:]`, for the loss (when the model
    does not compute its own) and for the metrics. `auto` (the default): true for a model that
    shifts the labels it is given itself, a Hugging Face causal LM (`*ForCausalLM`,
    `GPT2LMHeadModel`: it can generate and is not an encoder-decoder) taking `target_key`;
    false otherwise. `shifts` holds the decision (the run logs it as `task.shifts_labels`).
    """

    def __init__(
        self,
        target_key: str = "labels",
        ignore_index: int = -100,
        batch_first: bool = True,
        carry_state: bool = False,
        shift: bool | str = "auto",
    ) -> None:
        super().__init__(target_key)
        if shift not in (True, False, "auto"):
            raise ConfigError(
                f"task.shift={shift!r} is not a choice; allowed: auto, true, false",
                hint="task.shift=auto decides from the model (a Hugging Face causal LM "
                "shifts its labels itself)",
            )
        self.ignore_index, self.batch_first = ignore_index, batch_first
        self.carry_state, self.shift = carry_state, shift
        self.shifts = shift is True
        self.state: Any = None
        self.init_hidden: Any = None

    def bind(self, model: nn.Module) -> Task:
        super().bind(model)
        self.init_hidden = getattr(model, "init_hidden", None)
        if self.shift == "auto":
            self.shifts = self.passes_targets and shifts_its_labels(model)
        return self

    def check_batch(self, batch: Any) -> None:
        """Next-token labels given to a model that shifts its labels again would train it to
        predict two tokens ahead: refused, when the batch shows it (`labels[t] ==
        input_ids[t+1]` wherever a label counts)."""
        if not (self.shifts and isinstance(batch, Mapping)):
            return
        inputs, labels = batch.get("input_ids"), batch.get(self.target_key)
        if not (isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)):
            return
        if inputs.shape != labels.shape or inputs.ndim != 2 or inputs.shape[1] < 3:
            return
        nexts, counted = inputs[:, 1:], labels[:, :-1] != self.ignore_index
        ahead = bool(counted.any()) and bool((labels[:, :-1] == nexts)[counted].all())
        if ahead and not bool((labels == inputs)[labels != self.ignore_index].all()):
            raise ConfigError(
                f"the batch's {self.target_key!r} are already the next tokens "
                f"({self.target_key}[t] = input_ids[t+1]), but the model shifts the labels it "
                "is given itself, so it would learn to predict two tokens ahead",
                hint=f"give {self.target_key} = input_ids (the Hugging Face convention), or "
                "keep next-token labels under another key (task.target_key) that the model "
                "does not take, with task.shift=false",
            )

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

    def check_outputs(self, outputs: Any, batch: Any) -> None:
        """Targets are token sequences: one label per sample (`[batch]`, classification data)
        would train as a classifier under this task's name, its perplexity meaningless."""
        labels = Task.targets(self, batch)
        if labels.ndim < 2:
            raise ConfigError(
                f"task=language_model takes a sequence of target tokens per sample, but the "
                f"batch's targets are {describe(labels)} (one label per sample) and the model "
                f"returns {describe(logits_of(outputs))}",
                hint="use task=classification for one label per sample, or give the model "
                "token sequences",
            )

    def targets(self, batch: Any) -> torch.Tensor:
        """The labels as the outputs are laid out (sequence first when the model is); with
        `shifts`, the labels of positions 1.. (what outputs 0..-1 predict)."""
        targets = super().targets(batch)
        targets = targets if self.batch_first else _sequence_first(targets)
        if self.shifts:
            seq = 1 if self.batch_first else 0
            targets = targets.narrow(seq, 1, targets.shape[seq] - 1)
        return targets

    def align(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shifts:  # the last position predicts a token the batch does not hold
            seq = 1 if self.batch_first else 0
            outputs = outputs.narrow(seq, 0, outputs.shape[seq] - 1)
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


def shifts_its_labels(model: nn.Module) -> bool:
    """A Hugging Face causal LM: it shifts the labels it is given itself (its loss compares
    logits[:-1] with labels[1:]). Read from its public `can_generate()` and config, so that
    seq2seq models (which compare position by position) and encoders are not counted."""
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    if not callable(can_generate) or config is None:
        return False
    return bool(can_generate()) and not getattr(config, "is_encoder_decoder", False)


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
