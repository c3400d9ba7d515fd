"""Runs left RUNNING: list them, and end those whose process is gone.

    python -m reprotrain.runs                 # RUNNING runs, and whether their owner is alive
    python -m reprotrain.runs --clean         # end the orphans KILLED; print how to resume each
                                              # (one whose record waits in a spool: to replay it)
    python -m reprotrain.runs --clean --tracking-uri http://host:5000 --experiment reprotrain

A run whose training process was killed outright (kill -9, the OOM killer, a power cut, a
container killed) cannot end its own MLflow run, which stays RUNNING. Every training run
does this check for its own experiment when it opens; this command does it for every
experiment of the store. A run is ended only when its owner is provably gone
(reprotrain.tracking.orphans): a live run, or one on another machine, is listed and left
alone, and one whose record waits in its spool file is left for `python -m reprotrain.replay`.
"""

from __future__ import annotations

import argparse

from mlflow.tracking import MlflowClient

from reprotrain.errors import TrackingError, UserError, report_and_exit
from reprotrain.project import default_tracking_uri
from reprotrain.tracking import check_store, end_orphans, redact
from reprotrain.tracking.orphans import Orphan, orphan_of


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--clean", action="store_true", help="end orphaned runs KILLED")
    parser.add_argument("--tracking-uri", default=None, help="default: as training picks it")
    parser.add_argument("--experiment", default=None, help="default: every experiment")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    try:
        check_store(uri, 10.0)
        client = MlflowClient(uri)
        experiment_ids = experiments(client, args.experiment, uri)
        running = (
            client.search_runs(
                experiment_ids, filter_string="attributes.status = 'RUNNING'", max_results=1000
            )
            if experiment_ids
            else []
        )
        ended = {o.run_id: o for o in end_orphans(client, experiment_ids)} if args.clean else {}
    except UserError as error:
        report_and_exit(error)
    for run in running:
        orphan = ended.get(run.info.run_id)
        if orphan is not None:
            print(f"{run.info.run_id}  {run.info.run_name}: {orphan.why}; {orphan.outcome()}")
            continue
        print(f"{run.info.run_id}  {run.info.run_name}: RUNNING, {state(orphan_of(run))}")
    killed = sum(orphan.spool is None for orphan in ended.values())
    action = f", {killed} marked KILLED" if args.clean else ""
    print(f"runs: {len(running)} RUNNING in {redact(uri)}{action}")


def state(orphan: Orphan | None) -> str:
    """A RUNNING run's state as a listing says it."""
    if orphan is None:
        return "its owner is alive or unknown"
    if orphan.spool is not None:
        return f"orphaned ({orphan.why}); {orphan.what_next()}"
    return f"orphaned ({orphan.why}); end it with --clean"


def experiments(client: MlflowClient, name: str | None, uri: str) -> list[str]:
    """The ids of the experiment named `name`, or of every experiment."""
    if name is None:
        return [e.experiment_id for e in client.search_experiments()]
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        known = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise TrackingError(
            f"--experiment {name!r} is not in {redact(uri)} (experiments there: {known})",
            hint="give one of those names, or leave --experiment out for all",
        )
    return [experiment.experiment_id]


if __name__ == "__main__":
    main()
