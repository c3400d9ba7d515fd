"""Config errors found by the schema (reprotrain.schema.validate) on configs that Hydra really
composes from conf/ (hydra.compose): a typed config back for a good one, one ConfigError line
(what was given, what is allowed, the fix) for each kind of bad one, before anything is built.
(The same mistakes through the command line: test_bad_input.)"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from reprotrain.errors import ConfigError, UserError
from reprotrain.project import conf_folder
from reprotrain.schema import validate


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(conf_folder()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_default_config_comes_back_typed() -> None:
    config = validate(composed("experiment=smoke", "optimizer=sgd", "scheduler=cosine"))
    assert config.train.steps == 20 and isinstance(config.train.batch_size, int)
    assert config.train.epochs is None and config.device.type in ("auto", "cpu", "cuda", "mps")
    assert config.optimizer["_target_"] == "torch.optim.SGD"
    assert float(config.optimizer["lr"]) > 0
    assert config.scheduler["_target_"] == "torch.optim.lr_scheduler.CosineAnnealingLR"
    assert config.model["_target_"] == "reprotrain.models.MLP"


def test_a_plain_dict_validates_as_its_composed_config() -> None:
    """What a recorded config.yaml or params.yaml holds validates as the composed one."""
    from omegaconf import OmegaConf

    cfg = composed("experiment=smoke")
    tree = OmegaConf.to_container(cfg, resolve=True)
    assert validate(tree) == validate(cfg)


BAD = {
    # overrides: what the one line names
    "negative lr": (["optimizer.lr=-1"], "optimizer.lr=-1 is out of range; allowed: a number > 0"),
    "infinite lr": (["optimizer.lr=inf"], "optimizer.lr=inf is out of range; allowed: a finite"),
    "zero batch size": (["train.batch_size=0"], "train.batch_size=0 is out of range"),
    "negative seed": (["train.seed=-5"], "train.seed=-5 is out of range"),
    "steps and epochs": (["train.epochs=2"], "set exactly one"),
    "unknown non-finite mode": (["train.nonfinite=maybe"], "train.nonfinite='maybe' is out of"),
    "bf16 and deterministic": (["train.precision=bf16"], "change the arithmetic"),
    "fp16 on the cpu": (
        ["device=cpu", "train.precision=fp16", "train.deterministic=false"],
        "train.precision=fp16 needs a CUDA GPU (its GradScaler), but device=cpu",
    ),
    "tf32 on the cpu": (
        ["device=cpu", "train.tf32=true", "train.deterministic=false"],
        "train.tf32=true needs a CUDA GPU",
    ),
    "compile and cuda graphs": (
        ["train.compile=true", "train.cuda_graphs=true"],
        "train.compile=true and train.cuda_graphs=true: pick one",
    ),
    "objective not measured": (["train.objective=val/f1"], "is not a figure this run measures"),
    "early stopping without validation": (
        ["train.early_stopping={patience:2}"],
        "train.early_stopping needs validation during training, but train.val_every=0",
    ),
    "plateau without a monitor": (
        ["scheduler=plateau", "~scheduler.monitor", "train.val_every=5"],
        "is stepped with a validation figure, but scheduler.monitor is not set",
    ),
    "unknown section": (["+unknown=1"], "unknown=1 is not a config section or key"),
    "parameter the optimizer lacks": (
        ["+optimizer.momentum=0.9"],
        "optimizer.momentum=0.9 is not a parameter of torch.optim.AdamW",
    ),
    "size not a number": (["model.hidden_size=abc"], "model.hidden_size='abc' is not an integer"),
    "loss of another kind": (
        ["loss._target_=collections.OrderedDict"],
        "is a collections.OrderedDict, not a torch.nn",
    ),
    "target that does not import": (
        ["model._target_=nosuch_package.Net"],
        "model._target_='nosuch_package.Net' cannot be imported",
    ),
    "a negative validation cadence": (
        ["train.val_every=-1"],
        "train.val_every=-1 is out of range; allowed: epoch or an integer >= 0",
    ),
    "a nested key out of range": (
        ["train.val_every=5", "train.early_stopping={patience:-1}"],
        "train.early_stopping.patience=-1 is out of range; allowed: an integer >= 1; fix: give "
        "train.early_stopping.patience=<an integer >= 1>",
    ),
    "a name longer than MLflow takes": (
        ["tracking.experiment=" + "x" * 100_000],
        "... (100,002 characters) is out of range; allowed: at most 500 characters",
    ),
}


@pytest.mark.parametrize("overrides,expected", BAD.values(), ids=BAD.keys())
def test_a_bad_value_is_one_config_error_line_naming_it(
    overrides: list[str], expected: str
) -> None:
    cfg = composed(*overrides)
    with pytest.raises(ConfigError) as raised:
        validate(cfg)
    line = raised.value.one_line()
    assert expected in line, line
    assert len(line) < 600  # a huge value is cut, its length said
    assert "\n" not in line and "; fix: " in line  # what to do about it, on the same line
    assert isinstance(raised.value, UserError)  # printed as one line, exit code 2


def test_a_number_too_long_to_parse_is_one_short_line(app_in_process) -> None:
    result = app_in_process("runtime=local", "experiment=smoke", "train.steps=" + "9" * 5000)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("reprotrain: error: cannot parse the override 'train.steps=999")
    assert "(5,014 characters)" in line and len(line) < 600


def test_a_language_model_task_on_one_label_per_sample_is_one_line(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Classification data and a classifier under task=language_model would train silently
    as a classifier, its perplexity meaningless: refused before the first step."""
    import reprotrain

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        reprotrain.train(
            [
                "runtime=local",
                "experiment=smoke",
                "task=language_model",
                f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            ]
        )
    assert "task=language_model takes a sequence of target tokens per sample, but the " in str(
        refused.value
    )
    assert "task=classification" in refused.value.hint
