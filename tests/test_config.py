"""The config: each default set in one place (conf/), which the schema agrees with; a single
run validated once, by the app; a sweep's every job checked before the first one starts."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_object
from omegaconf import OmegaConf

from reprotrain import cli, overrides
from reprotrain.project import conf_folder
from reprotrain.schema import FIXED, target_kwargs

CONF = conf_folder()


def composed(section: str, *overrides: str) -> dict[str, Any]:
    """One section of conf/config.yaml as Hydra composes it (the app's and DVC's source)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    tree = OmegaConf.to_container(cfg[section], resolve=True)
    assert isinstance(tree, dict)
    return tree


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("section", sorted(FIXED))
def test_schema_defaults_are_the_yaml_defaults(section: str) -> None:
    schema = {name: field.default for name, field in FIXED[section].model_fields.items()}
    assert composed(section) == schema, f"change conf/{section}/ and schema.py together"


@pytest.mark.parametrize(
    "section,option",
    [(section, option) for section in sorted(FIXED) for option in options(section)],
)
def test_every_option_of_a_fixed_group_sets_every_key(section: str, option: str) -> None:
    """No key of a run is left to the schema's copy of a default."""
    assert set(composed(section, f"{section}={option}")) == set(FIXED[section].model_fields)


def standalone(group: str) -> list[str]:
    """The options that name their own _target_ (not a variant of another option)."""
    return [
        o for o in options(group) if "defaults" not in OmegaConf.load(CONF / group / f"{o}.yaml")
    ]


@pytest.mark.parametrize("option", standalone("data"))
def test_builtin_data_yaml_repeats_its_function_defaults(option: str) -> None:
    node = composed("data", f"data={option}")
    parameters = inspect.signature(get_object(node["_target_"])).parameters
    defaults = {name: p.default for name, p in parameters.items() if p.default is not p.empty}
    given = {k: v for k, v in target_kwargs("data", node).items() if k in defaults}
    assert given == {k: defaults[k] for k in given}, f"conf/data/{option}.yaml"


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which module validated a composed config, each time one did."""
    calls: list[str] = []
    for module in (cli, overrides):
        real = module.validate

        def counted(cfg: Any, real: Any = real, name: str = module.__name__) -> Any:
            calls.append(name)
            return real(cfg)

        monkeypatch.setattr(module, "validate", counted)
    return calls


def smoke(tmp_path: Path, *args: str) -> list[str]:
    return [
        "runtime=local",
        "experiment=smoke",
        "tracking.enabled=false",
        f"train.output_dir={tmp_path / 'results'}",
        *args,
    ]


def test_a_single_run_is_validated_once_by_the_app(
    tmp_path: Path, app_in_process, validations: list[str]
) -> None:
    # A config that passes the schema and fails later (the data file): every check ran.
    result = app_in_process(*smoke(tmp_path, "data.file=/nonexistent/data.npz"))
    assert result.returncode == 2 and "does not exist" in result.stderr, result.stderr[-3000:]
    assert validations == ["reprotrain.cli"]


def test_a_sweep_checks_every_job_before_the_first_starts(
    tmp_path: Path, app_in_process, validations: list[str]
) -> None:
    result = app_in_process("--multirun", *smoke(tmp_path, "optimizer.lr=0.1,-1"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "optimizer.lr=-1 is out of range" in errors[0]
    assert validations == ["reprotrain.overrides"] * 2  # no job reached the app
    assert not (tmp_path / "outputs" / "multirun").exists()
