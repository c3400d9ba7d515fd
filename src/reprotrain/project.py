"""Where the project is: its root, its conf/ folder, its MLflow store, its git state.

DVC runs queued and temporary experiments in a copy under `.dvc/tmp/exps/`; runs there
must still land in the project's own store, so the root is taken from above that copy.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from reprotrain.errors import ConfigError
from reprotrain.usercode import check_copy_has_files

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # src/reprotrain/ -> the checkout


def find_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: cwd) that holds conf/config.yaml."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "conf" / "config.yaml").is_file():
            return folder
    return PACKAGE_ROOT


def conf_folder() -> Path:
    """The app's primary config folder: the project's conf/ (found from cwd, so additions to a
    project's conf/ are used), else the one beside this package."""
    return find_root() / "conf"


def store_root(start: Path | None = None) -> Path:
    """The project that owns the MLflow store: above a DVC experiment's temporary copy."""
    dvc_root = os.environ.get("DVC_ROOT")  # DVC points queued experiments at the parent repo
    if dvc_root and (Path(dvc_root) / "conf" / "config.yaml").is_file():
        return Path(dvc_root).resolve()
    root = find_root(start)
    parts = root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


def default_tracking_uri(start: Path | None = None) -> str:
    """$MLFLOW_TRACKING_URI, else an absolute sqlite file at the project root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store_root(start) / 'mlflow.db'}"


def conf_digest(conf_dir: Path | None = None) -> str:
    """sha256 (first 16 hex) over every file's path and bytes under conf/."""
    conf_dir = conf_dir or conf_folder()
    digest = hashlib.sha256()
    for path in sorted(p for p in conf_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(conf_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def put_project_on_path() -> None:
    """Your own `_target_`s import from the project folder (a package there): in this process,
    in the processes a sweep's launcher starts, and in DVC's composition of params.yaml."""
    root = str(find_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])


def register_resolvers() -> None:
    """`${reprotrain.conf_digest:}` in conf/config.yaml; also loaded by DVC via hydra_plugins."""
    OmegaConf.register_new_resolver("reprotrain.conf_digest", _checked_conf_digest, replace=True)


def _checked_conf_digest(*, _root_: DictConfig) -> str:
    """Validate the whole composed config, then return conf/'s digest.

    DVC resolves this while composing params.yaml for `dvc exp run`: a bad value
    (`-S optimizer.lr=-1`) stops the composition with reprotrain's one-line message,
    before params.yaml is written and before any stage runs.
    """
    # Imported here, not at the top: Hydra imports this module in every process it starts
    # (hydra_plugins/reprotrain_resolvers), --help and Tab completion included, and the
    # schema brings torch (--help 5.3 s -> 2.2 s, completion 4.9 s -> 0.5 s without it).
    from reprotrain.schema import validate

    put_project_on_path()
    tree = cast(dict[str, Any], OmegaConf.to_container(_root_, resolve=False))  # a DictConfig
    tree.pop("conf_digest", None)
    tree.pop("hydra", None)
    config = validate(tree)
    root = find_root()
    check_copy_has_files(tree, config.code, root)  # dvc exp run --queue, --temp
    if "dvc" in sys.modules:  # DVC composing params.yaml: its prepare stage depends on it
        check_data_files(config.data_files, root)
    return conf_digest()


def check_data_files(data_files: str, root: Path) -> None:
    """`data_files` must exist for DVC to hash it (else `dvc repro` stops on its own error)."""
    if not (root / data_files).exists():
        raise ConfigError(
            f"data_files={data_files!r} does not exist in the project folder {root}; allowed: "
            "the folder (or file) of the files your data _target_ reads, relative to the "
            "project root (DVC's prepare stage depends on it)",
            hint=f"create it (mkdir -p {data_files}) and put those files there, or set "
            "data_files: <their folder> in conf/config.yaml",
        )


def git_state(root: Path) -> tuple[str, str]:
    """(commit, dirty) of the checkout; a container gets the host's values through env."""
    commit = os.environ.get("REPROTRAIN_GIT_COMMIT")
    dirty = os.environ.get("REPROTRAIN_GIT_DIRTY")
    if commit and dirty:
        return commit, dirty
    try:
        commit = _git(root, "rev-parse", "HEAD") or "none"
        # dvc.lock and the pipeline's outputs change during every `dvc repro` itself;
        # "dirty" means the code or config differs from the commit, a new file that git does
        # not ignore included (your model's package, before `git add`: the commit lacks it).
        changed = _git(
            root,
            "status",
            "--porcelain",
            "--untracked-files=normal",
            "--",
            ".",
            ":!dvc.lock",
            ":!results",
            ":!data",
            ":!*__pycache__*",  # Python's bytecode beside a new package
        )
        dirty = "true" if changed else "false"
    except (OSError, subprocess.SubprocessError):
        return "none", "unknown"
    return commit, dirty


def _git(root: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
    )
    return result.stdout.strip() if result.returncode == 0 else ""
