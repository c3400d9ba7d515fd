"""What a composed config may hold, checked before any work starts.

Two kinds of section:

- **Fixed sections** (`device`, `train`, `tracking`, `runtime`) are pydantic models below:
  a wrong type, an unknown key or an out-of-range value is one `ConfigError` line naming
  the key, the value given and what is allowed. The models hold types, ranges and what each
  key means; every default lives in conf/ only, in the YAML of the option conf/config.yaml's
  defaults list picks for the section (what `--cfg job` prints and DVC composes).
  `section_defaults` reads it (OmegaConf, no Hydra): it fills in a key that a config recorded
  before the key existed lacks (`python -m reprotrain.reproduce`), and `train_config` builds
  the train section of a run made in Python (`reprotrain.Trainer(..., batch_size=64)`).
- **`_target_` sections** (`model`, `data`, `loss`, `optimizer`, `scheduler`) name a Python
  callable, Hydra's convention (`hydra.utils.instantiate`). `check_target` imports it and
  binds the given keys to its signature, so a key the callable does not take, or a target
  that does not import, fails here, before any data is loaded.

`validate(cfg)` runs both on a composed config (Hydra's, a composed `params.yaml`, or a
recorded `config.yaml`) and returns a typed `Config`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import types
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from reprotrain.errors import ConfigError, shown
from reprotrain.project import PACKAGE_ROOT
from reprotrain.trust import KINDS, check_function

# The checkout (src/reprotrain/ -> ..): its conf/ holds the defaults of the fixed sections.
PACKAGE_CONF = PACKAGE_ROOT / "conf"
# Keys Hydra's instantiate reads itself; never passed to the target.
HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
# Keys reprotrain reads in a target section, never passed to the target (see conf/).
RESERVED = {
    # file: a prepared .npz (python -m reprotrain.prepare) read instead; collate_fn: how items
    # become a batch (a _target_); shuffle: false reads every epoch in order
    "data": ("file", "collate_fn", "shuffle"),
    # interval: step the scheduler every optimizer `step` or every `epoch`; monitor: the
    # validation figure a metric-driven scheduler (ReduceLROnPlateau) is stepped with
    "scheduler": ("interval", "monitor"),
}
# Model constructor arguments reprotrain fills in from the data when the YAML leaves them out.
DATA_SIZES = ("in_features", "input_shape", "in_channels", "num_classes")
# What a run can return to a sweeper (train.objective): these, or val/<a metric's name>.
OBJECTIVES = ("val/loss", "train/loss")

Seed = Annotated[int, Field(ge=0, lt=2**32)]  # numpy's seeds are 32-bit
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
Unit = Annotated[float, Field(ge=0.0, lt=1.0)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DeviceConfig(Section):
    type: str  # auto -> cuda, else mps, else cpu; "cuda:1" is read as cuda, index 1
    index: NonNegativeInt | None  # which GPU; None = the current one (cuda:0)

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda", "mps") and not re.fullmatch(r"cuda:\d+", value):
            raise ValueError("allowed: auto, cpu, cuda, cuda:N, mps")
        return value


class EarlyStoppingConfig(Section):
    """train.early_stopping: null (off) or these keys; its defaults live here, the one place,
    since the section's YAML leaves it null."""

    patience: PositiveInt = 3  # validations without improvement before the run stops
    min_delta: NonNegative = 0.0  # an improvement must exceed this


