"""Train in this process: resolve the device, build the pieces, open the MLflow run, run the
loop, write the outputs. The container runtime runs this same function inside the image.

    result = run(config)        # the figures written to run.json
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprotrain import fastpaths
from reprotrain.build import Pieces, build, check_fit
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
from reprotrain.loop import TIMING_KEYS, Fitted, fit
from reprotrain.outputs import check_writable, claim
from reprotrain.project import default_tracking_uri
from reprotrain.provenance import count_parameters, run_name, run_tags
from reprotrain.results import finish
from reprotrain.runtime import distributed
from reprotrain.schema import Config, as_dict, flatten
from reprotrain.seeding import seed_everything
from reprotrain.stopping import GracefulStop
from reprotrain.timing import process_age_s
from reprotrain.tracking import (
    NoRun,
    TrackingWorker,
    check_store,
    discard_early,
    redact,
    take_worker,
    where_to_look,
)


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
            return train_into(config, device, out_dir, runtime, varied or [], group)
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


def train_into(
    config: Config,
    device: torch.device,
    out_dir: Path,
    runtime: str,
    varied: list[str],
    group: distributed.Group = distributed.SINGLE,
) -> dict[str, Any]:
    """Seed, build, check the store, train and finish: `run` after its checks."""
    set_threads(config.train.threads)
    seed_everything(config.train.seed, config.train.deterministic, device)
    uri = config.tracking.uri or default_tracking_uri()
    tracking = config.tracking.enabled and group.main
    if tracking:
        check_store(uri, config.tracking.connect_timeout_s)  # now: a dead server fails fast
    # The MLflow run is kept by a process of its own (tracking/worker.py), started before
    # torch was imported: it opens the store now, on another core, while this one builds.
    worker = take_worker(uri, config.tracking.log_model) if tracking else None
    if worker is None:
        discard_early()
    try:
        return train_with(config, device, out_dir, runtime, varied, group, uri, worker)
    finally:
        if worker is not None:
            worker.close()  # a run it holds that was not ended here ends KILLED


def train_with(
    config: Config,
    device: torch.device,
    out_dir: Path,
    runtime: str,
    varied: list[str],
    group: distributed.Group,
    uri: str,
    worker: TrackingWorker | None,
) -> dict[str, Any]:
    """Build, train and finish, recording through `worker` (None: nothing recorded)."""
    tracking = worker is not None
    stop = GracefulStop().install()  # Ctrl-C / SIGTERM end the run KILLED, after a checkpoint
    resume_from = load_resume_point(config)
    # The resumed run's status, checked before any step, not after the first flush: the
    # worker reads it while this process builds.
    asked = worker.run_status(resume_from["run_id"]) if resume_from and worker else None
    try:
        pieces = build(config, device)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise out_of_memory(device, config, None) from None
    status = resumed_status(config, resume_from, asked(), worker.uri) if asked and worker else None
    example = check_fit(pieces.model, pieces.loss_fn, pieces.splits, device)
    batches = make_batches(pieces.splits.train, config.train, device, group.rank, group.world_size)
    total = config.train.steps or config.train.epochs * batches.batches_per_epoch
    start, losses = restore(resume_from, pieces)
    if group.rank > 0:  # dropout draws its own masks on each rank, resumable from the step
        torch.manual_seed(hash((config.train.seed, group.rank, start)) % 2**63)
    trained = distributed.wrap(pieces.model, group, device)  # DDP under torchrun
    finishing = resume_from is not None and start >= total
    if finishing and status == "FINISHED":
        raise already_finished(config, resume_from, status)
    info = describe_device(device)
    startup_s = process_age_s()  # process start to first step
    tracker = (
        worker.open(
            config.tracking.experiment,
            run_name(config, pieces, device, varied),
            {
                **info.as_tags(),
                **run_tags(config, pieces, runtime),
                **distributed_tags(config, group),
            },
            flatten(as_dict(config)),
            config.tracking.flush_every_s,
            resume_run_id=resume_from["run_id"] if resume_from else "",
            spool_dir=out_dir / "spool",
            checkpoint_dir=Path(config.train.checkpoint_dir).resolve(),
        )
        if worker is not None
        else NoRun()
    )
    with tracker as tracked:

        def save(
            step: int,
            losses_so_far: list[float],
            window: list[float],
            timings: dict[str, float] | None = None,
        ) -> None:
            save_checkpoint(
                checkpoint_path(config.train.checkpoint_dir, tracked.run_id),
                step=step,
                model=pieces.model,
                optimizer=pieces.optimizer,
                scheduler=pieces.scheduler,
                losses=losses_so_far,
                run_id=tracked.run_id,
                fingerprint=fingerprint(config),
                unsent=tracked.unsent(),
                window=window,
                timings=timings,
            )

        if resume_from:  # what the stopped try had not sent; those it had are not sent again
            tracked.resend(resume_from.get("unsent", []))
        if finishing:  # killed during its final phase: finish it without training again
            fitted = finished_fit(resume_from, total)
        else:
            try:
                fitted = fit(
                    trained,
                    batches,
                    pieces.loss_fn,
                    pieces.optimizer,
                    device=device,
                    train=config.train,
                    recorder=tracked,
                    scheduler=pieces.scheduler,
                    scheduler_interval=pieces.scheduler_interval,
                    total=total,
                    start=start,
                    losses=losses,
                    save=save if group.main else None,
                    stop=stop,
                    loss_every=config.tracking.loss_every,
                    window_values=resume_from.get("window") if resume_from else None,
                    group=group,
                )
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if is_out_of_memory(error):
                    raise out_of_memory(device, config, pieces) from None
                if group.active and distributed.collective_failed(error):
                    # torchrun now sends SIGTERM to the ranks left: this one ends FAILED first.
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    raise distributed.lost_rank(group, error) from None
                raise
            if not group.main:
                return {}
            save(total, fitted.losses, [], fitted.timings)  # the final phase restarts here
        result = finish(
            config,
            pieces,
            fitted,
            tracked,
            device,
            info,
            example,
            out_dir,
            total,
            startup_s,
            uri if config.tracking.enabled else None,
        )
    if tracking:
        where = (
            f"its record waits in {tracker.waiting} (python -m reprotrain.replay sends it)"
            if tracker.waiting
            else where_to_look(uri, tracker.experiment_id, result["run_id"])
        )
        print(
            f"reprotrain: run {result['run_id']} FINISHED in experiment "
            f"{config.tracking.experiment!r}; outputs in {out_dir}; {where}",
            file=sys.stderr,
            flush=True,
        )
    return result


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


def resumed_status(config: Config, state: dict[str, Any], status: str | None, uri: str) -> str:
    """The status of the run a checkpoint belongs to (None: not in the store at `uri`),
    which must be in this store."""
    if status is None:
        raise TrackingError(
            f"train.resume={config.train.resume!r}: its run {state['run_id']} is not in the "
            f"tracking store {redact(uri)}",
            hint="set tracking.uri to the store the run was recorded in, or start a new run",
        )
    return status


def finished_fit(state: dict[str, Any], total: int) -> Fitted:
    """What fit() left, from the last step's checkpoint: a run killed after training."""
    losses = list(state["losses"])
    timings = state.get("timings") or {}  # a checkpoint written at a stop has none
    return Fitted(
        list(range(1, total + 1)),
        losses,
        {key: float(timings.get(key, float("nan"))) for key in TIMING_KEYS},
        int(np.sum(~np.isfinite(np.asarray(losses, dtype=np.float64)))),
    )


def restore(state: dict[str, Any] | None, pieces: Pieces) -> tuple[int, list[float]]:
    """Load a checkpoint into the model, optimizer and scheduler; return (step, losses so far)."""
    if state is None:
        return 0, []
    pieces.model.load_state_dict(state["model"])
    pieces.optimizer.load_state_dict(state["optimizer"])
    if pieces.scheduler is not None and state.get("scheduler") is not None:
        pieces.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], list(state["losses"])


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
