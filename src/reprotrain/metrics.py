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
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from hydra.utils import get_object

from reprotrain.errors import ConfigError
from reprotrain.schema import check_target

# What the loop calls on a metric (torchmetrics' Metric has them all).
METHODS = ("update", "compute", "reset")


class Metric(Protocol):
    """A validation metric as the loop uses it (torchmetrics' Metric is one): updated with
    each batch's (predictions, targets), computed once per validation, then reset."""

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None: ...
    def compute(self) -> Any: ...
    def reset(self) -> None: ...


def with_class_count(node: dict[str, Any], num_classes: int | None) -> dict[str, Any]:
    """A metric config plus `num_classes` from the data when its class takes it and the YAML
    leaves it out (as a model's sizes are filled in)."""
    try:
        parameters = inspect.signature(get_object(node["_target_"])).parameters
    except Exception:  # check_target has said why in one line before this runs
        return dict(node)
    if "num_classes" in parameters and "num_classes" not in node and num_classes:
        return {**node, "num_classes": num_classes}
    return dict(node)


def build_metrics(
    nodes: dict[str, dict[str, Any]], num_classes: int | None, device: torch.device, make: Any
) -> dict[str, Any]:
    """The metrics the config names, on the device (`make(section, node)` instantiates).
    Their targets are imported here, at build time, not when the config is checked: a process
    that does not train (a launcher, a bad command line) never imports torchmetrics."""
    built: dict[str, Any] = {}
    for name, node in nodes.items():
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
        built[name] = metric.to(device) if hasattr(metric, "to") else metric
    return built


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
