"""The end of a run: validation, summary metrics, outputs, artifacts, the MLflow Model.

<output_dir>/metrics.json  the headline figures DVC compares and the MLflow run id and store
                           (written last: its presence means the run completed)
<output_dir>/run.json      every figure of the run: timings per phase, memory, device, ...
<output_dir>/loss.csv      step,loss for every step (a DVC plot)
<output_dir>/model.pt      {"state_dict", "model": the model's _target_ config with the data
                           sizes filled in, "loss", "task", "metrics", "collate_fn": their
                           configs, "num_classes"}
<output_dir>/loss.svg      the loss curve;  config.yaml  the resolved config
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from reprotrain.build import Pieces, class_name
from reprotrain.data.structure import batch_size, describe, move_to
from reprotrain.devices import DeviceInfo
from reprotrain.outputs import write_json, write_loss_csv, write_loss_plot, write_model, write_text
from reprotrain.provenance import count_parameters
from reprotrain.schema import Config, as_dict
from reprotrain.tasks import Task, logits_of
from reprotrain.timing import PHASES, training_flops_per_sample
from reprotrain.tracking import NoRun, TrackedRun, redact
from reprotrain.trainer import Fitted, Trainer

MODEL_FORMAT = 3  # 3: with the task, the metrics and the collate function (2: without)
# metrics.json: the few figures `dvc exp show` and `dvc metrics diff` compare, and the MLflow
# run they came from; run.json has every figure of the run.
HEADLINE = (
    "run_id",
    "tracking_uri",
    "final_loss",
    "val_*",  # val_loss and each metric's val_<name>
    "samples_per_s",
    "total_s",
)


class RunOutputs:
    """The end of a run: what `Run.finish` writes and records after the last step."""

    def __init__(
        self,
        config: Config,
        pieces: Pieces,
        out_dir: Path,
        recorder: TrackedRun | NoRun,
        device: torch.device,
        info: DeviceInfo,
        tracking_uri: str | None,
    ) -> None:
        self.config, self.pieces, self.out_dir, self.recorder = config, pieces, out_dir, recorder
        self.device, self.info, self.tracking_uri = device, info, tracking_uri

    def write(
        self,
        trainer: Trainer,
        fitted: Fitted,
        example: Any,
        startup_s: float,
        elapsed_s: Callable[[], float],
    ) -> dict[str, Any]:
        """The MLflow Model, the outputs and the summary figures; returns run.json's figures."""
        began = time.perf_counter()
        config, model, recorder = self.config, self.pieces.model, self.recorder
        if config.tracking.log_model:
            inputs = model_example(self.pieces.task, example)
            recorder.log_model(model, inputs, registered_name=config.tracking.register_as)
        if trainer.stopped_early is not None:
            recorder.set_tags({"reprotrain.stopped_early": trainer.stopped_early})
        timings = fitted.timings
        result: dict[str, Any] = {
            "steps": len(fitted.steps),
            "batch_size": config.train.batch_size,
            "final_loss": fitted.losses[-1],
            # val/loss and val/<metric> of the final validation (with train.keep_best, the best)
            **{f"val_{k.removeprefix('val/')}": v for k, v in fitted.validation.items()},
            "best_step": trainer.best.step if config.train.keep_best else None,
            "stopped_early": trainer.stopped_early,
            "samples_per_s": timings["samples_per_s"],
            "step_ms_median": timings["step_ms_median"],
            "startup_s": startup_s,
            "train_flops_per_s": timings["samples_per_s"] * self.example_flops(example),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "nonfinite_steps": fitted.nonfinite_steps,
            "tracking_s": recorder.tracking_s,
            "checkpoint_s": timings["checkpoint_s"],
            "model_class": class_name(model),
            "parameters": count_parameters(model),
            **{f"{phase}_ms_mean": timings[f"{phase}_ms_mean"] for phase in PHASES},
        }
        if self.device.type == "cuda":
            result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.write_files(fitted, example)
        result["outputs_s"] = time.perf_counter() - began
        result["total_s"] = elapsed_s()
        recorder.log_metrics(summary_metrics(result), step=len(fitted.steps))
        result.update(
            run_id=recorder.run_id,
            tracking_uri=redact(self.tracking_uri) if self.tracking_uri else None,
            device=self.info.type,
            device_name=self.info.name,
        )
        # NaN is not JSON: a figure that could not be measured is written as null.
        written = {k: _json_value(v) for k, v in result.items()}
        write_json(self.out_dir / "run.json", written)
        write_json(self.out_dir / "metrics.json", headline(written))  # last
        return result

    def example_flops(self, example: Any) -> float:
        """Training FLOPs per sample on the example batch (NaN where they cannot be counted)."""
        task, model = self.pieces.task, self.pieces.model
        batch = move_to(example, self.device)
        with task.evaluating():
            return training_flops_per_sample(
                model, lambda: logits_of(task.forward(model, batch)), batch_size(batch)
            )

    def write_files(self, fitted: Fitted, example: Any) -> None:
        config, pieces, out_dir = self.config, self.pieces, self.out_dir
        tree = as_dict(config)
        if tree["tracking"]["uri"]:
            tree["tracking"]["uri"] = redact(tree["tracking"]["uri"])  # an artifact: no password
        title = (
            f"{self.info.name} · {type(pieces.model).__name__} · {type(pieces.optimizer).__name__}"
        )
        saved = {
            "format": MODEL_FORMAT,
            "model": pieces.model_config,
            "loss": tree["loss"],
            "num_classes": pieces.splits.num_classes,
            "task": tree["task"],
            "metrics": tree["metrics"],
            "collate_fn": tree["data"].get("collate_fn"),
            "batch_size": config.train.batch_size,
            "val_batch_size": config.train.val_batch_size,
            # The run this model is the outcome of: `evaluate` records on it and no other.
            "run_id": self.recorder.run_id,
            "tracking_uri": redact(self.tracking_uri) if self.tracking_uri else None,
            "inputs": describe(example),  # a batch of two training items: their shapes
        }
        files = [
            write_text(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(tree))),
            write_loss_plot(out_dir / "loss.svg", fitted.steps, fitted.losses, title),
            write_model(out_dir / "model.pt", pieces.model, saved),
            write_loss_csv(out_dir / "loss.csv", fitted.steps, fitted.losses),
        ]
        for path in files:
            self.recorder.log_artifact(path)


