"""Step times and memory of one measured variant: warm-up left out, GPU work synchronised."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch

from reprotrain.devices import synchronize


class StepTimer:
    """Per-step times and the wall clock of the measured window, warm-up left out.

    On CUDA each step is bracketed by events, read once at the end: no sync per step. The
    window's wall clock starts and stops only after a sync, so queued work is counted.
    """

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.window_start: float | None = None

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        synchronize(self.device)  # mps: wait for the queue; a no-op on cpu
        return time.perf_counter()

    def begin(self) -> None:
        if len(self.spans) == self.warmup and self.window_start is None:
            synchronize(self.device)  # sync point: warm-up work is done before the window opens
            self.window_start = time.perf_counter()
        self._begin = self._now()

    def end(self) -> None:
        self.spans.append((self._begin, self._now()))

    def summary(self, batch_size: int) -> dict[str, Any]:
        synchronize(self.device)  # sync point: every queued step is done before the clock stops
        elapsed = time.perf_counter() - (self.window_start or time.perf_counter())
        measured = self.spans[self.warmup :]
        step_ms = [
            begin.elapsed_time(end) if self.cuda else (end - begin) * 1e3 for begin, end in measured
        ]
        return {
            "measured_steps": len(measured),
            "step_ms_median": statistics.median(step_ms),
            "samples_per_s": len(measured) * batch_size / elapsed,
            "window_s": elapsed,
        }


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def memory(device: torch.device) -> dict[str, float]:
    out = {"peak_rss_mb": peak_rss_mb()}
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def peak_rss_mb() -> float:
    # ru_maxrss is the process's high-water mark so far (KiB on Linux): it never goes down.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
