"""The training-step script: a Hydra app that trains and records the run in MLflow.

    python -m reprotrain.train                                   # conf/config.yaml defaults
    python -m reprotrain.train device=cpu optimizer=sgd optimizer.lr=3e-4 model=mlp_wide
    python -m reprotrain.train experiment=smoke                  # a few steps on tiny data
    python -m reprotrain.train --multirun optimizer=adamw,sgd train.batch_size=32,256
    python -m reprotrain.train --cfg job                         # print the composed config
    python -m reprotrain.train --config-dir . --config-name params   # a composed params.yaml (DVC)

The loop below is the course's: choose the device, move the model there once, move each
batch inside the loop, then forward, loss, zero_grad, backward, step (see step.py).
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import psutil
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn

from reprotrain import __version__, fastpaths, overrides
from reprotrain.checkpoint import (
    checkpoint_path,
    find_checkpoint,
    fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from reprotrain.data import Batches, Dataset, file_md5, fits_on_device, load_dataset
from reprotrain.devices import available_cpus, describe_device, resolve_device, synchronize
from reprotrain.errors import ConfigError, DeviceError, UserError, report_and_exit
from reprotrain.model import (
    build_model,
    build_optimizer,
    count_parameters,
    training_flops_per_sample,
)
from reprotrain.outputs import (
    write_json,
    write_loss_csv,
    write_loss_plot,
    write_model,
    write_text,
)
from reprotrain.progress import Progress
from reprotrain.project import conf_digest, default_tracking_uri, find_root, git_state
from reprotrain.schema import Config, as_dict, flatten, validate
from reprotrain.step import evaluate, move_batch_to_device
from reprotrain.timing import PHASES, PhaseClock, TimingSummary
from reprotrain.tracking import (
    GracefulStop,
    Interrupted,
    NoRun,
    TrackedRun,
    check_store,
)


@dataclass
class Fitted:
    """What fit() leaves: the figures for metrics.json, the loss curve and the trained model."""

    metrics: dict[str, Any]
    steps: list[int]
    losses: list[float]
    model: nn.Module


def run(config: Config, runtime: str = "local") -> dict[str, Any]:
    """Train once as `config` says; returns the metrics written to metrics.json."""
    device = resolve_device(config.device.type, config.device.index)  # fail before any run exists
    fastpaths.check(config.train, device)
    set_threads(config.train.threads)
    seed_everything(config.train.seed, config.train.deterministic, device)
    dataset = load_dataset(config.data)
    out_dir = check_output_dir(Path(config.train.output_dir))
    uri = config.tracking.uri or default_tracking_uri()
    if config.tracking.enabled:
        check_store(uri, config.tracking.connect_timeout_s)  # now: a dead server fails fast
    stop = GracefulStop().install()  # Ctrl-C / SIGTERM end the run KILLED, after a checkpoint
    resume_from = load_resume_point(config)
    info = describe_device(device)
    tags = {**info.as_tags(), **run_tags(config, dataset, runtime)}
    name = config.tracking.run_name or f"{config.model.name}-{config.optimizer.name}-{device.type}"
    tracker = (
        TrackedRun(
            uri,
            config.tracking.experiment,
            name,
            tags,
            flatten(as_dict(config)),
            config.tracking.flush_every_s,
            resume_run_id=resume_from["run_id"] if resume_from else "",
            spool_dir=out_dir / "spool",
        )
        if config.tracking.enabled
        else NoRun()
    )
    with tracker as tracked:
        try:
            fitted = fit(config, device, dataset, tracked, stop=stop, resume_from=resume_from)
        except torch.OutOfMemoryError:
            raise out_of_memory(device, config, dataset) from None
        except RuntimeError as error:  # the CPU allocator's OOM is a plain RuntimeError
            if "can't allocate memory" not in str(error):
                raise
            raise out_of_memory(device, config, dataset) from None
        result = fitted.metrics
        result.update(
            run_id=tracked.run_id,
            tracking_uri=uri if config.tracking.enabled else None,
            device=info.type,
            device_name=info.name,
        )
        write_outputs(config, out_dir, fitted, tracked)
    return result


def load_resume_point(config: Config) -> dict[str, Any] | None:
    if not config.train.resume:
        return None
    path = find_checkpoint(config.train.output_dir, config.train.resume)
    state = load_checkpoint(path, fingerprint(config))
    total = config.train.steps or 0
    if config.train.steps is not None and state["step"] >= total:
        raise ConfigError(
            f"train.resume={config.train.resume!r}: the checkpoint is at step {state['step']}, "
            f"which already reaches train.steps={total}",
            hint=f"raise train.steps above {state['step']} to train further",
        )
    return state


def fit(
    config: Config,
    device: torch.device,
    dataset: Dataset,
    tracked: Any,
    stop: GracefulStop | None = None,
    resume_from: dict[str, Any] | None = None,
) -> Fitted:
    train = config.train
    model = build_model(config.model, dataset.num_features, dataset.num_classes).to(device)  # once
    optimizer = build_optimizer(
        config.optimizer, model.parameters(), device, capturable=train.cuda_graphs
    )
    loss_fn = nn.CrossEntropyLoss()
    # step.train_step (forward, loss, zero_grad, backward, step), or its compiled or
    # CUDA-graph form when train.compile / train.cuda_graphs ask for it.
    step_fn = fastpaths.step_function(train, device, model, loss_fn, optimizer)
    resident = train.resident_data == "true" or (
        train.resident_data == "auto" and fits_on_device(dataset, device)
    )
    batches = Batches(dataset, train.batch_size, device, resident=resident, seed=train.seed)
    total = train.steps or train.epochs * batches.batches_per_epoch
    start, losses = restore(resume_from, model, optimizer)
    steps = list(range(1, start + 1))
    warmup_end = start + train.warmup_steps
    clock, summary = PhaseClock(device), TimingSummary(warmup_end)
    pending: list[torch.Tensor] = []
    nonfinite: list[int] = []  # steps whose loss was NaN/inf (train.nonfinite=warn goes on)
    progress = Progress(total, train.progress)
    startup_s = time.time() - psutil.Process().create_time()
    measure_from = None
    saved_at = start
    stop = stop or GracefulStop()

    def save(step: int) -> None:
        path = checkpoint_path(train.output_dir, tracked.run_id)
        save_checkpoint(
            path,
            step=step,
            model=model,
            optimizer=optimizer,
            losses=losses,
            run_id=tracked.run_id,
            fingerprint=fingerprint(config),
        )

    def record_window(step: int) -> None:
        """Read the window's losses off the device and hand them to MLflow."""
        values = torch.stack(pending).cpu().tolist()  # sync point: one read per log_every
        first = step - len(pending) + 1
        pending.clear()
        bad = check_finite(values, first, losses, train.nonfinite)
        if bad and not nonfinite:
            print(
                f"reprotrain: warning: the loss became {values[bad[0] - first]} at step {bad[0]}; "
                "training goes on (train.nonfinite=warn)",
                file=sys.stderr,
                flush=True,
            )
        nonfinite.extend(bad)
        for offset, value in enumerate(values):
            tracked.log_metric("train/loss", value, first + offset)
        window = clock.drain()
        for timed_step, phases in window:
            summary.add(timed_step, phases)
        # Sampled: one point per log window (its mean), not one per step, which would
        # double the points stored for a figure the end-of-run medians already give.
        window_ms = [phases["step"] for _, phases in window]
        tracked.log_metric("time/step_ms", sum(window_ms) / len(window_ms), step)
        steps.extend(range(first, step + 1))
        losses.extend(values)
        rate = train.batch_size / (summary.median("step") / 1e3) if summary.measured_steps else 0.0
        progress.update(step, values[-1], rate)

    step = start
    tracked.start()  # the MLflow run opens on its own thread while the first steps run
    stop.in_loop = True
    try:
        for step, batch in enumerate(batches.take(total, start=start), start=start + 1):
            clock.start_step()
            inputs, targets = move_batch_to_device(batch, device)  # every batch, inside the loop
            clock.mark("data_to_device")
            pending.append(step_fn(inputs, targets, clock.mark))  # the training step
            clock.end_step(step)
            if step == warmup_end:
                synchronize(device)  # sync point: the throughput clock starts after warm-up
                measure_from = time.perf_counter()
            if step % train.log_every == 0 or step == total:
                record_window(step)
                if train.checkpoint_every and step - saved_at >= train.checkpoint_every:
                    save(step)
                    saved_at = step
            if stop.requested is not None:  # a signal arrived: stop at this step boundary
                if pending:
                    record_window(step)
                save(step)
                stop.check()
    finally:
        stop.in_loop = False
        progress.close()
    synchronize(device)  # sync point: all queued work is done before the clock stops
    loop_end = time.perf_counter()
    measured = total - warmup_end if measure_from is not None else total - start
    elapsed = loop_end - (measure_from if measure_from is not None else loop_end)
    samples_per_s = measured * train.batch_size / elapsed if elapsed > 0 else float("nan")

    x_val, y_val = torch.from_numpy(dataset.x_val), torch.from_numpy(dataset.y_val)
    val_loss, val_accuracy, _ = evaluate(model, x_val, y_val, loss_fn)
    result = {
        "steps": total,
        "batch_size": train.batch_size,
        "final_loss": losses[-1],
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "samples_per_s": samples_per_s,
        "step_ms_median": summary.median("step"),
        "startup_s": startup_s,
        "total_s": time.time() - psutil.Process().create_time(),
        "train_flops_per_s": samples_per_s * training_flops_per_sample(model),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resident_data": resident,
        "nonfinite_steps": len(nonfinite),
        **{f"{phase}_ms_mean": summary.mean(phase) for phase in PHASES},
    }
    if device.type == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    tracked.log_metrics(summary_metrics(result), step=total)
    return Fitted(result, steps, losses, model)


