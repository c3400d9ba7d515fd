"""The files a project's data `_target_` reads, declared with `data_files` (conf/config.yaml):
the `prepare` stage depends on them, so an edited file re-runs the pipeline, and a Dataset's
`data.hash` covers their content. The hashes and checks in this process; the pipeline with
real dvc and git in a temporary project copy (e2e)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import yaml
from torch.utils.data import Dataset, TensorDataset

from conftest import ROOT, Store, make_project, sh
from reprotrain.build import Pieces
from reprotrain.data.prepared import files_md5
from reprotrain.data.splits import Splits
from reprotrain.errors import ConfigError
from reprotrain.provenance import data_hash
from reprotrain.schema import Config, validate

# A user's table: two features and a label per row, 48 rows.
ROWS = "".join(f"{i % 7 / 10:.1f},{i * 3 % 5 / 10:.1f},{i % 2}\n" for i in range(48))
EDITED = ROWS.replace("0.0,0.0,0\n", "0.9,0.9,1\n", 1)  # its first row changed

USER_DATA = '''
import csv

import torch
from torch.utils.data import Dataset


class Rows(Dataset):
    """A user's own dataset: one (features, label) item per CSV row."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        *features, label = self.rows[index]
        return torch.tensor([float(v) for v in features]), int(label)


def rows(path):
    with open(path, newline="") as handle:
        table = list(csv.reader(handle))
    return {"train": Rows(table[:40]), "val": Rows(table[40:]), "num_classes": 2}