class TrainConfig(Section):
    steps: PositiveInt | None  # optimizer steps; or null and set epochs
    epochs: PositiveInt | None
    batch_size: PositiveInt  # per process
    seed: Seed
    log_every: PositiveInt  # one host sync per N steps, not per step
    warmup_steps: NonNegativeInt  # kept out of the timing summary
    output_dir: str | None  # None: Hydra's run folder (each sweep job its own)
    checkpoint_dir: str  # <run id>.pt, found again by train.resume
    deterministic: bool
    progress: Literal["auto", "bar", "lines", "off"]
    resident_data: Literal["auto"] | bool  # the whole dataset on the device
    num_workers: NonNegativeInt  # DataLoader worker processes (streamed data only)
    pin_memory: bool  # page-locked host batches for faster copies to a GPU
    persistent_workers: bool  # keep DataLoader workers between epochs
    threads: Literal["auto"] | PositiveInt  # auto: the CPUs this process may use
    checkpoint_every: NonNegativeInt  # steps between checkpoints (0: no step cadence)
    checkpoint_every_s: NonNegative  # seconds between them (0: no time cadence)
    # Data-parallel training (torchrun): processes per machine, collective backend, timeout.
    nproc: Literal["auto"] | PositiveInt  # runtime=docker starts torchrun with this many
    backend: Literal["auto", "nccl", "gloo"]  # auto: nccl on CUDA, gloo on the CPU
    dist_timeout_s: Positive  # a collective that waits longer fails the run
    resume: str | None  # an MLflow run id, or "last", to continue from its checkpoint
    nonfinite: Literal["stop", "warn"]  # a NaN/inf loss: stop (FAILED) or log and go on
    objective: str  # val/loss, train/loss or val/<metric>: sweeps, best, stopping
    # Validation during training, and what it drives
    val_every: Literal["epoch"] | NonNegativeInt  # steps between validations (0: at the end)
    val_batch_size: PositiveInt | None  # None: batch_size (val/loss on train/loss's scale)
    early_stopping: EarlyStoppingConfig | None  # stop when the objective stalls
    keep_best: bool  # outputs and MLflow Model from the best validation's weights
    # The step's knobs
    clip_grad_norm: Positive | None  # clip the gradients' total norm before each step
    accumulate_grad_batches: PositiveInt  # micro-batches per optimizer step
    # Fast paths that change how (or in what precision) the step is computed: off in conf/.
    compile: bool  # torch.compile the model (forward and backward)
    cuda_graphs: bool  # capture the whole step once, replay it every step (CUDA)
    precision: Literal["fp32", "bf16", "fp16"]  # forward and loss under autocast
    tf32: bool  # TF32 tensor-core matmuls (CUDA, Ampere and newer)

    @field_validator("resume")
    @classmethod
    def _resume(cls, value: str | None) -> str | None:
        if value is not None and value != "last" and not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            raise ValueError("allowed: last, or an MLflow run id (letters, digits, - and _)")
        return value


class TrackingConfig(Section):
    uri: str | None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<project>/mlflow.db
    experiment: Annotated[str, Field(min_length=1, max_length=500, pattern=r"\S")]  # MLflow's limit
    run_name: str | None  # None: <model>-<optimizer>-<device>, plus what a sweep varies
    enabled: bool
    flush_every_s: Positive  # send buffered metrics at least this often
    connect_timeout_s: Positive
    loss_every: PositiveInt  # train/loss points: every step (1) or the mean of N steps
    log_model: bool  # an MLflow Model under `model` (mlflow.pytorch.load_model)
    system_metrics: bool  # MLflow's system/* metrics: CPU, memory, GPU (every 10 s)
    register_as: str | None  # also register that model under this name


class RuntimeConfig(Section):
    mode: Literal["auto", "docker", "local"]
    shm_size: str  # DataLoader workers share batches through /dev/shm
    cpus: Positive | None  # --cpus for the container; None: no quota
    network: Literal["auto", "none", "host"]  # auto: none unless the store is on the network


class OptimizerRanges(BaseModel):
    """Ranges of the hyperparameters most optimizers share; other keys go to the signature."""

    model_config = ConfigDict(extra="allow")
    lr: Positive | None = None
    eps: Positive | None = None
    weight_decay: Annotated[float, Field(ge=0.0)] | None = None
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    betas: tuple[Unit, Unit] | None = None  # each in [0, 1)

    @field_validator("lr", "eps", "weight_decay")
    @classmethod
    def _finite(cls, value: float | None, info: ValidationInfo) -> float | None:
        """`optimizer.lr=inf` passes `> 0` and fails at step 2 as a NaN loss: refused here."""
        if value is not None and not math.isfinite(value):
            bound = ">= 0" if info.field_name == "weight_decay" else "> 0"
            raise ValueError(f"allowed: a finite number {bound}")
        return value


