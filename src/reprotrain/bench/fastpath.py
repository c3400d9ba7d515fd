"""Each fast path against reprotrain's default step, side by side, tracking off (variant c).

A same-math fast path that is on by default (fused AdamW, resident data, no per-step sync) is
measured by switching it off; an opt-in one (torch.compile, CUDA graphs, bf16, TF32) by switching
it on. Runs alternate default, switched, default, switched ... and the effect is the median of
the pairs' ratios, so a drift of the machine lands on both sides. `speedup` is samples/s with
the fast path over samples/s without it (> 1: the path pays). `max_loss_diff` is the largest
|loss with - loss without| over the run; 0.0 means bit-identical. `one_off_s` is the extra
time outside the measured window (compilation, capture), over the default's, in the first
switched run (later ones reuse what torch cached in this process).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reprotrain.bench.variants import reprotrain_step
from reprotrain.data import Splits
from reprotrain.fastpaths import compiler_missing


@dataclass(frozen=True)
class Switch:
    name: str
    option: str  # the config setting that turns the fast path on
    switched: dict[str, Any]  # reprotrain_step arguments for the switched run
    default_on: bool  # on in the default run: the switched run is the run without it
    same_math: bool
    devices: tuple[str, ...] = ("cpu", "cuda", "mps")
    train_options: dict[str, Any] = field(default_factory=dict)


SWITCHES = (
    Switch("fused AdamW", "optimizer.fused=null (fused)", {"fused": False}, True, True),
    Switch("resident data", "train.resident_data=auto", {"resident": "false"}, True, True),
    Switch("no per-step sync", "train.log_every=25", {"log_every": 1}, True, True),
    Switch(
        "torch.compile",
        "train.compile=true",
        {"train_options": {"compile": True}},
        False,
        True,
        ("cpu", "cuda"),
    ),
    Switch(
        "CUDA graph of the step",
        "train.cuda_graphs=true",
        {"train_options": {"cuda_graphs": True}},
        False,
        True,
        ("cuda",),
    ),
    Switch(
        "bf16 autocast",
        "train.precision=bf16",
        {"train_options": {"precision": "bf16", "deterministic": False}},
        False,
        False,
        ("cpu", "cuda"),
    ),
    Switch(
        "TF32 matmuls",
        "train.tf32=true",
        {"train_options": {"tf32": True, "deterministic": False}},
        False,
        False,
        ("cuda",),
    ),
)


def fastpath_study(
    device: torch.device,
    dataset: Splits,
    batch_sizes: list[int],
    steps_for: Callable[[int], int],
    warmup: int,
    pairs: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """{batch: [row per fast path]} for this device."""
    out: dict[str, Any] = {}
    for batch_size in batch_sizes:
        total = warmup + steps_for(batch_size)
        rows = []
        for switch in SWITCHES:
            reason = unavailable(switch, device)
            if reason:
                rows.append({"name": switch.name, "option": switch.option, "skipped": reason})
                continue
            row = measure_switch(switch, device, dataset, batch_size, total, warmup, pairs)
            rows.append(row)
            say(
                f"  fast path {switch.name:<22} batch {batch_size:>5}: "
                f"x{row['speedup']:.2f}, max loss diff {row['max_loss_diff']:.2e}"
            )
        out[str(batch_size)] = rows
    return out


def unavailable(switch: Switch, device: torch.device) -> str:
    if device.type not in switch.devices:
        return f"not available on {device.type}"
    if "compile" in switch.switched.get("train_options", {}):
        missing = compiler_missing()
        if missing:
            return f"torch.compile cannot build kernels here: {missing}"
    return ""


def measure_switch(
    switch: Switch,
    device: torch.device,
    dataset: Splits,
    batch_size: int,
    total: int,
    warmup: int,
    pairs: int,
) -> dict[str, Any]:
    def timed(**kwargs: Any) -> tuple[dict[str, Any], list[float], float]:
        began = time.perf_counter()
        result, losses = reprotrain_step(device, dataset, batch_size, total, warmup, **kwargs)
        return result, losses, time.perf_counter() - began

    ratios, one_off, with_rates, without_rates = [], [], [], []
    losses_default: list[float] = []
    losses_switched: list[float] = []
    for _ in range(pairs):
        default, losses_default, default_wall = timed()
        switched, losses_switched, switched_wall = timed(**switch.switched)
        on, off = (default, switched) if switch.default_on else (switched, default)
        with_rates.append(on["samples_per_s"])
        without_rates.append(off["samples_per_s"])
        ratios.append(on["samples_per_s"] / off["samples_per_s"])
        one_off.append(
            (switched_wall - switched["window_s"]) - (default_wall - default["window_s"])
        )
    diffs = [abs(a - b) for a, b in zip(losses_default, losses_switched, strict=True)]
    return {
        "name": switch.name,
        "option": switch.option,
        "on_by_default": switch.default_on,
        "same_math": switch.same_math,
        "pairs": pairs,
        "with_samples_per_s": statistics.median(with_rates),
        "without_samples_per_s": statistics.median(without_rates),
        "speedup": statistics.median(ratios),
        "speedups": ratios,
        "max_loss_diff": max(diffs),
        # The first switched run pays what later ones reuse (torch.compile's in-process cache).
        "one_off_s": one_off[0] if not switch.default_on else None,
    }
