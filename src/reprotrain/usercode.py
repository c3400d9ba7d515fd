"""The project's own code (a model or dataset of yours) as the DVC pipeline must see it.

Every stage in dvc.yaml depends on the folder `code` names (conf/config.yaml, read from
params.yaml as `${code}`), so `dvc status` sees an edit to your model or data. Two checks keep
that promise:

- a DVC stage refuses to run a `_target_` whose code is in the project folder but outside
  `code`: no stage would depend on it;
- `dvc exp run --queue` (or `--temp`) refuses to queue an experiment that needs files git does
  not track (a config of yours in conf/, your package): DVC runs it in a copy of the project
  that holds only the files git tracks, where they would be missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from reprotrain.errors import ConfigError

OWN_PACKAGE = Path(__file__).resolve().parent  # reprotrain's own code: its stages name it
INSTALLED = ("site-packages", "dist-packages")
COPY_FLAGS = ("--queue", "--temp")  # `dvc exp run` flags that run the experiment in a copy
SHOWN = 5  # untracked paths named in the message
BYTECODE = "__pycache__"  # what Python writes beside your code: never needed in a copy


def targets(tree: Any, key: str = "") -> list[tuple[str, str]]:
    """Every `_target_` in a config tree, with its key: [('model._target_', 'my.Net'), ...]."""
    if isinstance(tree, dict):
        found = []
        for name, value in tree.items():
            path = f"{key}.{name}" if key else str(name)
            if name == "_target_" and isinstance(value, str):
                found.append((path, value))
            else:
                found += targets(value, path)
        return found
    if isinstance(tree, list):
        return [t for i, item in enumerate(tree) for t in targets(item, f"{key}.{i}")]
    return []


def module_location(target: str) -> Path | None:
    """The package folder (or module file) of a target's top-level module; None if not found."""
    top = target.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def project_code(tree: dict[str, Any], root: Path) -> dict[str, Path]:
    """The `_target_`s whose code is the project's own: in the project folder, neither
    reprotrain's package nor an installed one. `key=target` -> its path relative to root."""
    root = root.resolve()
    found = {}
    for key, target in targets(tree):
        where = module_location(target)
        if where is None or not where.is_relative_to(root) or where.is_relative_to(OWN_PACKAGE):
            continue
        if any(part in INSTALLED for part in where.parts):
            continue
        found[f"{key}={target}"] = where.relative_to(root)
    return found


def check_stage_code(tree: dict[str, Any], code: str, root: Path) -> None:
    """In a DVC stage: `code` exists, and every target's own code is inside it."""
    if not os.environ.get("DVC_STAGE"):
        return
    folder = (root / code).resolve()
    if not folder.exists():
        raise ConfigError(
            f"code={code!r} does not exist in the project folder {root}; allowed: the folder "
            "(or file) of your own code, relative to the project root",
            hint="set code: <the folder of your package> in conf/config.yaml, then dvc exp run",
        )
    outside = {
        key: path
        for key, path in project_code(tree, root).items()
        if not (root / path).resolve().is_relative_to(folder)
    }
    if outside:
        key, path = next(iter(outside.items()))
        raise ConfigError(
            f"{key} is code in {path.as_posix()} that the DVC stages do not depend on "
            f"(code={code!r}): `dvc status` would not see an edit to it",
            hint=f"set code: {path.as_posix()} in conf/config.yaml (one folder holding all of "
            "your code), then run dvc exp run",
        )


def runs_in_a_copy() -> bool:
    """Is this DVC's own process composing params.yaml for `dvc exp run --queue`/`--temp`?
    (DVC composes in the workspace, then runs the experiment in a copy of tracked files.)"""
    return "dvc" in sys.modules and any(flag in sys.argv[1:] for flag in COPY_FLAGS)


def untracked(root: Path, paths: list[str]) -> list[str]:
    """The files (a wholly new folder as one entry) under `paths` that git neither tracks
    nor ignores; [] outside a git repository."""
    result = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--others", "--exclude-standard", "--directory"]
        + ["-z", "--", *paths],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if result.returncode != 0:
        return []
    return sorted(p for p in result.stdout.split("\0") if p and BYTECODE not in p)


def check_copy_has_files(tree: dict[str, Any], code: str, root: Path) -> None:
    """At `dvc exp run --queue`/`--temp`: the config folder, `code` and the targets' own code
    must be files git tracks (added is enough), or the experiment's copy would lack them."""
    if not runs_in_a_copy():
        return
    paths = ["conf", code, *(p.as_posix() for p in project_code(tree, root).values())]
    missing = untracked(root, sorted(set(paths)))
    if not missing:
        return
    shown = ", ".join(missing[:SHOWN]) + (
        f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    )
    raise ConfigError(
        f"the experiment needs files git does not track ({shown}): dvc exp run --queue and "
        "--temp run it in a copy of the project that holds only the files git tracks",
        hint=f"git add {' '.join(missing)} (a commit is not needed), then queue it again",
    )
