"""Hydra's commands that only read conf/: --help, --hydra-help, --version, --info, --cfg job
and Tab completion (-sc). They print what the training app (cli.py) prints for them, from the
same conf/ folder, without importing the training code, torch or MLflow.

    reprotrain-train --help                           # the groups to choose from
    eval "$(reprotrain-train -sc install=bash)"       # Tab completion of groups and keys
    python -m reprotrain.train --cfg job model=cnn    # the composed config, nothing trained

`python -m reprotrain.train` and `reprotrain-train` start in train.py, which sends a command
line here when `prints_only` says Hydra answers it without a job, and anything else (a run, a
sweep) to cli.py.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from reprotrain import overrides
from reprotrain.errors import UserError, report_and_exit
from reprotrain.project import conf_folder, put_project_on_path

# Hydra answers these before it looks at any other flag (hydra/_internal/utils.py, _run_hydra).
ANSWERED_FIRST = {"--help", "-h", "--hydra-help", "--version"}
# These print and exit when they are the command line's one command (Hydra refuses two).
PRINT_COMMANDS = {"--info", "-i", "--shell-completion", "-sc"}
SHOW_CONFIG = {"--cfg", "-c"}
RUN_FLAGS = {"--run", "-r", "--multirun", "-m", "--experimental-rerun"}


def prints_only(argv: list[str]) -> bool:
    """Does Hydra answer this command line from the config alone, without running a job?

    `--cfg hydra` and `--cfg all` go to the training app: they print hydra.job.name, which
    Hydra takes from the module that holds the app's @hydra.main (`cli`)."""
    names = [arg.partition("=")[0] for arg in argv if arg.startswith("-")]
    if ANSWERED_FIRST.intersection(names):
        return True
    if RUN_FLAGS.intersection(names):
        return False
    commands = [name for name in names if name in PRINT_COMMANDS or name in SHOW_CONFIG]
    if len(commands) != 1:
        return False  # a run, or two commands (Hydra's own error)
    return commands[0] in PRINT_COMMANDS or shown_config(argv) == "job"


def shown_config(argv: list[str]) -> str:
    """The value of `--cfg job`, `--cfg=job` or `-c job`."""
    for i, arg in enumerate(argv):
        name, given, value = arg.partition("=")
        if name in SHOW_CONFIG:
            return value if given else next(iter(argv[i + 1 : i + 2]), "")
    return ""


@hydra.main(config_path=str(conf_folder()), config_name="config", version_base="1.3")
def config_app(cfg: DictConfig) -> None:
    """The training app's config folder and name (cli.py) with no job: for every command line
    `prints_only` accepts, Hydra prints and exits before a job would start."""
    raise RuntimeError("reprotrain.config_app runs no job; train with python -m reprotrain.train")


def main(argv: list[str]) -> None:
    """As cli.main prepares a command line (the project on the path, flags first, one-line
    errors), then Hydra prints what it is asked for."""
    put_project_on_path()
    argv = overrides.normalise(argv)
    try:
        overrides.check(argv)  # --cfg job: a composition's mistake as one line
    except UserError as error:
        report_and_exit(error)
    sys.argv = [sys.argv[0], *argv]
    config_app()
