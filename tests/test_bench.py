"""The benchmark: complete, self-consistent results, variants that differ only in overhead, and
fast paths that keep the math.

No assertion here is about speed: timings depend on the machine. The tests check that every
figure is measured, that every ratio is the quotient it claims to be, that the record lands in
MLflow, that every variant starts from the same weights and walks the same batches, that the
fast paths give the plain path's losses, and that the core never imports the benchmark.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import PYTHON, ROOT, Store, child_env, require_cuda
from reprotrain.bench.fastpath import SWITCHES
from reprotrain.bench.measure import FLOPS_RATIO, RATIOS, VARIANTS
from reprotrain.bench.reference import bench_config, bench_dataset, reference_batches
from reprotrain.bench.report import TARGETS
from reprotrain.bench.startup import WHOLE_PHASES, timed_process
from reprotrain.bench.variants import (
    course_loop,
    lightning_batches,
    lightning_or_reason,
    reprotrain_step,
)
from reprotrain.data import make_batches
from reprotrain.fastpaths import compiler_missing

CPU = torch.device("cpu")
STEPS, WARMUP = 20, 2
# torch's FlopCounterMode on the reference MLP (784 -> 512 -> 10), per sample: the forward's
# two matmuls, then backward's weight gradients of both layers and the input gradient of the
# second (the data needs none): 2 * (784*512*2 + 512*10*3).
REFERENCE_TRAIN_FLOPS = 2 * (784 * 512 * 2 + 512 * 10 * 3)


def bench(tmp_path: Path, store: Store, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "out" / "bench.json"
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "reprotrain.bench",
            "--quick",
            "--json",
            str(out),
            "--tracking-uri",
            store.uri,
            "--no-dvc",
            *args,
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def measured_number(device: dict[str, Any], variants: dict[str, Any], name: str) -> float:
    """'b.samples_per_s' -> the b variant's samples/s; 'matmul.flops_per_s' -> the device's."""
    owner, key = name.split(".")
    return device["matmul"][key] if owner == "matmul" else variants[owner][key]


def check_device(device: dict[str, Any], batch_sizes: list[int]) -> None:
    assert positive(device["matmul"]["flops_per_s"])
    assert all(positive(size["flops_per_s"]) for size in device["matmul"]["sizes"].values())
    assert sorted(device["batches"], key=int) == [str(b) for b in batch_sizes]
    for entry in device["batches"].values():
        variants = entry["variants"]
        assert set(variants) == set(VARIANTS)
        for variant in variants.values():
            assert positive(variant["step_ms_median"]) and positive(variant["samples_per_s"])
            assert positive(variant["train_flops_per_s"]) and positive(variant["peak_rss_mb"])
            assert variant["measured_steps"] == entry["measured_steps"]  # the same for all
        assert set(entry["ratios"]) == {name for name, _, _ in RATIOS} | {FLOPS_RATIO}
        for ratio in entry["ratios"].values():
            top = measured_number(device, variants, ratio["numerator"])
            bottom = measured_number(device, variants, ratio["denominator"])
            assert ratio["value"] == pytest.approx(top / bottom, rel=1e-12)


def check_fastpaths(study: dict[str, Any], batch_sizes: list[int], device: str = "cpu") -> None:
    """Every switch is measured or skipped with a reason, and each figure is what it claims."""
    assert sorted(study, key=int) == [str(b) for b in batch_sizes]
    for rows in study.values():
        assert [row["name"] for row in rows] == [switch.name for switch in SWITCHES]
        for row, switch in zip(rows, SWITCHES, strict=True):
            if device not in switch.devices:
                assert row["skipped"] == f"not available on {device}"
                continue
            if "skipped" in row:  # only torch.compile may lack a compiler, and says which
                assert switch.name == "torch.compile" and "cannot build kernels" in row["skipped"]
                continue
            assert positive(row["with_samples_per_s"]) and positive(row["without_samples_per_s"])
            assert len(row["speedups"]) == row["pairs"]
            assert row["speedup"] == pytest.approx(statistics.median(row["speedups"]), rel=1e-12)
            if row["pairs"] == 1:
                assert row["speedup"] == pytest.approx(
                    row["with_samples_per_s"] / row["without_samples_per_s"], rel=1e-12
                )
            if row["same_math"]:  # the same arithmetic: float rounding at most
                assert row["max_loss_diff"] <= 1e-5, row
            else:  # bf16 is visibly different, but it still trains the same model
                assert 0 < row["max_loss_diff"] < 0.05, row


def run_metric_keys_cover_fastpaths(store: Store, report: dict[str, Any]) -> bool:
    metrics = store.client.get_run(report["mlflow"]["run_id"]).data.metrics
    row = report["fastpaths"]["cpu"]["64"][0]
    return metrics["cpu/b64/fastpath/fused_adamw/speedup"] == pytest.approx(row["speedup"])


def test_quick_bench_measures_every_variant_and_records_the_run(
    tmp_path: Path, store: Store
) -> None:
    stdout, report = bench(
        tmp_path,
        store,
        "--batch-sizes",
        "4,64",
        "--whole-steps",
        "100",  # the whole-process rows: each a real process; the steps only add loop time
        "--whole-with",
        "tracking.enabled=false",
    )
    assert report["settings"]["mode"] == "quick" and report["settings"]["batch_sizes"] == [4, 64]
    assert "cpu" in report["devices"]
    for device in report["devices"].values():
        check_device(device, [4, 64])
    assert report["devices"]["cpu"]["train_flops_per_sample"] == REFERENCE_TRAIN_FLOPS

    targets = {(t["ratio"], t["batch_size"]): t for t in report["targets"]}
    assert len(targets) == len(TARGETS)
    for (ratio, batch), target in targets.items():
        if batch in (4, 64):
            assert target["status"] in ("PASS", "MISS")
            measured = report["devices"]["cpu"]["batches"][str(batch)]["ratios"][ratio]["value"]
            assert target["value"] == measured
            assert (target["status"] == "PASS") == (measured >= target["threshold"])
        else:
            assert target["status"] == "NOT MEASURED"  # 256 and 4096 were not in --batch-sizes

    check_fastpaths(report["fastpaths"]["cpu"], [64])
    assert "fast paths on cpu" in stdout
    assert run_metric_keys_cover_fastpaths(store, report)

    assert positive(report["startup"]["median_s"]) and len(report["startup"]["runs_s"]) == 1
    assert report["dvc"] == {"skipped": "--no-dvc"}
    whole = report["whole_process"]  # the lesson's script and reprotrain.train, one pair
    assert whole["steps"] == 100 and whole["batch_size"] == 64 and whole["pairs"] == 1
    assert "lesson_script.py --steps=100" in whole["commands"]["lesson"]
    assert "reprotrain.train device=cpu" in whole["commands"]["reprotrain"]
    for name in ("lesson", "reprotrain"):
        assert positive(whole["median_s"][name]) and positive(whole["peak_rss_mb"][name])
        assert positive(whole["median_cpu_s"][name])
    assert whole["cores"] == len(os.sched_getaffinity(0))
    assert re.search(
        r"on \d+ cores the least wall time that work could take is \d+\.\d\d s", stdout
    )
    reprotrain_s, lesson_s = whole["wall_s"]["reprotrain"][0], whole["wall_s"]["lesson"][0]
    assert whole["median_ratio"] == pytest.approx(reprotrain_s / lesson_s)
    # --whole-with: one more row, the same command with the overrides added; without
    # tracking no worker is started, so the row's peak RSS is the training process's alone.
    untracked = "reprotrain tracking.enabled=false"
    assert whole["variants"] == ["tracking.enabled=false"]
    assert (
        whole["commands"][untracked] == whole["commands"]["reprotrain"] + " tracking.enabled=false"
    )
    assert whole["peak_rss_mb"][untracked] < whole["peak_rss_mb"]["reprotrain"], whole
    assert whole["row_ratios"][untracked] == pytest.approx(whole["wall_s"][untracked][0] / lesson_s)
    assert re.search(r"reprotrain tracking\.enabled=false +\d+\.\d\d +\d+\.\d\d ", stdout)
    assert re.search(
        r"reprotrain / lesson wall time: \d+\.\d\d .*target <= 0\.8: (met|missed)", stdout
    )
    # Where each reprotrain row's wall time went, from its run.json: every part a real span
    # (the run's own clocks claim no more than the wall time measured around the process),
    # and for the one round, the parts are that round's wall time.
    assert set(whole["phases_s"]) == {"reprotrain", untracked}
    for name, split in whole["phases_s"].items():
        assert set(split) == set(WHOLE_PHASES)
        assert all(len(seconds) == 1 and seconds[0] >= 0 for seconds in split.values()), split
        assert positive(split["startup"][0]) and positive(split["loop"][0])
        total = sum(seconds[0] for seconds in split.values())
        assert total == pytest.approx(whole["wall_s"][name][0])
    assert re.search(r"where reprotrain's wall time went", stdout)
    assert re.search(r"reprotrain tracking\.enabled=false(  +\d+\.\d\d){5}$", stdout, re.M)
    (scaled,) = report["scaling"]  # 1 and 2 gloo processes under torchrun, batch 64 each
    assert scaled["device"] == "cpu" and scaled["processes"] == 2
    one, two = scaled["samples_per_s"]["1"], scaled["samples_per_s"]["2"]
    assert positive(one) and positive(two)
    assert scaled["efficiency"] == pytest.approx(two / (2 * one))
    assert "data-parallel scaling on cpu" in stdout
    assert "crossover" not in report
    for heading in ("ms/step", "samples/s", "ratios", "targets", "start-up"):
        assert heading in stdout
    assert re.search(r"cpu batch 64 +b/c +\d+\.\d+ +>= 0\.97 +(PASS|MISS)", stdout)

    run = store.client.get_run(report["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert store.client.get_experiment(run.info.experiment_id).name == "reprotrain-bench"
    assert "bench.json" in {a.path for a in store.client.list_artifacts(run.info.run_id)}
    b64 = report["devices"]["cpu"]["batches"]["64"]
    assert run.data.metrics["cpu/b64/b/samples_per_s"] == pytest.approx(
        b64["variants"]["b"]["samples_per_s"]
    )
    assert run.data.metrics["cpu/b64/ratio/b_over_c"] == pytest.approx(
        b64["ratios"]["b/c"]["value"]
    )
    assert run.data.params["mode"] == "quick"
    for name in ("lesson", "reprotrain"):
        assert run.data.metrics[f"whole/{name}_s"] == pytest.approx(whole["median_s"][name])
        assert run.data.metrics[f"whole/{name}_cpu_s"] == pytest.approx(whole["median_cpu_s"][name])
    assert run.data.metrics["whole/reprotrain_tracking.enabled_false_ratio"] == pytest.approx(
        whole["row_ratios"][untracked]
    )


def test_a_whole_process_cpu_time_counts_the_children_it_waited_for(tmp_path: Path) -> None:
    """The whole-process row's CPU time is the kernel's account of the process and of every
    child it waited for (reprotrain's tracking worker is one): a parent that only waits for a
    child burning ~0.6 s of CPU is charged that time, and its wall time covers it."""
    burn = "import time; end = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    timed = timed_process([sys.executable, "-c", parent], tmp_path, child_env())
    assert timed.failed == ""
    assert timed.cpu_s >= 0.6 and timed.wall_s >= 0.6, timed
    assert positive(timed.peak_rss_mb)
    failing = timed_process([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, child_env())
    assert failing.failed.startswith("exited 3"), failing


def test_crossover_cpu_half_writes_plot_and_table_and_says_gpu_half_is_absent(
    tmp_path: Path, store: Store
) -> None:
    stdout, report = bench(
        tmp_path,
        store,
        "--crossover-only",
        "--devices",
        "cpu",
        "--batch-sizes",
        "4,16",
        "--hidden-sizes",
        "16,32",
    )
    study = report["crossover"]
    assert study["gpu_absent"]  # no cuda among the devices: said, not faked
    assert "GPU half absent" in stdout
    assert len(study["points"]) == 4
    for point in study["points"]:
        assert point["device"] == "cpu" and positive(point["samples_per_s"])
        assert point["copy_share"] is None
    assert study["crossover"] == {"16": None, "32": None}

    plot, table = Path(study["files"]["plot"]), Path(study["files"]["table"])
    assert plot.parent == tmp_path / "out" and table.parent == tmp_path / "out"
    assert plot.read_bytes().startswith(b"\x89PNG")
    text = table.read_text()
    assert "GPU half absent" in text and "not measured (GPU half absent)" in text
    assert text.count("| cpu |") == 4

    parent = report["mlflow"]["run_id"]
    runs = store.runs("reprotrain-bench")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    assert all(positive(r.data.metrics["samples_per_s"]) for r in children)
    artifacts = {a.path for a in store.client.list_artifacts(parent)}
    assert {"bench.json", "crossover.png", "crossover.md"} <= artifacts


def test_cuda_requested_without_gpu_fails_with_hint(tmp_path: Path, store: Store) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the request can be met")
    result = subprocess.run(
        [PYTHON, "-m", "reprotrain.bench", "--quick", "--devices", "cpu,cuda"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "device=cuda was requested" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- the variants differ in overhead only


@pytest.fixture(scope="module")
def dataset():
    return bench_dataset(64)


def test_every_variant_walks_the_same_batches(dataset) -> None:
    """a's host batches, b's and c's (resident, or streamed by the DataLoader) and d's loader,
    across an epoch boundary, where the next epoch_order takes over."""
    total = len(dataset.train) // 64 + 3
    expected = list(reference_batches(dataset, 64, CPU).take(total))
    streams = {
        "b, c resident": make_batches(
            dataset.train, bench_config(CPU, 64, total, 0, resident="true").train, CPU
        ).take(total),
        "b, c streamed": make_batches(
            dataset.train, bench_config(CPU, 64, total, 0, resident="false").train, CPU
        ).take(total),
        "d": lightning_batches(dataset, 64, total),
    }
    assert not torch.equal(expected[0][1], expected[-3][1])  # a new epoch, a new order
    for name, stream in streams.items():
        batches = list(stream)
        assert len(batches) == total, name
        for step, ((x, y), (want_x, want_y)) in enumerate(zip(batches, expected, strict=True)):
            assert torch.equal(x, want_x) and torch.equal(y, want_y), f"{name}, step {step + 1}"


def test_lightning_gives_the_course_loop_losses(dataset, tmp_path: Path) -> None:
    """d starts from a's weights and walks a's batches with the same (default) AdamW."""
    pytest.importorskip("lightning", reason="the `bench` extra (lightning) is not installed")
    uri = f"sqlite:///{tmp_path / 'lightning.db'}"
    uri_before = os.environ.get("MLFLOW_TRACKING_URI")
    entry, lightning = lightning_or_reason(CPU, dataset, 64, STEPS, WARMUP, uri, tmp_path)
    assert os.environ.get("MLFLOW_TRACKING_URI") == uri_before  # MLFlowLogger's, put back
    _, course = course_loop(CPU, dataset, 64, STEPS, WARMUP)
    assert entry["measured_steps"] == STEPS - WARMUP and len(lightning) == STEPS
    assert lightning[0] == course[0]  # same weights, same first batch
    torch.testing.assert_close(lightning, course, rtol=1e-5, atol=1e-6)


def test_the_core_never_imports_the_benchmark() -> None:
    """Every module outside reprotrain.bench imports without pulling the benchmark in."""
    code = (
        "import importlib, pathlib, sys, reprotrain\n"
        "root = pathlib.Path(reprotrain.__file__).parent\n"
        "for path in sorted(root.rglob('*.py')):\n"
        "    parts = path.relative_to(root).with_suffix('').parts\n"
        "    if parts[0] == 'bench' or parts[-1] == '__main__':\n"
        "        continue\n"
        "    parts = parts[:-1] if parts[-1] == '__init__' else parts\n"
        "    importlib.import_module('.'.join(('reprotrain', *parts)))\n"
        "print(sum(name.startswith('reprotrain.') for name in sys.modules))\n"
        "print(sorted(name for name in sys.modules if name.startswith('reprotrain.bench')))\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported, bench_modules = result.stdout.strip().splitlines()
    assert int(imported) > 20  # the core really was imported
    assert bench_modules == "[]"


# ---------------------------------------------------------------- the fast paths keep the math


def test_fused_adamw_gives_the_default_adamw_losses(dataset) -> None:
    fused, fused_losses = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, fused=True)
    plain, plain_losses = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, fused=False)
    assert len(fused_losses) == len(plain_losses) == STEPS
    assert fused_losses[0] == plain_losses[0]  # same weights, same first batch
    torch.testing.assert_close(fused_losses, plain_losses, rtol=1e-5, atol=1e-6)


def test_reprotrain_step_gives_the_course_loop_losses(dataset) -> None:
    _, course = course_loop(CPU, dataset, 64, STEPS, WARMUP)  # default AdamW, .item() per step
    _, ours = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP)  # fused AdamW, batched reads
    torch.testing.assert_close(ours, course, rtol=1e-5, atol=1e-6)


def test_resident_batches_give_the_copied_batches_losses(dataset) -> None:
    _, resident = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, resident="true")
    _, copied = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, resident="false")
    assert resident == copied


@pytest.mark.gpu
def test_resident_batches_give_the_copied_batches_losses_on_cuda(dataset) -> None:
    require_cuda()
    cuda = torch.device("cuda")
    kept, resident = reprotrain_step(cuda, dataset, 64, STEPS, WARMUP, resident="true")
    moved, copied = reprotrain_step(cuda, dataset, 64, STEPS, WARMUP, resident="false")
    assert kept["resident_data"] and not moved["resident_data"]
    torch.testing.assert_close(resident, copied, rtol=1e-6, atol=1e-7)


def test_compiled_step_gives_the_eager_losses(dataset) -> None:
    if compiler_missing():
        pytest.skip(f"torch.compile cannot build kernels here: {compiler_missing()}")
    _, compiled = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, train_options={"compile": True})
    _, eager = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP)
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6)  # same weights, same first batch
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


LOW_BF16 = {"precision": "bf16", "deterministic": False}  # deterministic mode keeps exact fp32


def test_bf16_autocast_changes_the_losses_only_by_rounding(dataset) -> None:
    _, bf16 = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, train_options=LOW_BF16)
    _, fp32 = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP)
    assert bf16 != fp32  # autocast really ran in bf16
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_and_tf32_steps_on_cuda(dataset) -> None:
    require_cuda()
    cuda = torch.device("cuda")
    _, eager = reprotrain_step(cuda, dataset, 64, STEPS, WARMUP)
    _, graphed = reprotrain_step(
        cuda, dataset, 64, STEPS, WARMUP, train_options={"cuda_graphs": True}
    )
    assert len(graphed) == STEPS and graphed[:3] == eager[:3]  # eager warm-up steps
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    _, tf32 = reprotrain_step(
        cuda, dataset, 64, STEPS, WARMUP, train_options={"tf32": True, "deterministic": False}
    )
    torch.testing.assert_close(tf32, eager, rtol=1e-2, atol=1e-2)


def test_log_every_does_not_change_the_losses(dataset) -> None:
    _, every_step = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, log_every=1)
    _, every_25 = reprotrain_step(CPU, dataset, 64, STEPS, WARMUP, log_every=25)
    assert every_step == every_25


# ---------------------------------------------------------------- the other entry points


def test_tracking_overhead_script_prints_the_cost_of_each_cadence(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            PYTHON,
            str(ROOT / "benchmarks" / "tracking_overhead.py"),
            "--quick",
            "--loss-every",
            "1,5",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"untracked: +[\d,]+ samples/s, \d+\.\d{3} ms/step", result.stdout), (
        result.stdout
    )
    costs = re.findall(
        r"train/loss every +(\d+) step\(s\): costs -?\d+\.\d% of training time", result.stdout
    )
    assert costs == ["1", "5"], result.stdout  # one figure per cadence asked for


def run_length(cwd: Path, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/run_length.py ARGS`, run in `cwd`."""
    return subprocess.run(
        [PYTHON, str(ROOT / "benchmarks" / "run_length.py"), *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_length_script_prints_each_pair_and_the_medians(tmp_path: Path) -> None:
    """benchmarks/run_length.py, at its smallest: each run's figures are the quotients it
    says of that run.json, the table has a row per run, nothing is left in the folder."""
    out = tmp_path / "run_length.json"
    sizes = ("--steps", "30,60", "--pairs", "1", "--json", str(out))
    result = run_length(tmp_path, *sizes, "train.threads=1", "train.warmup_steps=5", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    (pair,) = summary["pairs"]
    for figures in pair.values():
        assert all(positive(figures[key]) for key in ("samples_per_s", "per_speed", "phase_share"))
        assert 0 <= figures["checkpoint_share"] < 1
    ratio = pair["30"]["per_speed"] / pair["60"]["per_speed"]
    assert summary["ratios"] == [pytest.approx(ratio)] and summary["median_ratio"] == ratio
    rows = re.findall(
        r"^ +1 +(30|60) +\d+ +\d+\.\d{3} +\d+\.\d{3} +\d+\.\d{4}$", result.stdout, re.M
    )
    assert rows == ["30", "60"], result.stdout
    assert f"30 over 60 steps: {ratio:.3f}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_length.json"]
    bad = run_length(tmp_path, "--steps", "3000,300", timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[-1].endswith("try --steps 300,3000")


def worker_start(cwd: Path, rounds: int, timeout: int) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/worker_start.py --rounds ROUNDS`, run in `cwd`."""
    return subprocess.run(
        [PYTHON, str(ROOT / "benchmarks" / "worker_start.py"), "--rounds", str(rounds)],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_worker_start_script_times_each_link_against_the_training_start_up(
    tmp_path: Path,
) -> None:
    result = worker_start(tmp_path, rounds=1, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    links = re.findall(r"^  (.+?) +(\d+\.\d\d) +(\d+\.\d\d)$", result.stdout, re.M)
    assert [name for name, _, _ in links] == [
        "import reprotrain's tracking modules",
        "import MLflow",
        "open the store",
        "import torch",
        "import mlflow.pytorch",
        "first export (torch.export, MLflow's requirements check)",
    ], result.stdout
    running = 0.0
    for _, seconds, total in links:  # each a real span; the last column adds them up
        assert float(seconds) >= 0
        running += float(seconds)
        assert float(total) == pytest.approx(running, abs=0.02)
    # The links that do work (imports of big packages, an export) take time of their own.
    assert all(float(seconds) > 0 for name, seconds, _ in links if "MLflow" in name), links
    ready = float(re.search(r"worker ready after: (\d+\.\d\d) s", result.stdout)[1])
    startup = float(re.search(r"start-up alone .*: (\d+\.\d\d) s", result.stdout)[1])
    left = float(re.search(r"left over .*: (\d+\.\d\d) s", result.stdout)[1])
    assert ready == pytest.approx(running, abs=0.02) and startup > 0
    assert left == pytest.approx(max(ready - startup, 0.0), abs=0.02)
    assert list((tmp_path).iterdir()) == []  # its store and scratch folders are removed
    none = worker_start(tmp_path, rounds=0, timeout=60)
    assert none.returncode == 2 and "Traceback" not in none.stderr
    assert none.stderr.splitlines()[-1].endswith(
        "--rounds 0: at least 1 round is needed; try --rounds 3"
    )


def test_crossover_preset_runs_as_a_multirun_under_one_parent(tmp_path: Path, store: Store) -> None:
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "reprotrain.train",
            "--multirun",
            "experiment=crossover",
            "device=cpu",
            "train.batch_size=4,8",
            "model.hidden_size=16",
            "train.steps=12",
            "train.warmup_steps=2",
            f"tracking.uri={store.uri}",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = store.runs("reprotrain-crossover")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.params["train.batch_size"] for r in children) == ["4", "8"]
    assert all(r.data.params["train.steps"] == "12" for r in children)


@pytest.mark.gpu
def test_quick_bench_on_cuda_measures_both_halves(tmp_path: Path, store: Store) -> None:
    require_cuda()
    _, report = bench(
        tmp_path,
        store,
        "--devices",
        "cpu,cuda",
        "--batch-sizes",
        "4,64",
        "--crossover",
        "--hidden-sizes",
        "16,512",
    )
    for device in ("cpu", "cuda"):
        check_device(report["devices"][device], [4, 64])
        check_fastpaths(report["fastpaths"][device], [64], device)
    cuda64 = report["devices"]["cuda"]["batches"]["64"]["variants"]
    assert all(positive(variant["cuda_peak_mb"]) for variant in cuda64.values())
    study = report["crossover"]
    assert study["gpu_absent"] is None
    shares = [p["copy_share"] for p in study["points"] if p["device"] == "cuda"]
    assert len(shares) == 4 and all(0 <= share < 1 for share in shares)
    for found in study["crossover"].values():
        assert found == "none in range" or found in (4, 64)
