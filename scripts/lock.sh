#!/usr/bin/env bash
# Regenerate the lock files from the ranges in pyproject.toml: resolve the runtime set alone
# (requirements.lock: host and images), then everything else (requirements-dev.lock).
#
#   scripts/lock.sh        # needs a Python 3.11 with pip; writes both files
#
# torch is pinned to the release the project tests (pyproject.toml); its local version label
# (+cpu) is dropped so each platform installs its own build of that release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m venv "$work/venv"
pip() { "$work/venv/bin/python" -m pip --disable-pip-version-check "$@"; }
runtime=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]))')
dev=$("$PY" -c 'import tomllib; d=tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]; print("\n".join(d["dev"]+d["bench"]))')
freeze() { pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/+cpu//' | LC_ALL=C sort -f; }
echo "$runtime" | pip install --quiet -r /dev/stdin
{ echo "# reprotrain runtime lock: every version pinned. Regenerate with scripts/lock.sh."; freeze; } > requirements.lock
echo "$dev" | pip install --quiet -r /dev/stdin
freeze > "$work/all.txt"
# Development lock = everything installed now, less what the runtime lock already pins.
{ echo "# reprotrain development (pipeline, tests, lint, benchmarks) lock: every version pinned. Regenerate with scripts/lock.sh."
  echo "-r requirements.lock"
  grep -v -i -x -F -f <(grep '==' requirements.lock) "$work/all.txt"; } > requirements-dev.lock
echo "lock: $(grep -c '==' requirements.lock) runtime, $(grep -c '==' requirements-dev.lock) development packages"
