"""Metric points off the training loop: the loop appends, a thread sends.

    sender = PointSender(send, every_s=5.0)   # send(points) writes them (or spools them)
    sender.start(); sender.add("train/loss", 0.7, step=1); sender.flush(); sender.close()

A synchronous `log_metric` costs milliseconds on sqlite, so the loop only appends points;
the `mlflow-points` thread hands them to `send` every `every_s` seconds, and `flush()` /
`close()` do it now. One send at a time keeps the points in order.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from reprotrain.tracking.recorder import Point


class PointSender:
    """Metric points: `add` appends (all the loop pays); the `mlflow-points` thread hands what
    is there to `send` every `every_s` seconds, and `flush` does it now, in order. A sending
    error that is not spooled is raised by the next `flush` or `close`. `busy_s` is the time
    spent sending (time/tracking_s)."""

    def __init__(self, send: Any, every_s: float) -> None:
        self.send, self.every_s = send, every_s
        self.points: list[Point] = []
        self.busy_s = 0.0
        self._taking = threading.Lock()  # the list's swap against appends
        self._sending = threading.Lock()  # one send at a time: points stay in order
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-points", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def add(self, key: str, value: float, step: int) -> None:
        point = (key, float(value), int(time.time() * 1000), int(step))
        with self._taking:
            self.points.append(point)

    def flush(self) -> None:
        self._send_now()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._stopped.set()
        if self._thread.ident is not None:
            self._thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                self._send_now()
            except BaseException as error:  # raised in the training thread by flush()
                self._error = error
                return

    def _send_now(self) -> None:
        with self._sending:
            with self._taking:
                points, self.points = self.points, []
            if points:
                began = time.perf_counter()
                try:
                    self.send(points)
                finally:
                    self.busy_s += time.perf_counter() - began
