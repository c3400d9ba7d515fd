"""Command-line overrides checked before Hydra starts any job.

Hydra reports a bad override as several lines (or a traceback); reprotrain first checks
the syntax, every group option, and every job of a sweep against the schema, so any
mistake is one line and no job of a sweep starts when another would fail.
"""

from __future__ import annotations

import re
from pathlib import Path

from reprotrain.errors import ConfigError
from reprotrain.project import find_root, register_resolvers
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
    if any(arg.split("=")[0] in _INFO_FLAGS for arg in argv):
        return
    flags, args = _split_flags(argv)
    multirun = "--multirun" in flags or "-m" in flags
    config_dir = Path(flags.get("--config-dir") or flags.get("-cd") or find_root() / "conf")
    config_name = flags.get("--config-name") or flags.get("-cn") or "config"
    config_path = flags.get("--config-path") or flags.get("-cp")
    if config_path:
        config_dir = Path(config_path)
    parsed = _parse(args)
    _check_groups(parsed, find_root() / "conf")
    for job in _jobs(parsed, multirun):
        _compose_and_validate(config_dir.resolve(), config_name, job)


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


def _parse(args: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for arg in args:
        try:
            parsed += parser.parse_overrides([arg])
        except OverrideParseException as error:
            reason = str(error).splitlines()[0]
            raise ConfigError(
                f"cannot parse the override {arg!r}: {reason}",
                hint="overrides look like key=value, group=option, +new.key=value or a=1,2 for sweeps; "
                "quote values with spaces",
            ) from None
    return parsed


def _check_groups(parsed: list, conf_dir: Path) -> None:
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()} if conf_dir.is_dir() else set()
    for override in parsed:
        key = override.key_or_group
        if key not in groups or override.is_delete():
            continue
        options = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
        for value in values:
            if value not in options and value != "null":
                raise ConfigError(
                    f"{key}={value!r} is not an option of the {key!r} group; allowed: {', '.join(options)}",
                    hint=f"pick one of those, or add conf/{key}/{value}.yaml",
                )


def _jobs(parsed: list, multirun: bool) -> list[list[str]]:
    sweeps = [p for p in parsed if p.is_sweep_override()]
    if sweeps and not multirun:
        raise ConfigError(
            f"{sweeps[0].input_line!r} lists several values, which needs a sweep",
            hint="add --multirun (or -m) to run one job per value",
        )
    if not multirun:
        return [[p.input_line for p in parsed]]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(job) for batch in batches for job in batch]


def _compose_and_validate(config_dir: Path, config_name: str, job: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    overrides = [o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except (OmegaConfBaseException, ValueError, KeyError) as error:
        raise _composition_error(error, job) from None
    except Exception as error:  # hydra.errors.* composition failures
        if type(error).__module__.startswith("hydra"):
            raise _composition_error(error, job) from None
        raise
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)


def _composition_error(error: Exception, job: list[str]) -> ConfigError:
    text = str(error)
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        given = next((o for o in job if o.split("=")[0].lstrip("+~") == key), key)
        return ConfigError(
            f"{key!r} is not a config key (given {given!r})",
            hint="check the spelling; `python -m reprotrain.train --cfg job` lists every key "
            f"(to add a new key on purpose, write +{given})",
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
    return ConfigError("; ".join(lines[:3]) + f" (overrides: {' '.join(job) or 'none'})")
