"""Specification of the lock files and of how they are installed.

Every pinned requirement carries sha256 hashes, and every install of the lock (scripts/setup.sh,
Dockerfile.cpu, Dockerfile.cuda) runs in pip's hash-checking mode, so a file that is not the one
locked is refused. scripts/lock.sh writes the hashes. transformers (requirements-hf.lock) lives
apart from .venv, in a folder only the processes that need it put on their path.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import HF_SITE, PYTHON, child_env, hf_env

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ("requirements.lock", "requirements-dev.lock", "requirements-hf.lock")
INSTALLERS = ("scripts/setup.sh", "Dockerfile.cpu", "Dockerfile.cuda")
CPU_WHEEL_DIRS = (Path("/opt/wheels"),)  # where this project's CI keeps PyTorch's CPU wheel
REQUIREMENT = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)"
    r"(?:\s*;\s*(?P<marker>[^-]+?))?"
    r"(?P<options>(?:\s+--hash=\S+)*)\s*$"
)


@dataclass
class Entry:
    name: str
    version: str
    marker: str | None
    hashes: list[str]


def logical_lines(path: Path) -> list[str]:
    """The file's lines with backslash continuations joined, comments and blanks left out."""
    text = path.read_text().replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def entries(lock: str) -> list[Entry]:
    found = []
    for line in logical_lines(ROOT / lock):
        if line.startswith("-r "):
            continue
        match = REQUIREMENT.match(line)
        assert match, f"{lock}: not a `name==version --hash=sha256:...` entry: {line[:120]}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})\b", match["options"])
        found.append(Entry(match["name"], match["version"], match["marker"], hashes))
    return found


def torch_entry() -> Entry:
    (torch,) = [e for e in entries("requirements.lock") if e.name.lower() == "torch"]
    return torch


def install_commands(path: str) -> list[str]:
    """Each `pip install` command in a script or Dockerfile, continuations joined."""
    text = (ROOT / path).read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;|\|", line):
            if re.search(r"\bpip install\b|\bpip_install\b", part) and "pip_install()" not in part:
                commands.append(" ".join(part.split()))
    return commands


@pytest.mark.parametrize("lock", LOCKS)
def test_every_locked_requirement_pins_a_version_and_sha256_hashes(lock: str) -> None:
    locked = entries(lock)
    assert len(locked) > 10, f"{lock} pins only {len(locked)} packages"
    unhashed = [f"{e.name}=={e.version}" for e in locked if not e.hashes]
    assert not unhashed, f"{lock}: no --hash=sha256 for {', '.join(unhashed)}"


def test_no_package_is_locked_twice() -> None:
    seen: dict[str, str] = {}
    for lock in LOCKS:
        for entry in entries(lock):
            key = re.sub(r"[-_.]+", "-", entry.name).lower()
            assert key not in seen, f"{entry.name} is pinned in {seen.get(key)} and again in {lock}"
            seen[key] = lock


def test_cuda_only_entries_are_marked_for_the_cuda_image() -> None:
    """pip skips `extra == "cuda"` entries in a plain install; only the CUDA consumers add them."""
    markers = {e.marker for e in entries("requirements.lock")}
    assert markers <= {None, 'extra == "cuda"'}, (
        f"unexpected markers in requirements.lock: {markers}"
    )
    cuda = [e.name for e in entries("requirements.lock") if e.marker]
    assert any(name.startswith("nvidia-") for name in cuda), (
        "no nvidia-* wheels for torch's CUDA build"
    )
    assert not any(e.marker for lock in LOCKS[1:] for e in entries(lock))


def test_torch_carries_pypi_and_cpu_wheel_hashes() -> None:
    torch = torch_entry()
    assert "+" not in torch.version, "the lock pins the release; each image picks its build"
    assert len(torch.hashes) >= 2, (
        f"torch has {len(torch.hashes)} hash(es): PyPI's and the CPU wheel's expected"
    )


def test_torch_carries_the_hash_of_the_local_cpu_wheel() -> None:
    torch = torch_entry()
    pattern = f"torch-{torch.version}+cpu-*.whl"
    wheels = sorted(w for folder in CPU_WHEEL_DIRS if folder.is_dir() for w in folder.glob(pattern))
    if not wheels:
        pytest.skip(f"no {pattern} in {', '.join(map(str, CPU_WHEEL_DIRS))} on this machine")
    for wheel in wheels:
        digest = hashlib.sha256()
        with wheel.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        assert digest.hexdigest() in torch.hashes, (
            f"{wheel.name} (sha256 {digest.hexdigest()}) is not among torch's hashes in "
            "requirements.lock: hash-checked installs of it would fail; rerun scripts/lock.sh"
        )


