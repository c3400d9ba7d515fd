"""A config is code: which `_target_`s reprotrain imports and calls.

    python -m reprotrain.reproduce <run id>            # builds trusted _target_s only
    python -m reprotrain.reproduce <run id> --trust    # builds whatever the recorded config names

Building a config imports each `_target_`'s module and calls it. Your own config (`conf/` and
the command line) is your code; two rules keep out code that you did not choose:

- **The right kind before the call** (every run). The model, loss, optimizer and scheduler name
  a class of their kind, checked before it is called, or a function, whose result can only be
  checked after it ran: a function is taken from trusted code only (`trusted_function`).
- **A config from elsewhere** (a run's recorded `config.yaml`, which anyone who can write the
  run's artifacts can change) is built only when every `_target_` in it, at any depth, is one
  that the project's `conf/` names, the project's own code, a module listed in its
  `pyproject.toml`, or one of torch's and reprotrain's public classes of a kind reprotrain
  builds (a module, optimizer or scheduler) or functions of `BUILT_FUNCTIONS`. torch and
  reprotrain are not trusted whole: `torch.load` reads a pickle, `torch.hub.load` runs a
  folder's `hubconf.py`, `torch.save` writes a file, and a torch dataset can be a data pipe
  that unpickles the files it reads. Nothing outside torch and reprotrain is imported before
  this check (`judge`).

The project folders are the working directory and the folders on the import path that hold
`conf/config.yaml` (reprotrain puts the project's first there); the project's own code is a
package (with an `__init__.py`) or a module directly in one, never a plain folder such as the
store's `mlruns/`. More code is trusted by listing its modules:

    # pyproject.toml in the project folder
    [tool.reprotrain]
    trusted = ["timm", "my_lib.models"]
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from hydra.utils import get_object

from reprotrain.callbacks import Callback
from reprotrain.errors import ConfigError
from reprotrain.tasks import Task

# What the model, loss, optimizer and scheduler sections must build (a loss is a module too).
KINDS: dict[str, tuple[type, str]] = {
    "model": (torch.nn.Module, "torch.nn.Module"),
    "loss": (torch.nn.Module, "torch.nn.Module"),
    "optimizer": (torch.optim.Optimizer, "torch.optim.Optimizer"),
    "scheduler": (torch.optim.lr_scheduler.LRScheduler, "torch.optim.lr_scheduler.LRScheduler"),
}
TRUSTED_PACKAGES = ("reprotrain", "torch")
# In a config from elsewhere: torch's and reprotrain's public classes of these kinds, and
# functions defined in these modules (losses, reprotrain's built-in data), none of which touch
# files. Not torch's datasets: its data pipes open files and unpickle what they read.
BUILT_KINDS = (
    torch.nn.Module,
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    Task,  # reprotrain's tasks and callbacks: classes that hold settings and touch no file
    Callback,
)
# The configs reprotrain ships (conf/ beside the package): what they name is reprotrain's choice.
SHIPPED_CONF = Path(__file__).resolve().parents[2] / "conf"
BUILT_FUNCTIONS = ("torch.nn.functional", "reprotrain.data.builtin")
LISTED_IN = "[tool.reprotrain] trusted in the project's pyproject.toml"


@dataclass(frozen=True)
class Target:
    """One `_target_` of a config: where it is, what it names, and whether it may be built."""

    key: str  # model._target_, metrics.accuracy._target_, model.layers.0._target_
    path: Any  # the dotted path as given
    trusted: bool
    why: str  # why it is trusted, or why not

    def line(self) -> str:
        return f"  {self.key}: {self.path} ({'' if self.trusted else 'NOT TRUSTED: '}{self.why})"


def check_function(section: str, path: str, target: Any) -> None:
    """A function for the model, loss, optimizer or scheduler: its result is known only after
    it ran (a file opened, a pickle loaded), so it must come from trusted code."""
    if section not in KINDS or inspect.isclass(target) or trusted_function(target, path):
        return
    name = KINDS[section][1]
    module = defining_module(target, path)
    raise ConfigError(
        f"{section}._target_={path!r} is a function of {module}, which cannot be checked to "
        f"build a {name} before it runs; allowed: a {name} subclass, or a function of "
        "reprotrain, torch, this project's own packages or a module listed in pyproject.toml",
        hint=f"point {section}._target_ at a {name} subclass; if you trust {module}, add "
        f"{module.split('.')[0]!r} to {LISTED_IN}",
    )


def trusted_function(target: Any, path: str) -> bool:
    """Is the function defined in reprotrain, torch, the project's own code or a listed module?"""
    module = defining_module(target, path)
    return within(module, (*TRUSTED_PACKAGES, *listed_modules())) or project_code(module)


def defining_module(target: Any, path: str) -> str:
    """Where a function is defined (`torch.serialization.pickle.loads` is pickle's)."""
    module = getattr(target, "__module__", None)
    return module if isinstance(module, str) and module else path.rpartition(".")[0]


