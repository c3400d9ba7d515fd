"""One device, every batch size: each variant measured in turn, then the ratios between them.

Every ratio carries the names of the two measured numbers it is the quotient of, so a reader
of bench.json can re-check it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reprotrain.bench.reference import Plan, example_batch, reference_model
from reprotrain.bench.variants import (
    course_loop,
    forward_backward_bound,
    lightning_or_reason,
    matmul_flops,
    reprotrain_step,
)
from reprotrain.data import Splits
from reprotrain.devices import describe_device
from reprotrain.timing import training_flops_per_sample
from reprotrain.tracking import prepare_store

VARIANTS = {
    "a": "course loop",
    "b": "reprotrain + MLflow",
    "c": "reprotrain, no tracking",
    "d": "Lightning + MLFlowLogger",
    "bound": "fwd+bwd bound",
}
RATIOS = (("b/c", "b", "c"), ("b/a", "b", "a"), ("b/d", "b", "d"), ("b/bound", "b", "bound"))
FLOPS_RATIO = "b_flops/matmul"


def measure_device(
    device: torch.device,
    batch_sizes: list[int],
    plan: Plan,
    dataset: Splits,
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    info = describe_device(device)
    say(f"{device.type}: {info.name}, {torch.get_num_threads()} torch threads")
    matmul = matmul_flops(device, plan.matmul_sizes.get(device.type, (2048,)), plan.matmul_repeats)
    say(f"  fp32 matmul {matmul['flops_per_s'] / 1e9:,.1f} GFLOP/s")
    # torch's FlopCounterMode on one forward and backward of the reference MLP, per sample.
    flops_per_sample = training_flops_per_sample(
        reference_model(dataset, device), example_batch(dataset, device)
    )
    step_store = f"sqlite:///{workdir / 'steps.db'}"
    lightning_store = f"sqlite:///{workdir / 'lightning.db'}"
    for uri in (step_store, lightning_store):
        prepare_store(uri)  # schema creation happens once, outside every timed window
    batches: dict[str, Any] = {}
    for batch_size in batch_sizes:
        steps = plan.steps(batch_size)
        total = plan.warmup + steps
        variants: dict[str, Any] = {}
        variants["a"], _ = course_loop(device, dataset, batch_size, total, plan.warmup)
        variants["b"], _ = reprotrain_step(
            device, dataset, batch_size, total, plan.warmup, tracking_uri=step_store
        )
        variants["c"], _ = reprotrain_step(device, dataset, batch_size, total, plan.warmup)
        variants["d"], _ = lightning_or_reason(
            device, dataset, batch_size, total, plan.warmup, lightning_store, workdir
        )
        variants["bound"] = forward_backward_bound(device, dataset, batch_size, total, plan.warmup)
        for name, entry in variants.items():
            if "samples_per_s" in entry:
                entry["label"] = VARIANTS[name]
                entry["train_flops_per_s"] = entry["samples_per_s"] * flops_per_sample
                entry["flops_fraction_of_matmul"] = (
                    entry["train_flops_per_s"] / matmul["flops_per_s"]
                )
                say(
                    f"  batch {batch_size:>5}  {name:<5} {entry['step_ms_median']:9.3f} ms/step "
                    f"{entry['samples_per_s']:>12,.0f} samples/s"
                )
            else:
                say(f"  batch {batch_size:>5}  {name:<5} skipped: {entry['skipped']}")
        batches[str(batch_size)] = {
            "measured_steps": steps,
            "warmup_steps": plan.warmup,
            "variants": variants,
            "ratios": ratios(variants, matmul["flops_per_s"]),
        }
    return {
        "name": info.name,
        "torch_threads": torch.get_num_threads(),
        "train_flops_per_sample": flops_per_sample,
        "matmul": matmul,
        "batches": batches,
    }


def ratios(variants: dict[str, Any], matmul_flops_per_s: float) -> dict[str, Any]:
    """Throughput ratios, each with the two measured numbers it is the quotient of."""
    out: dict[str, Any] = {}
    for name, top, bottom in RATIOS:
        if "samples_per_s" in variants[top] and "samples_per_s" in variants[bottom]:
            num, den = variants[top]["samples_per_s"], variants[bottom]["samples_per_s"]
            out[name] = {
                "value": num / den,
                "numerator": f"{top}.samples_per_s",
                "denominator": f"{bottom}.samples_per_s",
            }
    out[FLOPS_RATIO] = {
        "value": variants["b"]["train_flops_per_s"] / matmul_flops_per_s,
        "numerator": "b.train_flops_per_s",
        "denominator": "matmul.flops_per_s",
    }
    return out
