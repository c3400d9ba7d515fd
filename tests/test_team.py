"""A team's tracking server, for real: `mlflow server` on a PostgreSQL backend store (a
throwaway cluster from Debian's postgresql package) with artifacts in S3-compatible storage
(moto in server mode, checking access keys), proxied so clients need no S3 keys. Runs from
this machine and from the CPU container are read back from a second process."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import PYTHON, Store, child_env, make_project, require_docker, run_app
from teamserver import PASSWORD, S3, Postgres, TeamServer, require_team_parts


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
    tmp_path: Path, team: tuple[Postgres, S3, TeamServer], store: str, message: str
) -> None:
    postgres, s3, _ = team
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
