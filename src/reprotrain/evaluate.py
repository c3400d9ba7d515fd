"""DVC stage `evaluate`: validation metrics of the saved model, and its confusion matrix.

    python -m reprotrain.evaluate            # results/model.pt on data/dataset.npz

The model is rebuilt from what model.pt records (its `_target_` config with the data sizes,
and the loss config), so any model reprotrain trained evaluates here, yours included.
Writes results/eval.json (DVC metrics) and results/confusion.csv (one row per validation
sample: actual,predicted; DVC's `confusion` plot template draws the matrix). The figures
are also added to the training run in MLflow (its id is in results/metrics.json).
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from mlflow.tracking import MlflowClient

from reprotrain.build import build_loss, build_model
from reprotrain.data import read_npz
from reprotrain.data.batches import val_batches
from reprotrain.errors import DataError, UserError, report_and_exit
from reprotrain.outputs import write_json, write_text
from reprotrain.project import default_tracking_uri
from reprotrain.results import MODEL_FORMAT
from reprotrain.step import evaluate

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
        or saved.get("format") != MODEL_FORMAT
        or not isinstance(saved.get("model"), dict)
        or not isinstance(saved.get("state_dict"), dict)
    ):
        raise DataError(
            f"model file {str(path)!r} is not a reprotrain model file (format {MODEL_FORMAT}: "
            "state_dict, model, loss)",
            hint=FIX,
        )
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, default=Path("results/model.pt"))
    parser.add_argument("--data", type=Path, default=Path("data/dataset.npz"))
    parser.add_argument("--train-metrics", type=Path, default=Path("results/metrics.json"))
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    try:
        model, saved = load_model(args.model)
        splits = read_npz(args.data)
        loss_fn = build_loss(saved.get("loss") or {"_target_": "torch.nn.CrossEntropyLoss"})
    except UserError as error:
        report_and_exit(error)
    loss, accuracy, predicted = evaluate(model, val_batches(splits.val, device), loss_fn, device)
    actual = [int(y) for _, y in val_batches(splits.val, device) for y in y.flatten()]
    # eval_*: beside metrics.json's val_* in `dvc exp show`, names that need no file prefix
    metrics = {"eval_loss": loss, "eval_accuracy": accuracy, "eval_samples": len(splits.val)}
    if len(predicted):
        write_text(args.out_dir / "confusion.csv", confusion_csv(actual, predicted.tolist()))
    write_json(args.out_dir / "eval.json", metrics)
    add_to_training_run(args.train_metrics, metrics)
    print(
        f"evaluate: loss {loss:.4f}, accuracy {accuracy:.4f} on {metrics['eval_samples']} samples"
    )


def add_to_training_run(train_metrics: Path, metrics: dict[str, float]) -> None:
    """Record val/eval_loss and val/eval_accuracy on the MLflow run that trained the model
    (when it was tracked): beside val/*, after train/* on the run page."""
    if not train_metrics.is_file():
        return
    info = json.loads(train_metrics.read_text())
    if not info.get("run_id"):
        return
    client = MlflowClient(info.get("tracking_uri") or default_tracking_uri())
    for key in ("eval_loss", "eval_accuracy"):
        if metrics[key] == metrics[key]:  # NaN (no class labels) is not recorded
            client.log_metric(info["run_id"], f"val/{key}", metrics[key])


if __name__ == "__main__":
    main()
