"""DVC stage `prepare`: write the dataset the `data` config builds to data/dataset.npz.

    python -m reprotrain.prepare                 # reads the `data` section of params.yaml
    python -m reprotrain.prepare --params other.yaml --out data/other.npz

DVC hashes the file (dvc.lock), so the data is versioned like code; training reads it back
with data.file=data/dataset.npz and records the same md5 as the run's `data.hash` tag. The
stage depends on the folder `data_files` names (the files the data `_target_` reads), so an
edited data file re-runs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from reprotrain.build import build_data, build_reading
from reprotrain.data import write_npz
from reprotrain.errors import ConfigError, UserError, report_and_exit
from reprotrain.schema import Config, validate

DEFAULT_OUT = Path("data/dataset.npz")


def read_config(params: Path) -> Config:
    if not params.is_file():
        raise ConfigError(
            f"params file {str(params)!r} does not exist",
            hint="run `dvc exp run` to compose it from conf/, or pass --params",
        )
    try:
        tree = OmegaConf.load(params)
    except Exception as error:  # unreadable YAML: say which file, one line
        raise ConfigError(
            f"{str(params)!r} is not valid YAML: {str(error).splitlines()[0]}"
        ) from None
    if not isinstance(tree, DictConfig):
        raise ConfigError(
            f"{str(params)!r} holds a YAML list, not a config (a mapping of sections)",
            hint="run `dvc exp run` to compose it from conf/, or pass --params",
        )
    config = validate(tree)
    config.data["file"] = None  # prepare always builds from the source, never from a prepared file
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    try:
        config = read_config(args.params)
        splits = build_data(config)
        md5 = write_npz(splits, args.out, build_reading(config.data).collate_fn)
    except UserError as error:
        report_and_exit(error)
    print(
        f"prepared {config.data['_target_']}: {len(splits.train)} train / {len(splits.val)} "
        f"validation samples -> {args.out} (md5 {md5})"
    )


if __name__ == "__main__":
    main()
