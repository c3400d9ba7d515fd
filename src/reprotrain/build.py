"""Build the pieces a config names, with Hydra's `instantiate`: data, model, loss, optimizer,
scheduler. One path for reprotrain's own models and data and for yours.

    splits = build_data(config)                           # Splits(train, val, num_classes)
    model_cfg = with_data_sizes(config.model, splits)     # sizes that follow the data, filled in
    model = build_model(model_cfg).to(device)             # once
    optimizer = build_optimizer(config.optimizer, model.parameters(), device)

**Sizes that follow the data** (the one place they are filled in): when the model's
constructor takes an argument named `in_features` (a sample's element count), `input_shape`
(a sample's shape, e.g. [1, 8, 8]), `in_channels` (its first dimension) or `num_classes`, and
the YAML does not set it, it is taken from the training data's first sample and class count.
A value set in the YAML (or an interpolation such as `${data.num_features}`) wins.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object, instantiate
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from reprotrain.callbacks import Callback
from reprotrain.data import Splits, as_splits, read_npz
from reprotrain.data.batches import Reading, val_batches
from reprotrain.data.splits import first_batch, input_sample
from reprotrain.data.structure import describe, map_tensors, move_to
from reprotrain.devices import available_memory
from reprotrain.errors import ConfigError, DeviceError
from reprotrain.metrics import Metric, build_metrics
from reprotrain.schema import Config, drop_auto_fused, target_kwargs
from reprotrain.seeding import VALIDATION_STREAM, seeded
from reprotrain.step import LossFn, Scheduler
from reprotrain.tasks import Classification, Task, check_task, logits_of, model_loss


@dataclass
class Pieces:
    """What a run trains, built from its config; the Run hands them to a Trainer."""

    splits: Splits
    model: nn.Module
    model_config: dict[str, Any]  # the model's _target_ config with the data sizes filled in
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None
    scheduler_interval: str  # "step", "epoch", or "validation" (stepped with scheduler.monitor)
    task: Task = field(default_factory=Classification)
    metrics: dict[str, Metric] = field(default_factory=dict)
    callbacks: dict[str, Callback] = field(default_factory=dict)
    reading: Reading = field(default_factory=Reading)  # data.shuffle, data.collate_fn
    monitor: str | None = None  # scheduler.monitor: the figure a ReduceLROnPlateau steps with
    model_loss: bool = False  # the model returns its own loss, which trains (check_fit finds it)


def build(config: Config, device: torch.device, splits: Splits | None = None) -> Pieces:
    splits = splits or build_data(config)
    model_config = with_data_sizes(config.model, splits)
    model = build_model(model_config, device).to(device)  # once, before the loop
    loss_fn = build_loss(config.loss)
    if isinstance(loss_fn, nn.Module):
        loss_fn = loss_fn.to(device)
    optimizer = build_optimizer(
        config.optimizer, model.parameters(), device, capturable=config.train.cuda_graphs
    )
    scheduler, interval = build_scheduler(config.scheduler, optimizer)
    task = build_task(config.task).bind(model)
    metrics = build_metrics(config.metrics, splits.num_classes, device, instantiate_node)
    pieces = Pieces(splits, model, model_config, loss_fn, optimizer, scheduler, interval, task)
    pieces.metrics, pieces.callbacks = metrics, build_callbacks(config)
    pieces.reading = build_reading(config.data)
    pieces.monitor = config.scheduler.get("monitor") if config.scheduler else None
    return pieces


def build_task(node: dict[str, Any]) -> Task:
    return check_task(_instantiate("task", node), node["_target_"])


def build_callbacks(config: Config) -> dict[str, Callback]:
    """The `callbacks` config's objects (train.early_stopping's is the Trainer's own)."""
    return {
        name: _instantiate(f"callbacks.{name}", node) for name, node in config.callbacks.items()
    }


def build_reading(data: dict[str, Any]) -> Reading:
    """How the batches are read: data.shuffle, and data.collate_fn (a `_target_`: a class
    whose instance is called, or a function with `_partial_: true`)."""
    node = data.get("collate_fn")
    collate_fn = None
    if node:
        collate_fn = _instantiate("data.collate_fn", node)
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError(
                f"data.collate_fn._target_={node['_target_']!r} built a "
                f"{type(collate_fn).__name__}, which cannot be called with a list of items",
                hint="name a function with _partial_: true, or a class whose objects are callable",
            )
    return Reading(shuffle=bool(data.get("shuffle", True)), collate_fn=collate_fn)


