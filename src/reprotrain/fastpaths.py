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

from reprotrain.errors import ConfigError
from reprotrain.schema import TrainConfig
from reprotrain.step import train_step

CAPTURE_AFTER = 3  # eager steps before the capture: kernels chosen, allocator warm


def check(train: TrainConfig, device: torch.device) -> None:
    """What the resolved device cannot do, said before any run exists."""
    for key in ("cuda_graphs", "tf32"):
        if getattr(train, key) and device.type != "cuda":
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
    """The forward/loss context: bf16 autocast, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    # A CUDA graph replays the casts it captured: autocast's cast cache must be off there.
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not graphs)


def compiled(model: nn.Module) -> nn.Module:
    """The module the step calls; parameters are shared, so save and load use `model`."""
    return torch.compile(model)  # type: ignore[return-value]


StepFunction = Callable[[torch.Tensor, torch.Tensor, Callable[[str], None]], torch.Tensor]


def step_function(
    train: TrainConfig,
    device: torch.device,
    model: nn.Module,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> StepFunction:
    """`step(inputs, targets, mark) -> loss`: train_step as the options ask for it.
    Also sets torch's TF32 switch as train.tf32 says (a process-wide setting)."""
    set_tf32(train.tf32)
    context = autocast(device, train.precision, graphs=train.cuda_graphs)
    if train.cuda_graphs:
        return CudaGraphStep(model, loss_fn, optimizer, context)
    forward = compiled(model) if train.compile else model

    def step(inputs: torch.Tensor, targets: torch.Tensor, mark: Callable[[str], None]) -> Any:
        return train_step(forward, inputs, targets, loss_fn, optimizer, mark, context)

    return step


class CudaGraphStep:
    """The training step captured once as a CUDA graph and replayed with each new batch.

    The first CAPTURE_AFTER steps run eagerly on a side stream, as CUDA graph capture asks;
    they are real training steps on real batches, so the losses follow the eager loop's. The
    capture itself runs nothing; from then on each step copies its batch into the captured
    input buffers and replays the graph. The optimizer must be built with capturable=True.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        autocast_context: Any,
    ) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.autocast = autocast_context
        self.side = torch.cuda.Stream()
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs = self.targets = self.loss = torch.empty(0)

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor, mark: Callable[[str], None]
    ) -> torch.Tensor:
        if self.graph is None and self.eager_steps < CAPTURE_AFTER:
            self.eager_steps += 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self._step(inputs, targets, mark)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            self._capture(inputs, targets)
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        self.graph.replay()  # type: ignore[union-attr]
        mark("graph")  # forward, backward and step are one launch: no marks between them
        return self.loss.clone()  # the captured loss is overwritten by the next replay

    def _step(
        self, inputs: torch.Tensor, targets: torch.Tensor, mark: Callable[[str], None]
    ) -> torch.Tensor:
        return train_step(
            self.model, inputs, targets, self.loss_fn, self.optimizer, mark, self.autocast
        )

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs.clone(), targets.clone()
        # Gradients set to None now are allocated inside the graph's memory pool at capture,
        # so every replay's backward writes them afresh (no accumulation across steps).
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step(self.inputs, self.targets, _no_mark)


def _no_mark(_phase: str) -> None:
    pass  # a timing event cannot be recorded inside a capture
