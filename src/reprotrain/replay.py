"""Send what a run kept while its tracking store failed, and end the run as it ended.

    python -m reprotrain.replay results/spool/<run id>.jsonl     # after the run, if asked to
    python -m reprotrain.replay <spool file> --tracking-uri http://host:5000

When the store fails mid-run, training goes on and the run's metric points, artifacts and
final status go to a spool file beside its outputs (reprotrain.tracking.spool). If the store
is still away when the run ends, the run prints this command: it sends the rest, oldest
first, sets the run's final status and removes what a sweep marked on it. A spool whose
process was killed before the run ended holds no status: once it is sent, the run is marked
KILLED (with how to continue it), as `python -m reprotrain.runs --clean` would.

The spool names its store with `***` for a password: the password comes from
MLFLOW_TRACKING_PASSWORD, or the whole URI from --tracking-uri or MLFLOW_TRACKING_URI.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from reprotrain.errors import TrackingError, UserError, report_and_exit
from reprotrain.tracking import Spool, check_store, redact
from reprotrain.tracking.credentials import full_uri, hide_run_links
from reprotrain.tracking.failures import quiet_mlflow_logs
from reprotrain.tracking.mlflow_model import logged_model_of
from reprotrain.tracking.orphans import clear_sweep_marks, end_orphan, orphan_of, owner_alive


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
        spool = Spool.open(spool_file(args.spool))
        spool.uri = full_uri(spool.uri, args.tracking_uri)
        quiet_mlflow_logs()
        hide_run_links(spool.uri)
        check_store(spool.uri, 10.0)
        client = MlflowClient(spool.uri)
        ended = spool.ended()
        check_not_in_training(client, spool)
        sent = send(client, spool)
        outcome = settle(client, spool.run_id, ended)
    except UserError as error:
        report_and_exit(error)
    print(
        f"replay: sent {sent} metric points to run {spool.run_id} at {redact(spool.uri)}; {outcome}"
    )


def spool_file(path: Path) -> Path:
    """`path` if it is a file; a folder or a missing path is a one-line error."""
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.jsonl"))
        raise TrackingError(
            f"{str(path)!r} is a folder, not a spool file; spool files there: "
            f"{', '.join(found) or 'none'}",
            hint=f"give one of them: python -m reprotrain.replay {path}/<run id>.jsonl"
            if found
            else "a spool is removed once everything in it was sent: nothing waits here",
        )
    raise TrackingError(
        f"spool file {str(path)!r} does not exist",
        hint="a spool is removed once everything in it was sent; the run's last line names "
        "the one that waits, if any",
    )


def check_not_in_training(client: MlflowClient, spool: Spool) -> None:
    """A spool whose process still runs is that process's to send: both would send it."""
    run = get_run(client, spool)
    if run.info.status == "RUNNING" and owner_alive(run.data.tags):
        raise TrackingError(
            f"run {spool.run_id} is still training (process {run.data.tags.get('reprotrain.pid')}"
            f" on {run.data.tags.get('reprotrain.host')}), which sends {spool.path} itself once "
            "the store answers",
            hint="let it end; if the store is still away then, it prints this replay command",
        )


def send(client: MlflowClient, spool: Spool) -> int:
    try:
        return spool.send(client)
    except Exception as error:  # MLflow's own exceptions: an unknown run, a refused write
        if isinstance(error, UserError):
            raise
        raise TrackingError(
            f"could not send {spool.path} to run {spool.run_id} at {redact(spool.uri)} "
            f"({redact(str(error).splitlines()[0][:200])}); what was sent left the file",
            hint="check that the run is in that store (--tracking-uri names another), "
            "then run the replay again",
        ) from None


def settle(client: MlflowClient, run_id: str, ended: bool) -> str:
    """After the spool is sent: the run ends as its process ended it (the spool said how),
    without what a sweep marked on it and without an MLflow Model entry a failure left
    unfinished; or, killed before it ended, it is marked KILLED like any orphan."""
    logged_model_of(client, run_id)  # drops the PENDING / FAILED model entries of the run
    run = client.get_run(run_id)
    if ended:
        clear_sweep_marks(client, run)
        return f"it ended {run.info.status}"
    orphan = orphan_of(run) if run.info.status == "RUNNING" else None
    if orphan is None:
        return (
            f"it is {run.info.status}: its process did not end it (python -m reprotrain.runs "
            "--clean ends it once that process is gone)"
        )
    end_orphan(client, orphan)
    return f"its process was killed before the run ended ({orphan.why}): {orphan.outcome()}"


def get_run(client: MlflowClient, spool: Spool) -> Any:
    try:
        return client.get_run(spool.run_id)
    except Exception as error:
        raise TrackingError(
            f"could not send {spool.path} to run {spool.run_id} at {redact(spool.uri)} "
            f"({redact(str(error).splitlines()[0][:200])}); nothing was sent",
            hint="check that the run is in that store (--tracking-uri names another), "
            "then run the replay again",
        ) from None


if __name__ == "__main__":
    main()
