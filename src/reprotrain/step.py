"""The training step, as the course teaches it.

    device = resolve_device("auto")                     # devices.py
    model = model.to(device)                            # once, before the loop
    for batch in batches:
        inputs, targets = move_batch_to_device(batch, device)   # every batch, inside the loop
        loss = train_step(model, inputs, targets, loss_fn, optimizer)

`loss` comes back still on the device: reading it (`.item()`, `.cpu()`) waits for the GPU,
so the loop reads losses in batches every `log_every` steps instead of every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from reprotrain.errors import DeviceError


def _no_mark(_phase: str) -> None:
    pass


def move_batch_to_device(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batch
    # non_blocking: from pinned host memory the copy overlaps GPU work. Already there: a no-op.
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def train_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    mark: Callable[[str], None] = _no_mark,
    autocast: Any = contextlib.nullcontext(),  # noqa: B008 (stateless, shared on purpose)
) -> torch.Tensor:
    """Forward, loss, zero_grad, backward, step. `mark` stamps the timing boundaries;
    `autocast` is bf16 autocast with train.precision=bf16, else a no-op."""
    try:
        with autocast:
            logits = model(inputs)  # 1. forward
            loss = loss_fn(logits, targets)  # 2. loss
    except RuntimeError as error:
        raise _explain_device_mismatch(error, model, inputs, targets) from error
    mark("forward")
    optimizer.zero_grad(set_to_none=True)  # 3. zero_grad
    loss.backward()  # 4. backward
    mark("backward")
    optimizer.step()  # 5. step
    mark("optimizer")
    return loss.detach()  # still on the device: no sync here


def _explain_device_mismatch(
    error: RuntimeError, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> Exception:
    if "same device" not in str(error) and "device" not in str(error).lower():
        return error
    model_device = next(model.parameters(), inputs).device
    if inputs.device == model_device and targets.device == model_device:
        return error
    return DeviceError(
        f"model and data are on different devices: model on {model_device}, "
        f"inputs on {inputs.device}, targets on {targets.device}",
        hint="move the model once with model.to(device) and every batch inside the loop "
        "with move_batch_to_device(batch, device)",
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[Any], loss_fn: Any, device: torch.device
) -> tuple[float, float, np.ndarray]:
    """Mean loss, accuracy and predicted classes over a split's batches (eval mode, no grad).

    Accuracy and predictions are for class labels (outputs [n, classes], integer targets);
    for other targets accuracy is NaN and predictions are empty. Results reach NumPy via .cpu().
    """
    was_training = model.training
    model.eval()
    total_loss, correct, count = torch.zeros((), device=device), torch.zeros((), device=device), 0
    predictions: list[torch.Tensor] = []
    classes = True
    for batch in batches:
        inputs, targets = move_batch_to_device(batch, device)
        outputs = model(inputs)
        total_loss += loss_fn(outputs, targets).float() * targets.shape[0]
        count += targets.shape[0]
        classes = classes and outputs.ndim == 2 and not targets.is_floating_point()
        if classes:
            predicted = outputs.argmax(dim=1)
            correct += (predicted == targets).sum()
            predictions.append(predicted)
    model.train(was_training)
    mean_loss = (total_loss / max(count, 1)).cpu().item()  # sync point: the one read of the results
    if not classes:
        return mean_loss, float("nan"), np.empty(0, dtype=np.int64)
    return mean_loss, correct.cpu().item() / max(count, 1), torch.cat(predictions).cpu().numpy()
