"""The run's training and validation data as MLflow datasets, so the run page's Datasets box
names them with their digest (`mlflow.log_input`, through TrackedRun.log_inputs).

    datasets = as_mlflow_datasets(splits, "digits", "/abs/data/dataset.npz")  # or its _target_
    # [(<NumpyDataset digits-train>, "training"), (<NumpyDataset digits-val>, "validation")]

Tensors in memory become `mlflow.data.from_numpy` datasets (MLflow computes their digest);
a streamed dataset is not read a second time to hash it, so it is recorded by name and
source only (`MetaDataset`).
"""

from __future__ import annotations

import warnings
from typing import Any

import mlflow.data
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from torch.utils.data import TensorDataset

CONTEXTS = (("train", "training"), ("val", "validation"))


def as_mlflow_datasets(splits: Any, name: str, source: str) -> list[tuple[Any, str]]:
    """(MLflow dataset, context) for the train and val splits of `splits` (data.Splits);
    `source` is the data file's absolute path, or the data's `_target_` when it has none."""
    datasets = []
    with warnings.catch_warnings():
        # MLflow registers its local-file source twice and warns that a path is ambiguous.
        warnings.filterwarnings("ignore", message=".*can be interpreted in multiple ways.*")
        for split, context in CONTEXTS:
            data = getattr(splits, split)
            datasets.append((_dataset(data, f"{name}-{split}", source), context))
    return datasets


def _dataset(data: Any, name: str, source: str) -> Any:
    where = (
        resolve_dataset_source(source)  # a local file: MLflow's local artifact source
        if source.startswith("/")
        else CodeDatasetSource(tags={"data._target_": source})  # made by code, in memory
    )
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        features, targets = (tensor.numpy(force=True) for tensor in data.tensors)
        # mlflow.data's constructors (from_numpy, ...) are set on the module when it loads,
        # from its dataset registry: the module's type information does not list them.
        return mlflow.data.from_numpy(  # type: ignore[attr-defined]
            features, targets=targets, name=name, source=where
        )
    # MetaDataset leaves Dataset.profile abstract, but Dataset is no ABC: MLflow's documented
    # MetaDataset(source, name=...) builds it.
    return MetaDataset(where, name=name)  # type: ignore[abstract]
