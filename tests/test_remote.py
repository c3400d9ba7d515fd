"""DVC remote storage, for real: the pipeline's data and model pushed to an S3-compatible
server (moto, checking access keys) and to a folder, then pulled into a fresh clone."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BIN, make_project, sh
from teamserver import S3, require_team_parts

PIPELINE_FILES = ("data/dataset.npz", "results/model.pt")  # what `dvc repro` caches

pytestmark = pytest.mark.e2e  # dvc remotes: S3 (moto's server) and a folder


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def dvc(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(repo, str(BIN / "dvc"), *args, check=check)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    require_team_parts()
    server = S3(tmp_path_factory.mktemp("s3"))
    try:
        yield server.start(bucket="dvc-store")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A project after `dvc repro`, committed: what a teammate clones."""
    repo = make_project(tmp_path_factory.mktemp("origin") / "project", runtime="local")
    dvc(repo, "repro")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "trained")
    return repo, {name: md5(repo / name) for name in PIPELINE_FILES}


def clone(repo: Path, dest: Path) -> Path:
    sh(dest.parent, "git", "clone", "-q", str(repo), str(dest))
    assert not any((dest / name).exists() for name in PIPELINE_FILES)  # cached, not in git
    return dest


def use_s3_remote(repo: Path, s3: S3) -> None:
    """As the README shows: the remote in .dvc/config (committed), the keys in
    .dvc/config.local (never committed)."""
    dvc(repo, "remote", "add", "-d", "-f", "storage", f"s3://{s3.bucket}/cache")
    dvc(repo, "remote", "modify", "storage", "endpointurl", s3.endpoint)
    dvc(repo, "remote", "modify", "--local", "storage", "access_key_id", s3.key_id)
    dvc(repo, "remote", "modify", "--local", "storage", "secret_access_key", s3.secret)


def test_push_to_s3_then_pull_into_a_fresh_clone(
    tmp_path: Path, s3: S3, trained: tuple[Path, dict[str, str]]
) -> None:
    repo, hashes = trained
    use_s3_remote(repo, s3)
    sh(repo, "git", "add", ".dvc/config")
    sh(repo, "git", "commit", "-qm", "remote")
    assert s3.secret not in (repo / ".dvc" / "config").read_text()
    dvc(repo, "push")
    assert len(s3.objects("cache/")) >= len(PIPELINE_FILES)  # content-addressed files
    teammate = clone(repo, tmp_path / "teammate")
    dvc(teammate, "remote", "modify", "--local", "storage", "access_key_id", s3.key_id)
    dvc(teammate, "remote", "modify", "--local", "storage", "secret_access_key", s3.secret)
    dvc(teammate, "pull")
    assert {name: md5(teammate / name) for name in PIPELINE_FILES} == hashes
    assert "Data and pipelines are up to date" in dvc(teammate, "status").stdout


def test_s3_remote_that_refuses_the_keys_fails_the_push(
    tmp_path: Path, s3: S3, trained: tuple[Path, dict[str, str]]
) -> None:
    repo, _ = trained
    copy = clone(repo, tmp_path / "copy")
    dvc(copy, "remote", "add", "-d", "-f", "storage", f"s3://{s3.bucket}/cache")
    dvc(copy, "remote", "modify", "storage", "endpointurl", s3.endpoint)
    dvc(copy, "remote", "modify", "--local", "storage", "access_key_id", s3.key_id)
    dvc(copy, "remote", "modify", "--local", "storage", "secret_access_key", "wrong")
    done = dvc(copy, "pull", check=False)
    assert done.returncode != 0
    assert not any((copy / name).exists() for name in PIPELINE_FILES)


def test_push_to_a_folder_then_pull_into_a_fresh_clone(
    tmp_path: Path, trained: tuple[Path, dict[str, str]]
) -> None:
    repo, hashes = trained
    folder = tmp_path / "dvc-store"
    dvc(repo, "remote", "add", "-f", "shared-folder", str(folder))
    sh(repo, "git", "add", ".dvc/config")
    sh(repo, "git", "commit", "-qm", "folder remote")
    dvc(repo, "push", "-r", "shared-folder")
    assert any(folder.rglob("*"))
    teammate = clone(repo, tmp_path / "teammate")
    dvc(teammate, "pull", "-r", "shared-folder")
    assert {name: md5(teammate / name) for name in PIPELINE_FILES} == hashes