DEFAULT_TASK = {"_target_": "reprotrain.tasks.Classification"}
# `code` where a project names none: reprotrain's built-in models (README: Your own code).
DEFAULT_CODE = "src/reprotrain/models"
# `data_files` where a project names none: the folder for the files a data _target_ reads.
DEFAULT_DATA_FILES = "data/raw"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: dict[str, Any]
    data: dict[str, Any]
    loss: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None = None
    task: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_TASK))
    metrics: dict[str, dict[str, Any]] = Field(default_factory=dict)  # name -> _target_ node
    callbacks: dict[str, dict[str, Any]] = Field(default_factory=dict)  # name -> _target_ node
    device: DeviceConfig
    train: TrainConfig
    tracking: TrackingConfig
    runtime: RuntimeConfig
    conf_digest: str | None = None  # conf/'s digest when composed into params.yaml by DVC
    code: str = DEFAULT_CODE  # the project's own code (a folder): the DVC stages depend on it
    data_files: str = DEFAULT_DATA_FILES  # the files your data reads: the prepare stage's dep


FIXED: dict[str, type[Section]] = {
    "device": DeviceConfig,
    "train": TrainConfig,
    "tracking": TrackingConfig,
    "runtime": RuntimeConfig,
}
TARGETS = ("model", "data", "loss", "optimizer", "scheduler")


def section_defaults(section: str) -> dict[str, Any]:
    """A fixed section's defaults: the YAML of the option that conf/config.yaml's defaults
    list names for it (`train: default` -> conf/train/default.yaml), read once with OmegaConf;
    no Hydra composition, so it needs no initialised Hydra. A fresh copy on each call."""
    return copy.deepcopy(_section_defaults(section))


@functools.cache
def _section_defaults(section: str) -> dict[str, Any]:
    if section not in FIXED:
        raise ValueError(f"section_defaults({section!r}): allowed: {', '.join(FIXED)}")
    tree = OmegaConf.to_container(_option(section, _default_options()[section]))
    assert isinstance(tree, dict)
    return cast(dict[str, Any], tree)  # a YAML mapping's keys are strings


def _option(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml with the options its own defaults list names in that group
    merged under it, in the list's order (`defaults: [auto, _self_]`: auto's keys, then its
    own), as Hydra composes a group option."""
    node = OmegaConf.load(PACKAGE_CONF / group / f"{option}.yaml")
    assert isinstance(node, DictConfig)
    entries = node.pop("defaults", None) or ["_self_"]
    if "_self_" not in entries:
        entries = [*entries, "_self_"]
    parts = [node if entry == "_self_" else _option(group, str(entry)) for entry in entries]
    merged = OmegaConf.merge(OmegaConf.create(), *parts)
    assert isinstance(merged, DictConfig)
    return merged


@functools.cache
def _default_options() -> dict[str, str]:
    """Group -> option, from conf/config.yaml's defaults list (`- train: default`)."""
    entries = OmegaConf.select(OmegaConf.load(PACKAGE_CONF / "config.yaml"), "defaults") or []
    return {
        str(group): str(option)
        for entry in entries
        if isinstance(entry, DictConfig)
        for group, option in entry.items()
    }


def train_config(**knobs: Any) -> TrainConfig:
    """The train section of a run made in Python (`reprotrain.Trainer(..., batch_size=64)`):
    conf/train/default.yaml's values with `knobs` over them, checked. A wrong or unknown knob
    is one ConfigError line naming the keyword (`batch_size=0`)."""
    node = {**section_defaults("train"), **knobs}
    try:
        return TrainConfig(**node)
    except ValidationError as error:
        raise _one_line("train", error, node, keyword=True) from None


def validate(cfg: DictConfig | dict) -> Config:
    """Check a composed config; return it typed, or raise one ConfigError line."""
    tree = _resolved(cfg)
    unknown = sorted(set(tree) - set(Config.model_fields))
    if unknown:
        allowed = ", ".join(Config.model_fields)
        raise ConfigError(
            f"{unknown[0]}={tree[unknown[0]]!r} is not a config section or key; allowed: {allowed}",
            hint="remove it or fix the spelling (`python -m reprotrain.train --cfg job` lists every key)",
            key=unknown[0],
        )
    sections: dict[str, Any] = {}
    for name, schema in FIXED.items():
        sections[name] = _fixed(name, schema, tree.get(name))
    for name in TARGETS:
        node = tree.get(name)
        if node is None and name == "scheduler":
            sections[name] = None
            continue
        sections[name] = _target_node(name, node)
    # Sections a config recorded before they existed lacks: the behaviour of that time.
    sections["task"] = _target_node("task", tree.get("task") or dict(DEFAULT_TASK))
    for name in ("metrics", "callbacks"):
        sections[name] = _named_nodes(name, tree.get(name))
    _split_device_index(sections["device"])
    config = Config(
        **sections,
        conf_digest=tree.get("conf_digest"),
        code=_code(tree.get("code")),
        data_files=_project_path(
            "data_files",
            tree.get("data_files"),
            DEFAULT_DATA_FILES,
            "set data_files: <the folder of the files your data _target_ reads> in "
            "conf/config.yaml",
        ),
    )
    check_targets(config)
    _check_cross_field(config)
    _check_tracking_uri(config.tracking)
    return config