@pytest.mark.parametrize("path", INSTALLERS)
def test_every_install_of_the_lock_is_hash_checked(path: str) -> None:
    commands = install_commands(path)
    locked = [c for c in commands if "--dry-run" not in c and not re.search(r"(^|\s)-e \.", c)]
    assert locked, f"{path}: no pip install of the lock found"
    unchecked = [c for c in locked if "--require-hashes" not in c]
    assert not unchecked, f"{path}: pip install without --require-hashes: {unchecked}"
    # Names given on the command line would bypass the lock's hashes: installs go through -r files.
    by_name = [c for c in locked if not re.search(r"\s-r\s", c)]
    assert not by_name, f"{path}: pip install not from a requirements file: {by_name}"


def test_only_the_project_itself_is_installed_without_hashes() -> None:
    """The editable install of reprotrain (no index, no deps) is setup.sh's one unhashed install."""
    unhashed = [
        c
        for c in install_commands("scripts/setup.sh")
        if "--require-hashes" not in c and "--dry-run" not in c
    ]
    assert unhashed == ["pip_install --no-deps --no-build-isolation -e ."], unhashed


def tiny_wheel(folder: Path, name: str = "reprotrain_hashcheck", version: str = "1.0") -> Path:
    """A minimal valid wheel, so the check needs no index and no network."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test_lock\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in files.items()
    )
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def pip_download(tmp_path: Path, wheels: Path, requirement: str) -> subprocess.CompletedProcess:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(requirement + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "download",
            "--no-deps",
            "--require-hashes",
            "--no-index",
            "--find-links",
            str(wheels),
            "-r",
            str(requirements),
            "-d",
            str(tmp_path / "downloaded"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.e2e  # pip itself, offline, on a wheel made here
@pytest.mark.parametrize("tamper", ["none", "wrong hash", "changed file"])
def test_pip_hash_mode_refuses_a_file_that_is_not_the_locked_one(
    tmp_path: Path, tamper: str
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = tiny_wheel(wheels)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if tamper == "wrong hash":
        digest = hashlib.sha256(b"not the wheel").hexdigest()
    elif tamper == "changed file":
        with zipfile.ZipFile(wheel, "a") as archive:
            archive.writestr("reprotrain_hashcheck/extra.py", b"print('not locked')\n")
    result = pip_download(tmp_path, wheels, f"reprotrain-hashcheck==1.0 --hash=sha256:{digest}")
    if tamper == "none":
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "downloaded" / wheel.name).is_file()
    else:
        assert result.returncode != 0, f"pip accepted a tampered wheel ({tamper})"
        assert "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr, result.stderr


def site_packages() -> Path:
    """The venv's own site-packages: where the main install puts every package."""
    (path,) = {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}
    return path


def installed(folder: Path) -> dict[str, str]:
    """canonical name -> version of every distribution installed in `folder`."""
    found = importlib.metadata.distributions(path=[str(folder)])
    return {canonicalize_name(d.metadata["Name"]): d.version for d in found}


def hf_site() -> dict[str, str]:
    if not (HF_SITE / "transformers").is_dir():
        pytest.fail(f"transformers is not installed in {HF_SITE}: run scripts/setup.sh")
    return installed(HF_SITE)


def test_hf_site_holds_exactly_the_hf_lock_and_nothing_the_venv_has() -> None:
    locked = {canonicalize_name(e.name): e.version for e in entries("requirements-hf.lock")}
    assert "transformers" in locked
    # Installed with --no-deps beside .venv: `-r requirements-dev.lock` would copy the venv there.
    assert not any(line.startswith("-r ") for line in logical_lines(ROOT / "requirements-hf.lock"))
    assert hf_site() == locked, "rerun scripts/setup.sh"
    venv = installed(site_packages())
    assert not locked.keys() & venv.keys(), (
        f"in .venv and in {HF_SITE}: {sorted(locked.keys() & venv.keys())}"
    )


def test_what_hf_site_requires_is_installed_in_the_venv_or_beside_it() -> None:
    """pip check for .venv plus HF_SITE: shared packages (numpy, pyyaml, tqdm, ...) come from .venv."""
    available = {**installed(site_packages()), **hf_site()}
    unmet = []
    for dist in importlib.metadata.distributions(path=[str(HF_SITE)]):
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            version = available.get(canonicalize_name(requirement.name))
            if version is None or not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {requirement}, found {version}")
    assert not unmet, unmet


@pytest.mark.e2e  # what a new process finds with each environment
@pytest.mark.parametrize("hf", [False, True], ids=["child_env", "hf_env"])
def test_transformers_is_importable_only_where_hf_env_puts_it(hf: bool) -> None:
    """torchmetrics imports transformers whenever find_spec finds it: every training process
    (child_env) must not find it, and the Hugging Face tests (hf_env) must."""
    find = "import importlib.util; print(importlib.util.find_spec('transformers'))"
    result = subprocess.run(
        [PYTHON, "-c", find],
        env=hf_env() if hf else child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    if hf:
        assert str(HF_SITE / "transformers") in result.stdout
    else:
        assert result.stdout.strip() == "None", result.stdout
