"""What the benchmark reports: the performance targets, the tables on stdout, the MLflow record.

Every target is a ratio that bench.json holds, so a target can be re-checked from the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from reprotrain.bench.measure import FLOPS_RATIO, RATIOS, VARIANTS
from reprotrain.bench.startup import WHOLE_PHASES, WHOLE_TARGET
from reprotrain.tracking import TrackedRun


@dataclasses.dataclass(frozen=True)
class Target:
    what: str
    device: str
    batch_size: int
    ratio: str
    threshold: float


# The performance targets (README), all on CPU; every one is a ratio in the JSON, so a target can be re-checked.
TARGETS = (
    Target("tracking costs under 3%", "cpu", 64, "b/c", 0.97),
    Target("within 80% of forward+backward", "cpu", 64, "b/bound", 0.80),
    Target("within 80% of forward+backward", "cpu", 256, "b/bound", 0.80),
    Target("1.6x the course's loop", "cpu", 64, "b/a", 1.6),
    Target("5x Lightning + MLFlowLogger", "cpu", 64, "b/d", 5.0),
    Target("90% of matmul FLOP/s", "cpu", 4096, FLOPS_RATIO, 0.90),
)


def check_targets(devices: dict[str, Any]) -> list[dict[str, Any]]:
    checked = []
    for target in TARGETS:
        entry: dict[str, Any] = dataclasses.asdict(target)
        batch = devices.get(target.device, {}).get("batches", {}).get(str(target.batch_size))
        ratio = (batch or {}).get("ratios", {}).get(target.ratio)
        if ratio is None:
            entry.update(status="NOT MEASURED", value=None, margin=None)
        else:
            value = ratio["value"]
            entry.update(
                status="PASS" if value >= target.threshold else "MISS",
                value=value,
                margin=value - target.threshold,
                margin_fraction=value / target.threshold - 1,
            )
        checked.append(entry)
    return checked


def format_report(report: dict[str, Any]) -> str:
    out = [f"reprotrain bench ({report['settings']['mode']}), torch {torch.__version__}"]
    for note in report["absent"]:
        out.append(f"not measured: {note}")
    for kind, device in report["devices"].items():
        out += _device_tables(kind, device)
    for kind, batches in report.get("fastpaths", {}).items():
        out += _fastpath_table(kind, batches)
    if report.get("targets"):
        out += ["", "targets", _targets_table(report["targets"])]
    out.append("")
    out += _fixed_costs(report)
    if "crossover" in report:
        study = report["crossover"]
        out.append("")
        out.append(
            "crossover: "
            + (
                f"GPU half absent: {study['gpu_absent']}; CPU half only"
                if study["gpu_absent"]
                else ", ".join(f"hidden {h}: {b}" for h, b in study["crossover"].items())
            )
            + f" (table: {study['files']['table']}, plot: {study['files']['plot']})"
        )
    return "\n".join(out)


def _device_tables(kind: str, device: dict[str, Any]) -> list[str]:
    matmul = device["matmul"]["flops_per_s"]
    out = [
        "",
        f"== {kind}: {device['name']}, {device['torch_threads']} threads, "
        f"fp32 matmul {matmul / 1e9:,.1f} GFLOP/s",
        "   "
        + ", ".join(f"{name} = {label}" for name, label in VARIANTS.items())
        + "; ratios are of samples/s",
    ]
    names = list(VARIANTS)
    ms_rows, rate_rows, ratio_rows = [], [], []
    for batch, entry in device["batches"].items():
        v, r = entry["variants"], entry["ratios"]
        ms_rows.append(
            [batch, str(entry["measured_steps"])]
            + [_cell(v[n], "step_ms_median", ".3f") for n in names]
        )
        rate_rows.append([batch] + [_cell(v[n], "samples_per_s", ",.0f") for n in names])
        ratio_rows.append(
            [batch]
            + [_cell(r.get(name, {}), "value", ".2f") for name, _, _ in RATIOS]
            + [_cell(r[FLOPS_RATIO], "value", ".1%")]
        )
    out += ["", "ms/step (median after warm-up)"]
    out.append(_table(["batch", "steps", *names], ms_rows))
    out += ["", "samples/s"]
    out.append(_table(["batch", *names], rate_rows))
    out += ["", "ratios"]
    out.append(_table(["batch", *[name for name, _, _ in RATIOS], "b FLOP/s / matmul"], ratio_rows))
    if kind == "cuda":
        memory_rows = [
            [batch] + [_cell(entry["variants"][n], "cuda_peak_mb", ",.1f") for n in names]
            for batch, entry in device["batches"].items()
        ]
        out += ["", "peak CUDA memory allocated, MB"]
        out.append(_table(["batch", *names], memory_rows))
    return out


def _fastpath_table(kind: str, batches: dict[str, Any]) -> list[str]:
    out = [
        "",
        f"fast paths on {kind} (tracking off; speedup = samples/s with the path / without it, "
        "median of alternating pairs)",
    ]
    rows = []
    for batch, entries in batches.items():
        for e in entries:
            if "skipped" in e:
                rows.append([batch, e["name"], e["option"], "-", "-", "-", "-", e["skipped"]])
                continue
            rows.append(
                [
                    batch,
                    e["name"],
                    e["option"],
                    "on" if e["on_by_default"] else "off",
                    f"x{e['speedup']:.2f}",
                    f"{e['max_loss_diff']:.1e}",
                    "-" if e["one_off_s"] is None else f"{e['one_off_s']:.1f}",
                    "same math" if e["same_math"] else "changes the losses",
                ]
            )
    headers = ["batch", "fast path", "option", "default", "speedup", "max |dloss|", "one-off s", ""]
    out.append(_table(headers, rows))
    return out


def _targets_table(targets: list[dict[str, Any]]) -> str:
    rows = []
    for t in targets:
        if t["value"] is None:
            result = "NOT MEASURED"
        else:
            word = "by" if t["status"] == "PASS" else "short by"
            result = (
                f"{t['status']} {word} {abs(t['margin']):.3g} ({abs(t['margin_fraction']):.1%})"
            )
        rows.append(
            [
                f"{t['device']} batch {t['batch_size']}",
                t["ratio"],
                "-" if t["value"] is None else f"{t['value']:.3f}",
                f">= {t['threshold']:g}",
                result,
                t["what"],
            ]
        )
    return _table(["where", "ratio", "value", "target", "result", "why"], rows)


def _fixed_costs(report: dict[str, Any]) -> list[str]:
    """Start-up, `dvc repro` and the process's peak memory: one line each."""
    out = []
    startup = report.get("startup", {})
    if "median_s" in startup:
        out.append(
            f"start-up (process start to first step, {startup['command']}): "
            f"{startup['median_s']:.2f} s (median of {len(startup['runs_s'])})"
        )
    elif startup:
        out.append(f"start-up: {startup.get('error') or startup.get('skipped')}")
    whole = report.get("whole_process", {})
    if "median_ratio" in whole:
        ratio = whole["median_ratio"]
        out.append(
            f"whole process, CPU, {whole['steps']} steps at batch {whole['batch_size']} "
            f"(median of {whole['pairs']} alternating rounds, imports included):"
        )
        rows = [
            [
                name,
                f"{whole['median_s'][name]:.2f}",
                f"{whole['row_ratios'][name]:.2f}",
                f"{whole['median_cpu_s'][name]:.2f}",
                f"{whole['peak_rss_mb'][name]:,.0f}",
                whole["commands"][name],
            ]
            for name in whole["commands"]
        ]
        out.append(
            _table(["process", "wall s", "/ lesson", "CPU s", "peak RSS MB", "command"], rows)
        )
        out.append(
            f"reprotrain / lesson wall time: {ratio:.2f} (pairs "
            f"{', '.join(f'{r:.2f}' for r in whole['ratios'])}); target <= {WHOLE_TARGET:g}: "
            f"{'met' if ratio <= WHOLE_TARGET else 'missed'}"
        )
        cpu, cores = whole["median_cpu_s"], whole["cores"]
        out.append(
            f"CPU time (user + system, with reprotrain's tracking worker): reprotrain "
            f"{cpu['reprotrain']:.2f} s, lesson {cpu['lesson']:.2f} s; on {cores} cores the "
            f"least wall time that work could take is {cpu['reprotrain'] / cores:.2f} s, "
            f"{cpu['reprotrain'] / cores / whole['median_s']['lesson']:.2f}x the lesson's"
        )
        out.append(
            "where reprotrain's wall time went (median s; start-up: process start to first "
            "step; wait: for the tracking worker's run and warm-up; finish: evaluation, "
            "outputs and the MLflow Model; after: ending the run, exit):"
        )
        headers = ["process", "start-up", "wait", "loop", "finish", "after"]
        rows = [
            [name, *(f"{split[phase]:.2f}" for phase in WHOLE_PHASES)]
            for name, split in whole["median_phases_s"].items()
        ]
        out.append(_table(headers, rows))
    elif whole:
        out.append(f"whole process: {whole.get('error') or whole.get('skipped')}")
    for entry in report.get("scaling", []):
        if "efficiency" in entry:
            rates = entry["samples_per_s"]
            out.append(
                f"data-parallel scaling on {entry['device']}, batch "
                f"{entry['batch_size_per_process']} per process, {entry['steps']} steps: "
                f"1 process {rates['1']:,.0f} samples/s, {entry['processes']} processes "
                f"{rates[str(entry['processes'])]:,.0f} samples/s; efficiency "
                f"{entry['efficiency']:.2f}"
            )
        else:
            out.append(f"data-parallel scaling: {entry.get('error')}")
    dvc = report.get("dvc", {})
    if "median_s" in dvc:
        out.append(
            f"dvc repro, nothing changed: {dvc['median_s']:.2f} s (median of {len(dvc['runs_s'])})"
        )
    elif dvc:
        out.append(f"dvc repro: skipped: {dvc.get('skipped') or dvc.get('error')}")
    out.append(f"peak RSS of this process: {report['peak_rss_mb']:,.0f} MB")
    return out


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _cell(entry: dict[str, Any], key: str, spec: str) -> str:
    return "-" if entry.get(key) is None else format(entry[key], spec)