'''


class Items(Dataset):
    """A map-style dataset that is not a TensorDataset (hashed by what it reads)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(2), 0


def config_of(data_files: str, **data: object) -> Config:
    from reprotrain.schema import section_defaults

    tree = {name: section_defaults(name) for name in ("device", "train", "tracking", "runtime")}
    tree.update(
        model={"_target_": "reprotrain.models.MLP"},
        data={"_target_": "reprotrain.data.synthetic", **data},
        loss={"_target_": "torch.nn.CrossEntropyLoss"},
        optimizer={"_target_": "torch.optim.AdamW", "_partial_": True},
        data_files=data_files,
    )
    return validate(tree)


def pieces_of(train: Dataset, val: Dataset) -> Pieces:
    """Only what data_hash reads: the splits."""
    return cast(Pieces, SimpleNamespace(splits=Splits(train, val, 2)))


def test_a_datasets_hash_changes_when_a_declared_file_changes(tmp_path, monkeypatch) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("defaults: []\n")
    raw = tmp_path / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "rows.csv").write_text(ROWS)
    monkeypatch.chdir(tmp_path)  # the project root: the folder holding conf/config.yaml
    config = config_of("data/raw")
    pieces = pieces_of(Items(), Items())
    first = data_hash(config, pieces)
    assert first == data_hash(config, pieces) and len(first) == 32  # an md5, every time

    (raw / "rows.csv").write_text(EDITED)  # one row
    edited = data_hash(config, pieces)
    assert edited != first
    (raw / "more.csv").write_text("1,2,0\n")  # a file added beside it
    assert data_hash(config, pieces) not in (first, edited)
    (raw / "more.csv").unlink()
    assert data_hash(config, pieces) == edited  # the same files: the same hash

    other = config_of("data/raw", num_samples=64)  # the same files, built otherwise
    assert data_hash(other, pieces) != edited


def test_tensors_and_prepared_files_are_hashed_as_arrays_not_by_their_data_files(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("defaults: []\n")
    (tmp_path / "data" / "raw").mkdir(parents=True)
    tensors = TensorDataset(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))
    config = config_of("data/raw")
    before = data_hash(config, pieces_of(tensors, tensors))
    (tmp_path / "data" / "raw" / "unrelated.csv").write_text("1\n")
    assert data_hash(config, pieces_of(tensors, tensors)) == before


def test_files_md5_covers_names_and_bytes_of_a_folder_or_one_file(tmp_path) -> None:
    folder = tmp_path / "raw"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "a.bin").write_bytes(b"\x00" * 3)
    (folder / "rows.csv").write_text(ROWS)
    whole = files_md5(folder)
    (folder / "images" / "a.bin").rename(folder / "images" / "b.bin")
    assert files_md5(folder) != whole  # a renamed file is other data
    assert files_md5(folder / "rows.csv") == files_md5(folder / "rows.csv")
    assert files_md5(tmp_path / "missing") == files_md5(tmp_path / "empty-and-missing")


@pytest.mark.parametrize("value", ["/data/mine", "../elsewhere", "~/data", ""])
def test_data_files_outside_the_project_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_of(value)
    line = str(refused.value)
    assert line.startswith(f"data_files={value!r} is not a path inside the project; allowed: ")
    assert "fix: set data_files: " in line and "\n" not in line


def test_the_prepare_stage_depends_on_data_files() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert "${data_files}" in stages["prepare"]["deps"]
    configured = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["data_files"]
    assert (ROOT / configured).is_dir()  # a dependency DVC finds in a fresh clone
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params["data_files"] == configured


@pytest.mark.e2e  # dvc, git
def test_an_edited_dvc_added_data_file_reruns_prepare_and_train(tmp_path: Path) -> None:
    repo = make_project(tmp_path / "project", runtime="local")
    smoke = repo / "conf" / "experiment" / "smoke.yaml"  # its data keys are synthetic's
    smoke.write_text(smoke.read_text().replace("data:\n  num_samples: 512\n", ""))
    (repo / "my_project").mkdir()
    (repo / "my_project" / "__init__.py").write_text("")
    (repo / "my_project" / "data.py").write_text(USER_DATA)
    (repo / "conf" / "data" / "rows.yaml").write_text(
        "_target_: my_project.data.rows\npath: data/raw/rows.csv\nfile: null\n"
    )
    rows = repo / "data" / "raw" / "rows.csv"
    rows.write_text(ROWS)
    sh(repo, "dvc", "add", "data/raw/rows.csv")  # as the README shows
    sh(repo, "git", "add", "data/raw/rows.csv.dvc", "data/raw/.gitignore")
    assert "data/raw/rows.csv" not in sh(repo, "git", "ls-files").stdout.splitlines()
    sh(repo, "git", "add", "my_project", "conf")
    sh(repo, "git", "commit", "-qm", "the user's data")
    # A data_files folder that is not there: reprotrain's one line at the composition, not
    # DVC's own error when it hashes the prepare stage's dependencies.
    missing = subprocess.run(
        ["dvc", "exp", "run", "-S", "data=rows", "-S", "code=my_project", "-S", "data_files=raw"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0
    assert "data_files='raw' does not exist in the project folder" in missing.stderr
    assert "Traceback" not in missing.stderr
    sh(repo, "dvc", "exp", "run", "-S", "data=rows", "-S", "code=my_project")
    store = Store(repo)
    first = store.only_run()
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout

    rows.write_text(EDITED)  # one row changed
    status = json.loads(sh(repo, "dvc", "status", "--json").stdout)
    assert {"changed deps": {"data/raw": "modified"}} in status["prepare"], status
    again = sh(repo, "dvc", "repro")
    assert "Running stage 'prepare'" in again.stdout and "Running stage 'train'" in again.stdout
    second = store.runs()[0]
    assert second.info.run_id != first.info.run_id
    assert second.data.tags["data.hash"] != first.data.tags["data.hash"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert second.data.tags["data.hash"] == lock["stages"]["prepare"]["outs"][0]["md5"]
    digests = [
        {i.dataset.name: i.dataset.digest for i in run.inputs.dataset_inputs}
        for run in (first, second)
    ]
    assert digests[0]["dataset-train"] != digests[1]["dataset-train"], digests
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout
