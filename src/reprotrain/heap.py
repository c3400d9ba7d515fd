"""Python's cyclic garbage collector over a process's start.

    with long_lived():  # imports: torch, Hydra, MLflow
        from reprotrain.cli import main

Importing torch, Hydra and MLflow makes hundreds of thousands of objects that live as long
as the process. While they are made, the collector's full collection runs again and again and
walks every one of them: ~0.5 s of the training process's start and ~1.5 s of its tracking
worker's on a 2-core VM (docs/performance.md). `long_lived` pauses the collector over such a
phase, then moves what it made to the permanent generation (`gc.freeze`), which later
collections do not walk. Reference counting still frees what the phase drops; only garbage in
reference cycles made during the phase is kept (imports make little: measured in the tests).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def long_lived() -> Iterator[None]:
    """Pause the cyclic collector while the block runs; keep what it made out of later
    collections. Nests; leaves the collector as it found it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
