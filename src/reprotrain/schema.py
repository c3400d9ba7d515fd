"""The typed schema of a composed config, checked before any work starts.

Hydra composes `conf/` (or reads a composed `params.yaml`); `validate(cfg)` merges each
group into its dataclass below, so a wrong type, an unknown key or an out-of-range value
becomes one `ConfigError` line naming the key, the value given and what is allowed.
Each default sits next to the reason for it; the YAML files in `conf/` set the values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from reprotrain.errors import ConfigError

DEVICE_TYPES = ("auto", "cpu", "cuda", "mps")
RUNTIME_MODES = ("auto", "docker", "local")
PROGRESS_MODES = ("auto", "bar", "lines", "off")
DATASETS = ("synthetic", "digits")
NONFINITE_MODES = ("stop", "warn")
PRECISIONS = ("fp32", "bf16")


@dataclass
class ModelConfig:
    name: str = "mlp"
    hidden_size: int = 512  # the course's SimpleMLP width
    depth: int = 1  # hidden layers
    dropout: float = 0.0


@dataclass
class DeviceConfig:
    type: str = "auto"  # auto -> cuda, else mps, else cpu
    index: int | None = None  # which GPU; None = the current one (cuda:0)


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    fused: bool | None = None  # None = fused where torch supports it: same math, one kernel


@dataclass
class AdamConfig:
    name: str = "adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool | None = None


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0


OPTIMIZER_SCHEMAS: dict[str, type] = {"adamw": AdamWConfig, "adam": AdamConfig, "sgd": SGDConfig}


@dataclass
class DataConfig:
    name: str = "synthetic"
    num_samples: int | None = 8192  # None = all samples the source has
    num_features: int = 784
    num_classes: int = 10
    noise: float = 8.0
    val_fraction: float = 0.2
    seed: int = 0
    file: str | None = None  # a prepared .npz to read instead of generating


@dataclass
class TrainConfig:
    steps: int | None = 500
    epochs: int | None = None
    batch_size: int = 64
    seed: int = 0
    log_every: int = 25  # one host sync per N steps, not per step
    warmup_steps: int = 10  # kept out of the timing summary
    output_dir: str = "results"
    deterministic: bool = True
    progress: str = "auto"
    resident_data: str = "auto"  # auto, true, false
    threads: str = "auto"  # auto or a positive integer
    checkpoint_every: int = 100  # steps between checkpoints (0: only when stopped)
    resume: str | None = None  # an MLflow run id, or "last", to continue from its checkpoint
    nonfinite: str = "stop"  # a NaN/inf loss: stop (run FAILED) or warn (log it, go on)
    # Fast paths that change how (or in what precision) the step is computed: off by default.
    compile: bool = False  # torch.compile the model (forward and backward)
    cuda_graphs: bool = False  # capture the whole step once, replay it every step (CUDA)
    precision: str = "fp32"  # fp32, or bf16: forward and loss under bf16 autocast
    tf32: bool = False  # TF32 tensor-core matmuls (CUDA, Ampere and newer)


@dataclass
class TrackingConfig:
    uri: str | None = None
    experiment: str = "reprotrain"
    run_name: str | None = None
    enabled: bool = True
    flush_every_s: float = 5.0
    connect_timeout_s: float = 5.0


@dataclass
class RuntimeConfig:
    mode: str = "auto"
    shm_size: str = "1g"  # DataLoader workers share tensors through /dev/shm
    cpus: float | None = None
    network: str = "auto"  # auto = none unless the tracking URI is a server


@dataclass
class Config:
    model: ModelConfig
    device: DeviceConfig
    optimizer: AdamWConfig | AdamConfig | SGDConfig
    data: DataConfig
    train: TrainConfig
    tracking: TrackingConfig
    runtime: RuntimeConfig
    conf_digest: str | None = None


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "device": DeviceConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "tracking": TrackingConfig,
    "runtime": RuntimeConfig,
}

_POSITIVE = (lambda v: v > 0, "a number > 0")
_AT_LEAST_1 = (lambda v: v >= 1, "an integer >= 1")
_NON_NEGATIVE = (lambda v: v >= 0, "a number >= 0")

# key -> (check, what is allowed). None values are allowed where the type is Optional.
RANGES: dict[str, tuple[Any, str]] = {
    "model.hidden_size": _AT_LEAST_1,
    "model.depth": _AT_LEAST_1,
    "model.dropout": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "device.type": (lambda v: v in DEVICE_TYPES, "one of " + ", ".join(DEVICE_TYPES)),
    "device.index": _NON_NEGATIVE,
    "optimizer.lr": _POSITIVE,
    "optimizer.eps": _POSITIVE,
    "optimizer.weight_decay": _NON_NEGATIVE,
    "optimizer.momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "optimizer.betas": (
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "two numbers in [0, 1), e.g. [0.9,0.999]",
    ),
    "data.name": (lambda v: v in DATASETS, "one of " + ", ".join(DATASETS)),
    "data.num_samples": (lambda v: v >= 10, "an integer >= 10, or null for all"),
    "data.num_features": _AT_LEAST_1,
    "data.num_classes": (lambda v: v >= 2, "an integer >= 2"),
    "data.noise": _NON_NEGATIVE,
    "data.val_fraction": (lambda v: 0 < v < 1, "a number in (0, 1)"),
    "train.steps": _AT_LEAST_1,
    "train.epochs": _AT_LEAST_1,
    "train.batch_size": _AT_LEAST_1,
    "train.log_every": _AT_LEAST_1,
    "train.warmup_steps": _NON_NEGATIVE,
    "train.checkpoint_every": _NON_NEGATIVE,
    "train.progress": (lambda v: v in PROGRESS_MODES, "one of " + ", ".join(PROGRESS_MODES)),
    "train.resident_data": (
        lambda v: v.lower() in ("auto", "true", "false"),
        "auto, true or false",
    ),
    "train.nonfinite": (lambda v: v in NONFINITE_MODES, "one of " + ", ".join(NONFINITE_MODES)),
    "train.precision": (lambda v: v in PRECISIONS, "one of " + ", ".join(PRECISIONS)),
    "train.threads": (
        lambda v: v == "auto" or (v.isdigit() and int(v) >= 1),
        "auto or an integer >= 1",
    ),
    "tracking.experiment": (lambda v: v.strip() != "", "a non-empty name"),
    "tracking.flush_every_s": _POSITIVE,
    "tracking.connect_timeout_s": _POSITIVE,
    "runtime.mode": (lambda v: v in RUNTIME_MODES, "one of " + ", ".join(RUNTIME_MODES)),
    "runtime.cpus": _POSITIVE,
    "runtime.network": (lambda v: v in ("auto", "none", "host"), "auto, none or host"),
}

_CUDA_WITH_INDEX = re.compile(r"^cuda:(\d+)$")


def validate(cfg: DictConfig | dict) -> Config:
    """Check a composed config against the schema; return it typed, or raise ConfigError."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    sections = {name: _section(cfg, name, schema) for name, schema in SECTIONS.items()}
    sections["optimizer"] = _section(cfg, "optimizer", _optimizer_schema(cfg))
    _split_device_index(sections["device"])
    config = Config(**sections)
    _check_ranges(config)
    _check_cross_field(config)
    config.conf_digest = _plain(cfg, "conf_digest")  # last: its resolver validates again
    return config