def _code(value: Any) -> str:
    """`code`: the folder (or file) of the project's own code, relative to the project root;
    dvc.yaml's stages depend on it (`${code}`)."""
    return _project_path(
        "code",
        value,
        DEFAULT_CODE,
        "set code: <the folder of your own code> in conf/config.yaml",
        example="my_project",
    )


def _project_path(key: str, value: Any, default: str, hint: str, example: str = "") -> str:
    """A path inside the project, relative to its root (a dvc.yaml dependency): `code`,
    `data_files`."""
    if value is None:
        return default
    if (
        not isinstance(value, str)
        or not value.strip()
        or value.startswith(("/", "~"))
        or ".." in value.split("/")
    ):
        raise ConfigError(
            f"{key}={value!r} is not a path inside the project; allowed: a folder or file "
            f"relative to the project root, e.g. {example or default}",
            hint=hint,
        )
    return value


def as_dict(config: Config) -> dict[str, Any]:
    return config.model_dump()


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optimizer': {'lr': 1e-3}} -> {'optimizer.lr': 1e-3}: MLflow params and DVC keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def target_kwargs(section: str, node: dict[str, Any]) -> dict[str, Any]:
    """The keys of a target section that go to the callable."""
    skip = (*HYDRA_KEYS, *RESERVED.get(section, ()))
    return {k: v for k, v in node.items() if k not in skip}


def drop_auto_fused(node: dict[str, Any]) -> dict[str, Any]:
    """`fused: null` means "torch's fused kernel where the optimizer has one": for an optimizer
    that takes no `fused` (NAdam, RMSprop, a user's), the key is left out, not an error."""
    if "fused" not in node or node["fused"] is not None:
        return node
    try:
        parameters = inspect.signature(get_object(node["_target_"])).parameters
    except Exception:  # not importable: check_target says so in one line
        return node
    if "fused" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return node
    return {k: v for k, v in node.items() if k != "fused"}


def check_targets(config: Config) -> None:
    """Import every `_target_` and bind its keys to the callable's signature."""
    check_target("model", config.model, provided=DATA_SIZES, kind=torch.nn.Module)
    check_target("data", config.data)
    # A loss function (`_partial_: true`) is called with the task's arguments: (predictions,
    # targets), or task.loss_args's.
    called_with = len(config.task.get("loss_args") or ("predictions", "targets"))
    check_target("loss", config.loss, positional=called_with if config.loss.get("_partial_") else 0)
    optimizer = drop_auto_fused(config.optimizer)
    check_target("optimizer", optimizer, positional=1, kind=torch.optim.Optimizer)
    _check_optimizer_ranges(config.optimizer)
    if config.scheduler is not None:
        check_target(
            "scheduler",
            config.scheduler,
            positional=1,
            kind=torch.optim.lr_scheduler.LRScheduler,
        )
        interval = config.scheduler.get("interval", "step")
        if interval not in ("step", "epoch"):
            raise ConfigError(
                f"scheduler.interval={interval!r} is not allowed; allowed: step, epoch",
                hint="scheduler.interval=step steps it after every optimizer step, epoch after each epoch",
            )
    check_target("task", config.task)
    for name, node in config.metrics.items():  # imported when built (metrics.build_metrics)
        _target_path(f"metrics.{name}", node)
    for name, node in config.callbacks.items():
        check_target(f"callbacks.{name}", node)
    collate = config.data.get("collate_fn")
    if isinstance(collate, dict):  # a function with _partial_: the loader passes the items
        check_target("data.collate_fn", collate, positional=1 if collate.get("_partial_") else 0)


def _target_path(section: str, node: dict[str, Any]) -> str:
    path = node.get("_target_")
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"{section}._target_={path!r}: the {section} section names no callable",
            hint=f"set {section}._target_ to a dotted path, e.g. with {section}=<option> from conf/{section}/",
        )
    return path