def restore(
    state: dict[str, Any] | None, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, list[float]]:
    """Load a checkpoint into the model and optimizer; return (step, losses so far)."""
    if state is None:
        return 0, []
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], list(state["losses"])


def out_of_memory(device: torch.device, config: Config, dataset: Dataset) -> DeviceError:
    """A bare CUDA OOM names neither the batch nor the model; this message does."""
    with torch.device("meta"):  # count the parameters without allocating them
        model = build_model(config.model, dataset.num_features, dataset.num_classes)
    figures = ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        figures = (
            f"; {torch.cuda.memory_allocated(device) / 2**20:,.0f} MiB allocated by torch, "
            f"{free / 2**20:,.0f} of {total / 2**20:,.0f} MiB free"
        )
    return DeviceError(
        f"out of memory on {device} at train.batch_size={config.train.batch_size} with "
        f"model.hidden_size={config.model.hidden_size} ({count_parameters(model):,} parameters)"
        f"{figures}",
        hint="lower train.batch_size or model.hidden_size, or keep the data on the host with "
        "train.resident_data=false",
    )


def check_finite(
    values: list[float], first_step: int, history: list[float], mode: str = "stop"
) -> list[int]:
    """The steps whose loss is NaN/inf; under train.nonfinite=stop the first one ends the run."""
    bad = []
    for offset, value in enumerate(values):
        if np.isfinite(value):
            continue
        if mode == "stop":
            finite = [v for v in history + values[:offset] if np.isfinite(v)]
            last = f"{finite[-1]:.6g}" if finite else "none"
            raise UserError(
                f"the loss became {value} at step {first_step + offset} (last finite loss {last})",
                hint="lower optimizer.lr, check the data for NaN/inf, or use a smaller model "
                "(train.nonfinite=warn logs it and goes on)",
            )
        bad.append(first_step + offset)
    return bad


