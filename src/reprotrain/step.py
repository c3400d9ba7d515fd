"""The training step, as the course teaches it.

    device = resolve_device("auto")                     # devices.py
    model = model.to(device)                            # once, before the loop
    for batch in batches:
        batch = move_batch_to_device(batch, device)     # every batch, inside the loop
        loss = train_step(model, [batch], task, loss_fn, optimizer)

`task` (tasks.py) says how the batch reaches the model and becomes a loss: for the lesson's
classifier, `loss_fn(model(inputs), targets)`. `loss` comes back still on the device: reading
it (`.item()`, `.cpu()`) waits for the GPU, so the loop reads losses in batches every
`log_every` steps instead of every step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from reprotrain.data.structure import move_to, tensors
from reprotrain.errors import DeviceError
from reprotrain.tasks import Task

# A loss: `loss_fn(predictions, targets) -> scalar tensor` (an nn.Module such as
# nn.CrossEntropyLoss, or a function).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A learning-rate scheduler (ReduceLROnPlateau is one too, stepped with a validation figure).
Scheduler = torch.optim.lr_scheduler.LRScheduler


class Updatable(Protocol):
    """What evaluate() asks of a metric: `update(predictions, targets)` with each batch's
    (a `metrics.Metric`, or evaluate.py's `ClassPairs`)."""

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None: ...


def _no_mark(_phase: str) -> None:
    pass


def move_batch_to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of the batch (a pair, a tuple, a dict, nested) on the device."""
    return move_to(batch, device)


@dataclass
class Knobs:
    """How the step is taken beyond the lesson: `autocast` (bf16/fp16, else a no-op),
    `scaler` (fp16's GradScaler: the loss scaled up for backward, the gradients unscaled
    before the step, a step with inf/NaN gradients skipped), `clip_grad_norm` (the gradients'
    total norm clipped to it before the step)."""

    autocast: Any = field(default_factory=contextlib.nullcontext)
    scaler: torch.amp.GradScaler | None = None
    clip_grad_norm: float | None = None

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None and self.clip_grad_norm:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if self.clip_grad_norm:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()


def train_step(
    model: nn.Module,
    batches: Sequence[Any],
    task: Task,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    knobs: Knobs | None = None,
    mark: Callable[[str], None] = _no_mark,
) -> torch.Tensor:
    """Forward, loss, zero_grad, backward, step on one batch (`[batch]`); with gradient
    accumulation, on k micro-batches: the k gradients add up (each loss divided by k) before
    the one optimizer step, and under DDP only the last backward all-reduces them. Returns the
    mean loss, still on the device. `mark` stamps the timing boundaries."""
    knobs = knobs or Knobs()
    k = len(batches)
    total: torch.Tensor | None = None  # the micro-batches' losses, summed on the device
    for i, batch in enumerate(batches):
        with _gradient_sync(model, last=i == k - 1):
            try:
                with knobs.autocast:
                    outputs = task.forward(model, batch)  # 1. forward
                    loss = task.loss(outputs, batch, loss_fn)  # 2. loss
            except RuntimeError as error:
                raise _explain_device_mismatch(error, model, batch) from error
            mark("forward")
            if i == 0:
                optimizer.zero_grad(set_to_none=True)  # 3. zero_grad
            knobs.backward(loss / k if k > 1 else loss)  # 4. backward
            mark("backward")
        total = loss.detach() if total is None else total + loss.detach()
    if total is None:  # no batch: no gradients to step with
        raise ValueError(
            "train_step got batches=[]; give one batch: train_step(model, [batch], ...)"
        )
    knobs.step(optimizer)  # 5. step
    mark("optimizer")
    return total / k if k > 1 else total  # still on the device: no sync here


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Does `optimizer.step` require a closure (LBFGS's `step(closure)`), rather than take
    an optional one as most optimizers' `step(closure=None)` do?"""
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def closure_step(
    model: nn.Module,
    batches: Sequence[Any],
    task: Task,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    knobs: Knobs | None = None,
    mark: Callable[[str], None] = _no_mark,
) -> torch.Tensor:
    """The step for an optimizer that re-evaluates the loss itself (LBFGS): the same five
    steps, with forward, loss, zero_grad and backward handed to `step` as its closure, which
    it calls as often as it needs (LBFGS: up to max_iter times, with the line search). The
    gradients are clipped inside the closure when clip_grad_norm is set; with gradient
    accumulation the closure covers the k micro-batches. Returns the loss before the update
    (the closure's first evaluation), still on the device."""
    knobs = knobs or Knobs()
    k = len(batches)
    if k == 0:
        raise ValueError(
            "closure_step got batches=[]; give one batch: closure_step(model, [batch], ...)"
        )
    marks = [mark]  # the first evaluation's phases; later ones are the optimizer's time

    def closure() -> torch.Tensor:
        stamp = marks.pop() if marks else _no_mark
        optimizer.zero_grad(set_to_none=True)  # 3. zero_grad
        total: torch.Tensor | None = None
        for i, batch in enumerate(batches):
            with _gradient_sync(model, last=i == k - 1):
                with knobs.autocast:
                    outputs = task.forward(model, batch)  # 1. forward
                    loss = task.loss(outputs, batch, loss_fn)  # 2. loss
                stamp("forward")
                (loss / k if k > 1 else loss).backward()  # 4. backward
                stamp("backward")
            total = loss.detach() if total is None else total + loss.detach()
        if knobs.clip_grad_norm:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, knobs.clip_grad_norm)
        assert total is not None
        return total / k if k > 1 else total

    try:
        # 5. step, evaluating the closure as it needs; it returns the first evaluation's
        # loss (torch types the closure's value as a float: ours is the loss tensor).
        loss = optimizer.step(cast(Callable[[], float], closure))
    except RuntimeError as error:
        raise _explain_device_mismatch(error, model, batches[0]) from error
    mark("optimizer")
    return cast(torch.Tensor, loss)


def _gradient_sync(model: nn.Module, last: bool) -> Any:
    """DDP all-reduces the gradients at the last micro-batch's backward only."""
    no_sync = getattr(model, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def _explain_device_mismatch(error: RuntimeError, model: nn.Module, batch: Any) -> Exception:
    if "device" not in str(error).lower():
        return error
    found = tensors(batch)
    model_device = next(model.parameters(), found[0] if found else torch.empty(0)).device
    if all(t.device == model_device for t in found):
        return error
    where = ", ".join(sorted({str(t.device) for t in found}))
    return DeviceError(
        f"model and data are on different devices: model on {model_device}, batch on {where}",
        hint="move the model once with model.to(device) and every batch inside the loop "
        "with move_batch_to_device(batch, device)",
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    task: Task,
    loss_fn: LossFn,
    device: torch.device,
    metrics: Mapping[str, Updatable] | None = None,
) -> torch.Tensor:
    """`[loss x count summed, count]` over a split's batches (eval mode, no grad, on the
    device: the caller reads it, after reducing it over ranks), each metric updated with the
    task's (predictions, targets)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=device)
    with task.evaluating():
        for batch in batches:
            batch = move_batch_to_device(batch, device)
            outputs = task.forward(model, batch)
            count = task.count(batch)
            totals[0] += task.loss(outputs, batch, loss_fn).float() * count
            totals[1] += count
            if metrics:
                # Contiguous: metrics reshape with .view, which a sliced view of the data
                # (torch.from_numpy(a[3:, :-1])) cannot take.
                predictions, targets = map(_contiguous, task.predictions(outputs, batch))
                for metric in metrics.values():
                    metric.update(predictions, targets)
    model.train(was_training)
    return totals


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous()