def check_target(
    section: str,
    node: dict[str, Any],
    *,
    provided: tuple[str, ...] = (),
    positional: int = 0,
    kind: type | None = None,
) -> Any:
    """Import `node['_target_']`; check its kind and that it accepts the node's keys, before
    anything calls it.

    `provided`: argument names reprotrain fills in when the node leaves them out;
    `positional`: leading arguments reprotrain passes itself (an optimizer's parameters,
    a scheduler's optimizer), which needs `_partial_: true`; `kind`: the class the target must
    build (by default the section's, trust.KINDS: a class of another kind, or a function from
    untrusted code, is refused).
    """
    path = node.get("_target_")
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"{section}._target_={path!r}: the {section} section names no callable",
            hint=f"set {section}._target_ to a dotted path, e.g. with {section}=<option> from conf/{section}/",
        )
    try:
        target = get_object(path)
    except Exception as error:  # ImportError, AttributeError, ValueError from Hydra
        cause = error.__cause__ or error
        raise ConfigError(
            f"{section}._target_={path!r} cannot be imported ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else cause!r})",
            hint="check the dotted path; your own code must be importable from the project "
            "folder (a package there, with an __init__.py) or installed",
        ) from None
    kind = kind or KINDS.get(section, (None, ""))[0]
    if kind is not None and inspect.isclass(target) and not issubclass(target, kind):
        raise ConfigError(
            f"{section}._target_={path!r} is a {target.__module__}.{target.__qualname__}, "
            f"not a {kind.__module__}.{kind.__qualname__}",
            hint=f"point {section}._target_ at a subclass of {kind.__qualname__}",
        )
    if not callable(target):
        raise ConfigError(
            f"{section}._target_={path!r} is not callable (a {type(target).__name__})",
            hint=f"point {section}._target_ at a class or a function",
        )
    check_function(section, path, target)
    if positional and node.get("_partial_") is not True:
        raise ConfigError(
            f"{section}._partial_={node.get('_partial_')!r}: reprotrain passes the "
            f"{'model parameters' if section == 'optimizer' else 'optimizer'} to {path} itself",
            hint=f"set {section}._partial_=true (see conf/{section}/)",
        )
    _bind(section, path, target, target_kwargs(section, node), provided, positional)
    return target


def _bind(
    section: str,
    path: str,
    target: Any,
    kwargs: dict[str, Any],
    provided: tuple[str, ...],
    positional: int,
) -> None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: instantiate will say what it rejects
    params = list(signature.parameters.values())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    by_position = [p for p in params if p.kind is not p.KEYWORD_ONLY][:positional]
    names = [p.name for p in named if p not in by_position]
    if not takes_any:
        for key in kwargs:
            if key not in names:
                raise ConfigError(
                    f"{section}.{key}={kwargs[key]!r} is not a parameter of {path}; "
                    f"allowed: {', '.join(names) or 'none'}",
                    hint=f"remove {section}.{key} or fix the spelling "
                    f"(`~{section}.{key}` on the command line)",
                    key=f"{section}.{key}",
                )
    for param in named:
        if param in by_position or param.default is not param.empty:
            continue
        if param.name not in kwargs and param.name not in provided:
            raise ConfigError(
                f"{section}.{param.name} is missing: {path} needs it",
                hint=f"add it to the {section} YAML or give +{section}.{param.name}=...",
                key=f"{section}.{param.name}",
            )
    for param in named:
        if param.name in kwargs and param not in by_position:
            _check_number(section, path, param, kwargs[param.name])


NUMBERS = {int: "an integer", float: "a number", "int": "an integer", "float": "a number"}


def _check_number(section: str, path: str, param: inspect.Parameter, value: Any) -> None:
    """A parameter annotated or defaulting to a number, given text, a list or a mapping, is
    one line naming what it takes, before the callable compares it with one."""
    allowed = _number_taken(param)
    if allowed is None or not isinstance(value, str | list | dict):
        return
    default = "" if param.default is param.empty else f", default {param.default!r}"
    raise ConfigError(
        f"{section}.{param.name}={value!r} is not {allowed}; allowed: {allowed} "
        f"({path} takes {param.name}{default})",
        hint=f"give {section}.{param.name}=<{allowed}>",
        key=f"{section}.{param.name}",
    )


