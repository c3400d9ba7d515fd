"""The end of a run: validation, summary metrics, outputs, artifacts, the MLflow Model.

<output_dir>/metrics.json  the headline figures DVC compares and the MLflow run id and store
                           (written last: its presence means the run completed)
<output_dir>/run.json      every figure of the run: timings per phase, memory, device, ...
<output_dir>/loss.csv      step,loss for every step (a DVC plot)
<output_dir>/model.pt      {"state_dict", "model": the model's _target_ config with the data
                           sizes filled in, "loss": the loss config, "num_classes"}
<output_dir>/loss.svg      the loss curve;  config.yaml  the resolved config
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from reprotrain.build import Pieces, class_name
from reprotrain.devices import DeviceInfo
from reprotrain.outputs import write_json, write_loss_csv, write_loss_plot, write_model, write_text
from reprotrain.provenance import count_parameters
from reprotrain.schema import Config, as_dict
from reprotrain.timing import PHASES, process_age_s, training_flops_per_sample
from reprotrain.tracking import redact
from reprotrain.trainer import Fitted, Trainer

MODEL_FORMAT = 2
# metrics.json: the few figures `dvc exp show` and `dvc metrics diff` compare, and the MLflow
# run they came from; run.json has every figure of the run.
HEADLINE = (
    "run_id",
    "tracking_uri",
    "final_loss",
    "val_loss",
    "val_accuracy",
    "samples_per_s",
    "total_s",
)


@dataclass
class Job:
    """One training job as the runtime builds it up: its config and device, where its outputs
    go, and, once built, its pieces and what the run records about them."""

    config: Config
    device: torch.device
    out_dir: Path
    runtime: str = "local"
    varied: list[str] = field(default_factory=list)  # what a sweep job varies (its run name)
    tracking_uri: str | None = None  # None: nothing recorded (tracking off, or not rank 0)
    pieces: Pieces = None  # type: ignore[assignment]  # set once built
    info: DeviceInfo = None  # type: ignore[assignment]
    example: np.ndarray = field(default_factory=lambda: np.empty(0))  # the model's input example
    startup_s: float = float("nan")


def finish(job: Job, trainer: Trainer, fitted: Fitted, recorder: Any) -> dict[str, Any]:
    """After the last step: the MLflow Model, validation, the outputs and the summary figures."""
    began = time.perf_counter()
    config, model = job.config, job.pieces.model
    if config.tracking.log_model:
        recorder.log_model(model, job.example, registered_name=config.tracking.register_as)
    val_loss, val_accuracy = trainer.validate()
    timings = fitted.timings
    flops = training_flops_per_sample(model, torch.from_numpy(job.example).to(job.device))
    result: dict[str, Any] = {
        "steps": len(fitted.steps),
        "batch_size": config.train.batch_size,
        "final_loss": fitted.losses[-1],
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "samples_per_s": timings["samples_per_s"],
        "step_ms_median": timings["step_ms_median"],
        "startup_s": job.startup_s,
        "train_flops_per_s": timings["samples_per_s"] * flops,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "nonfinite_steps": fitted.nonfinite_steps,
        "tracking_s": getattr(recorder, "tracking_s", 0.0),
        "checkpoint_s": timings["checkpoint_s"],
        "model_class": class_name(model),
        "parameters": count_parameters(model),
        **{f"{phase}_ms_mean": timings[f"{phase}_ms_mean"] for phase in PHASES},
    }
    if job.device.type == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(job.device) / 2**20
    write_outputs(job, fitted, recorder)
    result["outputs_s"] = time.perf_counter() - began
    result["total_s"] = process_age_s()
    recorder.log_metrics(summary_metrics(result), step=len(fitted.steps))
    result.update(
        run_id=recorder.run_id,
        tracking_uri=redact(job.tracking_uri) if job.tracking_uri else None,
        device=job.info.type,
        device_name=job.info.name,
    )
    # NaN is not JSON: a figure that could not be measured is written as null.
    written = {k: _json_value(v) for k, v in result.items()}
    write_json(job.out_dir / "run.json", written)
    write_json(job.out_dir / "metrics.json", {k: written[k] for k in HEADLINE})  # last
    return result


def summary_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow names of the end-of-run figures. MLflow's run page draws a chart per metric,
    in sections named by what comes before the last `/`, sorted by name, and metrics with no
    `/` in a last section: so the series are `train/*` and `val/*` (train/loss first), and
    the one-point summaries, named with dots, come after them."""
    metrics = {
        "val/loss": result["val_loss"],
        "val/accuracy": result["val_accuracy"],
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


def objective(result: dict[str, Any], name: str) -> float:
    """The figure a sweeper optimises: val/loss, val/accuracy or train/loss (the last step's)."""
    key = {"val/loss": "val_loss", "val/accuracy": "val_accuracy", "train/loss": "final_loss"}[name]
    value = result.get(key)
    return float("nan") if value is None else float(value)


def write_outputs(job: Job, fitted: Fitted, recorder: Any) -> None:
    config, pieces, out_dir = job.config, job.pieces, job.out_dir
    tree = as_dict(config)
    if tree["tracking"]["uri"]:
        tree["tracking"]["uri"] = redact(tree["tracking"]["uri"])  # an artifact: no password
    title = f"{job.info.name} · {type(pieces.model).__name__} · {type(pieces.optimizer).__name__}"
    saved = {
        "format": MODEL_FORMAT,
        "model": pieces.model_config,
        "loss": tree["loss"],
        "num_classes": pieces.splits.num_classes,
    }
    files = [
        write_text(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(tree))),
        write_loss_plot(out_dir / "loss.svg", fitted.steps, fitted.losses, title),
        write_model(out_dir / "model.pt", pieces.model, saved),
        write_loss_csv(out_dir / "loss.csv", fitted.steps, fitted.losses),
    ]
    for path in files:
        recorder.log_artifact(path)


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not np.isfinite(value) else value