def without_nan(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nan(v) for v in value]
    return value


def metrics_of(report: dict[str, Any]) -> dict[str, float]:
    """Every measured figure, as MLflow metric keys."""
    metrics: dict[str, Any] = {}
    for kind, device in report["devices"].items():
        metrics[f"{kind}/matmul_flops_per_s"] = device["matmul"]["flops_per_s"]
        for batch, entry in device["batches"].items():
            for name, variant in entry["variants"].items():
                for key, value in variant.items():
                    metrics[f"{kind}/b{batch}/{name}/{key}"] = value
            for name, ratio in entry["ratios"].items():
                key = name.replace("/", "_over_")
                metrics[f"{kind}/b{batch}/ratio/{key}"] = ratio["value"]
    for kind, batches in report.get("fastpaths", {}).items():
        for batch, entries in batches.items():
            for e in entries:
                slug = e["name"].lower().replace(" ", "_").replace(".", "_")
                for key in ("speedup", "max_loss_diff", "one_off_s"):
                    metrics[f"{kind}/b{batch}/fastpath/{slug}/{key}"] = e.get(key)
    for key in ("startup", "dvc"):
        if "median_s" in report.get(key, {}):
            metrics[f"{key}_s"] = report[key]["median_s"]
    for entry in report.get("scaling", []):
        if "efficiency" in entry:
            metrics[f"{entry['device']}/scaling/efficiency"] = entry["efficiency"]
    whole = report.get("whole_process", {})
    if "median_ratio" in whole:
        metrics["whole/ratio"] = whole["median_ratio"]
        for name in whole["commands"]:
            slug = re.sub(r"[^\w.-]+", "_", name)  # "reprotrain tracking.log_model=false"
            metrics[f"whole/{slug}_s"] = whole["median_s"][name]
            metrics[f"whole/{slug}_peak_rss_mb"] = whole["peak_rss_mb"][name]
            metrics[f"whole/{slug}_cpu_s"] = whole["median_cpu_s"][name]
            metrics[f"whole/{slug}_ratio"] = whole["row_ratios"][name]
            for phase, seconds in whole["median_phases_s"].get(name, {}).items():
                metrics[f"whole/{slug}_{phase}_s"] = seconds
    metrics["peak_rss_mb"] = report["peak_rss_mb"]
    # Labels, flags and figures that could not be measured (null) are not metrics.
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def record(run: TrackedRun, report: dict[str, Any], json_path: Path) -> None:
    """The benchmark's own MLflow run: every figure as a metric, bench.json and the study's files."""
    run.log_metrics(metrics_of(report), step=0)
    run.log_artifact(json_path)
    for path in report.get("crossover", {}).get("files", {}).values():
        run.log_artifact(Path(path))