def _number_taken(param: inspect.Parameter) -> str | None:
    """'an integer' / 'a number' when the annotation (int, float, int | None, 'int') or else
    the default's type says the parameter takes a number; None when it may take more."""
    annotation = param.annotation
    if annotation is param.empty:
        return NUMBERS.get(type(param.default))  # type(True) is bool: not a number here
    if isinstance(annotation, str):
        parts = [part.strip() for part in annotation.split("|")]
    elif get_origin(annotation) in (Union, types.UnionType):
        parts = list(get_args(annotation))
    else:
        parts = [annotation]
    taken = [NUMBERS.get(part) if isinstance(part, str | type) else None for part in parts]
    nothing = [part in ("None", type(None)) for part in parts]
    if not any(taken) or not all(t or n for t, n in zip(taken, nothing, strict=True)):
        return None
    return "an integer" if all(t in ("an integer", None) for t in taken) else "a number"


def _check_optimizer_ranges(node: dict[str, Any]) -> None:
    kwargs = target_kwargs("optimizer", node)
    try:
        OptimizerRanges(**kwargs)
    except ValidationError as error:
        raise _one_line("optimizer", error, kwargs) from None


def _fixed(name: str, schema: type[Section], node: Any) -> Section:
    if not isinstance(node, dict):
        raise ConfigError(
            f"config section {name!r} is missing or not a mapping (got {node!r})",
            hint=f"compose from conf/ or give {name}=<option> with an option from conf/{name}/",
        )
    # A config recorded before a key existed lacks it: the key takes conf/'s default.
    node = {**section_defaults(name), **node}
    try:
        return schema(**node)
    except ValidationError as error:
        raise _one_line(name, error, node) from None


def _named_nodes(name: str, nodes: Any) -> dict[str, dict[str, Any]]:
    """`metrics` / `callbacks`: a mapping of names to `_target_` nodes (null entries dropped,
    so `~metrics.accuracy` or `metrics.accuracy=null` removes one)."""
    if nodes is None:
        return {}
    if not isinstance(nodes, dict):
        raise ConfigError(
            f"{name}={nodes!r} is not a mapping of names to _target_ configs",
            hint=f"e.g. +{name}.<name>._target_=<dotted path>",
        )
    return {key: _target_node(f"{name}.{key}", node) for key, node in nodes.items() if node}


def _target_node(name: str, node: Any) -> dict[str, Any]:
    if not isinstance(node, dict):
        raise ConfigError(
            f"config section {name!r} is missing or not a mapping (got {node!r})",
            hint=f"pick one with {name}=<option> from conf/{name}/, or write one with a _target_",
        )
    return node


def _one_line(
    section: str, error: ValidationError, node: dict[str, Any], keyword: bool = False
) -> ConfigError:
    """The first thing pydantic refused, as `section.key=value ...` (a command line's
    spelling), or `key=value ...` for a keyword argument (`keyword`: train_config)."""
    errors = error.errors()
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else "?"
    # The key: the field, and the key inside it for a nested section (early_stopping.patience),
    # not the union member pydantic tried (literal['epoch'], constrained-int).
    inner = [str(part) for part in first["loc"][1:2] if str(part) in _nested_keys(section, field)]
    key = ".".join([field, *inner])
    full = f"{section}.{key}"
    named = key if keyword else full
    given = node.get(field, first.get("input")) if first["loc"] else node
    if inner and isinstance(given, dict):
        given = given.get(inner[0], first.get("input"))
    if first["type"] == "extra_forbidden":
        schema = FIXED.get(section)
        allowed = ", ".join(schema.model_fields) if schema else "see conf/"
        listed = f"conf/{section}/" if keyword else "`python -m reprotrain.train --cfg job`"
        return ConfigError(
            f"{named}={shown(given)} is not a setting of {section}; allowed: {allowed}",
            hint=f"remove it or fix the spelling ({listed} lists every key)",
            key=full,
        )
    # Each union member's bound, for a field that takes several kinds (epoch or an integer).
    same = [e for e in errors if e["loc"][:1] == first["loc"][:1] and len(e["loc"]) <= 2]
    allowed = " or ".join(dict.fromkeys(_allowed_text(e) for e in (same if not inner else [first])))
    if key == "betas":
        allowed = "two numbers in [0, 1), e.g. [0.9,0.999]"
    elif key in ("threads", "resident_data"):
        allowed = "auto or an integer >= 1" if key == "threads" else "auto, true or false"
    fix = f"pass {named}=<{allowed}>" if keyword else f"give {named}=<{allowed}>"
    kind = first["type"]
    if kind.split("_")[0] in ("int", "float", "bool", "string") and not kind.startswith(
        ("string_pattern", "string_too")
    ):
        return ConfigError(f"{named}={shown(given)} is not {allowed}", hint=fix, key=full)
    return ConfigError(
        f"{named}={shown(given)} is out of range; allowed: {allowed}", hint=fix, key=full
    )


