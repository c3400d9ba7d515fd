"""DVC stage `evaluate`: the saved model's validation loss and metrics, and for a classifier
its confusion matrix.

    python -m reprotrain.evaluate            # results/model.pt on data/dataset.npz

The model is rebuilt from what model.pt records (its `_target_` config with the data sizes,
and the loss config), so any model reprotrain trained evaluates here, yours included.
The model is evaluated under the task it was trained for, with the metrics its run measured.
Writes results/eval.json (DVC metrics: eval_loss and eval_<metric>; a figure that cannot be
measured is null) and, for task=classification, results/confusion.csv (one row per
validation sample: actual,predicted; DVC's `confusion` plot template draws the matrix). The
figures are also added, as val/eval_*, to the MLflow run that trained the model: the run
model.pt names, on any store (a password-protected one takes its password from the
environment, as `replay` does).
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from reprotrain.build import (
    FIT_ERRORS,
    build_loss,
    build_model,
    build_reading,
    build_task,
    instantiate_node,
)
from reprotrain.data import read_npz
from reprotrain.data.batches import val_batches, validation_batch_size
from reprotrain.data.splits import first_batch
from reprotrain.data.structure import describe
from reprotrain.errors import DataError, TrackingError, UserError, report_and_exit
from reprotrain.metrics import build_metrics
from reprotrain.metrics import compute as compute_metrics
from reprotrain.outputs import write_json, write_text
from reprotrain.project import default_tracking_uri
from reprotrain.results import MODEL_FORMAT
from reprotrain.schema import DEFAULT_TASK
from reprotrain.step import evaluate
from reprotrain.tasks import Classification
from reprotrain.tracking.credentials import full_uri, redact
from reprotrain.tracking.failures import failure_reason, is_store_failure
from reprotrain.trust import recorded_targets, refuse_untrusted

RECORDED_CONFIGS = ("model", "loss", "task", "metrics", "collate_fn")
FIX = "re-create it with `dvc repro train` (or python -m reprotrain.train)"


def load_model(path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model model.pt describes, with its weights; and what model.pt recorded."""
    if not path.is_file():
        raise DataError(
            f"model file {str(path)!r} does not exist", hint="run `dvc repro train` first"
        )
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)  # no code runs from it
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError) as error:
        raise DataError(
            f"model file {str(path)!r} is not a readable torch file ({type(error).__name__})",
            hint=FIX,
        ) from None
    if (
        not isinstance(saved, dict)
        or saved.get("format") not in (2, MODEL_FORMAT)
        or not isinstance(saved.get("model"), dict)
        or not isinstance(saved.get("state_dict"), dict)
    ):
        raise DataError(
            f"model file {str(path)!r} is not a reprotrain model file (format {MODEL_FORMAT}: "
            "state_dict, model, loss)",
            hint=FIX,
        )
    # model.pt may come from a DVC remote: its configs are code, built only where trusted.
    recorded = {k: saved.get(k) for k in RECORDED_CONFIGS if k != "collate_fn"}
    recorded["data"] = {"collate_fn": saved.get("collate_fn")}  # where a config holds it
    refuse_untrusted(recorded_targets(recorded), None)
    model = build_model(saved["model"])
    try:
        model.load_state_dict(saved["state_dict"])
    except (RuntimeError, KeyError, ValueError) as error:
        raise DataError(
            f"model file {str(path)!r}: its weights do not fit {saved['model'].get('_target_')} "
            f"({str(error).splitlines()[0]})",
            hint=FIX,
        ) from None
    return model, saved


def confusion_csv(actual: list[int], predicted: list[int]) -> str:
    buffer = io.StringIO()
    buffer.write("actual,predicted\n")
    buffer.writelines(f"{a},{p}\n" for a, p in zip(actual, predicted, strict=True))
    return buffer.getvalue()