def as_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


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


def _optimizer_schema(cfg: DictConfig) -> type:
    name = _plain(cfg, "optimizer.name")
    if name not in OPTIMIZER_SCHEMAS:
        allowed = ", ".join(OPTIMIZER_SCHEMAS)
        raise ConfigError(
            f"optimizer.name={name!r} is not a known optimizer; allowed: {allowed}",
            hint="pick one with optimizer=adamw|adam|sgd",
        )
    return OPTIMIZER_SCHEMAS[name]


def _section(cfg: DictConfig, name: str, schema: type) -> Any:
    node = cfg.get(name) if name in cfg else None
    if not isinstance(node, DictConfig):
        raise ConfigError(
            f"config section {name!r} is missing or not a mapping (got {node!r})",
            hint=f"compose from conf/ or give {name}=<option> with an option from conf/{name}/",
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except ConfigKeyError as error:
        fields = ", ".join(f.name for f in dataclasses.fields(schema))
        raise ConfigError(
            f"{name}.{error.key} is not a setting of {name} ({schema.__name__}); allowed: {fields}",
            hint=f"remove it or fix the spelling, e.g. {name}.{dataclasses.fields(schema)[1].name}=...",
        ) from None
    except ValidationError as error:
        key = f"{name}.{error.key}" if error.key is not None else name
        expected = _type_name(schema, str(error.key))
        raise ConfigError(
            f"{key}={_given(node, error.key)!r} is not {expected}",
            hint=f"give {key}=<{expected}>",
        ) from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"config section {name!r} is invalid: {error.msg}") from None


def _check_ranges(config: Config) -> None:
    flat = flatten(as_dict(config))
    for key, (check, allowed) in RANGES.items():
        if key not in flat or flat[key] is None:
            continue
        value = flat[key]
        if not check(value):
            raise ConfigError(f"{key}={value!r} is out of range; allowed: {allowed}")


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
        ("train.precision=bf16", train.precision == "bf16"),
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


def _split_device_index(device: DeviceConfig) -> None:
    """Accept the torch spelling 'cuda:1' as device.type=cuda, device.index=1."""
    match = _CUDA_WITH_INDEX.match(device.type)
    if match:
        device.type, device.index = "cuda", int(match.group(1))


def _plain(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=True)
    except OmegaConfBaseException as error:
        if isinstance(error.__cause__, ConfigError):  # raised inside one of our resolvers
            raise error.__cause__ from None
        raise ConfigError(f"{key} cannot be resolved: {str(error).splitlines()[0]}") from None


def _given(node: DictConfig, key: Any) -> Any:
    try:
        return node._get_node(key)._value()  # the raw value, before any conversion
    except Exception:
        return "?"


def _type_name(schema: type, key: str) -> str:
    types = {f.name: str(f.type) for f in dataclasses.fields(schema)}
    text = types.get(key, "the right type")
    for word, nice in (
        ("float", "a number"),
        ("int", "an integer"),
        ("bool", "true or false"),
        ("str", "a string"),
        ("list", "a list"),
    ):
        if text.startswith(word):
            return nice + (" or null" if "None" in text else "")
    return text
