"""What counts as a tracking store failing (try again later), as opposed to refusing a record,
and how the noise MLflow and its drivers make about one is kept off the terminal.

    is_store_failure(error)      # a server or database that is away, restarting, locked, full
    failure_reason(error)        # the one line of its text that says why (no password)
    quiet_mlflow_logs()          # MLflow's reports of one off the terminal; no password in logs

A failure is anything the store may take later: a connection refused, reset or timed out
(`OSError`, which `requests` errors are), a database that is shutting down, locked or full
(PEP 249's `OperationalError` / `InterfaceError`, which every driver and SQLAlchemy raise), a
server that answers 5xx, 429 or 401/403 (credentials can be fixed before the replay), or a
message that says so. A refusal (a deleted run, an invalid value: MLflow's 4xx codes) would be
refused again, so it is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from reprotrain.errors import UserError
from reprotrain.tracking.credentials import RedactSecrets, redact

# MLflow's error codes (MlflowException.error_code) for a store that cannot take a request now.
FAILURE_CODES = frozenset(
    {
        "INTERNAL_ERROR",  # HTTP 500, and what MLflow raises for a transport failure
        "TEMPORARILY_UNAVAILABLE",  # a database error (locked, gone, shutting down, full)
        "IO_ERROR",
        "SERVICE_UNDER_MAINTENANCE",
        "WORKSPACE_TEMPORARILY_UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "REQUEST_LIMIT_EXCEEDED",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "COULD_NOT_ACQUIRE_LOCK",
        "UNPARSEABLE_HTTP_ERROR",  # a proxy's error page in front of a restarting server
        "UNAUTHENTICATED",  # credentials that expired: the replay can give others
        "PERMISSION_DENIED",
        "CUSTOMER_UNAUTHORIZED",
    }
)
# PEP 249's names for "the database failed, not the request" (every driver's OperationalError
# and InterfaceError, and SQLAlchemy's wrappers of them), SQLAlchemy's pool timing out, and a
# session whose connection broke mid-transaction.
DATABASE_FAILURES = frozenset(
    {"OperationalError", "InterfaceError", "DisconnectionError", "PendingRollbackError"}
)
# How MLflow, sqlite, PostgreSQL and requests word a failure in messages that carry no
# exception (MLflow's warnings) or wrap it in another one.
FAILURE_MARKERS = (
    "failed with exception",
    "Connection broken",
    "Max retries exceeded",
    "Connection refused",
    "Connection reset",
    "ConnectionError",
    "Read timed out",
    "database is locked",
    "readonly database",
    "no such table",
    "unable to open database file",
    "disk I/O error",
    "database or disk is full",
    "No space left on device",
    "the database system is",  # ... shutting down / starting up / in recovery mode
    "server closed the connection",
    "terminating connection",
    "connection failed",
    "could not connect",
    "SQLAlchemy engine could not be created",
    "SQLAlchemy database error",
)


# The loggers that report a store's failures: MLflow's, and those of the libraries it uses.
STORE_LOGGERS = ("mlflow", "sqlalchemy", "alembic", "urllib3", "requests", "psycopg", "pymysql")


def causes(error: BaseException) -> Iterator[BaseException]:
    """The error and every exception it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_store_failure(error: BaseException) -> bool:
    """The store cannot take the request now (keep the record and send it later), as opposed
    to a request it refused (raise it)."""
    if isinstance(error, UserError):
        return False  # reprotrain's own verdict on the store, said as it is
    for cause in causes(error):
        code = getattr(cause, "error_code", None)
        if isinstance(code, str):  # MLflow's own: its code decides
            if code in FAILURE_CODES:
                return True
            continue  # a refusal by code; a database failure it wraps still counts
        if isinstance(cause, OSError):  # refused, reset, timed out; requests' errors too
            return True
        if any(kind.__name__ in DATABASE_FAILURES for kind in type(cause).__mro__):
            return True
    text = str(error)
    return any(marker in text for marker in FAILURE_MARKERS)


def failure_reason(error: BaseException) -> str:
    """The line of an error's text that says why the store failed (MLflow and SQLAlchemy wrap
    the driver's reason in several lines), without a password."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = lines or [type(error).__name__]
    line = next((text for text in lines if any(m in text for m in FAILURE_MARKERS)), lines[0])
    return redact(line)[:200]


class QuietStoreFailures(logging.Filter):
    """Drops the records MLflow, SQLAlchemy and urllib3 log about a store failure (MLflow logs
    a traceback for each failed database write before raising it, its system-metrics thread a
    warning per failed sample): reprotrain says once that the store is away, and once that it
    is back."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(STORE_LOGGERS):
            return True  # not a report of the store's: a user's own records are kept
        if record.exc_info and record.exc_info[1] is not None:
            return not is_store_failure(record.exc_info[1])
        message = record.getMessage()
        return not any(marker in message for marker in FAILURE_MARKERS)


def quiet_mlflow_logs() -> None:
    """Install QuietStoreFailures and RedactSecrets, once each, on the handlers that print or
    file what MLflow and its drivers log: MLflow's own (its loggers do not propagate), the root
    logger's (Hydra's console and log file) and the last-resort one (a process without
    handlers)."""
    for handler in logging_handlers():
        for kind in (QuietStoreFailures, RedactSecrets):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())


def logging_handlers() -> list[logging.Handler]:
    """Every handler a record of MLflow, SQLAlchemy, a driver or urllib3 can end in."""
    handlers = [
        handler
        for name in ("mlflow", "sqlalchemy.engine", "alembic", "")
        for handler in logging.getLogger(name or None).handlers
    ]
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    return list({id(handler): handler for handler in handlers}.values())
