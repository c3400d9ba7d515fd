"""The config: each default set in one place (conf/), the schema holding types and ranges
only; a single run validated once, by the app; a sweep's every job checked before the first
one starts; a mistake in an override one line, decided from the config and the parsed override."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import OmegaConf

from reprotrain import cli, overrides, schema
from reprotrain.errors import ConfigError
from reprotrain.project import conf_folder
from reprotrain.schema import (
    FIXED,
    PACKAGE_CONF,
    as_dict,
    section_defaults,
    target_kwargs,
    train_config,
    validate,
)

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


def yaml_of(section: str, option: str = "default") -> dict[str, Any]:
    tree = OmegaConf.to_container(OmegaConf.load(PACKAGE_CONF / section / f"{option}.yaml"))
    assert isinstance(tree, dict)
    return tree


@pytest.mark.parametrize("section", sorted(FIXED))
def test_the_schema_holds_no_default_of_a_fixed_section(section: str) -> None:
    """A default is written once, in conf/; the schema holds types, ranges and meanings."""
    assert all(field.is_required() for field in FIXED[section].model_fields.values())
    assert section_defaults(section) == composed(section)


def test_a_recorded_config_missing_a_key_validates_with_the_yaml_value() -> None:
    """A config.yaml recorded before a key existed (python -m reprotrain.reproduce)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        recorded = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    assert isinstance(recorded, dict)
    del recorded["train"]["nonfinite"], recorded["tracking"]["system_metrics"]
    del recorded["runtime"]["network"], recorded["device"]["index"]
    config = validate(recorded)
    assert config.train.nonfinite == yaml_of("train")["nonfinite"]
    assert config.tracking.system_metrics == yaml_of("tracking")["system_metrics"]
    assert config.runtime.network == yaml_of("runtime", "auto")["network"]
    assert config.device.index == yaml_of("device", "auto")["index"]


def test_train_config_defaults_are_conf_train_default_yaml() -> None:
    GlobalHydra.instance().clear()  # a library caller's process: Hydra never initialised
    assert train_config().model_dump() == yaml_of("train")
    tuned = train_config(batch_size=8, seed=3, early_stopping={"patience": 2})
    assert (tuned.batch_size, tuned.seed, tuned.early_stopping.patience) == (8, 3, 2)
    assert tuned.log_every == yaml_of("train")["log_every"]
    assert not GlobalHydra.instance().is_initialized()


@pytest.mark.parametrize(
    "knobs,expected",
    [
        (
            {"batch_size": 0},
            "batch_size=0 is out of range; allowed: an integer >= 1; fix: pass batch_size=",
        ),
        ({"precision": "fp8"}, "precision='fp8' is out of range; allowed: fp32, bf16 or fp16"),
        ({"deterministic": "maybe"}, "deterministic='maybe' is not true or false; fix: pass"),
        ({"epochz": 3}, "epochz=3 is not a setting of train; allowed: steps, epochs, batch_size"),
    ],
    ids=["out of range", "not allowed", "wrong type", "unknown keyword"],
)
def test_a_bad_knob_is_one_line_naming_the_keyword(knobs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        train_config(**knobs)
    line = str(raised.value)
    assert expected in line and "\n" not in line and "train." not in line, line
    assert raised.value.key == f"train.{next(iter(knobs))}"


@pytest.mark.parametrize(
    "section,option",
    [(section, option) for section in sorted(FIXED) for option in options(section)],
)
def test_every_option_of_a_fixed_group_sets_every_key(section: str, option: str) -> None:
    """No key of a run is left to the schema's copy of a default."""
    assert set(composed(section, f"{section}={option}")) == set(FIXED[section].model_fields)


@pytest.mark.parametrize(
    "choice",
    [f"{group}={option}" for group in ("task", "loss", "optimizer") for option in options(group)],
)
def test_every_task_loss_and_optimizer_option_validates(choice: str) -> None:
    """Each option composes with the defaults and binds to its _target_'s signature
    (task=binary, task=whole_output, loss=bce_with_logits, optimizer=lbfgs, ...)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[choice])
    config = validate(cfg)
    group, option = choice.split("=")
    source = OmegaConf.load(CONF / group / f"{option}.yaml")
    expected = source["task"]["_target_"] if group == "task" else source["_target_"]
    assert as_dict(config)[group]["_target_"] == expected


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
    """Which of the app (cli) and the overrides' check validated a composed config, each time
    one did (the app binds the schema's validate at import, the check imports it when it
    runs; the conf_digest resolver's validation, for DVC's composition, is not counted)."""
    calls: list[str] = []
    watched = (cli.__name__, overrides.__name__)
    for module in (cli, schema):
        real = module.validate

        def counted(cfg: Any, real: Any = real) -> Any:
            caller = inspect.currentframe().f_back.f_globals["__name__"]  # who asked
            if caller in watched:
                calls.append(caller)
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


OVERRIDE_MISTAKES = {
    # argv: a substring of the one-line message
    "delete a key that is not there": (
        ["~train.nosuch"],
        "'train.nosuch' cannot be deleted (given '~train.nosuch'): it is not a config key",
    ),
    "delete a null key": (["~train.resume"], "'train.resume' cannot be deleted"),
    "delete a key holding another value": (
        ["~train.steps=3"],
        f"(given '~train.steps=3'): its value is {yaml_of('train')['steps']}",
    ),
    "set a key deleted before": (
        ["~model.hidden_size", "model.hidden_size=3"],
        "'model.hidden_size' is not a config key (given 'model.hidden_size=3')",
    ),
    "one option of a list that is not there": (
        ["optimizer=[adamw,nosuch]"],
        "optimizer='nosuch' is not an option of the 'optimizer' group",
    ),
    "a sweep names the job's other values": (
        ["--multirun", "optimizer=adamw,sgd", "optimizer.betas=[0.9,0.99]"],
        "'optimizer.betas' is not a config key (given 'optimizer.betas=[0.9,0.99]') "
        "(in the sweep's job optimizer=sgd)",
    ),
    "but not the value it is about": (
        ["--multirun", "optimizer.lr=0.1,-1", "train.seed=1,2"],
        "optimizer.lr=-1 is out of range; allowed: a number > 0 (in the sweep's job train.seed=1)",
    ),
}


@pytest.mark.parametrize("argv,expected", OVERRIDE_MISTAKES.values(), ids=OVERRIDE_MISTAKES)
def test_an_override_hydra_cannot_apply_is_one_line(argv: list[str], expected: str) -> None:
    """Decided from the parsed override and the composed config (the override grammar's rules),
    not from the words of Hydra's message."""
    with pytest.raises(ConfigError) as raised:
        overrides.check(overrides.normalise(argv))
    line = str(raised.value)
    assert expected in line and "\n" not in line, line


def test_overrides_hydra_can_apply_pass() -> None:
    overrides.check(["+a.b=1", "a.b=2", "~train.steps=500", "+train.epochs=2", "++train.steps=5"])


def test_a_default_option_that_inherits_another_gives_the_merged_keys() -> None:
    """conf/runtime/docker.yaml is `defaults: [auto, _self_]` + `mode: docker`: a project whose
    config.yaml picks it (as the container tests' projects do) gets auto's keys under it,
    never a `defaults` key of its own."""
    from reprotrain.schema import _option

    merged = OmegaConf.to_container(_option("runtime", "docker"))
    assert merged == {**OmegaConf.to_container(_option("runtime", "auto")), "mode": "docker"}
    assert "defaults" not in merged
