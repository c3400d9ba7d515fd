#!/usr/bin/env bash
# Regenerate the lock files from the ranges in pyproject.toml: resolve the runtime set alone
# (requirements.lock: host and images), then the development set (requirements-dev.lock), then
# the `hf` extra on top of it (requirements-hf.lock: transformers and only what it adds, every
# package the development set shares with it at that set's version). Every pin
# carries the sha256 of each file PyPI has for that version (wheels for all platforms and the
# sdist), so installs run in pip's hash-checking mode (--require-hashes) and a file that differs
# from the one locked is refused.
#
#   scripts/lock.sh                  # Linux x86_64, Python 3.11 with pip, PyPI and PyTorch's CPU index
#   scripts/lock.sh --keep-versions  # the versions locked now, hashes refreshed (no upgrade)
#   TORCH_INDEX_URL=https://pypi.org/simple TORCH_FIND_LINKS=/opt/wheels scripts/lock.sh
#                          # the CPU torch wheel from a local folder instead (as in CI)
#
# torch is pinned to the release the project tests (pyproject.toml); its local version label
# (+cpu) is dropped so each platform installs its own build of that release. Its hashes are
# PyPI's files plus the CPU wheel Dockerfile.cpu installs: that one is downloaded here from
# TORCH_INDEX_URL / TORCH_FIND_LINKS (the image's build args, same defaults) and hashed, so the
# lock holds the hash of the file actually fetched, for this machine's platform only.
#
# PyPI's Linux torch is the CUDA build: it needs nvidia-* wheels, triton, cuda-bindings, which
# the runtime set (resolved with whichever torch this machine installs) may not hold. They are
# resolved here for the CUDA image (Linux x86_64, CPython 3.11, glibc <= 2.36 as in bookworm)
# against PyPI and pinned at the end of requirements.lock with the marker `extra == "cuda"`:
# pip skips them in a plain install (a requirements file never requests an extra), and
# Dockerfile.cuda and scripts/setup.sh (when the torch it got is that build) drop the marker.
set -euo pipefail
cd "$(dirname "$0")/.."
keep=false
case "${1:-}" in
    --keep-versions) keep=true ;;
    "") ;;
    *) echo "usage: scripts/lock.sh [--keep-versions]" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3.11}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m venv "$work/venv"
pip() { "$work/venv/bin/python" -m pip --disable-pip-version-check "$@"; }
# name==version of each entry in a lock file, without hashes (the CUDA section is recomputed).
locked() { grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==[^ ;]+( \\)?$' "$1" | sed 's/ \\$//'; }
if $keep; then
    # Same versions as the lock files now (hashes refreshed, CUDA set completed): install the
    # pins instead of the ranges, and keep the CUDA section's pins where torch allows them.
    runtime=$(locked requirements.lock)
    dev=$(locked requirements-dev.lock)
    hf=$(locked requirements-hf.lock)
    sed -n 's/^\([A-Za-z0-9][^ ;]*==[^ ;]*\) ; extra == "cuda".*/\1/p' requirements.lock > "$work/cuda-pins.txt"
else
    runtime=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]))')
    dev=$("$PY" -c 'import tomllib; d=tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]; print("\n".join(d["dev"]+d["bench"]))')
    hf=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["hf"]))')
    : > "$work/cuda-pins.txt"
