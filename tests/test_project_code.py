"""The pipeline around a project's own code: DVC stages that depend on it, queued experiments
that need it tracked, `git.dirty` that sees it, `reproduce` that compares its data, and the
console script whose shell completion works (real dvc, git, bash and MLflow: e2e). What needs
no process of its own runs in this one (conftest.InProcess)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, ROOT, InProcess, Reproduced, Store, child_env, sh
from reprotrain.project import git_state

USER_MODEL = '''
from torch import nn


class Linear(nn.Module):
    """A user's own model: one linear layer."""

    def __init__(self, in_features, num_classes):
        super().__init__()
        self.layer = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.layer(x)
'''

USER_DATA = '''
from pathlib import Path

import torch


def from_file(path, count=96):
    """A user's own data built in memory: its values follow the number in `path`."""
    generator = torch.Generator().manual_seed(int(Path(path).read_text()))
    inputs = torch.randn(count, 12, generator=generator)
    targets = (inputs[:, 0] > 0).long()
    return {
        "train": (inputs[:64], targets[:64]),
        "val": (inputs[64:], targets[64:]),
        "num_classes": 2,
    }
'''


@pytest.fixture
def reproduced_copy(reproduced: Reproduced, tmp_path: Path) -> Path:
    """A copy of the shared project after `dvc repro` (conftest.reproduced), no runs stored."""
    return reproduced.copy(tmp_path / "project")


def add_user_model(repo: Path) -> None:
    """The user's package my_project/ and conf/model/tiny.yaml naming its model, not added to
    git (as right after writing them)."""
    (repo / "my_project").mkdir()
    (repo / "my_project" / "__init__.py").write_text("")
    (repo / "my_project" / "models.py").write_text(USER_MODEL)
    (repo / "conf" / "model" / "tiny.yaml").write_text("_target_: my_project.models.Linear\n")


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def wait_for_queue(repo: Path, timeout: float = 900) -> str:
    """`dvc queue status` once no experiment is queued or running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = sh(repo, "dvc", "queue", "status").stdout
        if "Queued" not in status and "Running" not in status:
            return status
        time.sleep(1)
    raise AssertionError(f"the queue did not finish: {status}")


# --- DVC stages depend on the project's own code -------------------------------------------


@pytest.mark.e2e  # dvc
def test_stages_depend_on_the_users_code_folder_once_code_names_it(reproduced_copy: Path) -> None:
    repo = reproduced_copy
    add_user_model(repo)
    refused = sh(repo, "dvc", "exp", "run", "-S", "model=tiny", check=False)
    assert refused.returncode != 0 and "Traceback" not in output(refused)
    assert (
        "model._target_=my_project.models.Linear is code in my_project that the DVC stages do "
        "not depend on (code='src/reprotrain/models')" in output(refused)
    )
    assert "fix: set code: my_project in conf/config.yaml" in output(refused)
    assert Store(repo).runs() == []  # refused before a run started

    sh(repo, "dvc", "exp", "run", "-S", "model=tiny", "-S", "code=my_project")  # the fix
    run = Store(repo).only_run()
    assert run.info.status == "FINISHED"
    assert run.data.tags["model.class"] == "my_project.models.Linear"
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout
    models = repo / "my_project" / "models.py"
    models.write_text(models.read_text() + "# an edit\n")
    status = json.loads(sh(repo, "dvc", "status", "--json").stdout)
    for stage in ("prepare", "train", "evaluate"):
        assert {"changed deps": {"my_project": "modified"}} in status[stage], status


@pytest.mark.e2e  # dvc
def test_plots_and_repro_do_without_a_confusion_matrix(reproduced_copy: Path, tmp_path) -> None:
    """confusion.csv is a top-level plot, not a stage output: a task that writes none (or a
    removed one) leaves the pipeline up to date and its plots drawable."""
    repo = reproduced_copy
    (repo / "results" / "confusion.csv").unlink()
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "repro").stdout
    assert not (repo / "results" / "confusion.csv").exists()
    sh(repo, "dvc", "plots", "show", "-o", str(tmp_path / "plots"))
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "results/loss.csv" in html


# --- queued experiments need tracked files -------------------------------------------------


@pytest.mark.e2e  # dvc's queue
def test_queued_experiment_with_untracked_files_is_refused_naming_git_add(
    reproduced_copy: Path,
) -> None:
    repo = reproduced_copy
    add_user_model(repo)
    queue = ("dvc", "exp", "run", "--queue", "-S", "model=tiny", "-S", "code=my_project")
    refused = sh(repo, *queue, check=False)
    assert refused.returncode != 0 and "Traceback" not in output(refused)
    assert (
        "the experiment needs files git does not track (conf/model/tiny.yaml, my_project/)"
        in output(refused)
    )
    assert "fix: git add conf/model/tiny.yaml my_project/ (a commit is not needed)" in output(
        refused
    )
    assert "No experiment tasks in the queue" in sh(repo, "dvc", "queue", "status").stdout

    sh(repo, "git", "add", "conf/model/tiny.yaml", "my_project/")  # the fix, as given
    sh(repo, *queue)
    sh(repo, "dvc", "queue", "start", "-j", "1")
    status = wait_for_queue(repo)
    assert "Success" in status and "Failed" not in status, status
    run = Store(repo).only_run()
    assert run.data.tags["model.class"] == "my_project.models.Linear"


# --- git.dirty ------------------------------------------------------------------------------


def test_git_dirty_counts_new_files_git_does_not_ignore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("REPROTRAIN_GIT_COMMIT", "REPROTRAIN_GIT_DIRTY"):  # a container's values
        monkeypatch.delenv(name, raising=False)
    repo = tmp_path
    (repo / "conf").mkdir()
    (repo / "conf" / "config.yaml").write_text("defaults: []\n")
    (repo / ".gitignore").write_text("/outputs/\n")
    for command in (("init", "-q"), ("add", "-A"), ("commit", "-qm", "start")):
        sh(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", *command)
    assert git_state(repo)[1] == "false"
    (repo / "outputs").mkdir()
    (repo / "outputs" / "run.log").write_text("ignored\n")
    (repo / "results").mkdir()
    (repo / "results" / "confusion.csv").write_text("written by the pipeline\n")
    (repo / "conf" / "__pycache__").mkdir()
    (repo / "conf" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"written by Python")
    assert git_state(repo)[1] == "false"
    (repo / "my_project").mkdir()
    (repo / "my_project" / "models.py").write_text("class Net: ...\n")
    assert git_state(repo)[1] == "true"  # the commit alone cannot reproduce the run


# --- extra packages ---------------------------------------------------------------------------


@pytest.mark.e2e  # pip, from PyPI
def test_lock_extra_pins_hashes_that_pip_checks(tmp_path: Path) -> None:
    """scripts/lock-extra.sh pins the package with PyPI's sha256s; pip installs it in hash-checking
    mode and refuses a file whose hash the lock does not hold (needs PyPI)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "lock-extra.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "requirements.lock", tmp_path)
    env = child_env(PYTHON=PYTHON, PATH=f"{BIN}:{os.environ['PATH']}")  # the venv's pip
    sh(tmp_path, "scripts/lock-extra.sh", "einops==0.8.2", env=env)
    lock = tmp_path / "requirements-extra.lock"
    assert "einops==0.8.2 \\\n    --hash=sha256:" in lock.read_text()
    install = ("pip", "install", "--require-hashes", "-r", "requirements-extra.lock")
    sh(tmp_path, *install, "--target", "site", env=env)
    assert (tmp_path / "site" / "einops" / "__init__.py").is_file()
    lock.write_text(re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, lock.read_text()))
    refused = sh(tmp_path, *install, "--target", "refused", check=False, env=env)
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in output(refused)
    sh(tmp_path, "scripts/lock-extra.sh", env=env)  # none
    assert "==" not in lock.read_text()


# --- reproduce compares data built in memory ----------------------------------------------


def test_reproduce_names_the_data_when_in_memory_data_changed(
    tmp_path: Path, store: Store, here: InProcess
):
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "data.py").write_text(USER_DATA)
    (tmp_path / "my_conf" / "data").mkdir(parents=True)
    seed = tmp_path / "seed.txt"
    seed.write_text("1")
    config = f"_target_: my_project.data.from_file\npath: {seed}\n"
    (tmp_path / "my_conf" / "data" / "seeded.yaml").write_text(config)
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"
    here.train(tmp_path, store, searchpath, "data=seeded", "train.steps=8", "device=cpu")
    recorded = store.only_run()
    seed.write_text("2")  # what the data function reads changed since the run
    result = here.module("reproduce", recorded.info.run_id, "--tracking-uri", store.uri)
    assert result.returncode == 1, result.stderr[-2000:]
    recorded_hash = recorded.data.tags["data.hash"]
    assert (
        "the data differs (data._target_=my_project.data.from_file built data with hash "
        in result.stderr
    )
    assert f"the run recorded {recorded_hash}): what it reads changed since" in result.stderr


# --- the console script ---------------------------------------------------------------------


@pytest.mark.e2e  # bash completing the console script
def test_bash_completes_groups_and_options_of_the_console_script(tmp_path: Path) -> None:
    """Hydra's completion, installed as the README says, completes the script run by name."""
    script = """
eval "$(reprotrain-train -sc install=bash)"
COMP_LINE="reprotrain-train optimizer=s" COMP_POINT=28 COMP_CWORD=1
hydra_bash_completion
printf '%s\\n' "${COMPREPLY[@]}"
complete -p reprotrain-train
"""
    env = child_env(PATH=f"{BIN}:/usr/bin:/bin")
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "optimizer=sgd"
    assert lines[-1].endswith("-F hydra_bash_completion reprotrain-train")


def test_help_lists_the_groups_without_hydras_banner_or_internal_keys(here: InProcess) -> None:
    """`reprotrain-train --help`: the console script's main(), as `python -m reprotrain.train`."""
    helped = here.app("--help", defaults=False, cwd=ROOT)
    assert helped.returncode == 0, helped.stderr[-2000:]
    shown = helped.stdout
    assert shown.startswith("reprotrain-train: train a model and record the run in MLflow")
    for group in ("model", "data", "optimizer", "device", "task", "runtime", "experiment"):
        assert f"\n{group}: " in shown, group
    assert "model: cnn, mlp, mlp_deep, mlp_wide" in shown
    assert 'eval "$(reprotrain-train -sc install=bash)"' in shown
    for internal in ("powered by Hydra", "conf_digest", "_target_", "callbacks"):
        assert internal not in shown, internal
