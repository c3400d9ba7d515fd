"""Fast paths that change how the step is run, each a `train.` option, all off by default.

    train.compile=true       torch.compile the model: forward and backward as generated kernels
    train.cuda_graphs=true   capture forward, loss, zero_grad, backward and step once as a CUDA
                             graph, then replay it: one launch per step instead of dozens (CUDA)
    train.precision=bf16     forward and loss under bf16 autocast (weights and update stay fp32)
    train.tf32=true          fp32 matmuls on TF32 tensor cores (CUDA, Ampere and newer)

compile and cuda_graphs keep the arithmetic (losses agree within float tolerance: fused kernels
round differently); bf16 and TF32 change it (fewer mantissa bits), which is why none is on by
default. The same-math fast paths (fused AdamW, resident data, no per-step sync, threads) are
on by default and live where they act (model.py, data.py, train.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reprotrain.data.structure import map_tensors, tensors
from reprotrain.errors import ConfigError
from reprotrain.schema import TrainConfig
from reprotrain.step import Knobs, LossFn, closure_step, needs_closure, train_step
from reprotrain.tasks import Task

CAPTURE_AFTER = 3  # eager steps before the capture: kernels chosen, allocator warm


def check(train: TrainConfig, device: torch.device) -> None:
    """What the resolved device cannot do, said before any run exists."""
    for key in ("cuda_graphs", "tf32", "fp16"):
        on = train.precision == "fp16" if key == "fp16" else getattr(train, key)
        if on and device.type != "cuda":
            if key == "fp16":
                raise ConfigError(
                    f"train.precision=fp16 needs a CUDA GPU (its GradScaler), but this run "
                    f"resolved to {device}",
                    hint="use train.precision=bf16 here, or run on a machine with a GPU",
                )
            raise ConfigError(
                f"train.{key}=true needs a CUDA GPU, but this run resolved to {device}",
                hint=f"set train.{key}=false, or run on a machine with a GPU (device=cuda)",
            )
    if train.compile:
        missing = compiler_missing()
        if missing:
            raise ConfigError(
                f"train.compile=true builds kernels with a C++ compiler, but {missing}",
                hint="install g++ and the Python headers (Debian: g++ python3-dev), "
                "or set train.compile=false",
            )


def compiler_missing() -> str:
    """Why torch.compile could not build kernels here ('' when it can)."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"{compiler!r} is not on PATH"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"the Python headers are missing ({headers})"
    return ""


def set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def autocast(device: torch.device, precision: str, graphs: bool = False) -> Any:
    """The forward/loss context: bf16 or fp16 autocast, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    # A CUDA graph replays the casts it captured: autocast's cast cache must be off there.
    return torch.autocast(device.type, dtype=dtype, cache_enabled=not graphs)


def knobs(train: TrainConfig, device: torch.device) -> Knobs:
    """The step's knobs as train.precision and train.clip_grad_norm say: fp16 scales the loss
    (torch.amp.GradScaler) so that small gradients do not underflow to zero."""
    scaler = torch.amp.GradScaler(device.type) if train.precision == "fp16" else None
    return Knobs(
        autocast=autocast(device, train.precision, graphs=train.cuda_graphs),
        scaler=scaler,
        clip_grad_norm=train.clip_grad_norm,
    )


def compiled(model: nn.Module) -> nn.Module:
    """The module the step calls; parameters are shared, so save and load use `model`."""
    # A module compiles to an OptimizedModule (an nn.Module); torch annotates it as a Callable.
    return torch.compile(model)  # type: ignore[return-value]


StepFunction = Callable[[tuple[Any, ...], Callable[[str], None]], torch.Tensor]


def step_function(
    train: TrainConfig,
    device: torch.device,
    model: nn.Module,
    task: Task,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    knobs: Knobs,
) -> StepFunction:
    """`step(batches, mark) -> loss`: train_step as the options ask for it. Also sets torch's
    TF32 switch as train.tf32 says (a process-wide setting)."""
    set_tf32(train.tf32)
    closure = needs_closure(optimizer)
    if closure:
        check_closure(train, optimizer)
    if train.cuda_graphs:
        return CudaGraphStep(model, task, loss_fn, optimizer, knobs)
    forward = compiled(model) if train.compile else model
    take = closure_step if closure else train_step

    def step(batches: tuple[Any, ...], mark: Callable[[str], None]) -> torch.Tensor:
        return take(forward, batches, task, loss_fn, optimizer, knobs, mark)

    return step


def check_closure(train: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """What an optimizer that needs a closure (LBFGS) cannot be combined with."""
    name = type(optimizer).__name__
    if train.cuda_graphs:
        raise ConfigError(
            f"train.cuda_graphs=true captures one fixed step, but {name}.step re-evaluates "
            "the loss a varying number of times (it takes a closure)",
            hint="set train.cuda_graphs=false, or use an optimizer without a closure",
        )
    if train.precision == "fp16":
        raise ConfigError(
            f"train.precision=fp16 scales the loss with a GradScaler, which cannot step "
            f"{name} (its step takes a closure)",
            hint="use train.precision=fp32 or bf16 with this optimizer",
        )


class CudaGraphStep:
    """The training step captured once as a CUDA graph and replayed with each new batch.

    The first CAPTURE_AFTER steps run eagerly on a side stream, as CUDA graph capture asks;
    they are real training steps on real batches, so the losses follow the eager loop's. The
    capture itself runs nothing; from then on each step copies its batch (every tensor in it:
    batches of one fixed shape) into the captured input buffers and replays the graph. The
    optimizer must be built with capturable=True.
    """

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        knobs: Knobs,
    ) -> None:
        self.model, self.task, self.loss_fn, self.optimizer = model, task, loss_fn, optimizer
        self.knobs = knobs
        self.side = torch.cuda.Stream()
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Any = None
        self.loss = torch.empty(0)

    def __call__(self, batches: tuple[Any, ...], mark: Callable[[str], None]) -> torch.Tensor:
        if self.graph is None and self.eager_steps < CAPTURE_AFTER:
            self.eager_steps += 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self._step(batches, mark)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        graph = self.graph if self.graph is not None else self._capture(batches)
        for static, new in zip(tensors(self.static), tensors(batches), strict=True):
            static.copy_(new, non_blocking=True)
        graph.replay()
        mark("graph")  # forward, backward and step are one launch: no marks between them
        return self.loss.clone()  # the captured loss is overwritten by the next replay

    def _step(self, batches: tuple[Any, ...], mark: Callable[[str], None]) -> torch.Tensor:
        return train_step(
            self.model, batches, self.task, self.loss_fn, self.optimizer, self.knobs, mark
        )

    def _capture(self, batches: tuple[Any, ...]) -> torch.cuda.CUDAGraph:
        self.static = map_tensors(torch.Tensor.clone, batches)
        # Gradients set to None now are allocated inside the graph's memory pool at capture,
        # so every replay's backward writes them afresh (no accumulation across steps).
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = self._step(self.static, _no_mark)
        return graph


def _no_mark(_phase: str) -> None:
    pass  # a timing event cannot be recorded inside a capture
