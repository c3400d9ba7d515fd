"""What a command costs before it does its work: --help, Tab completion and --cfg job answer
from conf/ alone (config_app.py) and print what the training app prints; a configured metric
is made when validation first uses it, so a run's first step waits for no torchmetrics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from conftest import BIN, PYTHON, ROOT, child_env, imported_modules
from reprotrain.config_app import prints_only
from reprotrain.errors import ConfigError
from reprotrain.metrics import ConfiguredMetric, build_metrics, compute

ACCURACY = {"_target_": "torchmetrics.classification.MulticlassAccuracy", "average": "micro"}
# What only a run needs: none of it is imported to print help or complete a word.
RUN_MODULES = ("reprotrain.cli", "reprotrain.trainer", "reprotrain.tracking", "mlflow")


def make(section: str, node: dict) -> object:
    return instantiate(node)


@pytest.mark.parametrize(
    ("argv", "answered_from_conf"),
    [
        (["--help"], True),
        (["model=cnn", "-h"], True),
        (["--multirun", "optimizer=adamw,sgd", "--help"], True),  # Hydra's help comes first
        (["--hydra-help"], True),
        (["--version"], True),
        (["-sc", "query=bash"], True),
        (["--shell-completion", "install=bash"], True),
        (["--info"], True),
        (["--info", "defaults"], True),
        (["--cfg", "job", "model=cnn"], True),
        (["model=cnn", "--cfg=job", "--resolve"], True),
        (["-c", "job"], True),
        (["--cfg", "hydra"], False),  # prints hydra.job.name, which names cli.py's module
        (["--cfg", "all"], False),
        ([], False),
        (["model=cnn", "train.steps=5"], False),
        (["--multirun", "optimizer=adamw,sgd"], False),
        (["--multirun", "--cfg", "job"], False),  # two commands: Hydra's own error
        (["--cfg", "job", "--info"], False),
        (["--experimental-rerun", "outputs/x/.hydra/config.pickle"], False),
    ],
)
def test_command_lines_hydra_answers_from_conf_alone_skip_the_training_app(
    argv: list[str], answered_from_conf: bool
) -> None:
    assert prints_only(argv) is answered_from_conf


@pytest.mark.parametrize(
    ("argv", "comp_line"),
    [
        (["--help"], None),
        (["--hydra-help"], None),
        (["--cfg", "job", "model=cnn", "optimizer.lr=0.1"], None),
        (["-sc", "query=bash"], "reprotrain-train optimizer="),
        (["-sc", "query=bash"], "reprotrain-train model=cnn train.st"),
        (["-sc", "install=bash"], None),
    ],
)
def test_the_script_prints_what_the_training_app_prints(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    comp_line: str | None,
) -> None:
    from reprotrain.cli import main as training_app
    from reprotrain.train import main as script

    monkeypatch.chdir(ROOT)
    if comp_line is not None:
        monkeypatch.setenv("COMP_LINE", comp_line)

    def printed(main: Callable[[], None]) -> str:
        monkeypatch.setattr(sys, "argv", ["reprotrain-train", *argv])
        try:
            main()
        except SystemExit as stop:
            assert stop.code in (None, 0)
        finally:
            GlobalHydra.instance().clear()
        return capsys.readouterr().out

    shown = printed(script)
    assert shown.strip()
    assert shown == printed(training_app)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("command", "comp_line"),
    [
        ([PYTHON, "-m", "reprotrain.train", "--help"], None),
        ([str(BIN / "reprotrain-train"), "-sc", "query=bash"], "reprotrain-train optimizer="),
    ],
    ids=["help", "completion"],
)
def test_help_and_tab_completion_import_nothing_a_run_needs(
    command: list[str], comp_line: str | None
) -> None:
    extra = {"PYTHONPROFILEIMPORTTIME": "1", **({"COMP_LINE": comp_line} if comp_line else {})}
    result = subprocess.run(
        command, cwd=ROOT, env=child_env(**extra), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()
    imported = set(imported_modules(result.stderr))
    assert "hydra" in imported
    for module in RUN_MODULES:
        assert module not in imported, module


def test_a_configured_metric_is_made_at_its_first_update() -> None:
    """Building a run's metrics imports no metric module; the first update makes the metric,
    which then counts as the torchmetrics object itself would."""
    metrics = build_metrics({"accuracy": ACCURACY}, 10, torch.device("cpu"), make)
    accuracy = metrics["accuracy"]
    assert isinstance(accuracy, ConfiguredMetric) and accuracy.built is None
    accuracy.reset()  # a metric not made yet holds nothing to reset
    assert accuracy.built is None

    predictions, targets = torch.eye(10)[[1, 2, 3, 3]], torch.tensor([1, 2, 3, 4])
    accuracy.update(predictions, targets)
    assert type(accuracy.built).__name__ == "MulticlassAccuracy"
    assert accuracy.built.num_classes == 10  # filled in from the data
    assert accuracy.higher_is_better is True
    assert compute(metrics) == {"accuracy": pytest.approx(0.75)}


def test_a_metric_that_cannot_take_the_predictions_is_one_config_error() -> None:
    metrics = build_metrics(
        {"r2": {"_target_": "torchmetrics.regression.R2Score"}}, 10, torch.device("cpu"), make
    )
    with pytest.raises(ConfigError) as raised:
        metrics["r2"].update(torch.zeros(2, 10), torch.tensor([1, 2]))
    line = raised.value.one_line()
    assert "\n" not in line
    assert line.startswith(
        "metrics.r2 (R2Score) cannot take the task's predictions (2x10) and targets (2) "
    )
    assert "drop it with ~metrics.r2" in line


def test_a_metric_target_that_does_not_import_fails_at_its_first_use() -> None:
    metrics = build_metrics(
        {"f1": {"_target_": "torchmetrics.classification.NoSuchScore"}},
        10,
        torch.device("cpu"),
        make,
    )
    with pytest.raises(ConfigError, match=r"^metrics\.f1\._target_="):
        metrics["f1"].update(torch.zeros(2, 10), torch.tensor([1, 2]))


@pytest.mark.e2e
def test_the_startup_benchmark_runs_and_its_json_holds_what_it_prints(tmp_path: Path) -> None:
    """benchmarks/startup.py at its smallest: every row measured, the targets checked."""
    written = tmp_path / "startup.json"
    result = subprocess.run(
        [PYTHON, str(ROOT / "benchmarks" / "startup.py"), "--rounds", "1", "--steps", "2"]
        + ["--json", str(written)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(written.read_text())["median"]
    assert set(figures["installed"]) == {"help", "script", "completion", "run"}
    assert set(figures["-"]) == {"floor"}
    assert 0 < figures["installed"]["run"]["startup_s"] < figures["installed"]["run"]["wall_s"]
    for row in ("help", "script", "completion", "run"):
        assert f"installed: {row} " in result.stdout, row
