"""DVC stage `evaluate`: validation metrics of the saved model, and its confusion matrix.

    python -m reprotrain.evaluate            # results/model.pt on data/dataset.npz

Writes results/eval.json (DVC metrics) and results/confusion.csv (one row per validation
sample: actual,predicted; DVC's `confusion` plot template draws the matrix). The figures
are also added to the training run in MLflow (its id is in results/metrics.json), so the
run shows how the model it produced did.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import torch
from torch import nn

from reprotrain.data import read_npz
from reprotrain.errors import DataError, UserError, report_and_exit
from reprotrain.model import MLP
from reprotrain.outputs import read_model, write_json, write_text
from reprotrain.step import evaluate


def load_model(path: Path) -> MLP:
    if not path.is_file():
        raise DataError(
            f"model file {str(path)!r} does not exist", hint="run `dvc repro train` first"
        )
    try:
        saved = read_model(path)
        meta = saved["meta"]
        model = MLP(
            meta["in_features"],
            meta["model"]["hidden_size"],
            meta["num_classes"],
            depth=meta["model"]["depth"],
            dropout=meta["model"]["dropout"],
        )
        model.load_state_dict(saved["state_dict"])
    except (KeyError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise DataError(
            f"model file {str(path)!r} is unreadable or does not match its metadata "
            f"({type(error).__name__})",
            hint="re-create it with `dvc repro train`",
        ) from None
    return model


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
    try:
        model = load_model(args.model)
        dataset = read_npz(args.data, model.layers[-1].out_features)
    except UserError as error:
        report_and_exit(error)
    x_val, y_val = torch.from_numpy(dataset.x_val), torch.from_numpy(dataset.y_val)
    loss, accuracy, predicted = evaluate(model, x_val, y_val, nn.CrossEntropyLoss())
    metrics = {"val_loss": loss, "val_accuracy": accuracy, "val_samples": int(y_val.shape[0])}
    write_text(
        args.out_dir / "confusion.csv", confusion_csv(dataset.y_val.tolist(), predicted.tolist())
    )
    write_json(args.out_dir / "eval.json", metrics)
    add_to_training_run(args.train_metrics, metrics)
    print(
        f"evaluate: val_loss {loss:.4f}, val_accuracy {accuracy:.4f} on {metrics['val_samples']} samples"
    )


def add_to_training_run(train_metrics: Path, metrics: dict[str, float]) -> None:
    """Record eval/* on the MLflow run that trained the model (when it was tracked)."""
    if not train_metrics.is_file():
        return
    info = json.loads(train_metrics.read_text())
    if not info.get("run_id"):
        return
    from mlflow.tracking import MlflowClient

    from reprotrain.project import default_tracking_uri

    client = MlflowClient(info.get("tracking_uri") or default_tracking_uri())
    for key in ("val_loss", "val_accuracy"):
        client.log_metric(info["run_id"], f"eval/{key.removeprefix('val_')}", metrics[key])


if __name__ == "__main__":
    main()
