"""Where this process runs: inside reprotrain's own image or not (no torch, no MLflow here:
the launcher asks before it imports either)."""

from __future__ import annotations

import os

CONTAINER_ENV = "REPROTRAIN_IN_CONTAINER"  # set by reprotrain's images and container runtime


def in_container() -> bool:
    """Inside reprotrain's own image, which sets REPROTRAIN_IN_CONTAINER=1. Not /.dockerenv:
    some hosts that are not containers (VMs, CI runners) have that file too."""
    return os.environ.get(CONTAINER_ENV) == "1"
