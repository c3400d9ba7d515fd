"""The training stage inside the CPU container, end to end: `dvc repro` as a non-root user,
the run read back from the host's store, browsed in the host's `mlflow ui` with Chromium."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import (
    BIN,
    CHROMIUM_FLAGS,
    PYTHON,
    ROOT,
    Store,
    _capability_skip,
    child_env,
    make_project,
    require_chromium,
    require_docker,
    run_app,
    sh,
    wait_for,
    wait_for_losses,
)
from reprotrain.tracking.orphans import checkpoint_file
from userproject import user_project

pytestmark = [pytest.mark.docker, pytest.mark.e2e]  # a Docker engine, dvc, `mlflow ui`

USER = "reprotrain-ci"
SCREENSHOTS = Path(os.environ.get("REPROTRAIN_SCREENSHOT_DIR", tempfile.gettempdir()))


def non_root_user() -> pwd.struct_passwd:
    """A non-root user in the docker group, created for the test (needs root to create), who
    can run this checkout's interpreter: checked every time, also for a user an earlier run
    created, since the checkout may now sit in a folder only root can enter."""
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        if os.geteuid() != 0:
            pytest.skip(f"creating the test user {USER!r} needs root")
        subprocess.run(["useradd", "--create-home", "--uid", "1234", USER], check=True)
        subprocess.run(["usermod", "-aG", "docker", USER], check=True)
        user = pwd.getpwnam(USER)
    probe = subprocess.run(
        ["runuser", "-u", USER, "--", PYTHON, "-c", "import reprotrain"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        _capability_skip(
            f"user {USER!r} cannot run {PYTHON} ({probe.stderr.strip()[-200:]}); "
            "make the checkout's and the interpreter's folders traversable "
            "(e.g. chmod o+x /root, or chmod 755 on the folder a mktemp -d made)"
        )
    return user


def as_user(
    user: pwd.struct_passwd, repo: Path, *args: str, timeout: float = 1500, check: bool = True
) -> subprocess.CompletedProcess:
    env = child_env(
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        DVC_NO_ANALYTICS="1",
        HOME=user.pw_dir,
        USER=user.pw_name,
    )
    command = [
        "runuser",
        "-u",
        user.pw_name,
        "--",
        "env",
        "-i",  # runuser keeps the caller's environment: pass exactly `env`, nothing inherited
        *[f"{k}={v}" for k, v in env.items()],
        *args,
    ]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def docker_project() -> Iterator[tuple[Path, pwd.struct_passwd, subprocess.CompletedProcess]]:
    """`dvc repro` with runtime=docker in a fresh clone owned by a non-root user."""
    require_docker()
    user = non_root_user()
    base = Path(tempfile.mkdtemp(prefix="reprotrain-docker-"))
    base.chmod(0o755)
    repo = make_project(base / "project", runtime="docker", child_defaults=False)
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(base)], check=True)
    result = as_user(user, repo, "dvc", "repro")
    yield repo, user, result
    shutil.rmtree(base, ignore_errors=True)


def test_repro_trains_inside_the_cpu_container(docker_project) -> None:
    repo, user, result = docker_project
    assert "Running stage 'train'" in result.stdout
    run = Store(repo).only_run()
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["runtime"] == "docker-cpu"
    assert tags["image.id"].startswith("sha256:")
    assert (
        tags["image.id"]
        in subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", "reprotrain:cpu"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert tags["device.type"] == "cpu" and tags["dvc.stage"] == "train"
    assert tags["git.commit"] == as_user(user, repo, "git", "rev-parse", "HEAD").stdout.strip()
    assert len(Store(repo).losses(run.info.run_id)) == 20  # experiment=smoke


def test_every_file_the_stage_wrote_belongs_to_the_user(docker_project) -> None:
    repo, user, _ = docker_project
    written = [
        repo / "mlflow.db",
        *(repo / "results").iterdir(),
        *(repo / "mlruns").rglob("*"),
        repo / "data" / "dataset.npz",
    ]
    owners = {path: path.lstat().st_uid for path in written}
    assert written and all(uid == user.pw_uid for uid in owners.values()), owners


def test_second_repro_reuses_the_image_and_does_nothing(docker_project) -> None:
    repo, user, _ = docker_project
    again = as_user(user, repo, "dvc", "repro")
    assert "Data and pipelines are up to date" in again.stdout
    assert len(Store(repo).runs()) == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_ui(docker_project) -> Iterator[str]:
    """`mlflow ui` on 127.0.0.1 over the store the container wrote, in its own process group."""
    repo, _, _ = docker_project
    port = free_port()
    # The README's command: given no store, `mlflow ui` opens ./mlflow.db, reprotrain's default.
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "ui", "--host", "127.0.0.1", "--port", str(port)],
        cwd=repo,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker processes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_host_ui_serves_the_containers_artifacts(docker_project, mlflow_ui: str) -> None:
    repo, _, _ = docker_project
    run_id = Store(repo).only_run().info.run_id
    url = f"{mlflow_ui}/get-artifact?path=loss.svg&run_uuid={run_id}"
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.read().startswith(b"<svg xmlns=")


@pytest.mark.browser
def test_run_page_in_chromium_shows_the_container_run_and_its_artifacts(
    docker_project, mlflow_ui: str
) -> None:
    chromium = require_chromium()
    from playwright.sync_api import sync_playwright

    repo, _, _ = docker_project
    run = Store(repo).only_run()
    page_url = f"{mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    mode = "?workflowType=machine_learning"  # the link a run prints (tests/test_ui.py)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(page_url + mode)
        page.get_by_text(run.data.tags["device.name"]).first.wait_for(timeout=60_000)
        overview = page.inner_text("body")
        assert run.info.run_name in overview and "docker-cpu" in overview
        page.screenshot(path=str(SCREENSHOTS / "mlflow-run-container.png"))

        page.goto(f"{page_url}/artifacts{mode}")
        page.get_by_text("model.pt").first.wait_for(timeout=60_000)
        listing = page.inner_text("body")
        assert all(name in listing for name in ("loss.svg", "config.yaml", "loss.csv"))
        page.screenshot(path=str(SCREENSHOTS / "mlflow-run-artifacts.png"))
        browser.close()


def launch(repo: Path, *overrides: str) -> subprocess.Popen:
    """`python -m reprotrain.train OVERRIDES` in `repo`, running on, in its own session."""
    return subprocess.Popen(
        [PYTHON, "-m", "reprotrain.train", *overrides],
        cwd=repo,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stop_container_mid_run(
    repo: Path, store: Store, how: str, losses: int, *overrides: str
) -> tuple[int, str]:
    """`python -m reprotrain.train OVERRIDES` in `repo`; once its run has `losses` losses,
    `docker stop` / `docker kill` its container. Returns the launcher's exit code and stderr."""
    proc = launch(repo, *overrides)
    try:
        wait_for_losses(store, losses, proc, timeout=900)  # the first call may build the image
        names = subprocess.run(  # the one container with this project mounted
            ["docker", "ps", "--filter", f"volume={repo}", "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert len(names) == 1, names
        subprocess.run(["docker", how, names[0]], check=True, capture_output=True)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


# `docker stop` (SIGTERM, exit 143): test_docker_stop_then_resume_in_the_container_...
@pytest.mark.parametrize("how,status,code", [("kill", "KILLED", 137)])
def test_container_stopped_mid_run_ends_the_run(
    tmp_path: Path, how: str, status: str, code: int
) -> None:
    require_docker()
    from reprotrain.tracking import prepare_store

    repo = make_project(tmp_path / "project", runtime="docker")
    store = Store(repo)
    prepare_store(store.uri)
    returncode, stderr = stop_container_mid_run(
        repo,
        store,
        how,
        30,
        "train.steps=1000000",
        "train.log_every=10",
        "tracking.flush_every_s=0.2",
        "data.num_samples=2048",
    )
    assert returncode != 0
    assert f"exited with code {code}" in stderr and "Traceback" not in stderr
    run = store.only_run()
    assert run.info.status == status
    assert len(store.losses(run.info.run_id)) >= 30  # the metrics sent before the end are kept


# Long enough that `docker stop` lands mid-run; threads fixed, so the container (whose
# thread count follows its CPU quota) and this process compute alike.
STOP_RESUME_RUN = (
    "device=cpu",
    "train.threads=2",
    "train.steps=2000",
    "train.log_every=10",
    "train.checkpoint_every=500",
    "tracking.flush_every_s=0.2",
    "data.num_samples=2048",
)


def test_docker_stop_then_resume_in_the_container_continues_bit_for_bit(tmp_path: Path) -> None:
    """`docker stop` mid-run, then train.resume=last in the container: the same run, every step
    once, and the losses (in the store and in loss.csv) bit for bit those of an uninterrupted
    local run: the same torch build on both sides, deterministic mode."""
    require_docker()
    import torch

    from reprotrain.tracking import prepare_store

    repo = make_project(tmp_path / "project", runtime="docker")
    store = Store(repo)
    prepare_store(store.uri)
    out = f"train.output_dir={repo / 'results' / 'docker'}"
    returncode, stderr = stop_container_mid_run(repo, store, "stop", 100, *STOP_RESUME_RUN, out)
    assert returncode == 143, stderr[-3000:]  # as a local run stopped by SIGTERM
    assert "exited with code 143" in stderr and "Traceback" not in stderr
    stopped = store.only_run()
    assert stopped.info.status == "KILLED" and stopped.data.tags["runtime"] == "docker-cpu"
    done = len(store.losses(stopped.info.run_id))
    assert 100 <= done < 2000
    assert [step for step, _ in store.losses(stopped.info.run_id)] == list(range(1, done + 1))
    checkpoint = repo / "outputs" / "checkpoints" / f"{stopped.info.run_id}.pt"
    assert torch.load(checkpoint, weights_only=True)["trainer"]["step"] == done  # at the stop

    resumed = run_app(repo, *STOP_RESUME_RUN, out, "train.resume=last", timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = store.only_run()  # the same MLflow run, continued; no other run created
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    history = store.losses(run.info.run_id)
    assert [step for step, _ in history] == list(range(1, 2001))

    reference = Store(tmp_path)  # uninterrupted, in this process's torch (the same build)
    uninterrupted = run_app(
        tmp_path,
        *STOP_RESUME_RUN,
        "experiment=smoke",  # the project's default preset (make_project), here explicit
        "runtime=local",
        f"tracking.uri={reference.uri}",
        f"train.output_dir={tmp_path / 'reference'}",
        timeout=900,
    )
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    local = reference.only_run()
    assert local.data.tags["runtime"] == "local"
    assert local.data.tags["torch.version"] == run.data.tags["torch.version"]
    assert history == reference.losses(local.info.run_id)
    docker_csv = (repo / "results" / "docker" / "loss.csv").read_text()
    assert docker_csv == (tmp_path / "reference" / "loss.csv").read_text()


def test_cuda_in_docker_without_the_toolkit_says_how_to_fix_it(tmp_path: Path) -> None:
    require_docker()
    from reprotrain.containers import host_has_docker_gpus

    if host_has_docker_gpus():
        pytest.skip("this host can hand GPUs to Docker; the failure cannot happen here")
    store = Store(tmp_path)
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "reprotrain.train",
            "runtime=docker",
            "device=cuda",
            "experiment=smoke",
            f"tracking.uri={store.uri}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert (
        "NVIDIA Container Toolkit" in result.stderr
        and "could not select device driver" in result.stderr
    )
    assert not store.path.exists() or "RUNNING" not in store.statuses()


def test_compile_in_a_container_says_to_run_it_here(tmp_path: Path) -> None:
    require_docker()
    store = Store(tmp_path)
    result = run_app(
        ROOT,
        "runtime=docker",
        "train.compile=true",
        "experiment=smoke",
        f"tracking.uri={store.uri}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1 and "train.compile=true cannot run in reprotrain's images" in errors[0]
    assert "runtime=local" in errors[0]
    assert not store.path.exists()  # refused before any run, image build or container


def test_error_inside_the_container_is_one_line_and_ends_the_run_failed(tmp_path: Path) -> None:
    require_docker()
    store = Store(tmp_path)
    broken = tmp_path / "data.npz"
    broken.write_bytes(b"PK\x03\x04 not a whole npz file")
    result = run_app(
        ROOT,
        "runtime=docker",
        "experiment=smoke",
        f"data.file={broken}",
        f"tracking.uri={store.uri}",
        f"train.output_dir={tmp_path / 'results'}",
        timeout=900,  # the first call may build the image
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "reprotrain: error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]  # the container's line, not repeated
    assert errors[0].startswith("reprotrain: error:") and str(broken) in errors[0]
    assert store.only_run().info.status == "FAILED"  # the run the launcher created


def test_cnn_and_a_user_model_train_in_the_container(tmp_path: Path) -> None:
    """reprotrain's CNN, and a model from a package in the user's project folder, in the CPU
    image: the project is mounted at the same path and its folder is on the path there too."""
    require_docker()
    repo = make_project(tmp_path / "project", runtime="docker")
    user_project(repo)
    store = Store(repo)
    for overrides in (
        ["model=cnn", "data=digits_images"],
        # ~experiment: the project's default preset (smoke) sizes the built-in data only
        ["--config-dir", str(repo / "my_conf"), "model=tiny", "data=blobs", "~experiment"],
    ):
        result = run_app(repo, *overrides, "device=cpu", "train.steps=40", timeout=1500)
        assert result.returncode == 0, result.stderr[-3000:]
    runs = {r.data.tags["model.class"]: r for r in store.runs()}
    assert set(runs) == {"reprotrain.models.cnn.SmallCNN", "my_project.models.TinyConvNet"}
    for run in runs.values():
        assert run.info.status == "FINISHED" and run.data.tags["runtime"] == "docker-cpu"
        assert len(store.losses(run.info.run_id)) == 40


def test_container_run_left_running_by_a_hard_kill_is_ended_by_runs_clean(tmp_path: Path) -> None:
    """kill -9 of the launcher leaves its container training: `runs --clean` leaves that run
    alone; once the container is gone too, it ends the run KILLED and says to resume it, or,
    killed before its first checkpoint, to start it again: the container wrote its checkpoint
    folder at the same path on this host, which its launcher recorded. Two launchers of one
    project side by side, each in an experiment of its own: one past a checkpoint, one before
    its first."""
    require_docker()
    from reprotrain.tracking import prepare_store

    repo = make_project(tmp_path / "project", runtime="docker")
    store = Store(repo)
    prepare_store(store.uri)
    cadences = {
        "checkpointed": ("train.checkpoint_every=100",),
        "no-checkpoint": ("train.checkpoint_every=0", "train.checkpoint_every_s=3600"),
    }
    run_args = ("device=cpu", "train.threads=1", "train.log_every=10", "data.num_samples=2048")
    procs = {
        kind: launch(
            repo,
            *run_args,
            *cadence,
            "train.steps=60000",
            "tracking.flush_every_s=0.2",
            f"tracking.experiment={kind}",
            f"train.output_dir={repo / 'results' / kind}",
        )
        for kind, cadence in cadences.items()
    }
    checkpoints = {}
    try:
        for kind, proc in procs.items():
            wait_for_losses(store, 100, proc, timeout=900, experiment=kind)  # may build the image
            (run,) = store.runs(kind)
            checkpoints[kind] = checkpoint_file(
                Path(run.data.tags["reprotrain.checkpoint_dir"]), run.info.run_id
            )
        wait_for(checkpoints["checkpointed"], procs["checkpointed"])
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, gone at once
        for proc in procs.values():
            proc.wait(timeout=30)
    runs = {kind: store.runs(kind)[0] for kind in cadences}
    names = {kind: run.data.tags["reprotrain.container"] for kind, run in runs.items()}
    for kind, run in runs.items():
        assert run.info.status == "RUNNING" and names[kind].startswith("reprotrain-cpu-")
        assert run.data.tags["reprotrain.launcher_host"] == socket.gethostname()
        assert checkpoints[kind].parent == (repo / "outputs" / "checkpoints").resolve()
    assert names["checkpointed"] != names["no-checkpoint"]

    def clean() -> dict[str, str]:
        """What `runs --clean` said of each run."""
        result = sh(repo, PYTHON, "-m", "reprotrain.runs", "--clean", "--tracking-uri", store.uri)
        lines = result.stdout.splitlines()
        said = {}
        for kind, run in runs.items():
            (said[kind],) = [line for line in lines if line.startswith(run.info.run_id)]
        return said

    try:
        for kind, line in clean().items():  # the containers still train
            assert "its owner is alive or unknown" in line, line
            assert store.client.get_run(runs[kind].info.run_id).info.status == "RUNNING"
    finally:
        subprocess.run(["docker", "kill", *names.values()], capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # --rm removes them once they have stopped
        gone = [
            subprocess.run(["docker", "container", "inspect", name], capture_output=True)
            for name in names.values()
        ]
        if all(inspect.returncode != 0 for inspect in gone):
            break
        time.sleep(0.5)
    said = clean()
    for kind, run in runs.items():
        assert f"its container {names[kind]} is gone; marked KILLED" in said[kind], said[kind]
        assert checkpoints[kind].exists() == (kind == "checkpointed")
        assert store.client.get_run(run.info.run_id).info.status == "KILLED"
    assert f"train.resume={runs['checkpointed'].info.run_id}" in said["checkpointed"]
    assert "killed before its first checkpoint" in said["no-checkpoint"]
    assert "train.resume=" not in said["no-checkpoint"]


def test_train_nproc_runs_torchrun_in_the_container_as_one_run(tmp_path: Path) -> None:
    """runtime=docker train.nproc=2: torchrun starts two gloo ranks in the CPU image; the host
    sees one FINISHED run with the job's shape, losses the mean over both ranks."""
    require_docker()
    repo = make_project(tmp_path / "project", runtime="docker")
    result = run_app(
        repo,
        "device=cpu",
        "train.nproc=2",
        "train.steps=60",
        "train.batch_size=32",
        "tracking.log_model=false",
        timeout=1500,
    )
    # A rank's own error comes before torchrun's summary of the failure: keep both.
    assert result.returncode == 0, result.stderr[-12000:]
    run = Store(repo).only_run()
    assert run.info.status == "FINISHED" and run.data.tags["runtime"] == "docker-cpu"
    assert run.data.tags["dist.world_size"] == "2" and run.data.tags["dist.backend"] == "gloo"
    assert [step for step, _ in Store(repo).losses(run.info.run_id)] == list(range(1, 61))
