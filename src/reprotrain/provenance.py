"""What a run records about where it came from: tags, its name, the data's and config's hashes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from reprotrain import __version__
from reprotrain.build import Pieces, class_name, data_sizes
from reprotrain.data import file_md5
from reprotrain.data.prepared import files_md5
from reprotrain.data.splits import first_batch
from reprotrain.data.structure import describe
from reprotrain.project import find_root, git_state
from reprotrain.schema import Config, as_dict

ENV_TAGS = (
    ("DVC_STAGE", "dvc.stage"),
    ("DVC_EXP_NAME", "dvc.exp_name"),
    ("DVC_EXP_BASELINE_REV", "dvc.baseline_rev"),
    ("REPROTRAIN_SWEEP_ID", "sweep.id"),
    ("REPROTRAIN_PARENT_RUN_ID", "mlflow.parentRunId"),
)


def run_tags(config: Config, pieces: Pieces, runtime: str) -> dict[str, str]:
    commit, dirty = git_state(find_root())
    tags = {
        "runtime": os.environ.get("REPROTRAIN_RUNTIME", runtime),
        "git.commit": commit,
        "git.dirty": dirty,
        "data.hash": data_hash(config, pieces),
        "config.hash": conf_hash(config),
        "reprotrain.version": __version__,
        "mlflow.source.name": "reprotrain.train",
        **built_tags(pieces),
    }
    if os.environ.get("REPROTRAIN_IMAGE_ID"):
        tags["image.id"] = os.environ["REPROTRAIN_IMAGE_ID"]
    tags.update({tag: os.environ[env] for env, tag in ENV_TAGS if os.environ.get(env)})
    return tags


def built_tags(pieces: Pieces) -> dict[str, str]:
    """What was built, by class, and the data's sizes: the names a dashboard filters on."""
    sizes = data_sizes(pieces.splits)
    tags = {
        "data.input_shape": input_shape_tag(pieces, sizes),
        "data.num_classes": str(sizes["num_classes"]),
        "data.train_samples": str(len(pieces.splits.train)),
        "data.val_samples": str(len(pieces.splits.val)),
        "model.class": class_name(pieces.model),
        "optimizer.class": class_name(pieces.optimizer),
        # The loss that trains: the model's own when it returns one (a Hugging Face model
        # given labels), else the loss config's.
        "loss.class": f"{class_name(pieces.model)}.loss (the model's own)"
        if pieces.model_loss
        else class_name(pieces.loss_fn),
        "model.parameters": str(count_parameters(pieces.model)),
    }
    if pieces.scheduler is not None:
        tags["scheduler.class"] = class_name(pieces.scheduler)
    return tags


def decided_params(pieces: Pieces) -> dict[str, str]:
    """What the run decided from the pieces rather than read from the config: the loss that
    trains (`loss.source`: model or loss_fn) and, for a language model, whether the labels
    are shifted against the outputs (`task.shifts_labels`, what task.shift=auto chose)."""
    params = {"loss.source": "model" if pieces.model_loss else "loss_fn"}
    shifts = getattr(pieces.task, "shifts", None)
    if isinstance(shifts, bool):
        params["task.shifts_labels"] = str(shifts).lower()
    return params


def input_shape_tag(pieces: Pieces, sizes: dict) -> str:
    """One sample's input shape (`64`, `1x8x8`), or the shapes of an item of another form
    (`{input_ids: 12, attention_mask: 12, labels: a scalar}`)."""
    if "input_shape" in sizes:
        return "x".join(str(n) for n in sizes["input_shape"]) or "scalar"
    return describe(first_batch(pieces.splits.train, 1, pieces.reading.collate_fn))


def run_name(config: Config, pieces: Pieces, device: torch.device, varied: list[str]) -> str:
    """tracking.run_name, else <model>-<optimizer>-<device>, plus what a sweep job varies."""
    if config.tracking.run_name:
        return config.tracking.run_name
    parts = [type(pieces.model).__name__, type(pieces.optimizer).__name__, device.type]
    name = "-".join(part.lower() for part in parts)
    return " ".join([name, *varied])


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


NOT_COMPUTED = "not computed"  # data.hash of a run that recorded none (reproduce names it)


def data_hash(config: Config, pieces: Pieces) -> str:
    """What the run's data is, as one md5: of the prepared file (as in dvc.lock), of in-memory
    tensors, else (a Dataset, which is not read item by item to hash it) of the data config
    and the files under `data_files`, the files it reads: equal hashes, the same data."""
    if config.data.get("file"):
        return file_md5(Path(config.data["file"]))
    train, val = pieces.splits.train, pieces.splits.val
    if not (isinstance(train, TensorDataset) and isinstance(val, TensorDataset)):
        return data_files_hash(config)
    digest = hashlib.md5()
    for tensor in (*train.tensors, *val.tensors):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def data_files_hash(config: Config, root: Path | None = None) -> str:
    """md5 of the data config (its `_target_` and arguments) and of the files under
    `data_files`, relative to the project root: what a Dataset is built from."""
    data = {key: value for key, value in config.data.items() if key != "file"}
    digest = hashlib.md5(json.dumps(data, sort_keys=True, default=str).encode() + b"\0")
    digest.update(files_md5((root or find_root()) / config.data_files).encode())
    return digest.hexdigest()


def conf_hash(config: Config) -> str:
    tree = {k: v for k, v in as_dict(config).items() if k != "conf_digest"}
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(tree)).encode()).hexdigest()[:16]


def dataset_source(config: Config) -> tuple[str, str]:
    """The data's name and source for its MLflow dataset inputs: the prepared file's stem and
    absolute path (data.file), else the last part of data._target_ and the target itself."""
    if config.data.get("file"):
        path = Path(config.data["file"]).resolve()
        return path.stem, str(path)
    target = str(config.data.get("_target_", "data"))
    return target.rsplit(".", 1)[-1], target
