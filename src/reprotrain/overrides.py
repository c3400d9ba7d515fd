"""Command-line overrides checked before Hydra starts any job.

Hydra reports a bad override as several lines (or a traceback); reprotrain first checks
the syntax and every group option, and composes what Hydra will compose, so any mistake
is one line. A single run is composed once here and validated once, by the app itself
(cli.py). A sweep (--multirun) has every job composed and validated against the schema
here, so that no job of a sweep starts when another would fail.

A sweep is what Hydra's sweepers read: the command line's overrides on top of the
search space a config file sets under `hydra.sweeper.params` (`experiment=crossover`
does). Every job that can be listed (`a=1,2`, `choice(...)`, `range(...)`, `glob(...)`
over a group's options, with `tag`, `sort` and `shuffle` around them) is composed and
validated; a continuous `interval(a,b)` (Optuna samples it) is validated at both ends.
Overrides of `hydra.*` and `hydra/...` are Hydra's own to check, except an Optuna
`hydra.sweeper.storage`: optuna 2.10 cannot open a database with SQLAlchemy 2.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_loader import ConfigLoader
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    Glob,
    IntervalSweep,
    Override,
    QuotedString,
    RangeSweep,
    Transformer,
)
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reprotrain.errors import ConfigError
from reprotrain.project import conf_folder, register_resolvers
from reprotrain.schema import validate

# Hydra flags that print something and exit: nothing to check.
_INFO_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
}
_VALUE_FLAGS = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
}
_CUDA_INDEX = re.compile(r"^device=cuda:(\d+)$")
# Composing a job takes ~0.12 s here, a small part of running it. A sweep of more jobs than
# this (an Optuna space of many choices runs only n_trials of them) is checked on fewer jobs
# that still give every swept key each of its values; a longer range() is checked at its two
# ends (the schema's limits are intervals: the ends stand for the values between them).
_MAX_JOBS_COMPOSED = 100
_PARAMS_SOURCE = "hydra.sweeper.params"


def normalise(argv: list[str]) -> list[str]:
    """Flags first (Hydra's parser rejects `a=1 --multirun b=2`), then the overrides;
    `device=cuda:1` (torch's spelling) becomes `device=cuda device.index=1`."""
    flags, args = [], []
    items = iter(argv)
    for arg in items:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _VALUE_FLAGS:
                flags.append(next(items, ""))
            continue
        match = _CUDA_INDEX.match(arg)
        args += ["device=cuda", f"device.index={match.group(1)}"] if match else [arg]
    return flags + args


def check(argv: list[str]) -> None:
    """Raise ConfigError (one line) for the first override, group option or job that is wrong:
    a single run's composition (the app validates it), or every job of a sweep."""
    if any(arg.split("=")[0] in _INFO_FLAGS for arg in argv):
        return
    flags, args = _split_flags(argv)
    parsed = _parse(args, source="the command line")
    task = [p for p in parsed if not p.is_hydra_override()]
    hydra_overrides = [p for p in parsed if p.is_hydra_override()]
    multirun = (
        "--multirun" in flags
        or "-m" in flags
        or any(p.key_or_group == "hydra.mode" and p.value() == "MULTIRUN" for p in hydra_overrides)
    )
    sweeps = [p for p in task if p.is_sweep_override()]
    if sweeps and not multirun:
        raise ConfigError(
            f"{sweeps[0].input_line!r} lists several values, which needs a sweep",
            hint="add --multirun (or -m) to run one job per value",
        )
    register_resolvers()
    if multirun:
        check_launcher(hydra_overrides)
        check_sweep(flags, task, hydra_overrides)
    else:
        check_composes(flags, task, hydra_overrides)


def check_composes(flags: dict[str, str], task: list[Override], hydra: list[Override]) -> None:
    """A single run: its group options and Hydra's composition of it (Hydra's own settings
    included), each error one line. Its schema is the app's to check, once (cli.py)."""
    with _configs(flags, hydra) as configs:
        searchpath = [p for p in hydra if p.get_key_element() == "hydra.searchpath"]
        axes = configs.axes([*task, *(p for p in hydra if p not in searchpath)])
        job = [axis.overrides[0] for axis in axes.values()]
        given = {axis.group: axis.given for axis in axes.values()}
        cfg = configs.compose(job, given, with_hydra=True)  # the search path is configs.search
        if not (flags.get("--cfg") or flags.get("-c")):  # printing a config makes no folder
            check_run_folder(cfg, "hydra.run.dir")


def check_sweep(flags: dict[str, str], task: list[Override], hydra: list[Override]) -> None:
    """Every job of a sweep composed and validated before the first one starts."""
    with _configs(flags, hydra) as configs:
        # Hydra's sweepers take the config's search space, then the command line's
        # overrides, which replace a key both give.
        axes = configs.axes(task)
        axes = {**configs.sweeper_params(axes, hydra), **axes}
        given = {axis.group: axis.given for axis in axes.values()}
        swept = [axis.sweep for axis in axes.values()]
        for job in _jobs([axis.overrides for axis in axes.values()]):
            values = [o for o, sweep in zip(job, swept, strict=True) if sweep]
            configs.validate_job(job, given, swept=values)


def check_run_folder(cfg: DictConfig, key: str) -> None:
    """Hydra makes the run's folder (a sweep's, for --multirun) before the job starts, and a
    path it cannot make is a traceback there: its nearest existing part must be a writable
    folder. Nothing is made here."""
    try:
        given = OmegaConf.select(cfg, key)
    except OmegaConfBaseException:
        return  # an interpolation only Hydra's job can resolve: Hydra's to report
    if not given:
        return
    folder = Path(str(given)).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    why = "not writable" if existing.is_dir() else "not a folder"
    raise ConfigError(
        f"{key}={str(given)!r} cannot be made: {existing} is {why}; allowed: a folder path "
        "whose existing part is a writable folder",
        hint=f"give {key}=<a writable folder>, or drop the override (conf/config.yaml's)",
    )


SLURM_LAUNCHERS = ("slurm", "submitit_slurm")  # conf/hydra/launcher/slurm.yaml, the plugin's


def check_launcher(hydra_overrides: list[Any]) -> None:
    """A SLURM launcher submits with `sbatch`: without it every job would fail after the
    sweep started; say so before anything runs."""
    for override in hydra_overrides:
        slurm = override.key_or_group == "hydra/launcher" and override.value() in SLURM_LAUNCHERS
        if slurm and shutil.which("sbatch") is None:
            raise ConfigError(
                f"hydra/launcher={override.value()} submits jobs with SLURM's sbatch, which "
                "is not on this machine's PATH; allowed: a SLURM login node, or another "
                "launcher here",
                hint="run the sweep where sbatch is, or use hydra/launcher=submitit_local "
                "(or joblib) on this machine",
            )


@dataclass
class _Axis:
    """One key of a sweep: the override each of its jobs gets, and where it was given."""

    key: str  # Hydra's key element: `optimizer.lr`, `+loss`, `model@net`
    group: str  # the key without prefix and package: `optimizer.lr`, `loss`, `model`
    overrides: list[str]  # `optimizer.lr=0.1`, `optimizer.lr=0.01`, ...
    options: list[object]  # the values given, for the group check
    given: str  # `'optimizer.lr=0.1,0.01'`, or `'optimizer.lr=...' in hydra.sweeper.params`
    sweep: bool = False


class _Configs:
    """The config search path Hydra will use, and composition on it (public Hydra API only)."""

    def __init__(self, loader: ConfigLoader, config_name: str, search: list[str]) -> None:
        self.loader = loader
        self.config_name = config_name
        self.search = search  # `hydra.searchpath=[...]` when --config-dir or an override adds one
        self._options: dict[str, list[str]] = {}

    def options(self, group: str) -> list[str]:
        """The options of a config group on the whole search path ([] for a plain key)."""
        if group not in self._options:
            self._options[group] = sorted(
                self.loader.get_group_options(
                    group, ObjectType.CONFIG, config_name=self.config_name, overrides=self.search
                )
            )
        return self._options[group]

    def axes(self, overrides: list[Override], source: str = "") -> dict[str, _Axis]:
        """Each override as an axis (the last one given for a key wins), group options checked."""
        axes = {}
        for override in overrides:
            axis = self.axis(override, source)
            self.check_group_options(axis)
            axes[axis.key] = axis
        return axes

    def axis(self, override: Override, source: str = "") -> _Axis:
        key = override.get_key_element()
        given = repr(override.input_line) + (f" in {source}" if source else "")
        group = override.key_or_group
        if override.is_delete():
            return _Axis(key, group, [override.input_line or key], [], given)
        if not override.is_sweep_override():
            value = override.get_value_element_as_str()
            return _Axis(key, group, [f"{key}={value}"], [_plain(override.value())], given)
        sweep = override.value()
        if isinstance(sweep, Glob):
            values: list = sweep.filter(self.options(group))
            if not values:
                raise ConfigError(
                    f"{given} matches no option of the {group!r} group; allowed: "
                    f"{', '.join(self.options(group)) or 'none'}",
                    hint="change the glob pattern, or add a matching option file",
                )
        elif isinstance(sweep, IntervalSweep):
            values = [sweep.start, sweep.end]  # continuous: a sampler picks between the ends
        elif isinstance(sweep, RangeSweep):
            values = list(override.sweep_iterator())
            if len(values) > _MAX_JOBS_COMPOSED:
                values = [min(values), max(values)]
        else:
            values = list(override.sweep_iterator())
        if not values:
            raise ConfigError(
                f"{given} sweeps over no value",
                hint="give at least one value (check the range's start, stop and step)",
            )
        strings = [Transformer.str(value) for value in values]
        options = [_plain(value) for value in values]
        return _Axis(key, group, [f"{key}={s}" for s in strings], options, given, sweep=True)

    def sweeper_params(self, axes: dict[str, _Axis], hydra: list[Override]) -> dict[str, _Axis]:
        """The search space the composed config sets under hydra.sweeper.params.

        Hydra's sweepers read it from the config composed without the command line's
        sweeps, and take each entry as a `key=value` override (basic and Optuna alike).
        """
        fixed = [axis.overrides[0] for axis in axes.values() if not axis.sweep]
        hydra_fixed = [p.input_line for p in hydra if not p.is_sweep_override()]
        try:
            cfg = self.compose([*fixed, *hydra_fixed], given={}, with_hydra=True)
        except ConfigError:
            # A wrong hydra.* setting is Hydra's to report; the group choices
            # (hydra/sweeper=optuna) still decide which sweeper settings exist.
            groups = [o for o in hydra_fixed if o.lstrip("+~").startswith("hydra/")]
            cfg = self.compose([*fixed, *groups], given={}, with_hydra=True)
        check_run_folder(cfg, "hydra.sweep.dir")
        storage = OmegaConf.select(cfg, "hydra.sweeper.storage")
        if storage:
            raise ConfigError(
                f"hydra.sweeper.storage={storage!r}: the Optuna sweeper for Hydra 1.3 runs "
                "optuna 2.10, whose database storage does not work with SQLAlchemy 2 (which "
                "MLflow needs)",
                hint="leave hydra.sweeper.storage null: the study stays in memory, every trial "
                "is still an MLflow run and the best one is recorded on the sweep's parent run",
            )
        params = OmegaConf.select(cfg, "hydra.sweeper.params")
        if not isinstance(params, DictConfig):
            return {}
        lines = [f"{key}={value}" for key, value in params.items()]
        parsed = _parse(lines, source=_PARAMS_SOURCE)
        return self.axes([p for p in parsed if not p.is_hydra_override()], _PARAMS_SOURCE)

    def check_group_options(self, axis: _Axis) -> None:
        options = self.options(axis.group)
        if not options:
            return  # a config key, not a group
        for value in axis.options:
            for name in value if isinstance(value, list) else [value]:
                if name is not None and str(name) not in options:
                    raise ConfigError(
                        f"{axis.group}={str(name)!r} is not an option of the {axis.group!r} group"
                        f" (given {axis.given}); allowed: {', '.join(options)}",
                        hint=f"pick one of those, or add conf/{axis.group}/{name}.yaml",
                    )

    def validate_job(self, job: list[str], given: dict[str, str], swept: list[str]) -> None:
        """Compose and validate one job; an error in a sweep names the job's other swept values
        (`optimizer.betas` is not a key *of the job optimizer=sgd*)."""
        try:
            validate(self.compose(job, given))
        except ConfigError as error:
            others = [o for o in swept if not _names_key(error.message, o.split("=")[0])]
            if not others:
                raise
            message = f"{error.message} (in the sweep's job {' '.join(others)})"
            raise ConfigError(message, hint=error.hint) from None

    def compose(
        self, overrides: list[str], given: dict[str, str], with_hydra: bool = False
    ) -> DictConfig:
        try:
            return compose(
                config_name=self.config_name,
                overrides=[*self.search, *overrides],
                return_hydra_config=with_hydra,
            )
        except (OmegaConfBaseException, HydraException, ValueError, KeyError) as error:
            raise _composition_error(error, overrides, given) from None


@contextmanager
def _configs(flags: dict[str, str], hydra_overrides: list[Override]) -> Iterator[_Configs]:
    """The app's primary config folder (or --config-path), with --config-dir and a
    `hydra.searchpath=[...]` override added to the search path as Hydra adds them."""
    config_name = flags.get("--config-name") or flags.get("-cn") or "config"
    config_path = flags.get("--config-path") or flags.get("-cp")
    primary = conf_folder()  # the folder cli.py's @hydra.main names
    if config_path:  # relative to the module holding @hydra.main, as Hydra reads it
        primary = Path(__file__).resolve().parent / config_path
    primary = primary.resolve()
    searchpath = next(
        (list(p.value()) for p in hydra_overrides if p.get_key_element() == "hydra.searchpath"),
        None,
    )
    extra = []
    if flags.get("--config-dir") or flags.get("-cd"):
        config_dir = Path(flags.get("--config-dir") or flags["-cd"]).resolve()
        if (primary / f"{config_name.removesuffix('.yaml')}.yaml").is_file():
            extra = [f"file://{config_dir}"]
        else:
            # compose() does not find a primary config that only a hydra.searchpath entry
            # holds, so a config kept in --config-dir (`--config-dir . --config-name params`)
            # makes that folder the primary one here, and conf/ is searched after it.
            primary, extra = config_dir, [f"file://{primary}"]
    with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
        if extra and searchpath is None:  # keep what the primary config adds itself
            searchpath = _primary_searchpath(config_name)
        paths = [*(searchpath or []), *extra]
        search = [_searchpath_override(paths)] if paths else []
        loader = GlobalHydra.instance().config_loader()
        yield _Configs(loader, config_name, search)


def _primary_searchpath(config_name: str) -> list[str]:
    try:
        cfg = compose(config_name=config_name, return_hydra_config=True)
    except (OmegaConfBaseException, HydraException):
        return []  # the composition of the jobs reports what is wrong
    return list(OmegaConf.select(cfg, "hydra.searchpath") or [])


def _names_key(message: str, key: str) -> bool:
    """Does the message name this key itself (`optimizer.lr=-1`, not `optimizer.lr.x`)?"""
    return re.search(rf"(?<![\w.]){re.escape(key.lstrip('+~'))}(?![\w.])", message) is not None


def _plain(value: object) -> object:
    """A parsed value without its quotes, for comparing with option names."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value.text if isinstance(value, QuotedString) else value


def _searchpath_override(paths: list[str]) -> str:
    return "hydra.searchpath=[" + ",".join(Transformer.str(p) for p in paths) + "]"


def _split_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    args: list[str] = []
    items = iter(argv)
    for arg in items:
        if arg.startswith("-"):
            name, _, value = arg.partition("=")
            if name in _VALUE_FLAGS and not value:
                value = next(items, "")
            flags[name] = value
        else:
            args.append(arg)
    return flags, args


def _parse(args: list[str], source: str) -> list[Override]:
    parser = OverridesParser.create()
    parsed = []
    for arg in args:
        try:
            parsed += parser.parse_overrides([arg])
        except OverrideParseException as error:
            reason = str(error).splitlines()[0]
            where = "" if source == "the command line" else f" in {source}"
            raise ConfigError(
                f"cannot parse the override {arg!r}{where}: {reason}",
                hint="overrides look like key=value, group=option, +new.key=value or a=1,2 for "
                "sweeps; quote values with spaces",
            ) from None
    return parsed


def _jobs(axes: list[list[str]]) -> list[list[str]]:
    """Every combination, as Hydra's basic sweeper runs them; past _MAX_JOBS_COMPOSED, the
    fewest jobs that still give each key every one of its values."""
    if math.prod(len(axis) for axis in axes) <= _MAX_JOBS_COMPOSED:
        return [list(job) for job in itertools.product(*axes)]
    width = max(len(axis) for axis in axes)
    return [[axis[i % len(axis)] for axis in axes] for i in range(width)]


def _composition_error(error: Exception, job: list[str], given: dict[str, str]) -> ConfigError:
    # Hydra's "Error merging override a=b" keeps what was wrong with it in its cause.
    text = "\n".join(str(e) for e in (error, error.__cause__) if e is not None)
    undeletable = re.search(r"Could not delete from config\. '([^']+)'", text)
    if undeletable:
        key = undeletable.group(1)
        return ConfigError(
            f"{key!r} cannot be deleted (given {given.get(key, repr('~' + key))}): "
            "it is not a config key, or its value is already null",
            hint="check the spelling; `python -m reprotrain.train --cfg job` lists every key",
        )
    taken = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if taken:
        key = taken.group(1)
        return ConfigError(
            f"{key!r} is already a config key (given {given.get(key, repr('+' + key))}): "
            "+ adds a new key only",
            hint=f"drop the + ({key}=...), or write ++{key}=... to add or override it",
        )
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        source = given.get(key) or next(
            (repr(o) for o in job if o.split("=")[0].lstrip("+~") == key), repr(key)
        )
        return ConfigError(
            f"{key!r} is not a config key (given {source})",
            hint="check the spelling; `python -m reprotrain.train --cfg job` lists every key "
            f"(to add a new key on purpose, write +{key}=...)",
        )
    missing = re.search(r"Cannot find primary config '([^']+)'", text)
    if missing:
        return ConfigError(
            f"config {missing.group(1)!r} was not found", hint="check --config-dir/--config-name"
        )
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip()
        and not line.strip().startswith(("full_key", "object_type", "reference_type"))
    ]
    return ConfigError(
        "; ".join(lines[:3]) + f" (overrides: {' '.join(job) or 'none'})",
        hint="correct that override; `python -m reprotrain.train --cfg job` (or --cfg hydra) "
        "prints every key with its value",
    )
