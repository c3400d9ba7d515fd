"""The variants measured side by side, each on the reference MLP from the same weights.

    a      course_loop             the course's loop as written
    b, c   reprotrain_step         reprotrain's loop.fit(), with and without MLflow tracking
    d      lightning_or_reason     Lightning's Trainer with MLFlowLogger (the `bench` extra)
    bound  forward_backward_bound  forward, loss, backward only: the ceiling for b
plus matmul_flops, the fp32 arithmetic ceiling that b's FLOP/s is set against.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import mlflow
import torch
from torch import nn

from reprotrain.bench.clock import StepTimer, memory, reset_memory
from reprotrain.bench.reference import (
    EXPERIMENT,
    HIDDEN,
    LOG_EVERY,
    LR,
    SEED,
    bench_config,
    num_samples_of,
    reference_batches,
    reference_model,
)
from reprotrain.build import build
from reprotrain.data import EpochBatches, Splits, make_batches, to_tensors
from reprotrain.devices import synchronize
from reprotrain.loop import fit
from reprotrain.schema import as_dict, flatten
from reprotrain.timing import PHASES
from reprotrain.tracking import NoRun, TrackedRun


def course_loop(
    device: torch.device, dataset: Splits, batch_size: int, steps: int, warmup: int
) -> tuple[dict[str, Any], list[float]]:
    """(a) The loop as the course writes it, on b's batches kept on the host."""
    reset_memory(device)
    model = reference_model(dataset, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # default: no fused, per-tensor
    loss_fn = nn.CrossEntropyLoss()
    host = reference_batches(dataset, batch_size, torch.device("cpu"))
    timer, losses = StepTimer(device, warmup), []
    for inputs, targets in host.take(steps):
        timer.begin()
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # sync point: the course reads the loss every step
        timer.end()
    return {**timer.summary(batch_size), **memory(device)}, losses


def reprotrain_step(
    device: torch.device,
    dataset: Splits,
    batch_size: int,
    steps: int,
    warmup: int,
    *,
    hidden: int = HIDDEN,
    tracking_uri: str | None = None,
    log_every: int = LOG_EVERY,
    resident: str = "auto",
    fused: bool | None = None,
    train_options: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[float]]:
    """(b) with a tracking URI, (c) without: reprotrain's own loop, loop.fit(), on the pieces
    build.py builds and the batches data.make_batches gives, as a run gets them.
    `train_options`: more train.* settings (the fast-path study's switches)."""
    config = bench_config(
        device,
        batch_size,
        steps,
        warmup,
        hidden=hidden,
        tracking=tracking_uri is not None,
        log_every=log_every,
        resident=resident,
        fused=fused,
        train_options=train_options,
        num_samples=num_samples_of(dataset),
    )
    tracker: TrackedRun | NoRun = NoRun()
    if tracking_uri is not None:
        tracker = TrackedRun(
            tracking_uri,
            config.tracking.experiment,
            f"b-{device.type}-{batch_size}",
            {"bench.variant": "b", "device.type": device.type},
            flatten(as_dict(config)),
            config.tracking.flush_every_s,
        )
    reset_memory(device)
    torch.manual_seed(SEED)  # build() makes the model first: the same weights as the others
    pieces = build(config, device, dataset)
    batches = make_batches(dataset.train, config.train, device)
    flush_s = open_s = 0.0
    with tracker as tracked:
        if isinstance(tracked, TrackedRun):
            # Opening the run is once per run, not per step (~20-30 ms with MLflow imported; in
            # an app run it overlaps the first steps): timed on its own as open_run_s, so a
            # short measurement is not charged with it as if it were per-step cost.
            began = time.perf_counter()
            tracked.ready()
            open_s = time.perf_counter() - began
        accounted = AccountedRun(tracked)
        fitted = fit(
            pieces.model,
            batches,
            pieces.loss_fn,
            pieces.optimizer,
            device=device,
            train=config.train,
            recorder=accounted,
            total=steps,
            loss_every=config.tracking.loss_every,
        )
        if isinstance(tracked, TrackedRun):
            # A short run may never reach a flush inside fit(); its buffered points are sent
            # here. Count that send in b's window (all of it, warm-up points included).
            began = time.perf_counter()
            tracked.metrics.flush()
            flush_s = time.perf_counter() - began
    timings = fitted.timings
    measured = steps - warmup
    # fit()'s samples/s counts training only; the time it spent inside the window reading
    # losses and handing them to the recorder (tracking_s) is added back, so b's and c's
    # window is wall-clock like a's, d's and the bound's.
    fit_window_s = measured * batch_size / timings["samples_per_s"]
    window_s = fit_window_s + timings["tracking_s"] + timings["checkpoint_s"] + flush_s
    out = {
        "measured_steps": measured,
        "step_ms_median": timings["step_ms_median"],
        "samples_per_s": measured * batch_size / window_s,
        "window_s": window_s,
        "fit_samples_per_s": timings["samples_per_s"],
        "loop_tracking_s": timings["tracking_s"],
        "final_flush_s": flush_s,
        "open_run_s": open_s,
        "in_tracking_s": accounted.spent_s + flush_s,
        "resident_data": batches.resident,
        **{f"{phase}_ms_mean": timings[f"{phase}_ms_mean"] for phase in PHASES},
        **memory(device),
    }
    return out, fitted.losses


class AccountedRun:
    """The run as fit() sees it, adding up the time spent inside its metric calls (appending
    points, and sending a batch when one is due): the tracking's direct cost, to set beside
    the on/off comparison, which also catches indirect costs but moves with machine load."""

    def __init__(self, run: TrackedRun | NoRun) -> None:
        self.run, self.spent_s = run, 0.0

    def log_metric(self, key: str, value: float, step: int) -> None:
        began = time.perf_counter()
        self.run.log_metric(key, value, step)
        self.spent_s += time.perf_counter() - began

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        began = time.perf_counter()
        self.run.log_metrics(values, step)
        self.spent_s += time.perf_counter() - began

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)


