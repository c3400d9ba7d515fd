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

What was wrong is decided from what Hydra's API gives plugin authors, never from the words
of a message: the parsed `Override`s, each group's options, the composed config, and a
`MissingConfigException`'s file. A job that does not compose is explained by the override
grammar's rules, applied as Hydra applies them (`_first_refused`)."""

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
    RangeSweep,
    Transformer,
)
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from reprotrain.errors import ConfigError, shown
from reprotrain.project import conf_folder, register_resolvers

# Hydra's flags that print something and exit (nothing to check), and those taking a value.
_HELP_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--version"}
_INFO_FLAGS = _HELP_FLAGS | {"--shell-completion", "-sc"}
_CONFIG_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}
_VALUE_FLAGS = _CONFIG_FLAGS | {"--cfg", "-c", "--package", "-p", "--experimental-rerun"}
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
    """A single run: Hydra's composition of it (Hydra's own settings included), each error
    one line. Its schema is the app's to check, once (cli.py)."""
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
        every = list({**configs.sweeper_params(axes, hydra), **axes}.values())
        given = {axis.group: axis.given for axis in every}
        for job in _jobs([axis.overrides for axis in every]):
            swept = {a.group: o for a, o in zip(every, job, strict=True) if a.sweep}
            configs.validate_job(job, given, swept)


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

    def is_group(self, override: Override) -> bool:
        """Does it choose a group's option (Hydra's defaults list), not set a config key?"""
        return bool(self.options(override.key_or_group))

    def axes(self, overrides: list[Override], source: str = "") -> dict[str, _Axis]:
        """Each override as an axis (the last one given for a key wins)."""
        return {axis.key: axis for axis in (self.axis(o, source) for o in overrides)}

    def axis(self, override: Override, source: str = "") -> _Axis:
        key = override.get_key_element()
        given = repr(override.input_line) + (f" in {source}" if source else "")
        group = override.key_or_group
        if override.is_delete():
            return _Axis(key, group, [override.input_line or key], given)
        if not override.is_sweep_override():
            return _Axis(key, group, [f"{key}={override.get_value_element_as_str()}"], given)
        sweep = override.value()
        if isinstance(sweep, Glob):
            values: list = sweep.filter(self.options(group))
            if not values:
                raise ConfigError(
                    f"{given} matches no option of the {group!r} group; allowed: "
                    f"{', '.join(self.options(group)) or 'none'}",
                    hint="change the glob pattern, or add a matching option file",
                    key=group,
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
                key=group,
            )
        strings = [Transformer.str(value) for value in values]
        return _Axis(key, group, [f"{key}={s}" for s in strings], given, sweep=True)

    def sweeper_params(self, axes: dict[str, _Axis], hydra: list[Override]) -> dict[str, _Axis]:
        """The search space the composed config sets under hydra.sweeper.params.

        Hydra's sweepers read it from the config composed without the command line's
        sweeps, and take each entry as a `key=value` override (basic and Optuna alike).
        """
        fixed = [axis.overrides[0] for axis in axes.values() if not axis.sweep]
        given = {axis.group: axis.given for axis in axes.values()}
        hydra_fixed = _lines([p for p in hydra if not p.is_sweep_override()])
        try:
            cfg = self.compose([*fixed, *hydra_fixed], given, with_hydra=True)
        except ConfigError:
            # A wrong hydra.* setting is Hydra's to report; the group choices
            # (hydra/sweeper=optuna) still decide which sweeper settings exist.
            groups = [p for p in hydra if not p.is_sweep_override() and self.is_group(p)]
            cfg = self.compose([*fixed, *_lines(groups)], given, with_hydra=True)
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
        lines = [f"{key!s}={value}" for key, value in params.items()]
        parsed = _parse(lines, source=_PARAMS_SOURCE)
        return self.axes([p for p in parsed if not p.is_hydra_override()], _PARAMS_SOURCE)

    def validate_job(self, job: list[str], given: dict[str, str], swept: dict[str, str]) -> None:
        """Compose and validate one job; an error in a sweep names the job's other swept values
        (`optimizer.betas` is not a key *of the job optimizer=sgd*). `swept`: key -> this
        job's override of it."""
        # Imported for a sweep only: the schema brings torch, which the commands that only
        # print from conf/ (--help, Tab completion: config_app.py) never need (seconds).
        from reprotrain.schema import validate

        try:
            validate(self.compose(job, given))
        except ConfigError as error:
            others = [override for key, override in swept.items() if key != error.key]
            if not others:
                raise
            message = f"{error.message} (in the sweep's job {' '.join(others)})"
            raise ConfigError(message, hint=error.hint, key=error.key) from None

    def compose(
        self, overrides: list[str], given: dict[str, str], with_hydra: bool = False
    ) -> DictConfig:
        try:
            return self._compose(overrides, with_hydra)
        except (OmegaConfBaseException, HydraException, ValueError, KeyError) as error:
            raise self.explain(error, overrides, given) from None

    def _compose(self, overrides: list[str], with_hydra: bool) -> DictConfig:
        return compose(
            config_name=self.config_name,
            overrides=[*self.search, *overrides],
            return_hydra_config=with_hydra,
        )

    def explain(self, error: Exception, job: list[str], given: dict[str, str]) -> ConfigError:
        """Why Hydra could not compose `job`, as one line: a config file that is not there, or
        the first override the grammar refuses on the config the job's group choices compose
        (Hydra applies the other overrides to that config, in the order given)."""
        if isinstance(error, MissingConfigException):  # the file is `group/option`, or the
            path = error.missing_cfg_file or self.config_name  # primary config's name
            group, _, name = path.rpartition("/")
            options = self.options(group) if group else []
            if not options:
                hint = "check --config-dir/--config-name"
                return ConfigError(f"config {path!r} was not found", hint=hint, key=path)
            shown = f" (given {given[group]})" if group in given else ""
            return ConfigError(
                f"{group}={name!r} is not an option of the {group!r} group{shown}; allowed: "
                f"{', '.join(options)}",
                hint=f"pick one of those, or add conf/{group}/{name}.yaml",
                key=group,
            )
        parsed = _parse(job, source="the command line")
        try:
            cfg = self._compose(_lines([o for o in parsed if self.is_group(o)]), with_hydra=True)
        except (OmegaConfBaseException, HydraException, ValueError, KeyError):
            return _unexplained(error, job)
        keys = [o for o in parsed if not self.is_group(o)]
        return _first_refused(cfg, keys, given) or _unexplained(error, job)


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
        (
            list(value)
            for p in hydra_overrides
            if p.get_key_element() == "hydra.searchpath" and isinstance(value := p.value(), list)
        ),
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