def build_data(config: Config) -> Splits:
    """The prepared file when data.file is set, else whatever data._target_ returns."""
    if config.data.get("file"):
        return read_npz(Path(config.data["file"]))
    return as_splits(_instantiate("data", config.data), config.data["_target_"])


def data_sizes(splits: Splits) -> dict[str, Any]:
    """The sizes a model may take from the data: the input's (for (input, target) items
    with a tensor input) and the class count."""
    inputs = input_sample(splits.train)
    sizes: dict[str, Any] = {"num_classes": splits.num_classes}
    if inputs is not None:
        sizes["in_features"] = int(inputs.numel())
        sizes["input_shape"] = list(inputs.shape)
        sizes["in_channels"] = int(inputs.shape[0]) if inputs.ndim else 1
    return sizes


def with_data_sizes(node: dict[str, Any], splits: Splits) -> dict[str, Any]:
    """The model config plus the data sizes its constructor takes and the YAML leaves out."""
    try:
        parameters = inspect.signature(get_object(node["_target_"])).parameters
    except (TypeError, ValueError):
        return dict(node)
    filled = dict(node)
    for name, value in data_sizes(splits).items():
        if name in parameters and name not in node:
            if value is None:
                raise ConfigError(
                    f"model._target_={node['_target_']!r} takes {name}, but the data gives no "
                    "class count (num_classes=None)",
                    hint=f"set model.{name}=N, or return num_classes from data._target_",
                )
            filled[name] = value
    return filled


def build_model(node: dict[str, Any], device: torch.device | None = None) -> nn.Module:
    """The model `node` describes. With `device`, construction stops with a one-line error as
    soon as its parameters, with their gradients and optimizer state, cannot fit in that
    device's free memory (before the kernel's OOM killer would end the process silently)."""
    if device is not None:
        _estimate(node, device)
    with _memory_bound(node["_target_"], device):
        model = _instantiate("model", node)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={node['_target_']!r} built a {type(model).__name__}, not a torch.nn.Module",
            hint="point model._target_ at an nn.Module subclass (or a function returning one)",
        )
    return model


# Bytes a parameter's element needs while training: the value, its gradient and two slots
# of optimizer state (AdamW's; SGD with momentum needs one).
TRAINING_COPIES = 4


def _estimate(node: dict[str, Any], device: torch.device) -> None:
    """Build the model on torch's meta device first (shapes, no memory, no initialisation),
    under the same bound: a model far too large is refused in moments, not after it has
    allocated a quarter of the machine. A model whose constructor cannot run on meta (it
    loads weights, say) is left to the real build, which is bounded too."""
    try:
        with torch.device("meta"), _memory_bound(node["_target_"], device):
            _instantiate("model", node)
    except DeviceError:
        raise
    except Exception:  # noqa: S110 - the real build reports its own errors
        pass


@contextmanager
def _memory_bound(target: str, device: torch.device | None) -> Iterator[None]:
    """Count parameters as the model registers them (torch's global registration hook) and
    stop the build once they cannot fit; the model is then at most one tensor past the
    estimate's quarter, far from the limit."""
    if device is None:
        yield
        return
    limit, host = available_memory(device), available_memory(torch.device("cpu"))
    count = {"elements": 0, "bytes": 0}

    def check(_module: nn.Module, _name: str, param: nn.Parameter | None) -> None:
        if param is None:
            return
        count["elements"] += param.numel()
        count["bytes"] += param.numel() * param.element_size()
        needed = count["bytes"] * TRAINING_COPIES
        if needed > limit or count["bytes"] > host:
            raise DeviceError(
                f"model._target_={target!r} needs more than {needed / 2**30:,.1f} GiB to train "
                f"({count['elements']:,} parameters so far, x{TRAINING_COPIES} for gradients "
                f"and optimizer state), more than the {limit / 2**30:,.1f} GiB free on {device}",
                hint="make the model smaller (its size settings under model.), or train on a "
                "device with more memory",
            )

    handle = register_module_parameter_registration_hook(check)
    try:
        yield
    finally:
        handle.remove()


def build_loss(node: dict[str, Any]) -> LossFn:
    loss_fn = _instantiate("loss", node)
    if not callable(loss_fn):
        raise ConfigError(
            f"loss._target_={node['_target_']!r} built a {type(loss_fn).__name__}, which cannot "
            "be called as loss_fn(outputs, targets)",
            hint="use a loss module such as torch.nn.CrossEntropyLoss",
        )
    return loss_fn