def lightning_or_reason(
    device: torch.device,
    dataset: Splits,
    batch_size: int,
    steps: int,
    warmup: int,
    tracking_uri: str,
    workdir: Path,
) -> tuple[dict[str, Any], list[float]]:
    """(d) where Lightning is installed; otherwise why it was not measured (and no losses)."""
    try:
        import lightning  # noqa: F401  (the `bench` extra)
    except ImportError:
        return {"skipped": "lightning is not installed (pip install -e '.[bench]')"}, []
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no workers", "tensor cores": advice, not results
            return lightning_loop(device, dataset, batch_size, steps, warmup, tracking_uri, workdir)
    finally:  # MLFlowLogger sets the process-wide URI (and $MLFLOW_TRACKING_URI): put it back
        mlflow.set_tracking_uri(previous)


def lightning_loop(
    device: torch.device,
    dataset: Splits,
    batch_size: int,
    steps: int,
    warmup: int,
    tracking_uri: str,
    workdir: Path,
) -> tuple[dict[str, Any], list[float]]:
    """(d) Lightning's Trainer with MLFlowLogger, timed from a Callback.

    A step's time is batch start to the next batch start: that interval holds Lightning's
    logger write, which happens after on_train_batch_end. One extra step closes the last one.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import MLFlowLogger

    class ReferenceModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = reference_model(dataset, torch.device("cpu"))
            self.loss_fn = nn.CrossEntropyLoss()
            self.losses: list[torch.Tensor] = []  # read once, after fit: no extra sync

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            loss = self.loss_fn(self.model(inputs), targets)
            self.log("train/loss", loss)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class BatchClock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []

        def on_train_batch_start(self, *_args: Any) -> None:
            synchronize(device)  # sync point: the previous step's GPU work is done
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, *_args: Any) -> None:
            synchronize(device)  # sync point
            self.ends.append(time.perf_counter())

    loader = lightning_batches(dataset, batch_size, steps + 1)
    clock = BatchClock()
    reset_memory(device)
    module = ReferenceModule()
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=steps + 1,
        logger=MLFlowLogger(experiment_name=f"{EXPERIMENT}-lightning", tracking_uri=tracking_uri),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[clock],
        default_root_dir=str(workdir),
    )
    trainer.fit(module, train_dataloaders=loader)
    starts = clock.starts[warmup : steps + 1]
    intervals = [
        (later - earlier) * 1e3 for earlier, later in zip(starts, starts[1:], strict=False)
    ]
    inside = [
        (e - s) * 1e3
        for s, e in zip(clock.starts[warmup:steps], clock.ends[warmup:steps], strict=True)
    ]
    window_s = starts[-1] - starts[0]
    losses = torch.stack(module.losses[:steps]).cpu().tolist() if module.losses else []
    return {
        "measured_steps": len(intervals),
        "step_ms_median": statistics.median(intervals),
        "samples_per_s": len(intervals) * batch_size / window_s,
        "window_s": window_s,
        "batch_start_to_end_ms_median": statistics.median(inside),
        **memory(device),
    }, losses


def lightning_batches(dataset: Splits, batch_size: int, steps: int) -> torch.utils.data.DataLoader:
    """d's DataLoader: b's batches (EpochBatches: epoch_order(n, SEED, epoch)), each fetched
    whole by its index list from the host tensors, without per-sample indexing and collation,
    which would charge d for data loading."""
    tensors = torch.utils.data.TensorDataset(*to_tensors(dataset.train))
    order = EpochBatches(len(tensors), batch_size, SEED, 0, steps)
    return torch.utils.data.DataLoader(tensors, batch_size=None, sampler=order)


def forward_backward_bound(
    device: torch.device, dataset: Splits, batch_size: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Forward, loss, backward only: no optimizer, no logging, no copies. The batches are the
    ones b and c see, resident on the device (views into a per-epoch shuffled copy), so the bound
    differs from c only by what a training step adds to forward and backward."""
    reset_memory(device)
    model = reference_model(dataset, device)
    loss_fn = nn.CrossEntropyLoss()
    resident = reference_batches(dataset, batch_size, device)
    timer = StepTimer(device, warmup)
    for inputs, targets in resident.take(steps):
        timer.begin()
        model.zero_grad(set_to_none=True)  # as in the real step: backward writes fresh gradients
        loss_fn(model(inputs), targets).backward()
        timer.end()
    return {**timer.summary(batch_size), **memory(device)}


def matmul_flops(device: torch.device, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """fp32 square matmuls (TF32 off): the arithmetic ceiling the training FLOP/s is set against."""
    torch.backends.cuda.matmul.allow_tf32 = False
    by_size = {}
    for n in sizes:
        left = torch.randn(n, n, device=device)
        right = torch.randn(n, n, device=device)
        out = torch.empty(n, n, device=device)
        for _ in range(2):
            torch.mm(left, right, out=out)  # warm-up: thread pool, cuBLAS handle, clocks
        times = []
        for _ in range(repeats):
            synchronize(device)  # sync point
            began = time.perf_counter()
            torch.mm(left, right, out=out)
            synchronize(device)  # sync point: the product is finished before the clock is read
            times.append(time.perf_counter() - began)
        median_s = statistics.median(times)
        by_size[str(n)] = {"median_s": median_s, "flops_per_s": 2 * n**3 / median_s}
        del left, right, out
    return {
        "dtype": "float32",
        "tf32": False,
        "repeats": repeats,
        "sizes": by_size,
        "flops_per_s": max(entry["flops_per_s"] for entry in by_size.values()),
    }
