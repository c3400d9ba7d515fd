"""Validation metrics: torchmetrics objects named by the `metrics` config, logged as `val/<name>`.

    metrics:                                   # conf/task/classification.yaml sets this one
      accuracy:
        _target_: torchmetrics.classification.MulticlassAccuracy
        average: micro                         # num_classes follows the data when left out

Each is updated with the task's `(predictions, targets)` on every validation batch and
computed once per validation (under torchrun, over every rank's share: torchmetrics reduces
across the process group). Whether a higher value is better comes from the metric
(`higher_is_better`), which is what `train.objective`, early stopping and the best checkpoint
use. `val/loss` is always measured; it is not a metric here.

A configured metric is made when validation first uses it (`ConfiguredMetric`), not when the
run is built: importing torchmetrics takes 1.1 to 1.9 s on a 2-core machine (it imports
matplotlib and scipy.signal), and a run's first step needs none of it (made at first use, the
start-up to the first step was 2.4 s shorter: docs/performance.md).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from hydra.utils import get_object

from reprotrain.data.structure import describe
from reprotrain.errors import ConfigError
from reprotrain.schema import check_target

# What the loop calls on a metric (torchmetrics' Metric has them all).
METHODS = ("update", "compute", "reset")
# What a metric raises when the task's predictions or targets are not what it takes
# (the errors build.py's check of the model and loss on a first batch catches).
MISFIT_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, KeyError, AttributeError)


class Metric(Protocol):
    """A validation metric as the loop uses it (torchmetrics' Metric is one): updated with
    each batch's (predictions, targets), computed once per validation, then reset."""

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None: ...
    def compute(self) -> Any: ...
    def reset(self) -> None: ...


class ConfiguredMetric:
    """A metric the config names, made from its node the first time validation uses it.

    It is moved with `.to(device)` and used as the metric itself (update, compute, reset,
    higher_is_better). When it is made, its `_target_` is imported, checked and bound to its
    config, and its first update checks that it takes the task's predictions. Each mistake is
    one ConfigError line, as in the rest of the config, but found at the first validation, not
    before the first step.
    """

    def __init__(self, name: str, node: dict[str, Any], num_classes: int | None, make: Any) -> None:
        self.name, self.node = name, dict(node)
        self.num_classes = num_classes
        self.make = make  # make(section, node) instantiates (build.instantiate_node)
        self.device: torch.device | None = None
        self.built: Metric | None = None
        self.fits = False  # a first update has taken the task's predictions

    @property
    def metric(self) -> Metric:
        """The metric object; the first use imports its module (torchmetrics) and makes it."""
        if self.built is None:
            metric = make_metric(self.name, self.node, self.num_classes, self.make)
            if self.device is not None and hasattr(metric, "to"):
                metric = metric.to(self.device)
            self.built = metric
        return self.built

    def to(self, device: torch.device | str) -> ConfiguredMetric:
        self.device = torch.device(device)
        if self.built is not None and hasattr(self.built, "to"):
            self.built = self.built.to(self.device)
        return self

    @property
    def higher_is_better(self) -> bool:
        return higher_is_better(self.metric)

    def update(self, predictions: Any, targets: Any) -> None:
        if self.fits:
            self.metric.update(predictions, targets)
            return
        metric = self.metric
        try:
            metric.update(predictions, targets)
        except MISFIT_ERRORS as error:
            raise misfit(self.name, metric, predictions, targets, error) from None
        self.fits = True

    def compute(self) -> Any:
        return self.metric.compute()

    def reset(self) -> None:
        if self.built is not None:  # a metric not made yet holds nothing
            self.built.reset()


def misfit(
    name: str, metric: Any, predictions: Any, targets: Any, error: BaseException
) -> ConfigError:
    """The one line for a metric that cannot take the task's predictions and targets."""
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return ConfigError(
        f"metrics.{name} ({type(metric).__name__}) cannot take the task's "
        f"predictions ({describe(predictions)}) and targets ({describe(targets)}) "
        f"({type(error).__name__}: {text})",
        hint=f"pick a metric for this task's outputs, or drop it with ~metrics.{name}",
    )


def build_metrics(
    nodes: dict[str, dict[str, Any]], num_classes: int | None, device: torch.device, make: Any
) -> dict[str, Metric]:
    """The metrics the config names, each made at its first use (`make(section, node)`
    instantiates it then, on `device`): building a run imports no metric's module."""
    return {
        name: ConfiguredMetric(name, node, num_classes, make).to(device)
        for name, node in nodes.items()
    }


def make_metric(name: str, node: dict[str, Any], num_classes: int | None, make: Any) -> Metric:
    """The metric object of `metrics.<name>`, its target checked and `num_classes` filled in."""
    node = with_class_count(node, num_classes)
    check_target(f"metrics.{name}", node)
    metric = make(f"metrics.{name}", node)
    missing = [m for m in METHODS if not callable(getattr(metric, m, None))]
    if missing:
        raise ConfigError(
            f"metrics.{name}._target_={node['_target_']!r} built a "
            f"{type(metric).__name__}, which has no {', '.join(missing)}",
            hint="point it at a torchmetrics class (update(preds, target), compute(), reset())",
        )
    return metric


def with_class_count(node: dict[str, Any], num_classes: int | None) -> dict[str, Any]:
    """A metric config plus `num_classes` from the data when its class takes it and the YAML
    leaves it out (as a model's sizes are filled in)."""
    try:
        parameters = inspect.signature(get_object(node["_target_"])).parameters
    except Exception:  # check_target says why in one line right after this
        return dict(node)
    if "num_classes" in parameters and "num_classes" not in node and num_classes:
        return {**node, "num_classes": num_classes}
    return dict(node)


def higher_is_better(metric: Any) -> bool:
    """A loss (None here) is lower-is-better; a metric says so itself."""
    return bool(getattr(metric, "higher_is_better", False)) if metric is not None else False


def compute(metrics: dict[str, Any]) -> dict[str, float]:
    """Every metric's value over the batches it was given since the last reset; then reset."""
    values = {}
    for name, metric in metrics.items():
        value = metric.compute()
        values[name] = float(value.float().mean()) if isinstance(value, torch.Tensor) else value
        metric.reset()
    return values