def _nested_keys(section: str, field: str) -> set[str]:
    """The keys of a field that is a section of its own (train.early_stopping's)."""
    schema = FIXED.get(section)
    annotation = (
        schema.model_fields[field].annotation if schema and field in schema.model_fields else None
    )
    members = getattr(annotation, "__args__", (annotation,))
    return {
        key
        for member in members
        if isinstance(member, type) and issubclass(member, BaseModel)
        for key in member.model_fields
    }


def _allowed_text(detail: ErrorDetails) -> str:
    ctx = detail.get("ctx") or {}
    kind = detail["type"]
    for name, sign in (("gt", ">"), ("ge", ">="), ("lt", "<")):
        if name in ctx:  # a float bound is a number's, an int bound an integer's
            bound = ctx[name]
            what = (
                f"a number {sign} {bound:g}"
                if isinstance(bound, float)
                else f"an integer {sign} {bound}"
            )
            return what + (" and >= 0" if name == "lt" else "")
    if kind == "literal_error":
        return str(ctx.get("expected", "")).replace("'", "")
    if kind == "value_error":
        return str(ctx.get("error", detail["msg"])).removeprefix("allowed: ")
    if kind.startswith("int"):
        return "an integer"
    if kind.startswith("float"):
        return "a number"
    if kind.startswith("bool"):
        return "true or false"
    if kind == "string_too_long":
        return f"at most {ctx['max_length']} characters"
    if kind.startswith("string"):
        return "a string" + (f" matching {ctx['pattern']}" if "pattern" in ctx else "")
    return detail["msg"].lower()


def _check_tracking_uri(tracking: TrackingConfig) -> None:
    """A blank tracking.uri is no store: the runtimes read a false value as "the default one",
    which would train into a store the user did not name. Every other URI is checked where it
    is opened (tracking/store.py: check_store)."""
    if tracking.uri is not None and not tracking.uri.strip():
        raise ConfigError(
            f"tracking.uri={tracking.uri!r} names no store; allowed: null (the default: "
            "$MLFLOW_TRACKING_URI, else the project's mlflow.db) or a URI such as "
            "sqlite:////abs/path/mlflow.db or http://host:port",
            hint="drop the override (tracking.uri=null) or give a store's URI",
        )


def _check_cross_field(config: Config) -> None:
    train = config.train
    if (train.steps is None) == (train.epochs is None):
        raise ConfigError(
            f"train.steps={train.steps!r} and train.epochs={train.epochs!r}: set exactly one",
            hint="e.g. train.steps=500 train.epochs=null, or train.steps=null train.epochs=3",
        )
    if config.device.index is not None and config.device.type != "cuda":
        raise ConfigError(
            f"device.index={config.device.index} is only meaningful with device=cuda "
            f"(device.type={config.device.type!r})",
            hint="use device=cuda device.index=N, or drop device.index",
        )
    if train.compile and train.cuda_graphs:
        raise ConfigError(
            "train.compile=true and train.cuda_graphs=true: pick one (torch.compile has its own "
            "CUDA-graph mode)",
            hint="set train.compile=false or train.cuda_graphs=false",
        )
    settings = (
        (f"train.precision={train.precision}", train.precision != "fp32"),
        ("train.tf32=true", train.tf32),
    )
    lower = [name for name, on in settings if on]
    if lower and train.deterministic:
        raise ConfigError(
            f"{' and '.join(lower)} change the arithmetic, but train.deterministic=true keeps "
            "every run on exact fp32",
            hint="add train.deterministic=false to train in lower precision",
        )
    for key in ("cuda_graphs", "tf32"):
        if getattr(train, key) and config.device.type in ("cpu", "mps"):
            raise ConfigError(
                f"train.{key}=true needs a CUDA GPU, but device={config.device.type}",
                hint=f"set train.{key}=false, or train on a GPU with device=cuda",
            )
    _check_validation_plan(config)
    _check_step_knobs(config)