fi
freeze() { pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/+cpu//' | LC_ALL=C sort -f; }
# --report: which file pip installed for each package, and its sha256 (checked against PyPI's
# below, so a local mirror serving different files shows up).
echo "$runtime" | pip install --quiet --report "$work/installed-runtime.json" -r /dev/stdin
freeze > "$work/runtime.txt"
echo "$dev" | pip install --quiet --report "$work/installed-dev.json" -r /dev/stdin
freeze > "$work/all.txt"
# Development lock = everything installed now, less what the runtime lock already pins.
grep -v -i -x -F -f "$work/runtime.txt" "$work/all.txt" > "$work/dev.txt"
# Hugging Face lock = what the `hf` extra adds to that set, whose versions are constraints:
# scripts/setup.sh installs it with --no-deps next to .venv, which keeps the shared packages.
echo "$hf" | pip install --quiet --report "$work/installed-hf.json" -c "$work/all.txt" -r /dev/stdin
freeze > "$work/all-hf.txt"
grep -v -i -x -F -f "$work/all.txt" "$work/all-hf.txt" > "$work/hf.txt"
torch_version="$(sed -n 's/^torch==//p' "$work/runtime.txt")"
test -n "$torch_version"

# The CUDA image's torch and what it brings, from PyPI alone (--isolated: no local find-links or
# mirrors from pip's user config), the runtime pins as constraints. Resolution only (--dry-run).
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for glibc in $(seq 17 36); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
pip --isolated install --quiet --dry-run --ignore-installed --report "$work/cuda.json" \
    --target "$work/cuda-target" --only-binary=:all: "${platforms[@]}" \
    --python-version 3.11 --implementation cp --abi cp311 \
    --index-url https://pypi.org/simple -c "$work/runtime.txt" -c "$work/cuda-pins.txt" \
    "torch==$torch_version"

# The CPU wheel Dockerfile.cpu installs, fetched the way it does.
pip download --quiet --no-deps --only-binary=:all: --dest "$work/cpu" \
    --index-url "$TORCH_INDEX_URL" ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
    "torch==$torch_version+cpu"

"$work/venv/bin/python" - "$work" <<'PY'
"""Write requirements.lock, requirements-dev.lock and requirements-hf.lock with PyPI's sha256 for
every pinned file."""
import concurrent.futures
import hashlib
import json
import pathlib
import sys
import urllib.request

# pip's own copy of `packaging`: file names are parsed exactly as pip parses them.
from pip._vendor.packaging.utils import (
    canonicalize_name,
    canonicalize_version,
    parse_sdist_filename,
    parse_wheel_filename,
)

work = pathlib.Path(sys.argv[1])


def pins(path):
    return dict(line.split("==", 1) for line in path.read_text().split())


def pypi_hashes(name, version):
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
            if filename.endswith(".whl"):
                file_version = parse_wheel_filename(filename)[1]
            else:
                file_version = parse_sdist_filename(filename)[1]
        except ValueError:  # eggs, .exe installers, odd legacy names: never pip's choice here
            continue
        if canonicalize_version(file_version) == canonicalize_version(version) and "sha256" in file["hashes"]:
            found.add(file["hashes"]["sha256"])
    if not found:
        sys.exit(f"lock: PyPI lists no file for {name}=={version}")
    return found


runtime, dev, hf = pins(work / "runtime.txt"), pins(work / "dev.txt"), pins(work / "hf.txt")
runtime_versions = {canonicalize_name(n): v for n, v in runtime.items()}
cuda = {}
for item in json.loads((work / "cuda.json").read_text())["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if canonicalize_name(name) not in runtime_versions:
        cuda[name] = version
    elif canonicalize_version(runtime_versions[canonicalize_name(name)]) != canonicalize_version(version):
        sys.exit(f"lock: the CUDA torch resolved {name}=={version}, the runtime lock pins another version")

wanted = {**runtime, **dev, **hf, **cuda}
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    hashes = dict(zip(wanted, pool.map(pypi_hashes, wanted, wanted.values())))

(cpu_wheel,) = (work / "cpu").glob("torch-*.whl")
cpu_sha256 = hashlib.sha256(cpu_wheel.read_bytes()).hexdigest()
torch_name = next(n for n in runtime if canonicalize_name(n) == "torch")
hashes[torch_name] = hashes[torch_name] | {cpu_sha256}

# Every file pip installed for the lock must be one the lock accepts. One that is not (a local
# mirror's own build) is reported and left out: hash-checked installs then take PyPI's file.
by_name = {canonicalize_name(n): hashes[n] for n in wanted}
foreign = []
for report in ("installed-runtime.json", "installed-dev.json", "installed-hf.json"):
    for item in json.loads((work / report).read_text())["install"]:
        info = item["download_info"]
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        name = canonicalize_name(item["metadata"]["name"])
        if name in by_name and sha256 not in by_name[name]:
            foreign.append(f"{item['metadata']['name']}=={item['metadata']['version']} {info['url']} sha256:{sha256}")
for line in foreign:
    print(f"lock: not PyPI's file, left out of the lock: {line}", file=sys.stderr)


def entry(name, version, marker=""):
    lines = [f"{name}=={version}{marker}"] + [f"    --hash=sha256:{h}" for h in sorted(hashes[name])]
    return " \\\n".join(lines) + "\n"


def block(pinned, marker=""):
    # The order `LC_ALL=C sort -f` gives: case-folded to upper case, line by line.
    out = ""
    for name in sorted(pinned, key=lambda n: f"{n}=={pinned[n]}".upper()):
        if name == torch_name:
            out += f"# torch: PyPI's files, plus {cpu_wheel.name} (the CPU build; host and Dockerfile.cpu).\n"
        out += entry(name, pinned[name], marker)
    return out


pathlib.Path("requirements.lock").write_text(
    "# reprotrain runtime lock: every version pinned, with the sha256 of each of its files on PyPI.\n"
    "# Install with pip's --require-hashes. Regenerate with scripts/lock.sh.\n"
    + block(runtime)
    + "# torch's CUDA build (PyPI's Linux x86_64 wheel) needs these. pip skips them in a plain install\n"
    "# (no extra is requested from a requirements file); Dockerfile.cuda and scripts/setup.sh (when\n"
    "# the torch it got needs them) install them with the marker removed.\n"
    + block(cuda, ' ; extra == "cuda"')
)
pathlib.Path("requirements-dev.lock").write_text(
    "# reprotrain development (pipeline, tests, lint, benchmarks) lock: every version pinned, with the\n"
    "# sha256 of each of its files on PyPI. Install with pip's --require-hashes. Regenerate with scripts/lock.sh.\n"
    "-r requirements.lock\n" + block(dev)
)
pathlib.Path("requirements-hf.lock").write_text(
    "# reprotrain Hugging Face test lock (transformers and what only it needs): every version pinned,\n"
    "# with the sha256 of each of its files on PyPI. scripts/setup.sh installs it with --no-deps into\n"
    "# .venv/hf-site, apart from .venv: torchmetrics imports transformers whenever it is installed.\n"
    "# Regenerate with scripts/lock.sh.\n" + block(hf)
)
print(
    f"lock: {len(runtime)} runtime, {len(cuda)} CUDA-only, {len(dev)} development,"
    f" {len(hf)} Hugging Face packages,"
    f" {sum(map(len, hashes.values()))} hashes; CPU torch wheel {cpu_wheel.name} sha256:{cpu_sha256}"
)
PY
