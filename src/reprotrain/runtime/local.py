"""Train in this process: resolve the device, build the pieces, open the MLflow run, hand
them to the Trainer, write the outputs. The container runtime runs this same function inside
the image, and torchrun runs it in each rank.

    result = run(config)        # the figures written to run.json
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from reprotrain import fastpaths
from reprotrain.build import Pieces, build, check_fit, class_name
from reprotrain.build import out_of_memory as is_out_of_memory
from reprotrain.checkpoint import (
    already_finished,
    checkpoint_path,
    fingerprint,
    load_resume_point,
    save_checkpoint,
)
from reprotrain.data import make_batches
from reprotrain.devices import describe_device, resolve_device, set_threads
from reprotrain.errors import ConfigError, DeviceError, TrackingError
from reprotrain.outputs import check_writable, claim
from reprotrain.project import default_tracking_uri
from reprotrain.provenance import count_parameters, dataset_source, run_name, run_tags
from reprotrain.results import Job, finish
from reprotrain.runtime import distributed
from reprotrain.schema import Config, as_dict, flatten
from reprotrain.seeding import seed_everything
from reprotrain.stopping import GracefulStop
from reprotrain.timing import process_age_s
from reprotrain.tracking import (
    NoRun,
    RunSpec,
    TrackedRun,
    as_mlflow_datasets,
    check_store,
    redact,
    run_status,
    where_to_look,
)
from reprotrain.trainer import TIMING_KEYS, Fitted, Trainer


def run(config: Config, runtime: str = "local", varied: list[str] | None = None) -> dict[str, Any]:
    """Train once as `config` says; returns the figures written to run.json (rank 0's; the
    other ranks of a torchrun job return {})."""
    distributed.adopt_cluster_tasks()  # a submitit job's tasks: one torchrun-style job
    device = place(config)  # before any run exists
    fastpaths.check(config.train, device)
    out_dir = check_writable(
        Path(config.train.output_dir or "outputs/runs/latest"), "train.output_dir"
    )
    check_writable(Path(config.train.checkpoint_dir), "train.checkpoint_dir")  # also on Ctrl-C
    group = distributed.join(config.train.backend, config.train.dist_timeout_s, device)
    # Rank 0 alone writes outputs; another run writing there is a warning.
    claimed = claim(out_dir, "train.output_dir") if group.main else contextlib.nullcontext()
    try:
        with claimed:
            job = Job(config, device, out_dir, runtime, varied or [])
            return train(job, group)
    finally:
        distributed.leave(group)


def place(config: Config) -> torch.device:
    """The device: as config.device says; under torchrun, each rank on cuda:LOCAL_RANK."""
    if distributed.under_torchrun():
        if config.train.cuda_graphs:
            raise ConfigError(
                "train.cuda_graphs=true under torchrun; allowed: CUDA graphs in one process",
                hint="drop train.cuda_graphs, or train in one process",
            )
        if config.device.type in ("auto", "cuda") and torch.cuda.is_available():
            distributed.check_devices()
            return resolve_device("cuda", distributed.local_rank())
    return resolve_device(config.device.type, config.device.index)


def train(job: Job, group: distributed.Group = distributed.SINGLE) -> dict[str, Any]:
    """Seed, build, open the run, train and finish: `run` after its checks."""
    config, device = job.config, job.device
    set_threads(config.train.threads)
    seed_everything(config.train.seed, config.train.deterministic, device)
    uri = config.tracking.uri or default_tracking_uri()
    job.tracking_uri = uri if config.tracking.enabled and group.main else None
    if job.tracking_uri:
        check_store(uri, config.tracking.connect_timeout_s)  # now: a dead server fails fast
    stop = GracefulStop().install()  # Ctrl-C / SIGTERM end the run KILLED, after a checkpoint
    resume_from = load_resume_point(config)
    status = resumed_status(config, resume_from, uri) if resume_from and job.tracking_uri else None
    job.pieces = build_pieces(config, device)
    job.example = check_fit(job.pieces, device)
    trainer = make_trainer(job, group, resume_from)
    total = config.train.steps or config.train.epochs * trainer.epoch_length
    finishing = resume_from is not None and (
        trainer.step >= total or trainer.stopped_early is not None
    )
    if finishing and status == "FINISHED":
        raise already_finished(config, resume_from, status)
    job.info = describe_device(device)
    with open_run(job, group, resume_from) as recorder:
        if job.tracking_uri:  # the data as the run's inputs: the run page's Datasets
            recorder.log_inputs(as_mlflow_datasets(job.pieces.splits, *dataset_source(config)))
        job.startup_s = process_age_s()  # process start to first step, the run open
        fitted = (
            finished_fit(trainer, recorder)
            if finishing
            else fit(job, trainer, recorder, stop, total)
        )
        if not group.main:
            return {}
        result = finish(job, trainer, fitted, recorder)
    if job.tracking_uri:
        say_where(job, recorder, result["run_id"])
    return result


def build_pieces(config: Config, device: torch.device) -> Pieces:
    try:
        return build(config, device)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise out_of_memory(device, config, None) from None


def make_trainer(job: Job, group: distributed.Group, resume_from: dict[str, Any] | None) -> Trainer:
    """The Trainer on this rank's batches, at the checkpoint's step when resuming."""
    config, device, pieces = job.config, job.device, job.pieces
    batches = make_batches(
        pieces.splits.train, config.train, device, pieces.reading, group.rank, group.world_size
    )
    model = distributed.wrap(pieces.model, group, device)  # DDP under torchrun
    trainer = Trainer(model, pieces, batches, device, config.train, group)
    if resume_from is not None:
        trainer.load_state_dict(resume_from["trainer"])
    if group.rank > 0:  # dropout draws its own masks on each rank, resumable from the step
        torch.manual_seed(hash((config.train.seed, group.rank, trainer.step)) % 2**63)
    return trainer


def open_run(
    job: Job, group: distributed.Group, resume_from: dict[str, Any] | None
) -> TrackedRun | NoRun:
    """This process's MLflow run (rank 0 under torchrun), or NoRun with tracking off."""
    if job.tracking_uri is None:
        return NoRun()
    config, pieces = job.config, job.pieces
    spec = RunSpec(
        config.tracking.experiment,
        run_name(config, pieces, job.device, job.varied),
        {
            **job.info.as_tags(),
            **run_tags(config, pieces, job.runtime),
            **distributed_tags(config, group),
        },
        flatten(as_dict(config)),
        resume_run_id=resume_from["run_id"] if resume_from else "",
        checkpoint_dir=Path(config.train.checkpoint_dir).resolve(),
    )
    return TrackedRun(
        job.tracking_uri,
        spec,
        flush_every_s=config.tracking.flush_every_s,
        spool_dir=job.out_dir / "spool",
        system_metrics=config.tracking.system_metrics,
    )


