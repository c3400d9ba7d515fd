"""The benchmarks in benchmarks/: each runs end to end at its smallest size, and what it prints
is what its --json holds; the comparison is fair (the Lightning script trains the lesson's
model to the lesson's losses); the package carries no benchmark code.

No assertion here is about speed: timings depend on the machine. Whether reprotrain's fast
paths keep the math is tests/test_fastpaths.py. A script that measures or starts processes runs
as a user runs it (e2e); the rest call their main() in this process.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from conftest import PYTHON, ROOT, InProcess, Store, child_env, require_cuda

BENCHMARKS = ROOT / "benchmarks"


def script(cwd: Path, name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME ARGS`, run in `cwd` as a user runs it."""
    return subprocess.run(
        [PYTHON, str(BENCHMARKS / name), *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py, loaded from its path (benchmarks/ is not a package; its scripts
    import each other as `python benchmarks/NAME.py` lets them)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def harness() -> ModuleType:
    return benchmark("harness")


def loss_csv(path: Path) -> list[float]:
    with path.open() as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


# ---------------------------------------------------------------- compare.py


def check_round(entry: dict[str, Any]) -> None:
    """Every figure measured, and every ratio the quotient (or difference) it says it is."""
    rows, ratios = entry["rows"], entry["ratios"]
    assert sorted(entry["order"]) == sorted(rows)
    for name, figures in rows.items():
        assert all(positive(figures[key]) for key in ("wall_s", "cpu_s", "peak_rss_mb")), name
        if name.startswith(("reprotrain", "untracked")):
            assert all(positive(figures[key]) for key in ("samples_per_s", "startup_s")), name
            assert ratios[f"{name} / untracked samples/s"] == pytest.approx(
                figures["samples_per_s"] / rows["untracked"]["samples_per_s"]
            )
        assert ratios[f"{name} / lesson wall"] == pytest.approx(
            figures["wall_s"] / rows["lesson"]["wall_s"]
        )
    ours = rows["reprotrain"]
    assert ratios["in_loop"] == ratios["reprotrain / untracked samples/s"]
    assert ratios["wall_vs_lesson"] == ratios["reprotrain / lesson wall"]
    assert ratios["wall_vs_lightning"] == pytest.approx(
        ours["wall_s"] / rows["lightning"]["wall_s"]
    )
    assert ratios["rss_above_lesson_mb"] == pytest.approx(
        ours["peak_rss_mb"] - rows["lesson"]["peak_rss_mb"]
    )
    assert ratios["startup_s"] == ours["startup_s"]


@pytest.mark.e2e  # the comparison measures whole processes
def test_compare_prints_every_row_and_the_targets_its_json_holds(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the `bench` extra (lightning) is not installed")
    out = tmp_path / "results" / "compare.json"
    sizes = ("--quick", "--pairs", "1", "--steps", "40", "--json", str(out))
    done = script(tmp_path, "compare.py", *sizes, "--with", "tracking.loss_every=10")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    extra = "reprotrain tracking.loss_every=10"
    assert list(result["commands"]) == ["lesson", "reprotrain", "untracked", "lightning", extra]
    commands = result["commands"]
    assert commands["lesson"].startswith("python benchmarks/lesson.py --steps 40 --batch-size 64")
    assert commands["reprotrain"].startswith("python -m reprotrain.train runtime=local device=cpu")
    assert commands["reprotrain"].endswith("tracking.loss_every=1")
    assert commands["untracked"].endswith("tracking.loss_every=1 tracking.enabled=false")
    assert commands["lightning"].startswith("python benchmarks/lesson_lightning.py --steps 40")
    assert commands[extra].endswith("tracking.loss_every=10")
    assert result["settings"] == {
        "steps": 40,
        "batch_size": 64,
        "pairs": 1,
        "device": "cpu",
        "with": ["tracking.loss_every=10"],
    }
    assert result["skipped"] == {} and result["git"]["commit"]

    (only,) = result["rounds"]
    check_round(only)
    median = result["median"]  # of one round: that round's figures
    assert median["ratios"] == only["ratios"]
    assert median["rows"] == only["rows"]

    printed = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    for name in result["commands"]:
        wall = f"{median['rows'][name]['wall_s']:.2f}"
        assert re.match(rf"{re.escape(name)} +{re.escape(wall)} ", printed[name]), printed
    keys = ["in_loop", "wall_vs_lesson", "wall_vs_lightning", "rss_above_lesson_mb", "startup_s"]
    assert [t["key"] for t in result["targets"]] == keys
    for target in result["targets"]:
        value, (op, threshold) = target["value"], target["target"].split()
        assert value == only["ratios"][target["key"]] and target["per_round"] == [value]
        assert target["met"] == (
            value >= float(threshold) if op == ">=" else value <= float(threshold)
        )
        shown = format(value, target["format"])
        word = "met" if target["met"] else "MISSED"
        line = printed[target["what"]]
        assert re.search(rf" {re.escape(shown)} +{op} {threshold} +{word} ", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # scratch removed


def test_compare_says_what_was_wrong_with_its_arguments_in_one_line(here: InProcess) -> None:
    compare = benchmark("compare")
    done = here.call(lambda: compare.main(["--pairs", "0"]))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith("'0': give an integer >= 1")


@pytest.mark.e2e  # the check asks a Python process of its own for the device
def test_compare_on_a_device_that_is_not_here_fails_before_any_run(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the request can be met")
    done = script(tmp_path, "compare.py", "--device", "cuda", "--quick", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--device cuda" in done.stderr and "fix:" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.gpu
def test_compare_on_cuda_measures_every_row(tmp_path: Path) -> None:
    require_cuda()
    out = tmp_path / "compare.json"
    done = script(
        tmp_path, "compare.py", "--device", "cuda", "--quick", "--steps", "40", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "device=cuda" in result["commands"]["reprotrain"]
    check_round(result["rounds"][0])


@pytest.mark.e2e  # it measures processes it starts
def test_measure_counts_the_largest_process_and_the_cpu_time_of_every_descendant(
    tmp_path: Path,
) -> None:
    """A parent that waits for a child holding ~200 MB and burning ~0.5 s of CPU is charged
    both; a child its parent left behind is still counted (the helper reaps it)."""
    measure = harness().measure
    child = (
        "import time; data = b'x' * (200 << 20); end = time.process_time() + 0.5\n"
        "while time.process_time() < end: pass"
    )
    waits = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    figures = measure([sys.executable, "-c", waits], tmp_path)
    assert set(figures) == {"wall_s", "cpu_s", "peak_rss_mb"}
    assert figures["peak_rss_mb"] >= 200 and figures["cpu_s"] >= 0.5, figures
    assert figures["wall_s"] >= 0.5, figures
    leaves = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
    left = measure([sys.executable, "-c", leaves], tmp_path)
    assert left["peak_rss_mb"] >= 200 and left["cpu_s"] >= 0.5, left
    with pytest.raises(SystemExit, match=r"exited 3: boom"):
        measure(
            [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
            tmp_path,
        )


# ---------------------------------------------------------------- the reference scripts


def test_lesson_script_writes_its_weights_and_every_loss(tmp_path: Path, here: InProcess) -> None:
    lesson = benchmark("lesson")
    done = here.call(
        lambda: lesson.main(["--steps", "30", "--device", "cpu", "--loss-csv", "l.csv"])
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("epoch 1: loss ")
    losses = loss_csv(tmp_path / "l.csv")
    assert len(losses) == 30 and all(positive(loss) for loss in losses)
    weights = torch.load(tmp_path / "lesson_model.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        "layers.1.weight": (512, 784),
        "layers.1.bias": (512,),
        "layers.3.weight": (10, 512),
        "layers.3.bias": (10,),
    }


@pytest.mark.e2e  # the comparison's Lightning row, run as the comparison runs it
def test_lightning_script_gives_the_lesson_losses(tmp_path: Path) -> None:
    """The Lightning row trains the lesson's model from the same weights on the same batches
    with the same AdamW: what the comparison charges it for is Lightning, not other work."""
    pytest.importorskip("lightning", reason="the `bench` extra (lightning) is not installed")
    sizes = ("--steps", "20", "--device", "cpu")
    store = Store(tmp_path)
    lightning = script(
        tmp_path, "lesson_lightning.py", *sizes, "--tracking-uri", store.uri, "--loss-csv", "d.csv"
    )
    assert lightning.returncode == 0, lightning.stderr[-3000:]
    lesson = script(tmp_path, "lesson.py", *sizes, "--loss-csv", "a.csv")
    assert lesson.returncode == 0, lesson.stderr[-3000:]
    theirs, ours = loss_csv(tmp_path / "d.csv"), loss_csv(tmp_path / "a.csv")
    assert len(theirs) == len(ours) == 20 and theirs[0] == ours[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    (run,) = store.runs("lesson-lightning")  # its logger sent every step's loss
    assert len(store.client.get_metric_history(run.info.run_id, "train/loss")) == 20


def run_length(cwd: Path, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/run_length.py ARGS`, run in `cwd`."""
    return script(cwd, "run_length.py", *args, timeout=timeout)


@pytest.mark.e2e  # it times `python -m reprotrain.train` processes
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


def test_crossover_preset_runs_as_a_multirun_under_one_parent(
    store: Store, here: InProcess
) -> None:
    """The CPU-versus-GPU crossover study is the app's own sweep: one parent run, a child per
    point (scripts/gpu-check.sh runs it on both devices)."""
    result = here.app(
        "--multirun",
        "experiment=crossover",
        "device=cpu",
        "train.batch_size=4,8",
        "model.hidden_size=16",
        "train.steps=12",
        "train.warmup_steps=2",
        f"tracking.uri={here.prepare(store).uri}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = store.runs("reprotrain-crossover")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.params["train.batch_size"] for r in children) == ["4", "8"]
    assert all(r.data.params["train.steps"] == "12" for r in children)


# ---------------------------------------------------------------- the product carries none of it


def imported(path: Path) -> set[str]:
    """The modules a Python file imports (top level of each name: `a.b` for `from a.b import c`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_core_never_imports_the_benchmark() -> None:
    """The package has no benchmark module, and nothing in src/ imports benchmarks/."""
    assert importlib.util.find_spec("reprotrain.bench") is None
    assert not (ROOT / "src" / "reprotrain" / "bench").exists()
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")}
    for path in (ROOT / "src").rglob("*.py"):
        for name in imported(path):
            top = name.split(".")[0]
            assert top not in scripts and top != "benchmarks", f"{path} imports {name}"
            assert not name.startswith("reprotrain.bench"), f"{path} imports {name}"


def test_the_benchmarks_reach_reprotrain_only_through_its_command_line() -> None:
    """benchmarks/ imports no module of reprotrain: it runs `python -m reprotrain.train` and
    reads the run.json each run writes, so a rewrite of the core's insides cannot break it."""
    for path in BENCHMARKS.glob("*.py"):
        reached = {name for name in imported(path) if name.split(".")[0] == "reprotrain"}
        assert not reached, f"{path.name} imports {sorted(reached)}"
        assert "import reprotrain" not in path.read_text(), path.name  # nor in a -c string
