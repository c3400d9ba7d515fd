#!/usr/bin/env bash
# Lock the extra packages your own code imports (a model from `transformers`, `einops`...):
# requirements-extra.lock, each version pinned with the sha256 of every file PyPI has for it,
# installed hash-checked (--require-hashes) by Dockerfile.cpu and Dockerfile.cuda and part of
# the images' digest. The images are rebuilt when it changes; `dvc repro` re-runs `train`.
#
#   scripts/lock-extra.sh inflection==0.5.1 'einops>=0.8'   # resolve and write the lock
#   scripts/lock-extra.sh                                     # no extra package (an empty lock)
#   pip install --require-hashes -r requirements-extra.lock   # the same packages here
#
# They are resolved from PyPI for Python 3.11 (the images' Python), with requirements.lock's
# versions as constraints: a package that needs another version of a locked one is refused.
# What requirements.lock already holds is left out (the images have it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" - "$@" <<'PY'
"""Resolve the packages named on the command line and write requirements-extra.lock."""
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import urllib.request

# pip's own copy of `packaging`: file names are parsed exactly as pip parses them.
from pip._vendor.packaging.utils import (
    canonicalize_name,
    canonicalize_version,
    parse_sdist_filename,
    parse_wheel_filename,
)

LOCK = pathlib.Path("requirements-extra.lock")
HEADER = (
    "# Extra packages for your own code, installed into the images after requirements.lock\n"
    "# (hash-checked: --require-hashes). Written by scripts/lock-extra.sh; empty: none.\n"
)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;\\]+)\s*\\?$")


def locked_pins() -> dict[str, str]:
    """name -> version of requirements.lock's plain entries (not its CUDA-only ones)."""
    pins = {}
    for line in pathlib.Path("requirements.lock").read_text().splitlines():
        if match := PIN.match(line):
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def resolve(specs: list[str], pins: dict[str, str]) -> dict[str, str]:
    """What pip installs for `specs` on top of the lock: name -> version."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write("".join(f"{name}=={version}\n" for name, version in pins.items()))
        constraints.flush()
        # --isolated: PyPI itself, not a mirror or find-links folder from pip's user config.
        report = subprocess.run(
            [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
            + ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-"]
            + ["--index-url", "https://pypi.org/simple", "-c", constraints.name, *specs],
            capture_output=True,
            text=True,
        )
    if report.returncode != 0:
        sys.exit(f"lock-extra: pip cannot resolve {' '.join(specs)}:\n{report.stderr.strip()}")
    found = {}
    for item in json.loads(report.stdout)["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if canonicalize_name(name) not in pins:
            found[name] = version
    return found


def pypi_hashes(name: str, version: str) -> list[str]:
    """sha256 of every file PyPI has for name==version (PEP 691 JSON simple API)."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{canonicalize_name(name)}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        files = json.load(reply)["files"]
    found = set()
    for file in files:
        filename = file["filename"]
        try:
            parse = parse_wheel_filename if filename.endswith(".whl") else parse_sdist_filename
            file_version = parse(filename)[1]
        except ValueError:  # eggs and other legacy names: never pip's choice
            continue
        if canonicalize_version(file_version) == canonicalize_version(version):
            found.add(file["hashes"]["sha256"])
    if not found:
        sys.exit(f"lock-extra: PyPI lists no file for {name}=={version}")
    return sorted(found)


specs = sys.argv[1:]
packages = resolve(specs, locked_pins()) if specs else {}
text = HEADER
for name in sorted(packages, key=str.lower):
    lines = [f"{name}=={packages[name]}"]
    lines += [f"    --hash=sha256:{h}" for h in pypi_hashes(name, packages[name])]
    text += " \\\n".join(lines) + "\n"
LOCK.write_text(text)
listed = ", ".join(f"{n}=={v}" for n, v in sorted(packages.items())) or "no package"
print(f"lock-extra: {LOCK}: {listed}")
PY
