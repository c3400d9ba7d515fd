#!/usr/bin/env bash
# Set up a checkout: a virtual environment in .venv with every locked dependency (hash-checked
# against the lock files) and reprotrain itself (editable), plus transformers in .venv/hf-site
# (requirements-hf.lock), a folder only the Hugging Face tests put on PYTHONPATH. Safe to run
# again; it only adds what is missing.
#
#   scripts/setup.sh && . .venv/bin/activate
#
# PYTHON picks the interpreter (default python3.11; reprotrain needs Python 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup: $PYTHON not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check --quiet "$@"; }
# Entries of requirements.lock whose first line matches $1, with their hashes (the CUDA marker
# removed: see below).
lock_entries() { awk -v re="$1" '/^[^ ]/ { p = $0 !~ /^#/ && $0 ~ re } p { sub(/ ; extra == "cuda"/, ""); print }' requirements.lock; }
# Does the torch installed in .venv require (on this machine) any package listed in file $1?
torch_requires_any() {
    .venv/bin/python - "$1" <<'PY'
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

listed = {canonicalize_name(line.split("==")[0]) for line in open(sys.argv[1]) if "==" in line}
required = {
    canonicalize_name(r.name)
    for r in map(Requirement, importlib.metadata.requires("torch") or [])
    if r.marker is None or r.marker.evaluate({"extra": ""})
}
sys.exit(0 if listed & required else 1)
PY
}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Every install is hash-checked (--require-hashes): a file whose sha256 is not in the lock is
# refused. torch and setuptools go first, alone.
# torch: the build pip ranks first here (PyPI's; a CPU build such as 2.13.0+cpu where a find-links
# folder or PyTorch's CPU index offers one), asked in a dry run before hash mode, whose ranking
# would put any file listed with a hash (PyPI's) above a wheel folder's. Then that exact version
# is installed, hash-checked: the lock holds PyPI's hashes and the CPU wheel's.
# setuptools: the locked one then builds the lock's one sdist (antlr4-python3-runtime) with
# --no-build-isolation, instead of a setuptools fetched unchecked into an isolated build
# environment.
echo "setup: installing requirements-dev.lock (torch, MLflow, Hydra, DVC, pytest, ...)" >&2
torch_locked="$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements.lock)"
torch_build="$(pip_install --dry-run --no-deps --ignore-installed --report - "torch==$torch_locked" \
    | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')"
lock_entries '^(torch|setuptools)==' | sed "s/^torch==[^ ]*/torch==$torch_build/" > "$tmp/first.txt"
pip_install --require-hashes --no-deps -r "$tmp/first.txt"
# PyPI's Linux torch is the CUDA build: it needs the nvidia-* wheels the lock pins under
# `extra == "cuda"` (which pip itself always skips). Add them only when this torch asks for them.
lock_entries '; extra == "cuda"' > "$tmp/cuda.txt"
if ! torch_requires_any "$tmp/cuda.txt"; then
    : > "$tmp/cuda.txt"
fi
pip_install --require-hashes --no-build-isolation --use-pep517 -r requirements-dev.lock -r "$tmp/cuda.txt"
# --no-build-isolation: build with the locked setuptools already in .venv, nothing fetched.
pip_install --no-deps --no-build-isolation -e .

# transformers, apart: torchmetrics imports it whenever it can (torchmetrics issue #2242), a
# slower start for every training process, so it is not in .venv but in .venv/hf-site, which
# the tests that need it put on PYTHONPATH (tests/conftest.py: hf_env). --no-deps: the lock
# holds only what transformers adds; numpy, pyyaml, tqdm, ... come from .venv. A .venv made
# before the move loses its copy. Reinstalled only when the lock changed.
hf_site=.venv/hf-site
hf_names() { sed -n 's/^\([A-Za-z0-9][^ =]*\)==.*/\1/p' requirements-hf.lock; }
# shellcheck disable=SC2046  # one argument per package name
in_venv="$(.venv/bin/python -I - $(hf_names) <<'PY'
import importlib.metadata, sys

print(" ".join(name for name in sys.argv[1:] if list(importlib.metadata.distributions(name=name))))
PY
)"
if [ -n "$in_venv" ]; then
    echo "setup: moving $in_venv from .venv to $hf_site" >&2
    # shellcheck disable=SC2086  # one argument per package name
    .venv/bin/python -m pip uninstall --disable-pip-version-check --quiet -y $in_venv
fi
if ! cmp -s requirements-hf.lock "$hf_site/requirements-hf.lock"; then
    echo "setup: installing requirements-hf.lock (transformers) into $hf_site" >&2
    rm -rf "$hf_site.new"
    pip_install --require-hashes --no-deps --target "$hf_site.new" -r requirements-hf.lock
    cp requirements-hf.lock "$hf_site.new/"
    rm -rf "$hf_site"
    mv "$hf_site.new" "$hf_site"
fi
echo "setup: done; activate with: . .venv/bin/activate" >&2
