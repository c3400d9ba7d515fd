"""Honest per-step timing: per phase, GPU-aware, read without a sync per step.

    clock = PhaseClock(device)
    clock.start_step()
    ... clock.mark("data_to_device") ... clock.mark("forward") ...
    clock.end_step(step)
    clock.drain()  # -> [(step, {"data_to_device": ms, ..., "step": ms})]

On CPU a mark reads perf_counter (CPU ops finish before they return). On CUDA a mark
records an event in the stream; events are read in `drain`, which waits for the last one:
that wait is the one sync point, taken every `log_every` steps, not every step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import psutil
import torch

PHASES = ("data_to_device", "forward", "backward", "optimizer")
# A timing boundary: a CUDA event recorded in the stream, or the CPU clock's reading.
Mark = torch.cuda.Event | float


def process_age_s() -> float:
    """Seconds since this process started. On Linux: the kernel's start time of the process
    (`/proc/self/stat`, in clock ticks since boot) against `CLOCK_BOOTTIME`, the clock it is
    counted on, so the figure is true to one tick (10 ms). Not `psutil`'s `create_time()`
    against `time.time()`: that adds the boot time `/proc/stat` gives in whole seconds, so the
    age comes out up to 1 s too long, by the same amount in every run on the machine. Elsewhere
    (macOS, where the kernel keeps the start time in microseconds) `create_time()`."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/stat", "rb") as stat:  # bytes: comm may be any bytes, ")" too
            fields = stat.read().rpartition(b")")[2].split()  # after "pid (comm)": field 3 on
        started = int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    return time.time() - psutil.Process().create_time()


class PhaseClock:
    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self._clock = now  # the CPU's clock (a test gives its own)
        self._marks: list[tuple[str, Mark]] = []
        self._pending: list[tuple[int, list[tuple[str, Mark]]]] = []

    def _now(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._clock()

    def start_step(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def end_step(self, step: int) -> None:
        self._pending.append((step, self._marks))
        self._marks = []

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Durations in ms of every step ended since the last drain."""
        if not self._pending:
            return []
        last = self._pending[-1][1][-1][1]
        if isinstance(last, torch.cuda.Event):  # on CUDA (self.cuda): every mark is an event
            last.synchronize()  # sync point: waits for the last step's work
        out = []
        for step, marks in self._pending:
            phases: dict[str, float] = {}  # a phase marked more than once (gradient
            for i in range(1, len(marks)):  # accumulation's micro-batches) adds up
                name = marks[i][0]
                phases[name] = phases.get(name, 0.0) + self._ms(marks[i - 1][1], marks[i][1])
            phases["step"] = self._ms(marks[0][1], marks[-1][1])
            out.append((step, phases))
        self._pending = []
        return out

    def _ms(self, begin: Mark, end: Mark) -> float:
        if isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return begin.elapsed_time(end)
        if isinstance(begin, torch.cuda.Event) or isinstance(end, torch.cuda.Event):
            raise TypeError("a CUDA event and a CPU clock reading cannot be subtracted")
        return (end - begin) * 1e3


class TimingSummary:
    """Collects per-step phase times after warm-up; reports medians and means."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.samples: dict[str, list[float]] = {}

    def add(self, step: int, phases: dict[str, float]) -> None:
        if step <= self.warmup_steps:
            return
        for name, ms in phases.items():
            self.samples.setdefault(name, []).append(ms)

    def median(self, name: str) -> float:
        values = self.samples.get(name)
        return statistics.median(values) if values else float("nan")

    def mean(self, name: str) -> float:
        values = self.samples.get(name)
        return statistics.fmean(values) if values else float("nan")

    @property
    def measured_steps(self) -> int:
        return len(self.samples.get("step", []))


def training_flops_per_sample(
    model: torch.nn.Module, forward: Callable[[], torch.Tensor], samples: int
) -> float:
    """FLOPs of one forward and backward per sample, counted by torch's own FlopCounterMode
    (any model: convolutions, attention, ... not only Linear layers); `forward()` runs the
    model on an example batch of `samples` and returns its predictions. Eval mode, so no
    batch statistic moves and no dropout mask is drawn; gradients are cleared afterwards."""
    from torch.utils.flop_counter import FlopCounterMode  # imports torch's op registry: once

    was_training = model.training
    model.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            forward().float().sum().backward()
    except (RuntimeError, TypeError, ValueError):
        return float("nan")  # an op the counter cannot follow: say "not measured"
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return counter.get_total_flops() / max(samples, 1)
