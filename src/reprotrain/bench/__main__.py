"""Performance, measured side by side in one process.

    python -m reprotrain.bench --quick                       # CI size: a few dozen steps per point
    python -m reprotrain.bench                               # full: more steps, start-up x3, crossover
    python -m reprotrain.bench --devices cpu --batch-sizes 64,256 --json results/bench.json
    python -m reprotrain.bench --quick --crossover           # add the CPU-vs-GPU crossover study
    python -m reprotrain.bench --crossover-only --hidden-sizes 128,512
    python -m reprotrain.bench --quick --whole-with tracking.log_model=false   # one more row

For each device and batch size, on the reference MLP (784 -> 512 -> 10, AdamW lr 1e-3):
    a      the course's loop as written: default AdamW, .to(device) per batch, loss.item() per step
    b      reprotrain's loop.fit() with full MLflow tracking (sqlite store, every step's loss)
    c      reprotrain's loop.fit() with tracking off
    d      PyTorch Lightning with MLFlowLogger, logging the loss every step (the `bench` extra)
    bound  forward, loss, backward only, on device-resident data: the ceiling for b
plus each fast path switched on and off against c (bench/fastpath.py), the machine's fp32
matmul FLOP/s, the start-up time of `python -m reprotrain.train`, the whole
`python -m reprotrain.train` process against the course's script as written (lesson_script.py,
on the CPU, imports included; --whole-with adds reprotrain rows with other overrides),
data-parallel scaling under torchrun (bench/scaling.py), and
`dvc repro` with nothing to do. Results: a table on stdout, results/bench.json, and an MLflow
run in experiment `reprotrain-bench` (crossover points are its child runs).

Timing rules: warm-up steps are left out; step times are medians; throughput is samples over the
measured wall-clock window (b's window includes sending its buffered MLflow points, d's includes
Lightning's per-step logger write); GPU work is synchronised before any clock is read; every
variant sees the same data, the same initial weights and the same arithmetic (the same AdamW
update, fused or not). Ratios are of samples/s; targets are the README's, checked on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from reprotrain.bench.clock import peak_rss_mb
from reprotrain.bench.crossover import (
    crossover_markdown,
    crossover_study,
    gpu_absence,
    log_crossover_children,
    write_crossover_plot,
)
from reprotrain.bench.fastpath import fastpath_study
from reprotrain.bench.measure import measure_device
from reprotrain.bench.reference import (
    EXPERIMENT,
    FULL,
    HIDDEN,
    LOG_EVERY,
    LR,
    QUICK,
    SEED,
    Plan,
    bench_dataset,
    samples_for,
)
from reprotrain.bench.report import check_targets, format_report, record, without_nan
from reprotrain.bench.scaling import SCALING_PROCESSES, scaling, scaling_processes
from reprotrain.bench.startup import (
    WHOLE_BATCH,
    dvc_repro_time,
    startup_time,
    whole_process,
)
from reprotrain.devices import describe_device, resolve_device, set_threads
from reprotrain.errors import UserError, report_and_exit
from reprotrain.outputs import write_json, write_text
from reprotrain.project import default_tracking_uri, find_root, git_state
from reprotrain.schema import flatten
from reprotrain.seeding import seed_everything
from reprotrain.tracking import RUN_ID_ENV, TrackedRun, check_store, prepare_store


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run_bench(args)
    except UserError as error:
        report_and_exit(error)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.bench", description=__doc__.split("\n\n")[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a few dozen steps per point (CI)")
    size.add_argument("--full", action="store_true", help="more steps; the default")
    parser.add_argument(
        "--devices", default="auto", help="cpu,cuda,... (default: cpu + cuda where visible)"
    )
    parser.add_argument("--batch-sizes", type=int_list, default=[4, 64, 256, 1024, 4096])
    parser.add_argument(
        "--hidden-sizes", type=int_list, default=[128, 512, 2048], help="crossover study"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("results/bench.json"),
        help="crossover files go next to it",
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI or the project's mlflow.db",
    )
    parser.add_argument(
        "--whole-steps",
        type=int,
        default=None,
        help="steps of each whole-process run (quick: 500, full: 3000)",
    )
    parser.add_argument(
        "--whole-pairs",
        type=int,
        default=None,
        help="alternating rounds of whole-process runs (quick: 1, full: 3)",
    )
    parser.add_argument(
        "--whole-with",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="one more whole-process row: reprotrain with these overrides (separated by "
        "spaces), e.g. --whole-with tracking.log_model=false; repeat for more rows",
    )
    parser.add_argument(
        "--crossover",
        action="store_true",
        help="also run the CPU-vs-GPU crossover study (on in --full)",
    )
    parser.add_argument(
        "--crossover-only", action="store_true", help="run only the crossover study"
    )
    parser.add_argument("--no-dvc", action="store_true", help="skip timing `dvc repro`")
    parser.add_argument(
        "--no-fastpaths", action="store_true", help="skip measuring each fast path on and off"
    )
    return parser.parse_args(argv)


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 4,64,256")
    return values


def choose_devices(spec: str) -> list[torch.device]:
    """`auto`: cpu plus cuda where visible. A device named explicitly must exist."""
    if spec == "auto":
        return [torch.device("cpu")] + (
            [resolve_device("cuda")] if torch.cuda.is_available() else []
        )
    return [resolve_device(kind.strip()) for kind in spec.split(",") if kind.strip()]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    devices = choose_devices(args.devices)
    uri = args.tracking_uri or default_tracking_uri()
    check_store(uri, 5.0)
    prepare_store(uri)
    os.environ.pop(RUN_ID_ENV, None)  # every run below is created here, none is handed in
    set_threads("auto")
    seed_everything(SEED, True, devices[-1])  # as runtime.local.run does: same for every variant
    crossover = args.crossover or args.crossover_only or plan is FULL
    no_gpu = gpu_absence(devices)
    settings = bench_settings(args, plan, devices, crossover)
    out_dir = args.json.parent
    with TrackedRun(
        uri, EXPERIMENT, f"bench-{plan.mode}", run_tags(devices), flatten(settings)
    ) as run:
        report: dict[str, Any] = {
            "schema": 1,
            "settings": settings,
            "absent": [f"cuda: {no_gpu}"] if no_gpu else [],
            "devices": {},
            "machine": {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "cuda": torch.version.cuda or "none",
                "devices": {d.type: describe_device(d).name for d in devices},
            },
        }
        dataset = bench_dataset(max(args.batch_sizes))
        with tempfile.TemporaryDirectory(prefix="reprotrain-bench-") as scratch:
            workdir = Path(scratch)
            if not args.crossover_only:
                for device in devices:
                    report["devices"][device.type] = measure_device(
                        device, args.batch_sizes, plan, dataset, workdir, say
                    )
                if not args.no_fastpaths:
                    report["fastpaths"] = {
                        device.type: fastpath_study(
                            device,
                            dataset,
                            fastpath_batches(args.batch_sizes),
                            plan.steps,
                            plan.warmup,
                            plan.fastpath_pairs,
                            say,
                        )
                        for device in devices
                    }
                report["targets"] = check_targets(report["devices"])
                say("start-up of python -m reprotrain.train ...")
                report["startup"] = startup_time(plan.startup_repeats, workdir)
                steps = args.whole_steps or plan.whole_steps
                say(f"whole process: the lesson's script and reprotrain, {steps} steps")
                report["whole_process"] = whole_process(
                    steps,
                    WHOLE_BATCH,
                    args.whole_pairs or plan.whole_pairs,
                    workdir,
                    args.whole_with,
                )
                say(f"data-parallel scaling: 1 and {SCALING_PROCESSES} processes under torchrun")
                report["scaling"] = [
                    scaling(device, scaling_processes(device), steps, WHOLE_BATCH, workdir)
                    for device in devices
                ]
                report["dvc"] = dvc_repro_time(plan.dvc_repeats, not args.no_dvc)
            if crossover:
                study = crossover_study(
                    devices, args.batch_sizes, args.hidden_sizes, plan, dataset, say
                )
                names = report["machine"]["devices"]
                study["files"] = {
                    "plot": str(write_crossover_plot(study, out_dir / "crossover.png")),
                    "table": str(
                        write_text(out_dir / "crossover.md", crossover_markdown(study, names))
                    ),
                }
                report["crossover"] = study
                log_crossover_children(run, study)
        report["peak_rss_mb"] = peak_rss_mb()
        report["mlflow"] = {"tracking_uri": uri, "experiment": EXPERIMENT, "run_id": run.run_id}
        report = without_nan(report)
        write_json(args.json, report)
        record(run, report, args.json)
    print(format_report(report), flush=True)
    print(f"\nwrote {args.json}; MLflow run {run.run_id} in {EXPERIMENT} at {uri}", flush=True)
    return report


def fastpath_batches(batch_sizes: list[int]) -> list[int]:
    """The fast paths at batch 64 (a small step, where overheads show) and the largest batch."""
    chosen = [b for b in (64, max(batch_sizes)) if b in batch_sizes]
    return sorted(set(chosen)) or [batch_sizes[0]]


def bench_settings(
    args: argparse.Namespace, plan: Plan, devices: list[torch.device], crossover: bool
) -> dict[str, Any]:
    """What was asked for: the run's params and bench.json's `settings`."""
    return {
        "mode": plan.mode,
        "devices": [str(d) for d in devices],
        "batch_sizes": args.batch_sizes,
        "warmup_steps": plan.warmup,
        "measured_steps": {str(b): plan.steps(b) for b in args.batch_sizes},
        "model": f"MLP 784-{HIDDEN}-10, ReLU, CrossEntropy",
        "optimizer": f"AdamW lr {LR:g}",
        "log_every": LOG_EVERY,
        "num_samples": samples_for(max(args.batch_sizes)),
        "torch_threads": torch.get_num_threads(),
        "crossover": crossover,
        "hidden_sizes": args.hidden_sizes if crossover else [],
        "crossover_only": args.crossover_only,
        "fastpaths": not args.no_fastpaths,
        "fastpath_batch_sizes": fastpath_batches(args.batch_sizes),
        "fastpath_pairs": plan.fastpath_pairs,
        "whole_with": args.whole_with,
    }


def run_tags(devices: list[torch.device]) -> dict[str, str]:
    commit, dirty = git_state(find_root())
    return {
        **describe_device(devices[-1]).as_tags(),
        "git.commit": commit,
        "git.dirty": dirty,
        "mlflow.source.name": "reprotrain.bench",
    }


def say(line: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
