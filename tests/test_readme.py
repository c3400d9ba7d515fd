"""The README is true: every command it and the pages of docs/ show is run by a test (or, for a
GPU, by scripts/gpu-check.sh), the cheap ones are run here exactly as written (the training
script's main() in this process where the command needs nothing else: conftest.InProcess), and
every file it links to exists."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import (
    BIN,
    ROOT,
    InProcess,
    Reproduced,
    Store,
    child_env,
    require_docker,
    run_app,
    sh,
)

README = (ROOT / "README.md").read_text()
# The user's guide and the pages it points to for measurements and design (docs/*.md).
GUIDES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}

# command as the README shows it -> where it is exercised
COVERED = {
    "dvc add data/raw/rows.csv": "test_data_files::test_an_edited_dvc_added_data_file_reruns_prepare_and_train",
    "git add data/raw/rows.csv.dvc data/raw/.gitignore": "test_data_files::test_an_edited_dvc_added_data_file_reruns_prepare_and_train",
    "dvc exp run -S data=rows -S code=my_project": "test_data_files::test_an_edited_dvc_added_data_file_reruns_prepare_and_train",
    "dvc status": "test_data_files::test_an_edited_dvc_added_data_file_reruns_prepare_and_train",
    "scripts/setup.sh && . .venv/bin/activate && dvc repro": ".ci/run (setup) + test_pipeline::test_repro_runs_once_then_is_a_no_op",
    "scripts/setup.sh && . .venv/bin/activate && pytest": ".ci/run",
    "mlflow ui --host 127.0.0.1 --port 5000": "test_docker_pipeline::mlflow_ui (same command, a free port)",
    "python -m reprotrain.train": "test_readme::test_plain_train_command",
    "python -m reprotrain.train device=cpu optimizer=sgd optimizer.lr=3e-4 model=mlp_wide": "test_train::test_overrides_reach_the_run",
    "python -m reprotrain.train experiment=smoke": "test_train::test_smoke_run_records_every_key",
    "python -m reprotrain.train data=digits train.steps=300": "test_readme::test_digits_command",
    "python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256": "test_train::test_multirun_groups_runs_under_a_parent",
    "python -m reprotrain.train --cfg job": "test_train::test_cfg_job_prints_the_composed_config",
    "reprotrain-train --help": "test_project_code::test_help_lists_the_groups_without_hydras_banner_or_internal_keys (the script's main)",
    'eval "$(reprotrain-train -sc install=bash)"': "test_project_code::test_bash_completes_groups_and_options_of_the_console_script",
    "dvc exp run -S model=tiny -S code=my_project": "test_project_code::test_stages_depend_on_the_users_code_folder_once_code_names_it",
    "scripts/lock-extra.sh einops==0.8.2": "test_project_code::test_lock_extra_pins_hashes_that_pip_checks + test_containers::test_extra_package_from_the_extra_lock_reaches_the_cpu_image",
    "pip install --require-hashes -r requirements-extra.lock": "test_project_code::test_lock_extra_pins_hashes_that_pip_checks (into a --target folder)",
    "python -m reprotrain.train runtime=local train.compile=true": "test_readme::test_compile_command",
    "python -m reprotrain.train device=cuda train.cuda_graphs=true": "scripts/gpu-check.sh (fast paths)",
    "python -m reprotrain.train optimizer.lr=-1": "test_bad_input::test_bad_input_is_one_clear_line",
    "python -m reprotrain.train device=cuda": "test_bad_input::test_bad_input_is_one_clear_line",
    "dvc repro": "test_pipeline::test_repro_runs_once_then_is_a_no_op",
    "dvc exp run -S optimizer=sgd -S optimizer.lr=0.01": "test_readme::test_exp_commands",
    "dvc exp run -S 'optimizer=adamw,sgd' -S 'train.batch_size=32,256' --queue": "test_pipeline::test_queued_sweep_runs_each_point_into_the_project_store",
    "dvc queue start": "test_pipeline::test_queued_sweep_runs_each_point_into_the_project_store",
    "dvc exp show": "test_readme::test_exp_commands",
    "dvc exp show --only-changed": "test_readme::test_exp_commands",
    "dvc exp show --drop '.*' --keep 'Experiment|val_accuracy|optimizer\\._target_|optimizer\\.lr$'": "test_readme::test_exp_commands",
    "dvc metrics diff": "test_readme::test_exp_commands",
    "dvc plots show": "test_pipeline::test_metrics_and_plots_show",
    "dvc dag": "test_pipeline::test_metrics_and_plots_show",
    "docker build -f Dockerfile.cpu -t reprotrain:cpu .": "test_containers (ensure_image runs this build, plus CI's base-image args)",
    "docker run --rm reprotrain:cpu python -m reprotrain.train experiment=smoke": "test_readme::test_docker_run_by_hand",
    "docker run --rm --gpus all reprotrain:cuda python -m reprotrain.train device=cuda": "scripts/gpu-check.sh --docker",
    "python benchmarks/compare.py --quick": "test_bench::test_compare_prints_every_row_and_the_targets_its_json_holds (--quick at 40 steps)",
    "python benchmarks/compare.py": "test_bench::test_compare_prints_every_row_and_the_targets_its_json_holds (CI size; full size by hand)",
    "python benchmarks/compare.py --with tracking.loss_every=10": "test_bench::test_compare_prints_every_row_and_the_targets_its_json_holds",
    "python benchmarks/compare.py --json benchmarks/results/2026-12-07-compare-cpu.json": "test_bench::test_compare_prints_every_row_and_the_targets_its_json_holds (--json)",
    "python benchmarks/compare.py --device cuda --with train.cuda_graphs=true": "scripts/gpu-check.sh (the comparison on cuda) + test_bench::test_compare_on_cuda_measures_every_row",
    "python benchmarks/startup.py": "test_startup::test_the_startup_benchmark_runs_and_its_json_holds_what_it_prints (--rounds 1 --steps 2)",
    "python benchmarks/startup.py --rounds 8": "test_startup::test_the_startup_benchmark_runs_and_its_json_holds_what_it_prints (--rounds 1)",
    "python benchmarks/run_length.py": "test_bench::test_run_length_script_prints_each_pair_and_the_medians",
    "python -m reprotrain.train --multirun experiment=crossover device=cpu": "test_bench::test_crossover_preset_runs_as_a_multirun_under_one_parent",
    "scripts/build-base-image.sh": ".ci/run",
    'export REPROTRAIN_BASE_IMAGE=reprotrain-base:bookworm REPROTRAIN_BUILD_FLAGS="--network host"': ".ci/run",
    "pytest": ".ci/run",
    'pytest -m "not docker and not slow"': "test_readme::test_marker_selection_collects",
    'pytest -m "not e2e"': "test_readme::test_marker_selection_collects",
    "pytest -m e2e": "test_readme::test_marker_selection_collects",
    "ruff check src tests benchmarks && ruff format --check src tests benchmarks": ".ci/run",
    "hadolint Dockerfile.cpu Dockerfile.cuda": ".ci/run + test_containers",
    "mypy": ".ci/run",
    "python -m reprotrain.train train.resume=last": "test_reliability::test_sigterm_ends_the_run_killed_and_resume_gives_the_same_losses_bit_for_bit",
    "python -m reprotrain.reproduce <run id>": "test_reliability::test_reproduce_reruns_a_past_run_and_reports_a_match",
    "python -m reprotrain.replay <spool file>": "test_reliability::test_server_still_away_at_the_end_then_replay",
    "python -m reprotrain.runs --clean": "test_hard_kill::test_sigkill_then_clean_says_resume_or_start_again_and_resume_records_every_step_once",
    "python -m reprotrain.train model=cnn data=digits_images": "test_byo::test_cnn_on_digit_images_trains",
    "python -m reprotrain.train model=tiny data=digits_images": "test_byo::test_readme_bring_your_own_model_example",
    "python -m reprotrain.train optimizer=rmsprop scheduler=cosine": "test_byo::test_optimizer_and_scheduler_from_yaml_log_the_learning_rate",
    "python -m reprotrain.train optimizer._target_=torch.optim.NAdam": "test_byo::test_readme_bring_your_own_model_example",
    "python -m reprotrain.train loss.label_smoothing=0.1": "test_byo::test_readme_bring_your_own_model_example",
    "python -m reprotrain.train +model.name=cnn": "test_byo::test_bad_pieces_are_one_clear_line",
    "python -m reprotrain.train --multirun hydra/sweeper=optuna 'optimizer.lr=interval(1e-4,1e-1)'": "test_sweeps (the same study, 4 trials)",
    "python -m reprotrain.train --multirun hydra/launcher=joblib optimizer=adamw,sgd": "test_sweeps (joblib launcher)",
    "torchrun --nproc-per-node=gpu -m reprotrain.train device=cuda": "scripts/gpu-check.sh (torchrun with nccl)",
    "torchrun --standalone --nproc-per-node=2 -m reprotrain.train device=cpu runtime=local": "test_distributed::test_two_processes_train_one_run_with_the_one_process_losses",
    "python -m reprotrain.train runtime=docker device=cpu train.nproc=2": "test_docker_pipeline::test_train_nproc_runs_torchrun_in_the_container_as_one_run",
    "docker run --rm --gpus all reprotrain:cuda torchrun --nproc-per-node=gpu -m reprotrain.train device=cuda": "scripts/gpu-check.sh --docker",
    "python -m reprotrain.train --multirun hydra/launcher=slurm hydra.launcher.partition=gpu optimizer=adamw,sgd": "test_sweeps::test_bad_sweep_is_one_line_before_any_run (no sbatch here) + test_sweeps::test_the_slurm_launcher_config_composes_with_what_a_site_fills_in",
    "python -m reprotrain.train task=regression model=regression_mlp data=diabetes train.val_every=20": "test_tasks::test_workload_validates_resumes_reproduces_and_its_model_loads (experiment=wl_regression sets these groups, val_every 20)",
    "python -m reprotrain.train train.val_every=100 train.early_stopping={patience:3} train.keep_best=true scheduler=plateau": "test_knobs::test_validation_drives_early_stopping_the_best_weights_and_a_plateau_scheduler (the same settings, smaller)",
    "python -m reprotrain.train --multirun hydra/launcher=submitit_local optimizer=adamw,sgd": "test_sweeps::test_parallel_launcher_jobs_finish_under_one_parent_each_in_its_folder",
}


def readme_commands(text: str = README) -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    for line in re.findall(r"^\$ (.+)$", text, flags=re.M):
        commands.append(line.strip())
    return commands


def test_every_readme_command_is_exercised() -> None:
    missing = [
        f"{page}: {c}"
        for page, text in GUIDES.items()
        for c in readme_commands(text)
        if c not in COVERED
    ]
    assert not missing, f"README commands no test exercises: {missing}"
    tests = {p.stem: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    for where in COVERED.values():
        for module, name in re.findall(r"(test_\w+)::(\w+)", where):
            assert f"def {name}(" in tests[module], f"{module}::{name} does not exist"


def test_readme_links_point_to_files() -> None:
    for page, text in GUIDES.items():
        base = (ROOT / page).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            path = target.split("#")[0]
            assert (base / path).exists(), f"{page} links to {target}, which does not exist"


@pytest.mark.e2e  # runtime=auto: in the container wherever Docker answers (CI)
def test_plain_train_command(tmp_path: Path) -> None:
    store = Store(tmp_path)
    result = run_app(tmp_path, env=child_env(MLFLOW_TRACKING_URI=store.uri))
    assert result.returncode == 0, result.stderr[-2000:]
    run = store.only_run()
    assert (
        run.data.params["train.steps"] == "500"
        and run.data.params["model._target_"] == "reprotrain.models.MLP"
    )
    assert len(store.losses(run.info.run_id)) == 500


@pytest.mark.e2e  # torch.compile builds C++ kernels and loads each in a Python of its own
def test_compile_command(tmp_path: Path) -> None:
    from reprotrain.fastpaths import compiler_missing

    if compiler_missing():
        pytest.skip(f"torch.compile cannot build kernels here: {compiler_missing()}")
    store = Store(tmp_path)
    result = run_app(
        tmp_path,
        "runtime=local",
        "train.compile=true",
        env=child_env(MLFLOW_TRACKING_URI=store.uri),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    run = store.only_run()
    assert run.info.status == "FINISHED" and run.data.params["train.compile"] == "True"
    assert len(store.losses(run.info.run_id)) == 500


def test_digits_command(tmp_path: Path, here: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    store = here.prepare(Store(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    result = here.app("data=digits", "train.steps=300", "runtime=local")
    assert result.returncode == 0, result.stderr[-2000:]
    run = store.only_run()
    assert run.data.tags["data.input_shape"] == "64" and run.data.metrics["val/accuracy"] > 0.9


@pytest.mark.e2e  # dvc
def test_exp_commands(tmp_path: Path, reproduced: Reproduced) -> None:
    repo = reproduced.copy(tmp_path / "project")  # after `dvc repro` (conftest)
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "baseline")
    sh(repo, "dvc", "exp", "run", "-S", "optimizer=sgd", "-S", "optimizer.lr=0.01")
    run = Store(repo).runs()[0]
    assert (
        run.data.tags["optimizer.class"] == "torch.optim.sgd.SGD"
        and run.data.params["optimizer.lr"] == "0.01"
    )
    wide = child_env(PATH=f"{BIN}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1", COLUMNS="400")
    shown = sh(repo, "dvc", "exp", "show", env=wide).stdout  # no terminal: set the table width
    assert run.data.tags["dvc.exp_name"] in shown and "optimizer.lr" in shown
    # The headline figures and what changed, each cell in full.
    terminal = child_env(PATH=f"{BIN}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1", COLUMNS="200")
    changed = sh(repo, "dvc", "exp", "show", "--only-changed", env=terminal).stdout
    rows = [line for line in changed.splitlines() if line.strip() and "──" not in line]
    assert not any("…" in row for row in rows), changed  # every cell in full
    header = rows[0].split()
    for column in ("val_accuracy", "eval_accuracy", "samples_per_s", "run_id", "optimizer.lr"):
        assert column in header, (column, header)  # short names: no file prefix needed
    # The columns one picks, in an 80-column terminal, each cell in full.
    narrow = child_env(PATH=f"{BIN}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1", COLUMNS="80")
    keep = r"Experiment|val_accuracy|optimizer\._target_|optimizer\.lr$"
    picked = sh(repo, "dvc", "exp", "show", "--drop", ".*", "--keep", keep, env=narrow).stdout
    rows = [line for line in picked.splitlines() if line.strip() and "──" not in line]
    assert rows[0].split() == ["Experiment", "val_accuracy", "optimizer._target_", "optimizer.lr"]
    assert not any("…" in row for row in rows) and max(map(len, rows)) <= 80, picked
    assert any("torch.optim.SGD" in row and "0.01" in row for row in rows), picked
    diff = sh(repo, "dvc", "metrics", "diff").stdout
    assert "results/metrics.json" in diff and "val_accuracy" in diff


@pytest.mark.docker
def test_docker_run_by_hand() -> None:
    require_docker()
    from reprotrain.containers import ensure_image

    ensure_image("cpu", ROOT)  # the friendly tag reprotrain:cpu points at the current build
    result = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "reprotrain:cpu",
            "python",
            "-m",
            "reprotrain.train",
            "experiment=smoke",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 20/20" in result.stderr


@pytest.mark.e2e  # pytest itself, as the README runs it
def test_marker_selection_collects() -> None:
    result = subprocess.run(
        [str(BIN / "pytest"), "-m", "not docker and not slow", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert "test_docker_pipeline.py::test_repro_trains" not in result.stdout
    assert "test_train.py::test_smoke_run_records_every_key" in result.stdout
    tiers = {
        marker: subprocess.run(
            [str(BIN / "pytest"), "-m", marker, "--collect-only", "-q", "-n", "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
        for marker in ("not e2e", "e2e")
    }
    assert "test_api.py::test_readme_from_python_example_runs" in tiers["not e2e"]
    assert "test_api.py::test_readme_from_python_example_runs" not in tiers["e2e"]
    assert "test_docker_pipeline.py::test_repro_trains" in tiers["e2e"]
