"""Keeping a run's record while the tracking store is unavailable, and sending it later.

When the store fails mid-run (failures.py: a server or database that is away or restarting,
a sqlite store locked past its busy timeout, deleted or on a full disk), training goes on:
metric points, artifacts and the final status are appended to a spool file (JSON lines)
beside the run's outputs. The first write after the store answers again sends what is
spooled first, so the order is kept; if the store is still unavailable when the run ends, the
run prints `python -m reprotrain.replay <spool file>`, which sends the rest (`Spool.send`).

The file is the run owner's alone (mode 0600) and names the store with `***` for a password
(the replay takes it from the environment: credentials.full_uri). Each record is one line
written with one `write` and flushed: a kill during an append can only leave the last line
cut short, and reading skips that line (with a warning) rather than refusing the whole file.
A point the store already holds (a write whose reply was lost) is not sent again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from reprotrain.errors import DataError
from reprotrain.tracking.credentials import redact
from reprotrain.tracking.failures import is_store_failure
from reprotrain.tracking.recorder import MAX_BATCH

# The name mlflow_model.py (and older callers) use for is_store_failure.
is_unreachable = is_store_failure
RECORD_KINDS = {"metrics", "artifact", "tags", "status"}


class Spool:
    """Append-only JSON lines. The first line names the run and the store (its password
    hidden); then {"metrics": [[key, value, timestamp, step], ...]}, {"artifact": path},
    {"tags": {key: value}}, {"status": ..., "error": ...}."""

    def __init__(self, path: Path, uri: str, run_id: str) -> None:
        self.path, self.uri, self.run_id = path, uri, run_id

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
                f'{{"run_id": ..., "uri": ...}}, got {redact((lines[0] if lines else "")[:80])!r})',
                hint="give the .jsonl file a reprotrain run wrote under <output_dir>/spool/",
            ) from None

    def pending(self) -> bool:
        return self.path.is_file() and len(self._records()) > 0

    def ended(self) -> bool:
        """The file holds the run's final status (the run ended while the store was away)."""
        return any("status" in json.loads(line) for line in self._records())

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = "" if self.path.exists() else self._header()
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "a", encoding="utf-8") as handle:
            handle.write(header + json.dumps(record) + "\n")  # one write: whole lines only
            handle.flush()
            os.fsync(handle.fileno())

    def _header(self) -> str:
        return json.dumps({"run_id": self.run_id, "uri": redact(self.uri)}) + "\n"

    def _records(self) -> list[str]:
        """The record lines; a last line cut short by a kill during an append is dropped (what
        it held was never completely written), a damaged line elsewhere is an error."""
        text = self.path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()[1:]
        for number, line in enumerate(lines, start=2):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not RECORD_KINDS & set(record):
                    raise ValueError("not a spool record")
            except ValueError:
                if number == len(lines) + 1 and not text.endswith("\n"):
                    warn(
                        f"the last line of {self.path} was cut short (a kill during a write); "
                        f"its {len(line)} bytes are skipped"
                    )
                    return lines[:-1]
                raise DataError(
                    f"spool file {str(self.path)!r}, line {number}, is not a spool record "
                    f"({line[:60]!r})",
                    hint="delete that line (what it held is lost) and run the replay again",
                ) from None
        return lines

    def send(self, client: Any, with_status: bool = True) -> int:
        """Send everything spooled, oldest first, through `client` (an MlflowClient); each
        record leaves the file once it is sent. Points the store already holds are not sent
        twice; without `with_status`, a final status is dropped, not set. Returns the number
        of metric points sent."""
        records = [json.loads(line) for line in self._records()]
        held = held_points(client, self.run_id, records)
        sent = 0
        while records:
            if with_status or "status" not in records[0]:
                sent += self._send_record(client, records[0], held)
            records.pop(0)
            self._rewrite(records)
        self.path.unlink()
        return sent

    def _send_record(self, client: Any, record: dict[str, Any], held: set) -> int:
        from mlflow.entities import Metric  # MLflow loads in ~2 s: only when there is a record

        if "metrics" in record:
            points = [Metric(*p) for p in record["metrics"] if (p[0], p[3]) not in held]
            for i in range(0, len(points), MAX_BATCH):
                client.log_batch(self.run_id, metrics=points[i : i + MAX_BATCH])
            return len(points)
        if "artifact" in record:
            if Path(record["artifact"]).exists():
                client.log_artifact(self.run_id, record["artifact"])
            else:  # nothing can send it any more
                warn(f"{record['artifact']} is gone: that artifact of run {self.run_id} is lost")
            return 0
        if "tags" in record:
            for key, value in record["tags"].items():
                client.set_tag(self.run_id, key, value)
            return 0
        if record.get("error"):
            client.set_tag(self.run_id, "error", redact(record["error"]))
        client.set_terminated(self.run_id, record["status"])
        return 0

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """The file without the records sent, replaced whole (a kill keeps one or the other)."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(self._header() + "".join(json.dumps(r) + "\n" for r in records))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)


def held_points(client: Any, run_id: str, records: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """The (key, step) of spooled points the store already holds: a write whose reply was lost
    in an outage may have been stored."""
    keys = {point[0] for record in records for point in record.get("metrics", [])}
    history = client.get_metric_history
    return {(key, m.step) for key in sorted(keys) for m in history(run_id, key)}


def warn(message: str) -> None:
    print(f"reprotrain: warning: {message}", file=sys.stderr, flush=True)