def fit(
    job: Job, trainer: Trainer, recorder: TrackedRun | NoRun, stop: GracefulStop, total: int
) -> Fitted:
    """Train to `total`, checkpointing (rank 0) as train.checkpoint_* say."""
    config, group = job.config, trainer.group
    path = checkpoint_path(config.train.checkpoint_dir, recorder.run_id)
    model_class = class_name(job.pieces.model)

    def save(at: Trainer) -> None:
        state = at.state_dict()
        save_checkpoint(
            path,
            state,
            run_id=recorder.run_id,
            fingerprint=fingerprint(config),
            model_class=model_class,
        )

    try:
        fitted = trainer.fit(total, recorder, save, stop, config.tracking.loss_every)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if is_out_of_memory(error):
            raise out_of_memory(job.device, config, job.pieces) from None
        if group.active and distributed.collective_failed(error):
            # torchrun now sends SIGTERM to the ranks left: this one ends FAILED first.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise distributed.lost_rank(group, error) from None
        raise
    if group.main:
        recorder.flush()
        save(trainer)  # the last step's, with the timings: the final phase restarts here
    return fitted


def say_where(job: Job, recorder: TrackedRun | NoRun, run_id: str) -> None:
    where = (
        f"its record waits in {recorder.waiting} (python -m reprotrain.replay sends it)"
        if recorder.waiting
        else where_to_look(job.tracking_uri or "", recorder.experiment_id, run_id)
    )
    print(
        f"reprotrain: run {run_id} FINISHED in experiment {job.config.tracking.experiment!r}; "
        f"outputs in {job.out_dir}; {where}",
        file=sys.stderr,
        flush=True,
    )


def distributed_tags(config: Config, group: distributed.Group) -> dict[str, str]:
    """A torchrun job's shape: world size, backend, global batch, every rank's device."""
    if not group.active:
        return {}
    return {
        "dist.world_size": str(group.world_size),
        "dist.backend": group.backend,
        "dist.global_batch_size": str(config.train.batch_size * group.world_size),
        "dist.devices": "; ".join(f"{rank}: {m.device}" for rank, m in enumerate(group.members)),
    }


def resumed_status(config: Config, state: dict[str, Any], uri: str) -> str:
    """The status of the run a checkpoint belongs to, which must be in this store."""
    status = run_status(uri, state["run_id"])
    if status is None:
        raise TrackingError(
            f"train.resume={config.train.resume!r}: its run {state['run_id']} is not in the "
            f"tracking store {redact(uri)}",
            hint="set tracking.uri to the store the run was recorded in, or start a new run",
        )
    return status


def finished_fit(trainer: Trainer, recorder: TrackedRun | NoRun) -> Fitted:
    """What fit() left, from the last step's checkpoint: a run killed after training."""
    timings = trainer.timings or {}  # a checkpoint written at a stop has none
    trainer.timings = {key: float(timings.get(key, float("nan"))) for key in TIMING_KEYS}
    trainer.finish_validation(recorder)
    return trainer.fitted()


def out_of_memory(device: torch.device, config: Config, pieces: Pieces | None) -> DeviceError:
    """A bare OOM names neither the batch nor the model; this message does."""
    model = (
        f"{type(pieces.model).__name__} ({count_parameters(pieces.model):,} parameters)"
        if pieces is not None
        else f"{config.model['_target_']} (while building it)"
    )
    figures = ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        figures = (
            f"; {torch.cuda.memory_allocated(device) / 2**20:,.0f} MiB allocated by torch, "
            f"{free / 2**20:,.0f} of {total / 2**20:,.0f} MiB free"
        )
    return DeviceError(
        f"out of memory on {device} at train.batch_size={config.train.batch_size} with model "
        f"{model}{figures}",
        hint="lower train.batch_size or the model's size, or keep the data on the host with "
        "train.resident_data=false",
    )
