"""One run as the command line does it: a recipe that sets up, trains, checkpoints and finishes.

    figures = Run(validate(cfg)).execute()     # what run.json holds; {} on ranks other than 0

`python -m reprotrain.train` (cli.py), `reprotrain.train([...])` (api.py), each job of a
sweep, each rank under torchrun and the training process in a container all drive this same
class. It owns what a plain `Trainer` leaves to its caller: the device from the config, the
process's threads, seeds and signal handlers, the pieces built from the config, the MLflow
run (this process's active run), the checkpoints (`save_checkpoint`) and the outputs
(`finish`). The Trainer knows torch and the task; the Run knows the config, MLflow,
checkpoints and files.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from reprotrain import distributed, fastpaths
from reprotrain.build import Pieces, build, check_fit, class_name
from reprotrain.build import out_of_memory as is_out_of_memory
from reprotrain.checkpoint import (
    RunLock,
    already_finished,
    checkpoint_path,
    fingerprint,
    load_resume_point,
    save_checkpoint,
)
from reprotrain.devices import DeviceInfo, describe_device, resolve_device, set_threads
from reprotrain.errors import ConfigError, DeviceError, TrackingError
from reprotrain.outputs import check_writable, claim
from reprotrain.project import default_tracking_uri
from reprotrain.provenance import (
    count_parameters,
    dataset_source,
    decided_params,
    run_name,
    run_tags,
)
from reprotrain.results import RunOutputs
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
from reprotrain.trainer import Fitted, Trainer


class Run:
    """Train once as `config` says, in this process (`runtime` names where that process is:
    local, docker-cpu, docker-cuda); `varied` is what a sweep job varies (its run name)."""

    def __init__(
        self,
        config: Config,
        runtime: str = "local",
        varied: list[str] | None = None,
        *,
        began: float | None = None,
    ) -> None:
        """`began`: when the run started (time.monotonic()); None: when this process did (the
        command line), so that time.startup_s and time.total_s count the interpreter's start."""
        self.config, self.runtime, self.varied = config, runtime, list(varied or [])
        self.began = began
        self.device = torch.device("cpu")
        self.group: distributed.Group = distributed.SINGLE
        self.out_dir = Path(config.train.output_dir or "outputs/runs/latest")
        self.tracking_uri: str | None = None  # None: nothing recorded (off, or not rank 0)
        self.stop = GracefulStop()
        self.resume_from: dict[str, Any] | None = None
        self.resumed_status: str | None = None
        self.startup_s = float("nan")
        # Set by setup():
        self.pieces: Pieces
        self.example: Any = None  # two training items (CPU): the MLflow Model's input example
        self.trainer: Trainer
        self.info: DeviceInfo
        self.recorder: TrackedRun | NoRun = NoRun()
        self.lock: RunLock | None = None  # held while this process trains its run

    def execute(self) -> dict[str, Any]:
        """Set up, train and finish; returns the figures written to run.json (rank 0's; the
        other ranks of a torchrun job return {})."""
        distributed.adopt_cluster_tasks()  # a submitit job's tasks: one torchrun-style job
        config = self.config
        self.device = place(config)  # before any run exists
        fastpaths.check(config.train, self.device)
        self.out_dir = check_writable(self.out_dir, "train.output_dir")
        check_writable(Path(config.train.checkpoint_dir), "train.checkpoint_dir")  # on Ctrl-C too
        self.group = distributed.join(
            config.train.backend, config.train.dist_timeout_s, self.device
        )
        # Rank 0 alone writes outputs; another run writing there is a warning.
        main = self.group.main
        claimed = claim(self.out_dir, "train.output_dir") if main else contextlib.nullcontext()
        try:
            with claimed:
                self.setup()
                with self.open_record() as recorder:
                    self.recorder = self.trainer.recorder = recorder
                    if main and recorder.run_id and self.lock is None:  # a new run: ours now
                        self.lock = RunLock(config.train.checkpoint_dir, recorder.run_id)
                    if self.tracking_uri:  # the data as the run's inputs: the Datasets tab
                        source = dataset_source(config)
                        recorder.log_inputs(as_mlflow_datasets(self.pieces.splits, *source))
                    self.startup_s = self.elapsed_s()  # the start to the first step, run open
                    fitted = self.train()
                    if not main:
                        return {}
                    figures = self.finish(fitted)
                if self.tracking_uri:
                    self.say_where(figures["run_id"])
                return figures
        finally:
            if self.lock is not None:
                self.lock.release()
            distributed.leave(self.group)

    # -- the recipe
    def setup(self) -> None:
        """Threads, seeds, the store, signal handlers, the resume point, the pieces and the
        Trainer (at the checkpoint's step when resuming)."""
        config, device, group = self.config, self.device, self.group
        set_threads(config.train.threads)
        seed_everything(config.train.seed, config.train.deterministic, device)
        uri = config.tracking.uri or default_tracking_uri()
        self.tracking_uri = uri if config.tracking.enabled and group.main else None
        if self.tracking_uri:
            check_store(uri, config.tracking.connect_timeout_s)  # now: a dead server fails fast
        self.stop.install()  # Ctrl-C / SIGTERM end the run KILLED, after a checkpoint
        self.resume_from = load_resume_point(config)
        if self.resume_from and group.main and self.resume_from["run_id"]:
            # Before its record is touched: a second process resuming it is refused here.
            self.lock = RunLock(config.train.checkpoint_dir, self.resume_from["run_id"])
            if config.train.progress != "off":
                step = self.resume_from["trainer"]["step"]
                print(
                    f"reprotrain: resuming run {self.resume_from['run_id']} from step {step}",
                    file=sys.stderr,
                    flush=True,
                )
        if self.resume_from and self.tracking_uri:
            self.resumed_status = resumed_status(config, self.resume_from, uri)
        self.pieces = self.build_pieces()
        self.example = check_fit(self.pieces, device)
        self.trainer = self.make_trainer()
        if self.finishing and self.resumed_status == "FINISHED":
            raise already_finished(config, self.resume_from or {}, self.resumed_status)
        self.info = describe_device(device)

    def train(self) -> Fitted:
        """Train to the step count asked for, checkpointing (rank 0) as train.checkpoint_*
        say and after the last step; a run killed after training only finishes."""
        trainer, config = self.trainer, self.config
        if self.finishing:
            return trainer.finish_from_state()
        try:
            fitted = trainer.fit(
                config.train.steps, config.train.epochs, save=self.save_checkpoint, stop=self.stop
            )
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if is_out_of_memory(error):
                raise out_of_memory(self.device, config, self.pieces) from None
            if self.group.active and distributed.collective_failed(error):
                # torchrun now sends SIGTERM to the ranks left: this one ends FAILED first.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                raise distributed.lost_rank(self.group, error) from None
            raise
        if self.group.main:
            self.save_checkpoint(trainer)  # the last step's, with the timings: see finishing
        return fitted

    def save_checkpoint(self, trainer: Trainer) -> None:
        """<train.checkpoint_dir>/<run id>.pt: the Trainer's state_dict, for train.resume."""
        save_checkpoint(
            checkpoint_path(self.config.train.checkpoint_dir, self.recorder.run_id),
            trainer.state_dict(),
            run_id=self.recorder.run_id,
            fingerprint=fingerprint(self.config),
            model_class=class_name(self.pieces.model),
        )

    def finish(self, fitted: Fitted) -> dict[str, Any]:
        """The MLflow Model, the outputs, the summary figures (outputs: results.py)."""
        outputs = RunOutputs(
            self.config,
            self.pieces,
            self.out_dir,
            self.recorder,
            self.device,
            self.info,
            self.tracking_uri,
        )
        return outputs.write(self.trainer, fitted, self.example, self.startup_s, self.elapsed_s)

    def elapsed_s(self) -> float:
        """Seconds since the run (or, from the command line, its process) started."""
        return process_age_s() if self.began is None else time.monotonic() - self.began

    # -- its parts
    @property
    def finishing(self) -> bool:
        """A resumed run whose checkpoint already reaches the steps asked for (or that stopped
        early): only its final phase is left."""
        if self.resume_from is None:
            return False
        trainer = self.trainer
        total = trainer.total_steps(self.config.train.steps, self.config.train.epochs)
        return trainer.step >= total or trainer.stopped_early is not None

    def build_pieces(self) -> Pieces:
        try:
            return build(self.config, self.device)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            raise out_of_memory(self.device, self.config, None) from None

    def make_trainer(self) -> Trainer:
        """The Trainer on the pieces, this rank's batches, at the checkpoint's step when
        resuming."""
        config, pieces, group = self.config, self.pieces, self.group
        trainer = Trainer(
            pieces.model,
            pieces.optimizer,
            pieces.splits.train,
            val_data=pieces.splits.val,
            task=pieces.task,
            loss_fn=pieces.loss_fn,
            scheduler=pieces.scheduler,
            metrics=pieces.metrics,
            callbacks=pieces.callbacks,
            device=self.device,
            scheduler_interval=pieces.scheduler_interval,
            monitor=pieces.monitor,
            collate_fn=pieces.reading.collate_fn,
            shuffle=pieces.reading.shuffle,
            loss_every=config.tracking.loss_every,
            ranks=group,
            **config.train.model_dump(),
        )
        if self.resume_from is not None:
            trainer.load_state_dict(self.resume_from["trainer"])
        if group.rank > 0:  # dropout draws its own masks on each rank, resumable from the step
            torch.manual_seed(hash((config.train.seed, group.rank, trainer.step)) % 2**63)
        return trainer

    def open_record(self) -> TrackedRun | NoRun:
        """This process's MLflow run (rank 0 under torchrun), or NoRun with tracking off."""
        if self.tracking_uri is None:
            return NoRun()
        config, pieces = self.config, self.pieces
        spec = RunSpec(
            config.tracking.experiment,
            run_name(config, pieces, self.device, self.varied),
            {
                **self.info.as_tags(),
                **run_tags(config, pieces, self.runtime),
                **distributed_tags(config, self.group),
            },
            {**flatten(as_dict(config)), **decided_params(pieces)},
            resume_run_id=self.resume_from["run_id"] if self.resume_from else "",
            checkpoint_dir=Path(config.train.checkpoint_dir).resolve(),
        )
        return TrackedRun(
            self.tracking_uri,
            spec,
            flush_every_s=config.tracking.flush_every_s,
            spool_dir=self.out_dir / "spool",
            system_metrics=config.tracking.system_metrics,
        )

    def say_where(self, run_id: str) -> None:
        recorder = self.recorder
        where = (
            f"its record waits in {recorder.waiting} (python -m reprotrain.replay sends it)"
            if recorder.waiting
            else where_to_look(self.tracking_uri or "", recorder.experiment_id, run_id)
        )
        print(
            f"reprotrain: run {run_id} FINISHED in experiment {self.config.tracking.experiment!r}; "
            f"outputs in {self.out_dir}; {where}",
            file=sys.stderr,
            flush=True,
        )


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
