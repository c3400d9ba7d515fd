"""Keeping a run's record while the tracking server is away, and sending it later.

    python -m reprotrain.replay results/spool/<run id>.jsonl     # after the run, if asked to

When a server stops answering mid-run, training goes on: metric points, artifacts and the
final status are appended to a spool file (JSON lines) beside the run's outputs. Each later
flush first re-sends what is spooled, so nothing is lost and the order is kept; if the
server is still away when the run ends, the run says so and prints this command, which
sends the rest and sets the final status.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from reprotrain.errors import TrackingError, UserError, report_and_exit

MAX_BATCH = 1000


def is_unreachable(error: BaseException) -> bool:
    """A connection problem (retry later), as opposed to a request the server refused."""
    if isinstance(error, OSError):
        return True
    try:
        import requests
    except ImportError:  # pragma: no cover - requests comes with MLflow
        return False
    if isinstance(error, requests.exceptions.RequestException):
        return True
    # MLflow wraps transport failures (refused, reset, a reply cut off mid-body when the
    # server dies during a request) as "API request to ... failed with exception ...".
    text = str(error)
    return any(
        marker in text
        for marker in (
            "failed with exception",
            "Connection broken",
            "Max retries exceeded",
            "Connection refused",
            "ConnectionError",
            "Read timed out",
        )
    )


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
        """Send everything spooled, oldest first; each record leaves the file once it is sent."""
        from mlflow.entities import Metric

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spool", type=Path)
    parser.add_argument("--tracking-uri", default=None, help="default: the one the run used")
    args = parser.parse_args(argv)
    try:
        if not args.spool.is_file():
            raise TrackingError(
                f"spool file {str(args.spool)!r} does not exist",
                hint="it is removed once everything in it was sent",
            )
        spool = Spool.open(args.spool)
        if args.tracking_uri:
            spool.uri = args.tracking_uri
        from mlflow.tracking import MlflowClient

        from reprotrain.tracking import check_store

        check_store(spool.uri, 10.0)
        sent = spool.send(MlflowClient(spool.uri))
    except UserError as error:
        report_and_exit(error)
    print(f"replay: sent {sent} metric points to run {spool.run_id} at {spool.uri}")


if __name__ == "__main__":
    main()
