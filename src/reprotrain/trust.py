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
from types import ModuleType
from typing import Any

import torch
import yaml

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
    module = defining_module(target) or "no module it names"
    raise ConfigError(
        f"{section}._target_={path!r} is a function of {module}, which cannot be checked to "
        f"build a {name} before it runs; allowed: a {name} subclass, or a function of "
        "reprotrain, torch, this project's own packages or a module listed in pyproject.toml",
        hint=f"point {section}._target_ at a {name} subclass; if you trust {module}, add "
        f"{module.split('.')[0]!r} to {LISTED_IN}",
    )


def trusted_function(target: Any, path: str) -> bool:
    """Is the function defined in reprotrain, torch, the project's own code or a listed module?
    (By the module that defines it, never by the path that reached it: `my_project.models.
    torch.save` is torch's `save`; a callable that names no module is trusted nowhere.)"""
    module = defining_module(target)
    if module is None:
        return False
    return within(module, (*TRUSTED_PACKAGES, *listed_modules())) or project_module(
        module, project_folders()
    )


def defining_module(target: Any, path: str = "") -> str | None:
    """The module that defines a class or function (`torch.serialization.pickle.loads` is
    pickle's); None when it names none (a C method such as `numpy.ndarray.tofile`)."""
    module = getattr(target, "__module__", None)
    return module if isinstance(module, str) and module else None


# The keys of a config that build something: only these may hold a `_target_` in a config
# from elsewhere (a `_target_` under any other key, or nested in a builder's arguments, is
# refused: nothing documents building it).
BUILDERS = ("model", "data", "loss", "optimizer", "scheduler", "task", "data.collate_fn")
NAMED_BUILDERS = ("metrics", "callbacks")  # metrics.<name>, callbacks.<name>


def builder_key(key: str) -> bool:
    """Is `key` (`model._target_`, `metrics.accuracy._target_`) a builder's `_target_`?"""
    owner = key.removesuffix("_target_").removesuffix(".")
    group, _, name = owner.partition(".")
    return owner in BUILDERS or (group in NAMED_BUILDERS and bool(name) and "." not in name)


def recorded_targets(tree: Any) -> list[Target]:
    """Every `_target_` in a config from elsewhere (a plain tree), judged."""
    judge = Judge(conf_targets(), listed_modules(), project_folders())
    return [
        Target(key, path, *(judge(path) if builder_key(key) else NOT_A_BUILDER))
        for key, path in targets_in(tree)
    ]


NOT_A_BUILDER = (
    False,
    "under a key that builds nothing (a _target_ may stand only at "
    f"{', '.join(BUILDERS)}, metrics.<name> or callbacks.<name>)",
)