def summary_metrics(result: dict[str, Any]) -> dict[str, float]:
    metrics = {
        "val/loss": result["val_loss"],
        "val/accuracy": result["val_accuracy"],
        "throughput/samples_per_s": result["samples_per_s"],
        "time/step_ms_median": result["step_ms_median"],
        "time/startup_s": result["startup_s"],
        "time/total_s": result["total_s"],
        "memory/peak_rss_mb": result["peak_rss_mb"],
        "train/nonfinite_steps": result["nonfinite_steps"],
        **{f"time/{phase}_ms": result[f"{phase}_ms_mean"] for phase in PHASES},
    }
    if "cuda_peak_mb" in result:
        metrics["memory/cuda_peak_mb"] = result["cuda_peak_mb"]
    return {k: v for k, v in metrics.items() if np.isfinite(v)}


def write_outputs(config: Config, out_dir: Path, fitted: Fitted, tracked: Any) -> None:
    result, steps, losses, model = fitted.metrics, fitted.steps, fitted.losses, fitted.model
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(as_dict(config)))
    files = [
        write_text(out_dir / "config.yaml", config_yaml),
        write_loss_plot(
            out_dir / "loss.png",
            steps,
            losses,
            f"{result['device_name']} · {config.model.name} · {config.optimizer.name}",
        ),
        write_model(
            out_dir / "model.pt",
            model,
            {
                "model": as_dict(config)["model"],
                "in_features": config.data.num_features,
                "num_classes": config.data.num_classes,
            },
        ),
        write_loss_csv(out_dir / "loss.csv", steps, losses),
    ]
    for path in files:
        tracked.log_artifact(path)
    # NaN is not JSON: a value that could not be measured (or a NaN loss under
    # train.nonfinite=warn) is written as null. Last: its presence means the run completed.
    write_json(out_dir / "metrics.json", {k: _json_value(v) for k, v in result.items()})


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not np.isfinite(value) else value