def summary_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow names of the end-of-run figures. MLflow's run page draws a chart per metric,
    in sections named by what comes before the last `/`, sorted by name, and metrics with no
    `/` in a last section: so the series are `train/*` and `val/*` (train/loss first), and
    the one-point summaries, named with dots, come after them."""
    metrics = {
        "train.final_loss": result["final_loss"],
        "train.nonfinite_steps": result["nonfinite_steps"],
        "throughput.samples_per_s": result["samples_per_s"],
        "time.step_ms_median": result["step_ms_median"],
        "time.startup_s": result["startup_s"],
        "time.total_s": result["total_s"],
        "time.tracking_s": result["tracking_s"],
        "time.checkpoint_s": result["checkpoint_s"],
        "time.outputs_s": result["outputs_s"],
        "memory.peak_rss_mb": result["peak_rss_mb"],
        "model.parameters": result["parameters"],
        **{f"time.{phase}_ms": result[f"{phase}_ms_mean"] for phase in PHASES},
    }
    if "cuda_peak_mb" in result:
        metrics["memory.cuda_peak_mb"] = result["cuda_peak_mb"]
    return {k: float(v) for k, v in metrics.items() if np.isfinite(v)}


def headline(written: dict[str, Any]) -> dict[str, Any]:
    """metrics.json's figures, in HEADLINE's order."""
    out: dict[str, Any] = {}
    for key in HEADLINE:
        if key == "val_*":
            out.update({k: v for k, v in written.items() if k.startswith("val_")})
        else:
            out[key] = written[key]
    return out


def objective(result: dict[str, Any], name: str) -> float:
    """The figure a sweeper optimises: train/loss (the last step's), val/loss or val/<metric>
    (the final validation's)."""
    key = "final_loss" if name == "train/loss" else f"val_{name.removeprefix('val/')}"
    value = result.get(key)
    return float("nan") if value is None else float(value)


def model_example(task: Task, batch: Any) -> Any:
    """The model's inputs in the example batch, as MLflow takes an input example: one array,
    or a dict of arrays (None where the model takes several positional inputs)."""
    args, kwargs = task.model_inputs(batch)
    if kwargs and not args:
        return {k: v.numpy() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
        return args[0].numpy()
    return None


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not np.isfinite(value) else value