def build_optimizer(
    node: dict[str, Any], params: Any, device: torch.device, capturable: bool = False
) -> torch.optim.Optimizer:
    """`fused: null` in the YAML: the fused single-kernel update wherever torch has one (same
    math; on a small CPU step the per-tensor loop costs more than forward and backward).
    `capturable`: the step count stays on the device, as CUDA graph capture needs."""
    extra: dict[str, Any] = {}
    node = drop_auto_fused(node)
    if "fused" in node and node["fused"] is None:
        extra["fused"] = True if device.type in ("cuda", "cpu", "mps") else None
    if capturable:
        extra["capturable"] = True
    make = _instantiate("optimizer", node, **extra)
    optimizer = _call("optimizer", node["_target_"], make, list(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer._target_={node['_target_']!r} built a {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer",
            hint="point optimizer._target_ at an optimizer class, with _partial_: true",
        )
    return optimizer


def build_scheduler(
    node: dict[str, Any] | None, optimizer: torch.optim.Optimizer
) -> tuple[Scheduler | None, str]:
    if node is None:
        return None, "step"
    make = _instantiate("scheduler", node)
    scheduler = _call("scheduler", node["_target_"], make, optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(
            f"scheduler._target_={node['_target_']!r} built a {type(scheduler).__name__}, "
            "not a torch.optim.lr_scheduler.LRScheduler",
            hint="point scheduler._target_ at a scheduler class, with _partial_: true",
        )
    return scheduler, "validation" if node.get("monitor") else node.get("interval", "step")


FIT_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, KeyError, AttributeError)


def check_fit(pieces: Pieces, device: torch.device) -> Any:
    """Before any step: one forward and loss on a batch of two training items, and the same
    on the first validation batch (read as validation reads it) with the task's predictions
    and count, so that a model whose output does not fit the task or the loss, inputs of
    another dtype than the weights, or a batch the task would train on wrongly fail here in
    one line. Sets `pieces.model_loss` (the model returns its own loss). Returns the training
    batch (on the CPU) for the MLflow Model's input example. Eval mode, no grad: no RNG drawn,
    no statistic moved, no metric or task state kept."""
    with seeded(0, 0, 0, VALIDATION_STREAM):  # what the items draw: not from the run's streams
        batch = first_batch(pieces.splits.train, 2, pieces.reading.collate_fn)
    model, task = pieces.model, pieces.task
    task.check_batch(batch)
    was_training = model.training
    model.eval()
    try:  # its own seeds: a model that draws in eval mode draws nothing from the run's streams
        with torch.no_grad(), task.evaluating(), seeded(0, 0, 0, VALIDATION_STREAM):
            on_device = move_to(batch, device)
            outputs = _checked_forward(model, task, on_device, batch)
            task.check_outputs(outputs, batch)
            _checked_loss(pieces, outputs, on_device, batch)
            pieces.model_loss = model_loss(outputs) is not None
            if len(pieces.splits.val):
                cpu, collate = torch.device("cpu"), pieces.reading.collate_fn
                shown = next(val_batches(pieces.splits.val, cpu, 2, collate))
                on_device = move_to(shown, device)
                outputs = _checked_forward(model, task, on_device, shown)
                _checked_loss(pieces, outputs, on_device, shown)
                _checked_predictions(task, outputs, on_device, shown)
    finally:
        model.train(was_training)
    return batch


def dtype_mismatch(model: nn.Module, task: Task, batch: Any) -> ConfigError | None:
    """Why a forward that failed most likely did: floating-point inputs of another dtype than
    the model's weights (float64 NumPy data for a float32 model), with both dtypes."""
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    inputs = [t for t in input_tensors(batch, task.target_key) if t.is_floating_point()]
    other = sorted({str(t.dtype).removeprefix("torch.") for t in inputs if t.dtype != weights})
    if weights is None or not other:
        return None
    have = str(weights).removeprefix("torch.")
    return ConfigError(
        f"the data's inputs are {', '.join(other)} but the model {type(model).__name__}'s "
        f"weights are {have}",
        hint=f"make the inputs {have} in your data _target_ (torch.from_numpy(a).to(torch."
        f"{have}), or a.astype('{have}')), or build the model in {', '.join(other)}",
    )


def input_tensors(batch: Any, target_key: str) -> list[torch.Tensor]:
    """The tensors a batch feeds the model: a pair's or tuple's all but the last, a dict's
    all but its targets."""
    if isinstance(batch, tuple | list) and len(batch) > 1:
        batch = batch[:-1]
    elif isinstance(batch, dict):
        batch = {k: v for k, v in batch.items() if k != target_key}
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def _checked_predictions(task: Task, outputs: Any, batch: Any, shown: Any) -> None:
    """What validation asks of the task beyond the loss: its predictions and its count."""
    try:
        task.predictions(outputs, batch)
        task.count(batch)
    except FIT_ERRORS as error:
        raise ConfigError(
            f"validation cannot compare the model's output ({describe(outputs)}) with a "
            f"validation batch of {describe(shown)} under task {task.name} "
            f"({_first_line(error)})",
            hint="give the validation split items of the training split's form, or pick the "
            "task that fits them (README: Tasks)",
        ) from None


def _checked_forward(model: nn.Module, task: Any, batch: Any, shown: Any) -> Any:
    try:
        outputs = task.forward(model, batch)
        logits_of(outputs)
        return outputs
    except FIT_ERRORS as error:
        mismatch = dtype_mismatch(model, task, batch)
        if mismatch is not None:
            raise mismatch from None
        raise ConfigError(
            f"the model {type(model).__name__} cannot take the data's batches under task "
            f"{task.name} (a batch of {describe(shown)}: {_first_line(error)})",
            hint="leave the model's input size out of its YAML (in_features / input_shape "
            "follow the data), or pick the task and data whose batches the model takes "
            "(README: Tasks)",
        ) from None


def _checked_loss(pieces: Pieces, outputs: Any, batch: Any, shown: Any) -> None:
    task, loss_fn = pieces.task, pieces.loss_fn
    where = f"the model's output ({describe(outputs)} for a batch of {describe(shown)})"
    try:
        if isinstance(task, Classification):
            check_classes(logits_of(outputs), task.targets(batch), pieces.splits.num_classes)
        loss = task.loss(outputs, batch, loss_fn)
    except FIT_ERRORS as error:
        raise ConfigError(
            f"{where} does not fit the loss {type(loss_fn).__name__} under task {task.name} "
            f"({_first_line(error)})",
            hint="make the model's last layer produce what the loss takes (e.g. num_classes "
            "logits for CrossEntropyLoss), or pick the task and loss that fit it "
            "(task=regression loss=mse; task=binary for one logit against 0/1 targets; "
            "task=language_model)",
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(
            f"the loss {type(loss_fn).__name__} returned {shape}, not a scalar",
            hint="use reduction='mean' (or 'sum') in the loss config",
        )
    # The metrics are checked by the Trainer after the first step (Trainer.check_metrics):
    # their library (torchmetrics, ~2 s of imports) is not needed before it.


def _first_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"


def check_classes(outputs: torch.Tensor, targets: torch.Tensor, classes: int | None) -> None:
    """Class labels need at least `classes` outputs per sample."""
    if (
        classes
        and outputs.ndim == 2
        and not targets.is_floating_point()
        and outputs.shape[1] < classes
    ):
        raise ConfigError(
            f"the model outputs {outputs.shape[1]} values per sample but the data has "
            f"{classes} classes",
            hint="give the model num_classes outputs (take num_classes in its constructor)",
        )


def class_name(obj: Any) -> str:
    kind = obj if inspect.isclass(obj) else type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def instantiate_node(section: str, node: dict[str, Any]) -> Any:
    """Build `node` (a `_target_` config), a failing constructor being one ConfigError line."""
    return _instantiate(section, node)


def _instantiate(section: str, node: dict[str, Any], **extra: Any) -> Any:
    """hydra.utils.instantiate, with a failing constructor turned into one line."""
    kwargs = {"_target_": node["_target_"], **target_kwargs(section, node), **extra}
    if node.get("_partial_"):
        kwargs["_partial_"] = True
    try:
        return instantiate(kwargs, _convert_="all")
    except Exception as error:  # hydra's InstantiationException wraps the constructor's error
        cause = error.__cause__ or error
        if out_of_memory(cause) or isinstance(cause, DeviceError):
            raise cause from None  # the runtime names the device, batch and model
        raise ConfigError(
            f"{section}._target_={node['_target_']!r} failed to build: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}",
            hint=f"fix the {section} settings (python -m reprotrain.train --cfg job shows them)",
        ) from None


def out_of_memory(error: BaseException) -> bool:
    """torch's OOM on a GPU, or the CPU allocator's (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def _call(section: str, target: str, make: Any, argument: Any) -> Any:
    try:
        return make(argument)
    except Exception as error:
        raise ConfigError(
            f"{section}._target_={target!r} failed to build: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}",
            hint=f"fix the {section} settings (python -m reprotrain.train --cfg job shows them)",
        ) from None
