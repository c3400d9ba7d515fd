"""Stopping a run on Ctrl-C or SIGTERM without losing what it did.

    stop = GracefulStop().install()   # once, in the process that trains
    stop.in_loop = True               # the loop: a signal now waits for the step boundary
    stop.check()                      # between steps: raises Interrupted if one came

Either way the run ends KILLED (the tracking record's `end_status`), after the points so far
are sent and, inside the loop, a checkpoint is written.
"""

from __future__ import annotations

import signal
from types import FrameType


class Interrupted(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class GracefulStop:
    """SIGINT/SIGTERM during the training loop stop it at the next step boundary (so the
    losses so far are sent and a checkpoint is written); during a callback between two steps
    (one that blocks, say) they interrupt it and the loop stops there the same way; anywhere
    else, or a second signal, they stop the process at once. Either way the run ends KILLED."""

    def __init__(self) -> None:
        self.in_loop = False
        self.in_callback = False  # a callback runs between two steps: it may be interrupted
        self.requested: int | None = None

    def install(self) -> GracefulStop:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.in_loop and self.requested is None:
            self.requested = signum
            if not self.in_callback:
                return  # the loop stops at the next step boundary
        raise Interrupted(signum)  # a blocked callback is interrupted: its step is done

    def check(self) -> None:
        """Called between steps: raise if a stop was asked for."""
        if self.requested is not None:
            raise Interrupted(self.requested)
