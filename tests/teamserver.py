"""A team's tracking setup, started for real on 127.0.0.1 by the tests that need it:

    Postgres    a throwaway PostgreSQL cluster (Debian's `postgresql` package: initdb, pg_ctl)
    S3          moto in server mode: an S3-compatible endpoint, with IAM checking keys
    TeamServer  `mlflow server`: PostgreSQL backend store, artifacts in S3, served through it
    Gate        a TCP forwarder in front of a server: a network outage, and back, at will

Each runs in its own process group and is stopped with its folder removed afterwards.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from conftest import BIN, PYTHON, _capability_skip, child_env

PASSWORD = "s3cret-pw"  # must never appear in a message, tag, param or file


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(ready, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{what} did not start within {timeout:g}s")


def stop_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Gate:
    """A TCP forwarder on 127.0.0.1 in front of a running server. Closed, it is an outage as a
    client sees a crashed server: new connections are refused and open ones cut. Opened again,
    the server answers at once, with nothing restarted, so a test controls exactly when the
    outage begins and ends."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            self._listener.close()
            self._listener = None
        with self._lock:
            cut, self._open = self._open, set()
        for sock in cut:
            self._drop(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                self._drop(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            self._drop(sock)
            with self._lock:
                self._open.discard(sock)

    @staticmethod
    def _drop(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def mlflow_server(
    port: int,
    backend_store_uri: str,
    *options: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    log: Path | None = None,
) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port` in its own process group, once /health answers.
    Without MLflow's job executor (trace scoring and archival, which no test uses): it starts
    in about half the time."""
    env = {**(env or child_env()), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            backend_store_uri,
            *options,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=cwd,
        env=env,
        stdout=log.open("a") if log else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        start_new_session=True,
    )
    health = f"http://127.0.0.1:{port}/health"
    wait_until(
        lambda: urllib.request.urlopen(health, timeout=2).status == 200, "mlflow server", proc, 180
    )
    return proc


class Postgres:
    """initdb + pg_ctl as the `postgres` user (as root) or as this user, on a free port."""

    def __init__(self, folder: Path) -> None:
        binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = binaries[-1] if binaries else shutil.which("initdb")
        if initdb is None:
            _capability_skip("needs PostgreSQL (Debian's postgresql package: initdb, pg_ctl)")
        self.bin = Path(initdb).parent
        # Its own folder under /tmp: pytest's folders are private to this user, and the
        # cluster runs as `postgres`. `folder` keeps only a pointer to it.
        self.folder = Path(tempfile.mkdtemp(prefix="reprotrain-postgres-"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cluster").write_text(str(self.folder))
        self.port, self.user = free_port(), "reprotrain"
        self.data = self.folder / "data"

    def _as_owner(self, *argv: str) -> list[str]:
        if os.geteuid() == 0:  # postgres refuses to run as root
            return ["runuser", "-u", "postgres", "--", *argv]
        return list(argv)

    def start(self) -> Postgres:
        password_file = self.folder / "pw"
        password_file.write_text(PASSWORD)
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
            shutil.chown(password_file, "postgres")
            os.chmod(self.folder, 0o755)
        subprocess.run(
            self._as_owner(
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                self.user,
                "--auth=scram-sha-256",
                f"--pwfile={password_file}",
            ),
            check=True,
            capture_output=True,
        )
        self.start_again()
        self.create_database("mlflow")
        return self

    def pg_ctl(self, *args: str, check: bool = True) -> int:
        return subprocess.run(
            self._as_owner(str(self.bin / "pg_ctl"), "-D", str(self.data), *args),
            check=check,
            capture_output=True,
        ).returncode

    def start_again(self) -> None:
        """Start the cluster (again, after `shut_down`), once it takes connections."""
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        self.pg_ctl("-l", str(self.folder / "postgres.log"), "-o", options, "-w", "start")

    def shut_down(self, mode: str, wait: bool = True) -> None:
        """`pg_ctl stop -m fast` (every session ended now) or `-m smart` (new connections
        refused with "the database system is shutting down" until the last session ends; with
        wait=False it returns at once)."""
        if wait:  # a smart shutdown begun before may have ended meanwhile: stopped either way
            self.pg_ctl("-m", mode, "stop", check=False)
            assert self.pg_ctl("status", check=False) != 0, "PostgreSQL did not stop"
        else:
            self.pg_ctl("-m", mode, "--no-wait", "stop")

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.uri("postgres"), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.uri(name)

    def uri(self, database: str = "mlflow", password: str = PASSWORD) -> str:
        return f"postgresql://{self.user}:{password}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.data.is_dir():
            pg_ctl = str(self.bin / "pg_ctl")
            subprocess.run(self._as_owner(pg_ctl, "-D", str(self.data), "-m", "fast", "stop"))
        shutil.rmtree(self.folder, ignore_errors=True)


class S3:
    """moto's S3-compatible server; with IAM on, only the access key it made is accepted."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.key_id, self.secret = "", ""

    def start(self, bucket: str = "team-artifacts") -> S3:
        self.folder.mkdir(parents=True, exist_ok=True)
        env = child_env(**self._admin())
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=child_env(INITIAL_NO_AUTH_ACTION_COUNT="3"),  # three calls to make a key, then IAM
            stdout=(self.folder / "moto.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(lambda: socket.create_connection(("127.0.0.1", self.port), 1), "moto", self.proc)
        admin = self.client("iam", env)
        admin.create_user(UserName="mlflow")  # unauthenticated call 1
        key = admin.create_access_key(UserName="mlflow")["AccessKey"]  # unauthenticated call 2
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        admin.put_user_policy(  # unauthenticated call 3
            UserName="mlflow",
            PolicyName="s3",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        self.client("s3", self.credentials()).create_bucket(Bucket=bucket)
        self.bucket = bucket
        return self

    def _admin(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "bootstrap", "AWS_SECRET_ACCESS_KEY": "bootstrap"}

    def credentials(self, secret: str | None = None) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret if secret is None else secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
        }

    def client(self, service: str, env: dict[str, str]):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )

    def objects(self, prefix: str = "") -> list[str]:
        listed = self.client("s3", self.credentials()).list_objects_v2(
            Bucket=self.bucket, Prefix=prefix
        )
        return [item["Key"] for item in listed.get("Contents", [])]

    def stop(self) -> None:
        stop_group(self.proc)


class TeamServer:
    """`mlflow server` over PostgreSQL, artifacts proxied to S3 (clients need no S3 keys)."""

    def __init__(self, folder: Path, postgres: Postgres, s3: S3, secret: str | None = None) -> None:
        self.folder, self.postgres, self.s3, self.secret = folder, postgres, s3, secret
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> TeamServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = mlflow_server(
            self.port,
            self.postgres.uri(),
            "--artifacts-destination",
            f"s3://{self.s3.bucket}/mlflow",
            env=child_env(**self.s3.credentials(self.secret)),
            log=self.folder / "server.log",
        )
        return self

    def log(self) -> str:
        return (self.folder / "server.log").read_text()

    def stop(self) -> None:
        stop_group(self.proc)


def require_team_parts() -> None:
    """PostgreSQL binaries, psycopg and moto: all in the lock or .ci/run's packages."""
    for module in ("psycopg", "moto", "boto3"):
        try:
            __import__(module)
        except ImportError:
            _capability_skip(f"needs {module} (requirements-dev.lock)")
