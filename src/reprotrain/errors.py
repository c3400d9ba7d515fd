"""Errors that are part of reprotrain's interface.

A `UserError` is a mistake a user can fix (a config value, a missing device, an
unreachable server, a broken data file). It is printed as one line, without a
traceback, and the process exits non-zero. Everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import os
import sys

from reprotrain.redaction import redact


class UserError(Exception):
    """One-line, actionable error: what was wrong, the value given, what is allowed, the fix."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.message}; fix: {self.hint}" if self.hint else self.message


class ConfigError(UserError):
    """A config value, type, key or group option is not allowed; `key` names the config key
    (or group) it is about where there is one, e.g. `optimizer.lr`."""

    def __init__(self, message: str, *, hint: str | None = None, key: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key


class DeviceError(UserError):
    """A requested device cannot be used, or model and data sit on different devices."""


class TrackingError(UserError):
    """The MLflow tracking store cannot be reached or written."""


class DataError(UserError):
    """A data file is missing, truncated, of the wrong shape or holds non-finite values."""


class RuntimeEnvError(UserError):
    """The container runtime (Docker engine, NVIDIA toolkit, image build) is not usable."""


class OutputError(UserError):
    """An output (result file, checkpoint, prepared data) cannot be written there."""


class DiskFullError(OutputError):
    """The file system an output goes to has no room left (ENOSPC / EDQUOT)."""


def full_errors_requested() -> bool:
    """Hydra's convention: HYDRA_FULL_ERROR=1 shows full tracebacks."""
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


def report_and_exit(error: UserError) -> None:
    """Print the one-line error (or the traceback when asked for) and exit non-zero."""
    if full_errors_requested():
        raise error
    print(f"reprotrain: error: {redact(error.one_line())}", file=sys.stderr, flush=True)
    raise SystemExit(error.exit_code)


def shown(value: object, limit: int = 120) -> str:
    """A value for a message, as repr() gives it, cut to `limit` characters with its length
    said (a 100,000-character name, a 5,000-digit number): the line stays one line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 40]}... ({len(text):,} characters)"
