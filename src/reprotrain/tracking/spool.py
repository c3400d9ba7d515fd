"""Keeping a run's record while the tracking server is away, and sending it later.

When a server stops answering mid-run, training goes on: metric points, artifacts and the
final status are appended to a spool file (JSON lines) beside the run's outputs. Each later
flush first re-sends what is spooled, so nothing is lost and the order is kept; if the
server is still away when the run ends, the run says so and prints
`python -m reprotrain.replay <spool file>`, which sends the rest (`Spool.send`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from reprotrain.tracking.recorder import MAX_BATCH

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


def is_unreachable(error: BaseException) -> bool:
    """A connection problem (retry later), as opposed to a request the server refused."""
    import requests  # ~0.1 s to import: only once a request has failed (it comes with MLflow)

    if isinstance(error, OSError | requests.exceptions.RequestException):
        return True
    text = str(error)
    return any(marker in text for marker in UNREACHABLE_MARKERS)


class Spool:
    """Append-only JSON lines. The first line names the run and the store; then
    {"metrics": [[key, value, timestamp, step], ...]}, {"artifact": path}, {"status": ...}."""

    def __init__(self, path: Path, uri: str, run_id: str) -> None:
        self.path, self.uri, self.run_id = path, uri, run_id
        self.warned = False

    @classmethod
    def open(cls, path: Path) -> Spool:
        header = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
        return cls(path, header["uri"], header["run_id"])

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
            handle.write(header + json.dumps(record) + "\n")

    def warn_once(self, error: BaseException) -> None:
        if not self.warned:
            self.warned = True
            reason = str(error).splitlines()[0][:160]
            print(
                f"reprotrain: warning: tracking server {self.uri} is not answering ({reason}); "
                f"training goes on, metrics are kept in {self.path} and sent when it answers",
                file=sys.stderr,
                flush=True,
            )

    def _records(self) -> list[str]:
        return self.path.read_text(encoding="utf-8").splitlines()[1:]

    def send(self, client: Any) -> int:
        """Send everything spooled, oldest first, through `client` (an MlflowClient); each
        record leaves the file once it is sent. Returns the number of metric points sent."""
        from mlflow.entities import Metric  # MLflow loads in ~2 s: only when there is a record

        sent = 0
        records = self._records()
        header = self.path.read_text(encoding="utf-8").splitlines()[0]
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
