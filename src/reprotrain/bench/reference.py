"""What every measurement shares: the reference MLP, its data, batches and config, and how long
to measure.

Every variant starts from the same weights (SEED, and the MLP built as reprotrain builds it),
sees the same batches (each epoch's order from `reprotrain.data.batches.epoch_order`) and runs
the same AdamW update, so a ratio of two variants' samples/s measures their overhead and
nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reprotrain.build import build_data, build_model, with_data_sizes
from reprotrain.data import ResidentBatches, Splits, to_tensors
from reprotrain.schema import Config, validate

EXPERIMENT = "reprotrain-bench"
SEED = 0
HIDDEN = 512  # the reference MLP: 784 -> 512 -> 10
LR = 1e-3
LOG_EVERY = 25


@dataclass(frozen=True)
class Plan:
    """How long to measure. Measured steps per batch size = budget/batch, clamped."""

    mode: str
    warmup: int
    sample_budget: int
    min_steps: int
    max_steps: int
    cross_warmup: int
    cross_budget: int
    cross_min: int
    cross_max: int
    matmul_sizes: dict[str, tuple[int, ...]]
    matmul_repeats: int
    startup_repeats: int
    dvc_repeats: int
    fastpath_pairs: int
    whole_steps: int  # the whole-process comparison: steps per run
    whole_pairs: int  # and alternating pairs of runs

    def steps(self, batch_size: int) -> int:
        return _clamp(self.sample_budget // batch_size, self.min_steps, self.max_steps)

    def cross_steps(self, batch_size: int) -> int:
        return _clamp(self.cross_budget // batch_size, self.cross_min, self.cross_max)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


QUICK = Plan(
    mode="quick",
    warmup=5,
    sample_budget=40 * 1024,  # 40 measured steps up to batch 1024, 10 at 4096
    min_steps=10,
    max_steps=40,
    cross_warmup=3,
    cross_budget=16 * 1024,
    cross_min=5,
    cross_max=20,
    matmul_sizes={"cpu": (2048,), "cuda": (8192,)},
    matmul_repeats=5,
    startup_repeats=1,
    dvc_repeats=1,
    fastpath_pairs=1,
    whole_steps=500,
    whole_pairs=1,
)
FULL = Plan(
    mode="full",
    warmup=20,
    sample_budget=200 * 1024,  # 300 measured steps for small batches, 50 at 4096
    min_steps=50,
    max_steps=300,
    cross_warmup=10,
    cross_budget=100 * 1024,
    cross_min=20,
    cross_max=200,
    matmul_sizes={"cpu": (2048, 4096), "cuda": (8192,)},
    matmul_repeats=7,
    startup_repeats=3,
    dvc_repeats=3,
    fastpath_pairs=3,
    whole_steps=3000,
    whole_pairs=3,
)


def model_node(hidden: int = HIDDEN) -> dict[str, Any]:
    """conf/model/mlp.yaml with the benchmark's hidden size; the data fills in 784 and 10."""
    return {"_target_": "reprotrain.models.MLP", "hidden_size": hidden, "depth": 1, "dropout": 0.0}


def bench_config(
    device: torch.device,
    batch_size: int,
    steps: int,
    warmup: int,
    *,
    hidden: int = HIDDEN,
    tracking: bool = False,
    log_every: int = LOG_EVERY,
    resident: str = "auto",
    fused: bool | None = None,
    train_options: dict[str, Any] | None = None,
    num_samples: int = 8192,
) -> Config:
    """The config b and c train with: conf/'s defaults with the benchmark's sizes (progress,
    checkpoints and the MLflow Model off)."""
    return validate(
        {
            "model": model_node(hidden),
            "data": {
                "_target_": "reprotrain.data.synthetic",
                "num_samples": num_samples,
                "num_features": 784,
                "num_classes": 10,
                "noise": 8.0,
                "val_fraction": 0.2,
                "seed": SEED,
                "file": None,
            },
            "loss": {"_target_": "torch.nn.CrossEntropyLoss"},
            "optimizer": {
                "_target_": "torch.optim.AdamW",
                "_partial_": True,
                "lr": LR,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,  # torch's AdamW default, so a, b, c and d share the math
                "fused": fused,  # None: fused where torch has it (conf/'s default)
            },
            "device": {"type": device.type, "index": device.index},
            "train": {
                "steps": steps,
                "epochs": None,
                "batch_size": batch_size,
                "seed": SEED,
                "log_every": log_every,
                "warmup_steps": warmup,
                "deterministic": True,
                "progress": "off",
                "resident_data": resident,
                "threads": "auto",
                # fit() saves none: a, d and the bound write no checkpoint, and a save inside
                # the timed window would be charged to b and c alone.
                "checkpoint_every": 0,
                **(train_options or {}),
            },
            "tracking": {
                "enabled": tracking,
                "experiment": f"{EXPERIMENT}-steps",
                "loss_every": 1,  # b records every step's loss
                "log_model": False,  # the MLflow Model is written after the loop, never timed
            },
            "runtime": {"mode": "local"},
        }
    )


def bench_dataset(max_batch: int) -> Splits:
    """The synthetic 784-feature data, built as a run builds it (data._target_), with a
    training split of at least one largest batch."""
    config = bench_config(torch.device("cpu"), 1, 1, 0, num_samples=samples_for(max_batch))
    return build_data(config)


def samples_for(max_batch: int) -> int:
    return max(8192, math.ceil((max_batch + 1) / 0.8))  # val_fraction 0.2 is held out


def num_samples_of(dataset: Splits) -> int:
    return len(dataset.train) + len(dataset.val)  # type: ignore[arg-type]


def reference_model(dataset: Splits, device: torch.device, hidden: int = HIDDEN) -> nn.Module:
    """The MLP as build.py builds it for b and c, from the same seed: the same weights."""
    torch.manual_seed(SEED)  # every variant starts from the same weights
    return build_model(with_data_sizes(model_node(hidden), dataset)).to(device)


def reference_batches(dataset: Splits, batch_size: int, device: torch.device) -> ResidentBatches:
    """The training batches b and c see with resident data: each epoch's order from
    epoch_order(n, SEED, epoch), sliced from one shuffled copy. On the host for a, on the
    device for the bound."""
    return ResidentBatches(dataset.train, batch_size, device, SEED)


def example_batch(dataset: Splits, device: torch.device, size: int = 8) -> torch.Tensor:
    """A few training inputs, for counting the FLOPs of one step per sample."""
    inputs, _targets = to_tensors(dataset.train)
    return inputs[:size].to(device)
