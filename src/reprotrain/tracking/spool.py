"""Keeping a run's record while the tracking store is unavailable, and sending it later.

When a server stops answering mid-run, or a sqlite store is locked by another process for
longer than sqlite's busy timeout, deleted or on a full disk, training goes on: metric
points, artifacts and the final status are appended to a spool file (JSON lines) beside the
run's outputs. Each later flush first re-sends what is spooled, so nothing is lost and the
order is kept; if the store is still unavailable when the run ends, the run says so and
prints `python -m reprotrain.replay <spool file>`, which sends the rest (`Spool.send`).

Each record is one line written with one `write` and flushed: a kill during an append can
only leave the last line cut short, and reading skips that line (with a warning) rather
than refusing the whole file.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from reprotrain.errors import DataError
from reprotrain.tracking.recorder import MAX_BATCH
from reprotrain.tracking.store import redact

# How MLflow words a transport failure (refused, reset, a reply cut off mid-body when the
# server dies during a request): "API request to ... failed with exception ...".
UNREACHABLE_MARKERS = (
    "failed with exception",
    "Connection broken",
    "Max retries exceeded",
    "Connection refused",
    "ConnectionError",
    "Read timed out",
)
# How sqlite (through MLflow's SQLAlchemy store) words a store that cannot take a write now:
# locked by another process past the busy timeout, deleted or replaced under the run, full.
STORE_UNAVAILABLE_MARKERS = (
    "database is locked",
    "readonly database",
    "no such table",
    "unable to open database file",
    "disk I/O error",
    "database or disk is full",
)


class QuietUnavailable(logging.Filter):
    """MLflow logs a traceback for each failed store write before raising it; a store that is
    only unavailable for now (spooled, and said once) is not worth one per flush."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(marker in text for marker in STORE_UNAVAILABLE_MARKERS)


def quiet_store_errors() -> None:
    """Install QuietUnavailable on the handlers MLflow gives its `mlflow` logger (records of
    its modules reach them by propagation), once; after MLflow is imported."""
    for handler in logging.getLogger("mlflow").handlers:
        if not any(isinstance(f, QuietUnavailable) for f in handler.filters):
            handler.addFilter(QuietUnavailable())


def unavailable_reason(error: BaseException) -> str:
    """The line of an error's text that says why the store is unavailable (MLflow and
    SQLAlchemy wrap sqlite's reason in several lines)."""
    lines = str(error).splitlines() or [type(error).__name__]
    markers = UNREACHABLE_MARKERS + STORE_UNAVAILABLE_MARKERS
    return next((line for line in lines if any(m in line for m in markers)), lines[0])[:160]


def is_unreachable(error: BaseException) -> bool:
    """The store cannot take the request now (retry later): a connection problem, or a sqlite
    store that is locked, gone or full; as opposed to a request the store refused."""
    import requests  # ~0.1 s to import: only once a request has failed (it comes with MLflow)

    if isinstance(error, OSError | requests.exceptions.RequestException):
        return True
    text = str(error)
    return any(marker in text for marker in UNREACHABLE_MARKERS + STORE_UNAVAILABLE_MARKERS)


class Spool:
    """Append-only JSON lines. The first line names the run and the store; then
    {"metrics": [[key, value, timestamp, step], ...]}, {"artifact": path}, {"status": ...}."""

    def __init__(self, path: Path, uri: str, run_id: str) -> None:
        self.path, self.uri, self.run_id = path, uri, run_id
        self.warned = False

    @classmethod
    def open(cls, path: Path) -> Spool:
        """Read a spool file's header; a file that is not one is a one-line DataError."""
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        try:
            header = json.loads(lines[0])
            return cls(path, str(header["uri"]), str(header["run_id"]))
        except (IndexError, ValueError, KeyError, TypeError):
            raise DataError(
                f"spool file {str(path)!r} has no valid header (its first line should be "
                f'{{"run_id": ..., "uri": ...}}, got {(lines[0] if lines else "")[:80]!r})',
                hint="give the .jsonl file a reprotrain run wrote under <output_dir>/spool/",
            ) from None

    def pending(self) -> bool:
        return self.path.is_file() and len(self._records()) > 0

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = (
            ""
            if self.path.exists()
            else json.dumps({"run_id": self.run_id, "uri": self.uri}) + "\n"
        )
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(header + json.dumps(record) + "\n")  # one write: whole lines only
            handle.flush()
            os.fsync(handle.fileno())

    def warn_once(self, error: BaseException) -> None:
        if not self.warned:
            self.warned = True
            reason = unavailable_reason(error)
            print(
                f"reprotrain: warning: tracking store {redact(self.uri)} cannot take the run's "
                f"record now ({reason}); training goes on, the record is kept in {self.path} "
                "and sent when the store answers",
                file=sys.stderr,
                flush=True,
            )

    def _records(self) -> list[str]:
        """The record lines; a last line cut short by a kill during an append is dropped (what
        it held was never completely written), a damaged line elsewhere is an error."""
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()[1:]
        for number, line in enumerate(lines, start=2):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not {"metrics", "artifact", "status"} & set(
                    record
                ):
                    raise ValueError("not a spool record")
            except ValueError:
                if number == len(lines) + 1 and not text.endswith("\n"):
                    print(
                        f"reprotrain: warning: the last line of {self.path} was cut short "
                        f"(a kill during a write); its {len(line)} bytes are skipped",
                        file=sys.stderr,
                        flush=True,
                    )
                    return lines[:-1]
                raise DataError(
                    f"spool file {str(self.path)!r}, line {number}, is not a spool record "
                    f"({line[:60]!r})",
                    hint="delete that line (what it held is lost) and run the replay again",
                ) from None
        return lines

    def send(self, client: Any) -> int:
        """Send everything spooled, oldest first, through `client` (an MlflowClient); each
        record leaves the file once it is sent. Returns the number of metric points sent."""
        from mlflow.entities import Metric  # MLflow loads in ~2 s: only when there is a record

        sent = 0
        records = self._records()
        header = self.path.read_text(encoding="utf-8", errors="replace").splitlines()[0]
        while records:
            record = json.loads(records[0])
            if "metrics" in record:
                points = [Metric(*point) for point in record["metrics"]]
                for i in range(0, len(points), MAX_BATCH):
                    client.log_batch(self.run_id, metrics=points[i : i + MAX_BATCH])
                sent += len(points)
            elif "artifact" in record:
                client.log_artifact(self.run_id, record["artifact"])
            elif "status" in record:
                if record.get("error"):
                    client.set_tag(self.run_id, "error", record["error"])
                client.set_terminated(self.run_id, record["status"])
            records.pop(0)
            self.path.write_text(
                "".join(f"{line}\n" for line in [header, *records]), encoding="utf-8"
            )
        self.path.unlink()
        return sent