class ClassPairs:
    """Collects (actual, predicted class) for the confusion matrix: a validation metric's
    update(predictions, targets), with nothing to compute."""

    def __init__(self) -> None:
        self.actual: list[int] = []
        self.predicted: list[int] = []

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        self.actual += targets.flatten().tolist()
        self.predicted += predictions.argmax(dim=-1).flatten().tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, default=Path("results/model.pt"))
    parser.add_argument("--data", type=Path, default=Path("data/dataset.npz"))
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    try:
        model, saved = load_model(args.model)
        splits = read_npz(args.data)
        task = build_task(saved.get("task") or DEFAULT_TASK).bind(model)
        loss_fn = build_loss(saved.get("loss") or {"_target_": "torch.nn.CrossEntropyLoss"})
        metrics = build_metrics(
            saved.get("metrics") or {}, splits.num_classes, device, instantiate_node
        )
        reading = build_reading({"collate_fn": saved.get("collate_fn")})
    except UserError as error:
        report_and_exit(error)
    pairs = ClassPairs() if isinstance(task, Classification) else None
    size = validation_batch_size(saved.get("batch_size", 64), saved.get("val_batch_size"))
    batches = val_batches(splits.val, device, size, reading.collate_fn)
    try:
        totals = evaluate(
            model, batches, task, loss_fn, device, {**metrics, "pairs": pairs} if pairs else metrics
        )
    except FIT_ERRORS as error:  # the model was trained on data of another shape
        report_and_exit(misfit(args.model, saved, args.data, splits.val, reading, error))
    loss_sum, count = totals.tolist()
    # eval_*: beside metrics.json's val_* in `dvc exp show`, names that need no file prefix
    figures = {"eval_loss": loss_sum / count if count else None}
    figures.update({f"eval_{k}": v for k, v in compute_metrics(metrics).items()})
    figures = {k: v if v is None or math.isfinite(v) else None for k, v in figures.items()}
    figures["eval_samples"] = len(splits.val)
    confusion = args.out_dir / "confusion.csv"
    if pairs is not None:
        write_text(confusion, confusion_csv(pairs.actual, pairs.predicted))
    else:
        confusion.unlink(missing_ok=True)  # a classifier's, from an earlier run: not this task's
    write_json(args.out_dir / "eval.json", figures)
    try:
        where = add_to_its_run(saved, figures)
    except UserError as error:
        report_and_exit(error)
    shown = ", ".join(
        f"{k.removeprefix('eval_')} {v:.4f}" for k, v in figures.items() if isinstance(v, float)
    )
    print(f"evaluate: {shown} on {figures['eval_samples']} samples; {where}")


def add_to_its_run(saved: dict[str, Any], figures: dict[str, Any]) -> str:
    """Record val/eval_<figure> on the MLflow run that trained this model, the one model.pt
    names (never another: a model evaluated is described only by its own run), beside val/*
    on the run page. Its store's password, which model.pt does not keep, comes from
    MLFLOW_TRACKING_URI (the same store) or MLFLOW_TRACKING_PASSWORD. Says where it went."""
    run_id = saved.get("run_id")
    if not run_id:
        return "not recorded in MLflow: the model file names no run (untracked, or written before it did)"
    recorded = saved.get("tracking_uri") or default_tracking_uri()
    try:
        uri = full_uri(recorded, None)
    except TrackingError as error:
        raise TrackingError(
            f"the figures belong to run {run_id} at {recorded}, whose password is not here",
            hint=error.hint,
        ) from None
    client = MlflowClient(uri)
    try:
        for key, value in figures.items():
            if key != "eval_samples" and value is not None:  # an unmeasured figure: not recorded
                client.log_metric(run_id, f"val/{key}", value)
    except Exception as error:
        if not is_store_failure(error) and not isinstance(error, MlflowException):
            raise
        raise TrackingError(
            f"could not add the figures to run {run_id} at {redact(recorded)} "
            f"({failure_reason(error)}); results/eval.json has them",
            hint="check that the store answers and holds that run, then run evaluate again",
        ) from None
    return f"added to run {run_id} as val/eval_*"


def misfit(
    model_file: Path,
    saved: dict[str, Any],
    data_file: Path,
    split: Any,
    reading: Any,
    error: Exception,
) -> DataError:
    """The model cannot take the data's batches: both shapes, in one line."""
    shown = describe(first_batch(split, 2, reading.collate_fn))
    trained = saved.get("inputs") or "the data it was trained on (model.pt does not say)"
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return DataError(
        f"the model in {str(model_file)!r} cannot take {str(data_file)!r}'s validation batches: "
        f"it was trained on batches of {trained}, these are {shown} ({type(error).__name__}: {text})",
        hint="evaluate it on the data it was trained on (--data), or retrain it on this data",
    )


if __name__ == "__main__":
    main()