def refuse_untrusted(targets: list[Target], trust_option: str | None = "--trust") -> None:
    """One ConfigError line for the first target that is not trusted; the fix names
    `trust_option` where the command has one."""
    refused = [target for target in targets if not target.trusted]
    if not refused:
        return
    first = refused[0]
    passing = f"pass {trust_option}, or " if trust_option else ""
    raise ConfigError(
        f"the recorded config names {first.key}={first.path!r}, which is {first.why} "
        f"({len(refused)} untrusted _target_{'s' if len(refused) > 1 else ''} of "
        f"{len(targets)}); building it would run it",
        hint=f"check that artifact; if you trust it, {passing}add its module to {LISTED_IN}",
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


class Judge:
    """(trusted, why) for one dotted path, decided by the object it resolves to.

    The path is walked as Hydra's `get_object` walks it (an attribute of the object so far,
    else a submodule to import), importing only modules that may run here: torch's,
    reprotrain's, listed ones and the project's own. Each step must stay where it was: a
    module reached as an attribute must be that submodule itself (`torch.nn.functional.np` is
    NumPy, imported there: refused), and a class or function must name the module that defines
    it, which must be trusted (`my_project.models.torch.save` is torch's `save`; a C method
    such as `numpy.ndarray.tofile` names none). What it resolves to is then judged: the
    project's own code and listed modules are trusted; of torch and reprotrain only public
    classes of the kinds reprotrain builds and the functions of BUILT_FUNCTIONS are."""

    def __init__(self, named: set[str], listed: tuple[str, ...], folders: list[Path]) -> None:
        self.named, self.listed, self.folders = named, listed, folders

    def __call__(self, path: Any) -> tuple[bool, str]:
        if not isinstance(path, str) or not path:
            return False, "not a dotted path"
        if path in self.named:
            return True, "named in conf/"
        parts = path.split(".")
        if not all(part.isidentifier() for part in parts):
            return False, "not a dotted path"
        walked = self.walk(parts)
        if isinstance(walked, str):
            return False, walked
        return self.judge_object(walked, path)

    def scope(self, module: str) -> str | None:
        """Whose code a module is: 'project', 'listed', 'torch', 'reprotrain', or None."""
        if within(module, self.listed):
            return "listed"
        if within(module, TRUSTED_PACKAGES):
            return module.split(".")[0]
        if project_module(module, self.folders):
            return "project"
        return None

    def walk(self, parts: list[str]) -> Any:
        """The object the path names, or why it is refused (a str)."""
        top = parts[0]
        if self.scope(top) is None:
            return "not reprotrain's, torch's or this project's code"
        try:
            obj: Any = importlib.import_module(top)
        except Exception:  # an error while importing: Hydra would fail the same way
            return f"not found ({top} cannot be imported)"
        for i in range(1, len(parts)):
            here, name = ".".join(parts[: i + 1]), parts[i]
            try:
                found = getattr(obj, name)
            except AttributeError:
                if not isinstance(obj, ModuleType):
                    return f"not found ({'.'.join(parts[:i])} has no {name!r})"
                if self.scope(here) is None:
                    return "not reprotrain's, torch's or this project's code"
                try:
                    found = importlib.import_module(here)
                except Exception:
                    return f"not found ({here} cannot be imported)"
            except Exception as error:  # a property that raised: nothing to judge
                return f"not found ({type(error).__name__} reading {here})"
            if isinstance(found, ModuleType):
                if found.__name__ != here:
                    return (
                        f"reached through {'.'.join(parts[:i])}, where module "
                        f"{found.__name__} is imported: it is not that module's code"
                    )
            else:
                module = defining_module(found)
                if module is None:
                    return f"{here} names no module that defines it (a C method or an object)"
                if self.scope(module) is None:
                    return (
                        f"defined in {module}, reached through {'.'.join(parts[:i])}: not "
                        "reprotrain's, torch's or this project's code"
                    )
            obj = found
        return obj

    def judge_object(self, target: Any, path: str) -> tuple[bool, str]:
        if isinstance(target, ModuleType) or not callable(target):
            return False, "not a class or function"
        module = defining_module(target) or ""
        scope = self.scope(module)
        if scope == "listed":
            return True, "a listed module"
        if scope == "project":
            return True, "this project's code"
        package = scope or "torch"
        if any(part.startswith("_") for part in [*path.split("."), *module.split(".")]):
            return False, f"a private name of {package}"
        if inspect.isclass(target) and issubclass(target, BUILT_KINDS):
            return True, f"a {package} class"
        if inspect.isroutine(target) and within(module, BUILT_FUNCTIONS):
            return True, f"a {package} function"
        return False, (
            f"a {package} callable that is not a module, optimizer or scheduler class nor a "
            f"function of {' or '.join(BUILT_FUNCTIONS)}"
        )


def judge(path: Any, named: set[str], listed: tuple[str, ...]) -> tuple[bool, str]:
    """(trusted, why) for one dotted path (Judge), importing nothing untrusted."""
    return Judge(named, listed, project_folders())(path)


def within(path: str, modules: tuple[str, ...] | list[str]) -> bool:
    """Is the dotted path one of these modules or inside one?"""
    return any(path == module or path.startswith(f"{module}.") for module in modules)


def project_module(module: str, folders: list[Path]) -> bool:
    """Is `module` the project's own code: its top-level package (with an `__init__.py`) or
    module lies directly in a project folder, and `module` itself (when imported) is a file
    of it, not a module of the same name elsewhere?"""
    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.has_location or not spec.origin:
        return False
    origin = Path(spec.origin).resolve()
    home = origin.parent if origin.name == "__init__.py" else origin
    if home.parent not in folders:
        return False
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None) if loaded is not None else None
    return file is None or Path(file).resolve().is_relative_to(home)


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