def objectives(config: Config) -> tuple[str, ...]:
    """What train.objective (and scheduler.monitor) may name in this config."""
    return (*OBJECTIVES, *(f"val/{name}" for name in config.metrics))


def _check_validation_plan(config: Config) -> None:
    """The objective names a figure the run measures; what validation drives has one."""
    train, allowed = config.train, objectives(config)
    if train.objective not in allowed:
        raise ConfigError(
            f"train.objective={train.objective!r} is not a figure this run measures; allowed: "
            f"{', '.join(allowed)}",
            hint="name val/loss, train/loss or val/<a name under metrics:> (add the metric to "
            "metrics: first)",
        )
    driven = [
        name
        for name, on in (
            ("train.early_stopping", train.early_stopping is not None),
            ("train.keep_best", train.keep_best),
            ("a metric-driven scheduler", _plateau(config)),
        )
        if on
    ]
    if driven and train.val_every == 0:
        raise ConfigError(
            f"{driven[0]} needs validation during training, but train.val_every=0 validates "
            "only at the end",
            hint="set train.val_every=<steps> or train.val_every=epoch",
        )
    if (train.early_stopping is not None or train.keep_best) and train.objective == "train/loss":
        raise ConfigError(
            "train.objective=train/loss with early stopping or keep_best: those follow a "
            "validation figure",
            hint="set train.objective=val/loss (or val/<metric>)",
        )
    if config.scheduler is None:
        return
    monitor = config.scheduler.get("monitor")
    if _plateau(config) and monitor is None:
        raise ConfigError(
            f"scheduler._target_={config.scheduler['_target_']!r} is stepped with a "
            "validation figure, but scheduler.monitor is not set",
            hint=f"add +scheduler.monitor=val/loss (allowed: {', '.join(allowed)})",
        )
    if monitor is not None and (monitor not in allowed or monitor == "train/loss"):
        raise ConfigError(
            f"scheduler.monitor={monitor!r} is not a validation figure this run measures; "
            f"allowed: {', '.join(a for a in allowed if a != 'train/loss')}",
            hint="name val/loss or val/<a name under metrics:>",
        )


def _plateau(config: Config) -> bool:
    if config.scheduler is None:
        return False
    try:
        target = get_object(config.scheduler["_target_"])
    except Exception:  # check_target has reported it
        return False
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    return inspect.isclass(target) and issubclass(target, plateau)


def _check_step_knobs(config: Config) -> None:
    train = config.train
    if train.precision == "fp16" and config.device.type in ("cpu", "mps"):
        raise ConfigError(
            f"train.precision=fp16 needs a CUDA GPU (its GradScaler), but "
            f"device={config.device.type}",
            hint="use train.precision=bf16 on the CPU, or train on a GPU with device=cuda",
        )
    if train.cuda_graphs and (train.accumulate_grad_batches > 1 or train.precision == "fp16"):
        raise ConfigError(
            "train.cuda_graphs=true captures one fixed step: not with "
            f"train.accumulate_grad_batches={train.accumulate_grad_batches} or "
            f"train.precision={train.precision}",
            hint="drop train.cuda_graphs, or use train.accumulate_grad_batches=1 and fp32/bf16",
        )


def _split_device_index(device: DeviceConfig) -> None:
    """Accept the torch spelling 'cuda:1' as device.type=cuda, device.index=1."""
    match = re.fullmatch(r"cuda:(\d+)", device.type)
    if match:
        device.type, device.index = "cuda", int(match.group(1))


def _config_error_in(error: BaseException | None) -> ConfigError | None:
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, ConfigError):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _resolved(cfg: DictConfig | dict) -> dict[str, Any]:
    """A plain dict with every interpolation resolved (Hydra's own `hydra` node dropped)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    node = OmegaConf.masked_copy(node, [str(k) for k in node if k != "hydra"])
    try:
        tree = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as error:
        inner = _config_error_in(error)  # raised inside one of our resolvers
        if inner is not None:
            raise inner from None
        key = getattr(error, "full_key", "") or "?"
        raise ConfigError(
            f"{key} cannot be resolved: {str(error).splitlines()[0]}",
            hint="check the ${...} interpolation, or give the value with key=value",
        ) from None
    assert isinstance(tree, dict)
    return cast(dict[str, Any], tree)  # a config's keys are strings