def recorded_targets(tree: Any) -> list[Target]:
    """Every `_target_` in a config from elsewhere (a plain tree), judged."""
    named, listed = conf_targets(), listed_modules()
    return [Target(key, path, *judge(path, named, listed)) for key, path in targets_in(tree)]


def refuse_untrusted(targets: list[Target]) -> None:
    """One ConfigError line for the first target that is not trusted."""
    refused = [target for target in targets if not target.trusted]
    if not refused:
        return
    first = refused[0]
    raise ConfigError(
        f"the recorded config names {first.key}={first.path!r}, which is {first.why} "
        f"({len(refused)} untrusted _target_{'s' if len(refused) > 1 else ''} of "
        f"{len(targets)}); building it would run it",
        hint=f"check that artifact; if you trust it, pass --trust, or add its module to {LISTED_IN}",
    )


def targets_in(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, value) of every `_target_` in a plain tree, nested ones included."""
    if isinstance(node, dict):
        found = [(f"{prefix}_target_", node["_target_"])] if "_target_" in node else []
        children = [(key, child) for key, child in node.items() if key != "_target_"]
    elif isinstance(node, list):
        found, children = [], list(enumerate(node))
    else:
        return []
    for key, child in children:
        found += targets_in(child, f"{prefix}{key}.")
    return found


def judge(path: Any, named: set[str], listed: tuple[str, ...]) -> tuple[bool, str]:
    """(trusted, why) for one dotted path, importing nothing outside torch and reprotrain."""
    if not isinstance(path, str) or not path:
        return False, "not a dotted path"
    if path in named:
        return True, "named in conf/"
    if within(path, listed):
        return True, "a listed module"
    if project_code(path):
        return True, "this project's code"
    if within(path, TRUSTED_PACKAGES):
        return built_kind(path)
    return False, "not reprotrain's, torch's or this project's code"


def built_kind(path: str) -> tuple[bool, str]:
    """torch's or reprotrain's: trusted when of a kind reprotrain builds. Importing their own
    modules to look runs nothing a config chose."""
    package = path.split(".")[0]
    if any(part.startswith("_") for part in path.split(".")):
        return False, f"a private name of {package}"
    try:
        target = get_object(path)
    except Exception:  # ImportError, AttributeError, ValueError from Hydra
        return False, f"not found in {package}"
    if inspect.isclass(target) and issubclass(target, BUILT_KINDS):
        return True, f"a {package} class"
    if inspect.isroutine(target) and within(defining_module(target, path), BUILT_FUNCTIONS):
        return True, f"a {package} function"
    return False, (
        f"a {package} callable that is not a module, optimizer or scheduler class nor a "
        f"function of {' or '.join(BUILT_FUNCTIONS)}"
    )


def within(path: str, modules: tuple[str, ...] | list[str]) -> bool:
    """Is the dotted path one of these modules or inside one?"""
    return any(path == module or path.startswith(f"{module}.") for module in modules)


def project_code(path: str) -> bool:
    """Is the path's top-level package (with an `__init__.py`) or module in a project folder?
    Finding a top-level module runs none of its code."""
    try:
        spec = importlib.util.find_spec(path.split(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.has_location or not spec.origin:
        return False
    origin = Path(spec.origin).resolve()
    folder = origin.parent.parent if origin.name == "__init__.py" else origin.parent
    return folder in project_folders()


def project_folders() -> list[Path]:
    """The working directory, and the folders on the import path that hold conf/config.yaml."""
    folders = [Path(entry or ".").resolve() for entry in sys.path]
    found = [f for f in folders if (f / "conf" / "config.yaml").is_file()]
    return list(dict.fromkeys([Path.cwd().resolve(), *found]))


def listed_modules() -> tuple[str, ...]:
    """The modules listed under [tool.reprotrain] trusted in the project folders."""
    listed: list[str] = []
    for folder in project_folders():
        listed += _listed_in(folder / "pyproject.toml")
    return tuple(listed)


def conf_targets() -> set[str]:
    """Every `_target_` the project folders' conf/ files name."""
    named: set[str] = set()
    for conf in dict.fromkeys([*(folder / "conf" for folder in project_folders()), SHIPPED_CONF]):
        for path in sorted(conf.rglob("*.yaml")):
            try:
                tree = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue  # Hydra reports a broken config file where it is composed
            named.update(v for _, v in targets_in(tree) if isinstance(v, str) and "${" not in v)
    return named


def _listed_in(pyproject: Path) -> list[str]:
    if not pyproject.is_file():
        return []
    try:
        settings = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(
            f"{pyproject} cannot be read ({type(error).__name__}: {str(error)[:160]})",
            hint="fix its TOML; reprotrain reads [tool.reprotrain] trusted from it",
        ) from None
    listed = settings.get("tool", {}).get("reprotrain", {}).get("trusted", [])
    if not isinstance(listed, list) or not all(isinstance(m, str) and m for m in listed):
        raise ConfigError(
            f"[tool.reprotrain] trusted={listed!r} in {pyproject} is not a list of module names",
            hint='write it as trusted = ["my_lib", "other_lib.models"]',
        )
    return listed