def _lines(overrides: list[Override]) -> list[str]:
    return [str(override.input_line) for override in overrides]


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
        except (OverrideParseException, ValueError) as error:  # ValueError: a 5,000-digit int
            reason = str(error).splitlines()[0][:200]
            where = "" if source == "the command line" else f" in {source}"
            raise ConfigError(
                f"cannot parse the override {shown(arg)}{where}: {reason}",
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


_ABSENT = object()  # what OmegaConf.select returns here for a key the config does not have


def _first_refused(
    cfg: DictConfig, overrides: list[Override], given: dict[str, str]
) -> ConfigError | None:
    """The first of `overrides` that the override grammar refuses on `cfg`, each applied in
    turn (hydra.cc: Override grammar, Basic): `key=v` changes a key the config has, `+key=v`
    adds one it lacks (or one that is null), `++key=v` either, `~key` removes a key that is
    set (`~key=v`: only while its value is v). None when each applies (or one names a
    package): Hydra's own first lines then say what went wrong."""
    for override in overrides:
        if override.package is not None:
            return None
        key, value = override.key_or_group, override.value()
        shown = given.get(key) or repr(override.input_line)
        current = OmegaConf.select(
            cfg, key, default=_ABSENT, throw_on_missing=False, throw_on_resolution_failure=False
        )
        is_set = current is not None and current is not _ABSENT
        if override.is_delete():
            if not is_set or (value is not None and value != current):
                was = "null" if current is None else repr(current)
                why = "it is not a config key" if current is _ABSENT else f"its value is {was}"
                fix = f"write ~{key} to delete it whatever its value" if is_set else "drop it"
                return ConfigError(
                    f"{key!r} cannot be deleted (given {shown}): {why}",
                    hint=f"{fix}; `python -m reprotrain.train --cfg job` lists every key",
                    key=key,
                )
            parent, _, name = key.rpartition(".")
            with open_dict(cfg):
                del (OmegaConf.select(cfg, parent) if parent else cfg)[name]
            continue
        if override.is_add() and is_set and not isinstance(value, dict | list):
            return ConfigError(  # a mapping or a list given with + merges into the key
                f"{key!r} is already a config key (given {shown}): + adds a new key only",
                hint=f"drop the + ({key}=...), or write ++{key}=... to add or override it",
                key=key,
            )
        plain = not (override.is_add() or override.is_force_add())
        try:
            OmegaConf.update(cfg, key, value, merge=True, force_add=not plain)
        except (ConfigAttributeError, ConfigKeyError):
            if not plain:
                return None
            return ConfigError(
                f"{key!r} is not a config key (given {shown})",
                hint="check the spelling; `python -m reprotrain.train --cfg job` lists every key "
                f"(to add a new key on purpose, write +{key}=...)",
                key=key,
            )
        except OmegaConfBaseException:
            return None  # a value the key does not take: Hydra's first lines say which
    return None


def _unexplained(error: Exception, job: list[str]) -> ConfigError:
    """Hydra's own words, one line: the first line of its error and of the error's cause
    (`Error merging override a=b` keeps what was wrong with b in its cause)."""
    causes = (error, error.__cause__)
    reasons = [str(e).strip().splitlines()[0] for e in causes if e is not None and str(e).strip()]
    return ConfigError(
        "; ".join(reasons) + f" (overrides: {' '.join(job) or 'none'})",
        hint="correct that override; `python -m reprotrain.train --cfg job` (or --cfg hydra) "
        "prints every key with its value",
    )
