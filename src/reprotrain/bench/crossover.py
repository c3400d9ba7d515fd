"""The CPU-versus-GPU crossover: from which batch size does the GPU train the MLP faster?

reprotrain's step, tracking off, over device x hidden size x batch size; per hidden size, the
smallest batch where cuda's samples/s beats cpu's. Writes crossover.png and crossover.md, and
records each point as an MLflow child run of the benchmark's run. Without a GPU only the CPU
half is measured, and every output says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from reprotrain.bench.reference import Plan
from reprotrain.bench.variants import reprotrain_step
from reprotrain.data import Splits
from reprotrain.outputs import write_atomic
from reprotrain.timing import PHASES
from reprotrain.tracking import TrackedRun


def gpu_absence(devices: list[torch.device]) -> str | None:
    """Why the GPU half of the crossover study is not measured, or None when it is."""
    if any(device.type == "cuda" for device in devices):
        return None
    if not torch.cuda.is_available():
        return f"no CUDA device is visible to torch here (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})"
    return "cuda was left out of --devices"


def crossover_study(
    devices: list[torch.device],
    batch_sizes: list[int],
    hidden_sizes: list[int],
    plan: Plan,
    dataset: Splits,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """reprotrain's step, tracking off, over device x batch size x hidden size."""
    absent = gpu_absence(devices)
    say("crossover: " + (f"GPU half absent: {absent}" if absent else "CPU and GPU halves measured"))
    points = []
    for device in devices:
        for hidden in hidden_sizes:
            for batch_size in batch_sizes:
                point = crossover_point(device, dataset, hidden, batch_size, plan)
                say(
                    f"  {device.type:<4} hidden {hidden:>5} batch {batch_size:>5}  "
                    f"{point['samples_per_s']:>12,.0f} samples/s"
                    + ("" if point["copy_share"] is None else f"  copy {point['copy_share']:.0%}")
                )
                points.append(point)
    return {
        "gpu_absent": absent,
        "batch_sizes": batch_sizes,
        "hidden_sizes": hidden_sizes,
        "points": points,
        "crossover": crossover_batches(points, hidden_sizes, absent),
    }


def crossover_point(
    device: torch.device, dataset: Splits, hidden: int, batch_size: int, plan: Plan
) -> dict[str, Any]:
    """One point, batches resident on the device.

    On CUDA the point is also measured with batches kept on the host (pinned) and copied
    non_blocking every step; fit()'s CUDA events give the copy's share of the step.
    """
    measure = partial(
        reprotrain_step,
        device,
        dataset,
        batch_size,
        plan.cross_warmup + plan.cross_steps(batch_size),
        plan.cross_warmup,
        hidden=hidden,
    )
    kept, _ = measure()
    point: dict[str, Any] = {
        "device": device.type,
        "hidden_size": hidden,
        "batch_size": batch_size,
        "measured_steps": kept["measured_steps"],
        "samples_per_s": kept["samples_per_s"],
        "step_ms_median": kept["step_ms_median"],
        "copy_share": None,  # cpu: the batch is already where the model is
    }
    if device.type == "cuda":
        copied, _ = measure(resident="false")
        step_ms = sum(copied[f"{phase}_ms_mean"] for phase in PHASES)
        point["copied_samples_per_s"] = copied["samples_per_s"]
        point["copied_step_ms_median"] = copied["step_ms_median"]
        point["copy_ms_mean"] = copied["data_to_device_ms_mean"]
        point["copy_share"] = copied["data_to_device_ms_mean"] / step_ms
    return point


def crossover_batches(
    points: list[dict[str, Any]], hidden_sizes: list[int], absent: str | None
) -> dict[str, Any]:
    """Per hidden size: the smallest batch where cuda's samples/s beats cpu's."""
    out: dict[str, Any] = {}
    for hidden in hidden_sizes:
        if absent:
            out[str(hidden)] = None
            continue
        rate = {
            (p["device"], p["batch_size"]): p["samples_per_s"]
            for p in points
            if p["hidden_size"] == hidden
        }
        wins = sorted(
            batch
            for (device, batch), value in rate.items()
            if device == "cuda" and ("cpu", batch) in rate and value > rate[("cpu", batch)]
        )
        out[str(hidden)] = wins[0] if wins else "none in range"
    return out


def write_crossover_plot(study: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=100)
    for device in dict.fromkeys(p["device"] for p in study["points"]):
        for hidden in study["hidden_sizes"]:
            line = sorted(
                (p["batch_size"], p["samples_per_s"])
                for p in study["points"]
                if p["device"] == device and p["hidden_size"] == hidden
            )
            axes.plot(*zip(*line, strict=True), marker="o", label=f"{device}, hidden {hidden}")
    title = "reprotrain step, tracking off: samples/s by batch size"
    if study["gpu_absent"]:
        title += "\n(GPU half absent: CPU only)"
    axes.set(xscale="log", yscale="log", xlabel="batch size", ylabel="samples/s", title=title)
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    write_atomic(path, lambda handle: figure.savefig(handle, format="png"))
    plt.close(figure)
    return path


def crossover_markdown(study: dict[str, Any], names: dict[str, str]) -> str:
    lines = ["# CPU versus GPU crossover: reprotrain's step, tracking off", ""]
    lines.append("Devices: " + "; ".join(f"{kind}: {name}" for kind, name in names.items()) + ".")
    if study["gpu_absent"]:
        lines += [
            "",
            f"**GPU half absent: {study['gpu_absent']}.** Only the CPU half was measured; "
            "no crossover and no copy share can be given.",
        ]
    lines += [
        "",
        "| hidden size | crossover batch size (smallest where cuda beats cpu) | "
        "host-to-device copy share of the cuda step, by batch size |",
        "|---:|---|---|",
    ]
    for hidden in study["hidden_sizes"]:
        found = study["crossover"][str(hidden)]
        shares = [
            f"{p['batch_size']}: {p['copy_share']:.0%}"
            for p in study["points"]
            if p["hidden_size"] == hidden and p["copy_share"] is not None
        ]
        lines.append(
            f"| {hidden} | {'not measured (GPU half absent)' if found is None else found} | "
            f"{', '.join(shares) if shares else 'not measured (no cuda points)'} |"
        )
    lines += [
        "",
        "| device | hidden size | batch size | samples/s | median step ms | copy share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in study["points"]:
        share = "-" if p["copy_share"] is None else f"{p['copy_share']:.1%}"
        lines.append(
            f"| {p['device']} | {p['hidden_size']} | {p['batch_size']} | "
            f"{p['samples_per_s']:,.0f} | {p['step_ms_median']:.3f} | {share} |"
        )
    return "\n".join(lines) + "\n"


def log_crossover_children(run: TrackedRun, study: dict[str, Any]) -> None:
    """One child run per point under the benchmark's run (tag mlflow.parentRunId)."""
    from mlflow.entities import Metric, Param

    experiment_id = run.client.get_run(run.run_id).info.experiment_id
    now = int(time.time() * 1000)
    for p in study["points"]:
        child = run.client.create_run(
            experiment_id,
            run_name=f"crossover-{p['device']}-h{p['hidden_size']}-b{p['batch_size']}",
            tags={"mlflow.parentRunId": run.run_id, "bench.study": "crossover"},
        )
        child_id = child.info.run_id
        params = {k: p[k] for k in ("device", "hidden_size", "batch_size", "measured_steps")}
        metrics = {k: v for k, v in p.items() if k not in params and isinstance(v, int | float)}
        run.client.log_batch(
            child_id,
            params=[Param(k, str(v)) for k, v in params.items()],
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
        )
        run.client.set_terminated(child_id, "FINISHED")
