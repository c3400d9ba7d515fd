"""What every measurement shares: the reference MLP, its data and config, and how long to measure.

Every variant starts from the same weights (SEED), sees the same batches and runs the same
AdamW update, so a ratio of two variants' samples/s measures their overhead and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from reprotrain.data import Dataset, load_dataset
from reprotrain.model import MLP
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
)


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
    """The config fit() gets: conf/'s defaults with the benchmark's sizes (progress off)."""
    return validate(
        {
            "model": {"name": "mlp", "hidden_size": hidden, "depth": 1, "dropout": 0.0},
            "device": {"type": device.type, "index": device.index},
            "optimizer": {
                "name": "adamw",
                "lr": LR,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,  # torch's AdamW default, so a, b, c and d share the math
                "fused": fused,
            },
            "data": {"name": "synthetic", "num_samples": num_samples, "num_features": 784},
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
            "tracking": {"enabled": tracking, "experiment": f"{EXPERIMENT}-steps"},
            "runtime": {"mode": "local"},
        }
    )


def bench_dataset(max_batch: int) -> Dataset:
    """The synthetic 784-feature data, with a training split of at least one largest batch."""
    config = bench_config(torch.device("cpu"), 1, 1, 0, num_samples=samples_for(max_batch))
    return load_dataset(config.data)


def samples_for(max_batch: int) -> int:
    return max(8192, math.ceil((max_batch + 1) / 0.8))  # val_fraction 0.2 is held out


def reference_model(dataset: Dataset, device: torch.device) -> MLP:
    torch.manual_seed(SEED)  # every variant starts from the same weights
    return MLP(dataset.num_features, HIDDEN, dataset.num_classes).to(device)
