"""Send what a run kept while its tracking server was away.

    python -m reprotrain.replay results/spool/<run id>.jsonl     # after the run, if asked to
    python -m reprotrain.replay <spool file> --tracking-uri http://host:5000

When a server stops answering mid-run, training goes on and the run's metric points,
artifacts and final status go to a spool file beside its outputs (reprotrain.tracking.spool).
If the server is still away when the run ends, the run prints this command: it sends the
rest, oldest first, and sets the run's final status.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reprotrain.errors import TrackingError, UserError, report_and_exit
from reprotrain.tracking import Spool, check_store, redact


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
        check_store(spool.uri, 10.0)
        from mlflow.tracking import MlflowClient  # ~2 s: only once there is something to send

        try:
            sent = spool.send(MlflowClient(spool.uri))
        except Exception as error:  # MLflow's own exceptions: an unknown run, a refused write
            if isinstance(error, UserError):
                raise
            raise TrackingError(
                f"could not send {args.spool} to run {spool.run_id} at {redact(spool.uri)} "
                f"({str(error).splitlines()[0][:200]}); what was sent left the file",
                hint="check that the run is in that store (--tracking-uri names another), "
                "then run the replay again",
            ) from None
    except UserError as error:
        report_and_exit(error)
    print(f"replay: sent {sent} metric points to run {spool.run_id} at {redact(spool.uri)}")


if __name__ == "__main__":
    main()
