"""A team's tracking server, for real: `mlflow server` on a PostgreSQL backend store (a
throwaway cluster from Debian's postgresql package) with artifacts in S3-compatible storage
(moto in server mode, checking access keys), proxied so clients need no S3 keys. Runs from
this machine and from the CPU container are read back from a second process. The database
and the server are restarted under runs that go on training."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import (
    PYTHON,
    InProcess,
    Store,
    child_env,
    make_project,
    require_docker,
    run_app,
    train_args,
)
from teamserver import (
    PASSWORD,
    S3,
    Postgres,
    TeamServer,
    free_port,
    mlflow_server,
    require_team_parts,
    stop_group,
)

pytestmark = pytest.mark.e2e  # PostgreSQL, S3 (moto's server) and `mlflow server`


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Postgres, S3, TeamServer]]:
    require_team_parts()
    base = tmp_path_factory.mktemp("team")
    postgres, s3 = Postgres(base / "postgres"), S3(base / "s3")
    server = None
    try:
        postgres.start()
        s3.start()
        server = TeamServer(base / "server", postgres, s3).start()
        yield postgres, s3, server
    finally:
        for part in (server, s3, postgres):
            if part is not None:
                part.stop()


def app(cwd: Path, uri: str, *overrides: str) -> subprocess.CompletedProcess:
    return run_app(
        cwd,
        "runtime=local",
        "experiment=smoke",
        f"tracking.uri={uri}",
        f"train.output_dir={cwd / 'results'}",
        *overrides,
        timeout=600,
    )


def read_back(uri: str, run_id: str) -> dict:
    """The run as a teammate sees it: another process, MLflow's client, the server's URI."""
    probe = (
        "import json, sys; from mlflow.tracking import MlflowClient; "
        "c = MlflowClient(sys.argv[1]); r = c.get_run(sys.argv[2]); "
        "print(json.dumps({'status': r.info.status, 'tags': r.data.tags, "
        "'params': r.data.params, 'metrics': r.data.metrics, "
        "'losses': len(c.get_metric_history(r.info.run_id, 'train/loss')), "
        "'artifacts': [a.path for a in c.list_artifacts(r.info.run_id)], "
        "'artifact_uri': r.info.artifact_uri}))"
    )
    done = subprocess.run(
        [PYTHON, "-c", probe, uri, run_id],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_runs_live_in_postgres_and_artifacts_in_s3_through_the_server(
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer]
) -> None:
    postgres, s3, server = team
    done = app(tmp_path, server.uri)
    assert done.returncode == 0, done.stderr[-3000:]
    headline = json.loads((tmp_path / "results" / "metrics.json").read_text())
    run_id = headline["run_id"]
    assert headline["tracking_uri"] == server.uri  # dvc exp show links a teammate to the run
    run = read_back(server.uri, run_id)
    assert run["status"] == "FINISHED" and run["losses"] == 20
    assert run["tags"]["device.type"] == "cpu" and "val/accuracy" in run["metrics"]
    assert {"config.yaml", "loss.csv", "loss.svg", "model.pt"} <= set(run["artifacts"])
    assert run["artifact_uri"].startswith("mlflow-artifacts:")  # served, not a local path
    stored = s3.objects()
    assert any(key.endswith(f"{run_id}/artifacts/model.pt") for key in stored), stored[:20]
    assert not (tmp_path / "mlruns").exists()  # nothing kept on this machine
    import psycopg

    with psycopg.connect(postgres.uri()) as db:  # read-only: MLflow's own rows
        row = db.execute("SELECT status FROM runs WHERE run_uuid = %s", (run_id,)).fetchone()
    assert row == ("FINISHED",)
    assert f"open {server.uri}/#/experiments/" in done.stderr


def test_a_postgresql_uri_works_out_of_the_box_and_the_password_stays_hidden(
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer]
) -> None:
    postgres, _, _ = team
    uri = postgres.create_database("direct")  # its own: the server's experiment serves artifacts
    done = app(tmp_path, uri, "tracking.log_model=false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert PASSWORD not in done.stderr and PASSWORD not in done.stdout
    for name in ("metrics.json", "run.json", "config.yaml"):
        text = (tmp_path / "results" / name).read_text()
        assert PASSWORD not in text, name
    headline = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert headline["tracking_uri"] == uri.replace(PASSWORD, "***")
    run = read_back(uri, headline["run_id"])
    assert run["status"] == "FINISHED" and run["losses"] == 20
    recorded = json.dumps([run["tags"], run["params"]])
    assert PASSWORD not in recorded and "***" in recorded  # tracking.uri, redacted


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ("wrong password", "refused the credentials (connection failed"),
        ("database down", "did not answer within 5s (connection failed"),
        ("missing driver", "the database driver is not installed (No module named 'pg8000')"),
        ("artifact store refuses the server", "its artifact store refused it (Failed to list"),
        ("the server's experiment, direct", "keeps its artifacts on a tracking server"),
    ],
)
def test_a_team_store_that_cannot_be_used_is_one_line_before_any_step(
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer], here: InProcess, store: str, message: str
) -> None:
    """The training script's main() in this process (conftest.InProcess), against the real
    database, S3 and servers."""
    postgres, s3, _ = team

    def app(cwd: Path, uri: str, *overrides: str):
        return here.app(
            "runtime=local",
            "experiment=smoke",
            f"tracking.uri={uri}",
            f"train.output_dir={cwd / 'results'}",
            *overrides,
            defaults=False,
        )

    refusing = None
    try:
        if store == "wrong password":
            uri = postgres.uri(password="not-" + PASSWORD)
        elif store == "database down":
            uri = f"postgresql://reprotrain:{PASSWORD}@127.0.0.1:{closed_port()}/mlflow"
        elif store == "missing driver":
            uri = postgres.uri().replace("postgresql://", "postgresql+pg8000://")
        elif store == "the server's experiment, direct":  # made by the server in the first test
            server = TeamServer(tmp_path / "server", postgres, s3).start()
            app(tmp_path, server.uri, "train.steps=1", "tracking.log_model=false")
            server.stop()
            uri = postgres.uri()
        else:
            refusing = TeamServer(tmp_path / "refusing", postgres, s3, secret="wrong").start()
            uri = refusing.uri
        done = app(tmp_path, uri)
    finally:
        if refusing is not None:
            refusing.stop()
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reprotrain: error: "), lines
    assert message in lines[0] and "; fix: " in lines[0]
    assert "Traceback" not in done.stderr and "step 1" not in done.stderr
    assert PASSWORD not in done.stderr.replace("not-" + PASSWORD, "")
    assert "not-" + PASSWORD not in done.stderr


# Long enough to outlast every restart (the test stops it); points sent every 0.2 s; steps
# of a larger batch, so that a restart's spool holds a few thousand points, not tens.
CHAOS_RUN = (
    "experiment=smoke",
    "train.steps=10000000",
    "train.batch_size=256",
    "train.log_every=10",
    "tracking.flush_every_s=0.2",
    "train.progress=off",
)


def holding_a_connection(postgres: Postgres) -> contextlib.closing:
    """Another client of the database, connected until the block ends."""
    import psycopg

    return contextlib.closing(psycopg.connect(postgres.uri()))


class Restartable:
    """`mlflow server` over the team's database, artifacts in a folder: stopped and started
    again on the same port."""

    def __init__(self, folder: Path, postgres: Postgres) -> None:
        self.folder, self.backend = folder, postgres.uri()
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        artifacts = ("--artifacts-destination", str(self.folder / "artifacts"))
        self.proc = mlflow_server(self.port, self.backend, *artifacts, cwd=self.folder)

    def stop(self) -> None:
        stop_group(self.proc)


def fast_shutdown(postgres: Postgres, _server: Restartable) -> None:
    """`pg_ctl stop -m fast` with a client holding a connection; started again 2 s later."""
    with holding_a_connection(postgres):
        postgres.shut_down("fast")
        time.sleep(2)
    postgres.start_again()


def smart_shutdown(postgres: Postgres, _server: Restartable) -> None:
    """`pg_ctl stop -m smart` with a client holding a connection: for 3 s, every new
    connection is refused ("the database system is shutting down"); the runs' own sessions
    would keep it waiting for ever, so it ends as an administrator ends it, fast."""
    with holding_a_connection(postgres):
        postgres.shut_down("smart", wait=False)
        time.sleep(3)
    postgres.shut_down("fast")
    postgres.start_again()


def server_restart(_postgres: Postgres, server: Restartable) -> None:
    server.stop()
    server.start()  # once /health answers


def losses(reader, run_id: str) -> list[int]:
    return sorted(m.step for m in reader.get_metric_history(run_id, "train/loss"))


def wait_for_points(reader, procs: dict, run_ids: dict, beyond: dict) -> dict[str, int]:
    """Until each run has 30 more losses in the store than `beyond` says (so the store takes
    points again after an outage); the counts then."""
    counts = dict(beyond)
    deadline = time.monotonic() + 300
    for name, run_id in run_ids.items():
        while counts[name] < beyond[name] + 30:
            assert procs[name].poll() is None, f"the {name} run ended"
            assert time.monotonic() < deadline, f"the {name} run's points stopped coming"
            time.sleep(0.2)
            counts[name] = len(losses(reader, run_id))
    return counts


def find_run(reader, experiment: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the {experiment} run ended"
        found = reader.get_experiment_by_name(experiment)
        runs = reader.search_runs([found.experiment_id]) if found else []
        if runs:
            return runs[0].info.run_id
        time.sleep(0.2)
    raise AssertionError(f"no run in {experiment}")


def test_database_and_server_restarts_mid_run_lose_nothing(
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer]
) -> None:
    """Two runs train, one straight on PostgreSQL, one through an mlflow server over it,
    while PostgreSQL is stopped fast, then smart (each with a client holding a connection)
    and started again, and the server is restarted. Both go on training; each outage is one
    line when it begins and one when it ends, with none of MLflow's tracebacks; once stopped,
    each run holds every step's loss exactly once."""
    import torch
    from mlflow.tracking import MlflowClient

    postgres = team[0]
    server = Restartable(tmp_path, postgres)
    folders = {"direct": tmp_path / "direct", "served": tmp_path / "served"}
    uris = {"direct": postgres.uri(), "served": server.uri}
    procs = {}
    try:
        for name, folder in folders.items():
            if name == "served":
                server.start()  # while the direct run starts
            folder.mkdir()
            args = train_args(folder, uris[name], f"tracking.experiment=chaos-{name}", *CHAOS_RUN)
            procs[name] = subprocess.Popen(
                ["nice", "-n", "10", *args],  # the restarts get the CPUs first
                cwd=folder,
                env=child_env(),
                stderr=(folder / "stderr.txt").open("w"),
                start_new_session=True,
            )
        reader = MlflowClient(postgres.uri())  # MLflow's rows of both runs, read here
        run_ids = {name: find_run(reader, f"chaos-{name}", procs[name]) for name in procs}
        counts = wait_for_points(reader, procs, run_ids, dict.fromkeys(procs, 0))
        for outage in (fast_shutdown, smart_shutdown, server_restart):
            outage(postgres, server)
            counts = wait_for_points(reader, procs, run_ids, counts)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)  # stopped: a checkpoint says at which step
        codes = {name: proc.wait(timeout=120) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.stop()
    for name, folder in folders.items():
        stderr = (folder / "stderr.txt").read_text()
        assert codes[name] == 143, stderr[-3000:]
        run_id = run_ids[name]
        assert reader.get_run(run_id).info.status == "KILLED"
        checkpoint = folder / "outputs" / "checkpoints" / f"{run_id}.pt"
        stopped_at = torch.load(checkpoint, weights_only=True)["trainer"]["step"]
        assert losses(reader, run_id) == list(range(1, stopped_at + 1)), name  # once each
        began = stderr.count("cannot take the run's record now")
        assert began == stderr.count("answers again") >= 1, stderr[-3000:]
        assert "Traceback" not in stderr and " ERROR " not in stderr, stderr[-3000:]
        assert not list((folder / "results" / "spool").glob("*.jsonl"))


@pytest.mark.docker
def test_a_container_run_records_into_the_team_server(
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer]
) -> None:
    """runtime=docker with tracking.uri=http://...: the container gets the host's network
    (the store is a server) and its run, artifacts included, lands on the server."""
    require_docker()
    _, s3, server = team
    repo = make_project(tmp_path / "project", runtime="docker")
    done = run_app(
        repo,
        "device=cpu",
        "train.steps=30",
        f"tracking.uri={server.uri}",
        "tracking.log_model=false",
        f"train.output_dir={repo / 'results'}",
        timeout=1500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = json.loads((repo / "results" / "metrics.json").read_text())["run_id"]
    run = read_back(server.uri, run_id)
    assert run["status"] == "FINISHED" and run["tags"]["runtime"] == "docker-cpu"
    assert run["losses"] == 30 and "loss.csv" in run["artifacts"]
    assert any(key.endswith(f"{run_id}/artifacts/loss.csv") for key in s3.objects())
    assert not (repo / "mlflow.db").exists() or not Store(repo).runs()  # not the project's store
