#!/usr/bin/env bash
# Set up a checkout: a virtual environment in .venv with every locked dependency and
# reprotrain itself (editable). Safe to run again; it only adds what is missing.
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
echo "setup: installing requirements-dev.lock (torch, MLflow, Hydra, DVC, pytest, ...)" >&2
pip_install -r requirements-dev.lock
# --no-build-isolation: build with the locked setuptools already in .venv, nothing fetched.
pip_install --no-deps --no-build-isolation -e .
echo "setup: done; activate with: . .venv/bin/activate" >&2