def check_output_dir(out_dir: Path) -> Path:
    """Fail before training, not after it, when the results cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as error:
        raise ConfigError(
            f"train.output_dir={str(out_dir)!r} cannot be written ({error.strerror})",
            hint="point train.output_dir at a writable folder",
        ) from None
    return out_dir


def run_tags(config: Config, dataset: Dataset, runtime: str) -> dict[str, str]:
    root = find_root()
    commit, dirty = git_state(root)
    data_hash = (
        file_md5(Path(config.data.file))
        if config.data.file
        else _arrays_md5(dataset.x_train, dataset.y_train)
    )
    tags = {
        "runtime": os.environ.get("REPROTRAIN_RUNTIME", runtime),
        "git.commit": commit,
        "git.dirty": dirty,
        "data.hash": data_hash,
        "config.hash": conf_hash(config),
        "reprotrain.version": __version__,
        "mlflow.source.name": "reprotrain.train",
    }
    if os.environ.get("REPROTRAIN_IMAGE_ID"):
        tags["image.id"] = os.environ["REPROTRAIN_IMAGE_ID"]
    for env, tag in (
        ("DVC_STAGE", "dvc.stage"),
        ("DVC_EXP_NAME", "dvc.exp_name"),
        ("DVC_EXP_BASELINE_REV", "dvc.baseline_rev"),
        ("REPROTRAIN_SWEEP_ID", "sweep.id"),
        ("REPROTRAIN_PARENT_RUN_ID", "mlflow.parentRunId"),
    ):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


def conf_hash(config: Config) -> str:
    text = OmegaConf.to_yaml(
        OmegaConf.create({k: v for k, v in as_dict(config).items() if k != "conf_digest"})
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _arrays_md5(*arrays: np.ndarray) -> str:
    digest = hashlib.md5()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def set_threads(threads: str) -> None:
    # torch sizes its pool from the host's cores, not a container's CPU quota.
    torch.set_num_threads(available_cpus() if threads == "auto" else int(threads))


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by cuBLAS determinism
        if "torch._inductor" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # The same switch. The public function also imports torch's compiler (~1.8 s
            # here) just to set a flag that only matters under torch.compile.
            torch._C._set_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def check_conf_digest(config: Config) -> None:
    """A composed params.yaml must come from today's conf/, or training would use stale values."""
    if config.conf_digest is None:
        return
    current = conf_digest()
    if config.conf_digest != current:
        raise ConfigError(
            f"conf/ changed since params.yaml was composed (params.yaml conf_digest="
            f"{config.conf_digest}, conf/ is now {current})",
            hint="run `dvc exp run` to compose params.yaml from conf/ and train with the new values",
        )


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> None:
    try:
        config = validate(cfg)
        if HydraConfig.get().job.config_name != "config":  # a composed params file
            check_conf_digest(config)
        from reprotrain.launcher import launch

        launch(config, list(HydraConfig.get().overrides.task))
    except UserError as error:
        report_and_exit(error)


def main() -> None:
    argv = overrides.normalise(sys.argv[1:])
    try:
        overrides.check(argv)
    except UserError as error:
        report_and_exit(error)
    sys.argv = [sys.argv[0], *argv]
    try:
        hydra_app()
    except KeyboardInterrupt:
        _stopped(signal.SIGINT)
    except Interrupted as stop:
        _stopped(stop.signum)


def _stopped(signum: int) -> None:
    """Ctrl-C / SIGTERM: the run was already ended KILLED with its metrics flushed."""
    print(f"reprotrain: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
