"""Build the reprotrain images and run the training step in a container.

What the launcher does with it:

    from reprotrain import containers

    status = containers.engine_status()          # EngineStatus(available, reason)
    image = containers.ensure_image("cpu", project_root)   # builds once per inputs digest
    where = containers.Placement(project_root, env={"MLFLOW_TRACKING_URI": uri}, network="host")
    cmd = containers.container_command(
        image, "cpu", ["python", "-m", "reprotrain.train", "device=cpu"], where
    )
    exit_code = containers.run_container(cmd, kind="cpu")

Images are tagged `reprotrain:{kind}-{digest}`; the digest covers what decides an image's
contents (the Dockerfile, requirements.lock, requirements-extra.lock with your own extra
packages, build args and flags), not the project's code, which is mounted at run time.
`reprotrain:{kind}` names the latest one.

Environment variables for CI and offline machines (all part of the digest):
    REPROTRAIN_BASE_IMAGE   --build-arg BASE_IMAGE=..., e.g. reprotrain-base:bookworm
                            (a local base made by scripts/build-base-image.sh)
    REPROTRAIN_BUILD_ARGS   extra KEY=VALUE build args, space separated,
                            e.g. "TORCH_INDEX_URL=https://pypi.org/simple
                                  TORCH_FIND_LINKS=http://127.0.0.1:8765/"
    REPROTRAIN_BUILD_FLAGS  extra `docker build` flags, e.g. "--network host"

Inside the container the launcher's code sees REPROTRAIN_RUNTIME (docker-cpu, docker-cuda) and
REPROTRAIN_IMAGE_ID (the image id, for the MLflow tag `image.id`).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from reprotrain.errors import RuntimeEnvError, UserError
from reprotrain.tracking.store import redact

KINDS = ("cpu", "cuda")
IMAGE_REPO = "reprotrain"
ENGINE_TIMEOUT_S = 10  # a hung engine must not stall `dvc repro` for minutes
BUILD_TAIL_LINES = 15
RUN_TAIL_LINES = 15
STOP_GRACE_S = 10  # time between SIGTERM and SIGKILL: enough to end the MLflow run as KILLED
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
TOOLKIT_MISSING = 'could not select device driver "" with capabilities: [[gpu]]'
TOOLKIT_HINT = (
    "install the NVIDIA Container Toolkit and restart Docker "
    "(sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker), "
    "or run on the CPU with device=cpu"
)
TORCH_HINT = (
    "the CPU torch wheel comes from PyTorch's index by default; where that cannot be reached, "
    "point the build at a folder or server holding the wheel: "
    "REPROTRAIN_BUILD_ARGS='TORCH_FIND_LINKS=<URL with torch-*.whl> "
    "TORCH_INDEX_URL=https://pypi.org/simple' (README: Containers)"
)
EXTRA_LOCK = "requirements-extra.lock"  # your own packages (scripts/lock-extra.sh)
EXTRA_HINT = (
    "write requirements-extra.lock with scripts/lock-extra.sh <package>==<version> ... "
    "(no package: scripts/lock-extra.sh alone); README: Containers"
)
LOCAL_BASE_HINT = (
    "without a registry, build a local base with scripts/build-base-image.sh "
    "and set REPROTRAIN_BASE_IMAGE=reprotrain-base:bookworm"
)


@dataclass(frozen=True)
class EngineStatus:
    available: bool
    reason: str  # one line, e.g. "Docker engine 27.3.1" or why it cannot be used


@dataclass(frozen=True)
class ImageRef:
    tag: str  # reprotrain:{kind}-{digest}
    id: str  # sha256:...
    built: bool  # False when an existing image was reused


# --- the engine and the GPUs ---------------------------------------------------------------


def engine_status() -> EngineStatus:
    """Ask the engine for its version: the cheapest call that needs a working daemon."""
    try:
        proc = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
        )
    except FileNotFoundError:
        return EngineStatus(False, "docker client not installed")
    except subprocess.TimeoutExpired:
        return EngineStatus(False, f"Docker engine did not answer within {ENGINE_TIMEOUT_S} s")
    version = proc.stdout.strip()
    if proc.returncode == 0 and version:
        return EngineStatus(True, f"Docker engine {version}")
    return EngineStatus(False, _engine_failure_reason(proc.stderr))


def _engine_failure_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = " ".join(lines)
    if "permission denied" in text.lower():
        socket = re.search(r"unix://(/[^\s:\"]+)", text)
        path = socket.group(1) if socket else "/var/run/docker.sock"
        return f"permission denied on {path} (add your user to the docker group)"
    for line in lines:
        if "Cannot connect to the Docker daemon" in line:
            return f"Docker engine not running ({line.split('. Is the docker daemon')[0]})"
    return lines[-1] if lines else "docker version failed without a message"


def gpu_count() -> int:
    """GPUs the host's driver lists (`nvidia-smi -L`); 0 without a driver."""
    listed = _output_or_none(["nvidia-smi", "-L"]) or ""
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def host_has_docker_gpus() -> bool:
    """True when the host lists a GPU and Docker can hand it to a container (no container run)."""
    gpus = _output_or_none(["nvidia-smi", "-L"])
    if not gpus or "GPU " not in gpus:
        return False
    # `--gpus` works when dockerd finds the toolkit's prestart hook, or an nvidia runtime is
    # registered, or CDI specs describe the GPUs (the newer route).
    if shutil.which("nvidia-container-runtime-hook"):
        return True
    runtimes = _output_or_none(["docker", "info", "--format", "{{json .Runtimes}}"])
    if runtimes and "nvidia" in runtimes:
        return True
    cdi_dirs = (Path("/etc/cdi"), Path("/var/run/cdi"))
    return any("nvidia" in spec.name for d in cdi_dirs if d.is_dir() for spec in d.iterdir())


def _output_or_none(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


# --- images ----------------------------------------------------------------------------------


def image_inputs_digest(
    project_root: Path,
    kind: str,
    *,
    build_args: dict[str, str] | None = None,
    extra_build_flags: list[str] | None = None,
) -> str:
    """First 12 hex chars of sha256(Dockerfile, requirements.lock, requirements-extra.lock,
    build args, build flags)."""
    _check_kind(kind)
    digest = hashlib.sha256()
    for name in (f"Dockerfile.{kind}", "requirements.lock", EXTRA_LOCK):
        path = Path(project_root) / name
        if not path.is_file():
            raise RuntimeEnvError(
                f"{name} not found in {project_root}",
                hint=EXTRA_HINT
                if name == EXTRA_LOCK
                else "run from the reprotrain project root, where the Dockerfiles live",
            )
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for key, value in sorted(_build_args(build_args).items()):
        digest.update(f"arg {key}={value}\0".encode())
    for flag in _build_flags(extra_build_flags):
        digest.update(f"flag {flag}\0".encode())
    return digest.hexdigest()[:12]


def ensure_image(
    kind: str,
    project_root: Path,
    *,
    build_args: dict[str, str] | None = None,
    extra_build_flags: list[str] | None = None,
) -> ImageRef:
    """Reuse reprotrain:{kind}-{digest} if it exists, else build it (a line per step on stderr,
    the whole log in <project>/outputs/logs/build-<kind>.log).

    Explicit build_args win over REPROTRAIN_BASE_IMAGE / REPROTRAIN_BUILD_ARGS.
    """
    _check_kind(kind)
    project_root = Path(project_root).resolve()
    status = engine_status()
    if not status.available:
        raise RuntimeEnvError(
            f"cannot build the {kind} image: {status.reason}",
            hint="start Docker, or run without a container with runtime=local",
        )
    args = _build_args(build_args)
    flags = _build_flags(extra_build_flags)
    digest = image_inputs_digest(
        project_root, kind, build_args=build_args, extra_build_flags=extra_build_flags
    )
    tag = f"{IMAGE_REPO}:{kind}-{digest}"
    # Parallel launchers (dvc exp run --queue -j 2) must not build the same image twice.
    with _build_lock(tag):
        image_id = _image_id(tag)
        built = image_id is None
        if image_id is None:
            _build(kind, project_root, tag, args, flags)
            image_id = _image_id(tag)
            if image_id is None:
                raise RuntimeEnvError(
                    f"docker build reported success but {tag} is missing",
                    hint="check `docker image ls` and the engine's log",
                )
    subprocess.run(["docker", "tag", tag, f"{IMAGE_REPO}:{kind}"], check=False, capture_output=True)
    return ImageRef(tag=tag, id=image_id, built=built)


def _build(kind: str, root: Path, tag: str, args: dict[str, str], flags: list[str]) -> None:
    dockerfile = f"Dockerfile.{kind}"
    cmd = ["docker", "build", "--force-rm", "-f", str(root / dockerfile), "-t", tag]
    cmd += [f"--build-arg={key}={value}" for key, value in args.items()]
    cmd += [*flags, str(root)]
    print(
        f"reprotrain: building {tag} from {dockerfile} (once for these inputs): {shlex.join(cmd)}",
        file=sys.stderr,
        flush=True,
    )
    steps = _BuildSteps()
    # plain progress: BuildKit's interactive view is unreadable once piped.
    env = {**os.environ, "BUILDKIT_PROGRESS": "plain"}
    log_path = root / "outputs" / "logs" / f"build-{kind}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The whole log goes to a file; the terminal (and `dvc exp run`) sees one line per step.
    with (
        open(log_path, "w", encoding="utf-8") as log,
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if steps.feed(line.rstrip("\n")):
                print(f"reprotrain: build {steps.current}"[:160], file=sys.stderr, flush=True)
    if proc.returncode == 0:
        print(f"reprotrain: built {tag} (full log: {log_path})", file=sys.stderr, flush=True)
        return
    print(
        f"reprotrain: last {len(steps.tail)} lines of the build output (full log: {log_path}):",
        file=sys.stderr,
    )
    for line in steps.tail:
        print(f"  {line}", file=sys.stderr)
    step = steps.failing_step()
    base_problem = "FROM" in step or "load metadata" in step
    if base_problem:  # the usual cause on a machine without a registry: say which base
        if "FROM" not in step:  # BuildKit names the base's metadata lookup, not the FROM line
            step = f"FROM: {step}"
        step += f" with BASE_IMAGE={args.get('BASE_IMAGE', 'the default')}"
    hint = "read the build output above and fix that step"
    if base_problem:
        hint = LOCAL_BASE_HINT
    elif "torch-cpu.txt" in step:  # the torch wheel, from PyTorch's index by default
        hint = TORCH_HINT
    elif EXTRA_LOCK in step:
        hint = f"a package of {EXTRA_LOCK} did not install: {EXTRA_HINT}"
    raise RuntimeEnvError(
        f"docker build of {dockerfile} failed at step {step!r} "
        f"(exit code {steps.exit_code or proc.returncode})",
        hint=hint,
    )


class _BuildSteps:
    """Follows the build log to name the failing step, for the legacy builder and BuildKit."""

    LEGACY_STEP = re.compile(r"^Step (\d+/\d+) : (.*)$")  # Step 4/12 : RUN pip install ...
    BUILDKIT_STEP = re.compile(r"^#(\d+) (\[[^\]]*\] .*)$")  # #8 [4/12] RUN pip install ...
    BUILDKIT_ERROR = re.compile(r"^#(\d+) ERROR")
    # BuildKit's client exits 1 whatever failed; its ERROR line has the RUN's own exit code.
    BUILDKIT_EXIT_CODE = re.compile(r"exit code: (\d+)")

    def __init__(self) -> None:
        self.tail: deque[str] = deque(maxlen=BUILD_TAIL_LINES)
        self.headers: dict[str, str] = {}
        self.current = ""
        self.failed_id: str | None = None
        self.exit_code: int | None = None  # the failing RUN's, where BuildKit's log says it

    def feed(self, line: str) -> bool:
        """Take one line of the log; True when it starts a step (a line worth showing)."""
        line = ANSI_ESCAPE.sub("", line)  # the legacy builder colours RUN's stderr
        self.tail.append(line)
        if match := self.LEGACY_STEP.match(line):
            self.current = f"{match.group(1)} {match.group(2)}"
            return True
        if (match := self.BUILDKIT_STEP.match(line)) and match.group(1) not in self.headers:
            self.headers[match.group(1)] = self.current = match.group(2)
            return True
        if (match := self.BUILDKIT_ERROR.match(line)) and self.failed_id is None:
            self.failed_id = match.group(1)
            if code := self.BUILDKIT_EXIT_CODE.search(line):
                self.exit_code = int(code.group(1))
        return False

    def failing_step(self) -> str:
        step = self.headers.get(self.failed_id or "", self.current) or "unknown step"
        return step if len(step) <= 160 else step[:157] + "..."


def _build_args(explicit: dict[str, str] | None) -> dict[str, str]:
    args: dict[str, str] = {}
    if base := os.environ.get("REPROTRAIN_BASE_IMAGE", "").strip():
        args["BASE_IMAGE"] = base
    for item in _split_env("REPROTRAIN_BUILD_ARGS"):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RuntimeEnvError(
                f"REPROTRAIN_BUILD_ARGS entry {item!r} is not KEY=VALUE",
                hint="write space-separated KEY=VALUE pairs, "
                "e.g. REPROTRAIN_BUILD_ARGS='TORCH_FIND_LINKS=http://127.0.0.1:8765/'",
            )
        args[key] = value
    args.update(explicit or {})
    return args


def _build_flags(explicit: list[str] | None) -> list[str]:
    return [*_split_env("REPROTRAIN_BUILD_FLAGS"), *(explicit or [])]


def _split_env(name: str) -> list[str]:
    value = os.environ.get(name, "")
    try:
        return shlex.split(value)
    except ValueError as error:
        raise RuntimeEnvError(
            f"{name}={value!r} cannot be split into words ({error})", hint="balance the quotes"
        ) from None


def _image_id(tag: str) -> str | None:
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


@contextlib.contextmanager
def _build_lock(tag: str):
    path = Path(tempfile.gettempdir()) / f"reprotrain-build-{tag.replace(':', '-')}.lock"
    try:
        handle = open(path, "a")  # noqa: SIM115 (held open for the whole build)
    except OSError:  # e.g. another user's lock file in /tmp: build without the lock
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RuntimeEnvError(f"image kind {kind!r} is not known", hint="use cpu or cuda")


# --- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where and how a training container runs: the project mounted at its own path, the
    environment it gets, its network, /dev/shm size, CPU limit, name, working folder and
    other folders it reads or writes (each mounted at its own path too)."""

    project_root: Path
    env: dict[str, str]
    network: str = "none"
    shm_size: str = "1g"
    cpus: float | None = None
    name: str | None = None
    cwd: Path | None = None
    mounts: tuple[Path, ...] = ()


def container_command(image: ImageRef, kind: str, argv: list[str], where: Placement) -> list[str]:
    """The `docker run` argv for one training run (pure: it runs nothing)."""
    _check_kind(kind)
    root, env, mounts, cpus = (
        Path(where.project_root).resolve(),
        where.env,
        where.mounts,
        where.cpus,
    )
    here = Path.cwd() if where.cwd is None else Path(where.cwd)
    # Same absolute path inside and out: MLflow stores artifact paths as absolute paths.
    mounted = [root, *(Path(m).resolve() for m in mounts)]
    workdir = here if any(here.resolve().is_relative_to(m) for m in mounted) else root
    user = f"{os.getuid()}:{os.getgid()}" if hasattr(os, "getuid") else "1000:1000"
    run_env = {
        "HOME": "/tmp",  # the host uid has no home in the image
        # The mounted code wins over the copy in the image; a package of yours in the project
        # folder (a model's or dataset's _target_) imports as it does on the host.
        "PYTHONPATH": f"{root}/src:{root}",
        "REPROTRAIN_RUNTIME": f"docker-{kind}",
        "REPROTRAIN_IMAGE_ID": image.id,
        **env,
    }
    name = where.name or f"reprotrain-{kind}-{uuid.uuid4().hex[:12]}"
    cmd = ["docker", "run", "--rm", "--name", name]
    cmd += ["--user", user]  # files written into the mount belong to the host user, not root
    cmd += ["--mount", bind_mount(root), "-w", str(workdir)]
    # Folders the run reads or writes outside the project (a store, an output folder, the
    # current folder), each at its own path too.
    for folder in sorted({Path(m).resolve() for m in mounts}):
        if not folder.is_relative_to(root):
            cmd += ["--mount", bind_mount(folder)]
    cmd += ["--network", where.network, "--shm-size", where.shm_size]  # for DataLoader workers
    if cpus is not None:
        if cpus <= 0:
            raise RuntimeEnvError(
                f"cpus must be a positive number, got {cpus}",
                hint="set e.g. cpus=2, or leave it unset for no limit",
            )
        cmd += ["--cpus", f"{cpus:g}"]
    if kind == "cuda":
        cmd += ["--gpus", "all"]
    for key, value in run_env.items():
        # A value with a password is passed by name: docker takes it from its own
        # environment (run_container's `secrets`), so it is not in this argv (ps, logs).
        cmd += ["-e", key if redact(value) != value else f"{key}={value}"]
    return [*cmd, image.tag, *argv]


def bind_mount(folder: Path) -> str:
    """`--mount` for `folder` at the same path inside. Not `-v src:dst`, which splits at every
    `:` of a path; --mount's value is CSV, so a `,` or `"` in a path is quoted."""
    fields = ["type=bind", f"source={folder}", f"target={folder}"]
    line = io.StringIO()
    csv.writer(line, lineterminator="").writerow(fields)
    return line.getvalue()


def run_container(cmd: list[str], *, kind: str, secrets: dict[str, str] | None = None) -> int:
    """Run a container_command, stream its output, forward SIGINT/SIGTERM, return its exit code.
    `secrets`: the values container_command passed by name only (they hold a password)."""
    name = cmd[cmd.index("--name") + 1] if "--name" in cmd else None
    tail: deque[str] = deque(maxlen=RUN_TAIL_LINES)
    # Own session: a terminal's Ctrl-C reaches only us, and we forward it exactly once
    # (docker's own signal proxy would deliver a second one mid-cleanup).
    try:
        proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            env={**os.environ, **(secrets or {})},
        )
    except FileNotFoundError:
        raise RuntimeEnvError(
            f"cannot run {cmd[0]!r}: docker client not installed",
            hint="install Docker, or run without a container with runtime=local",
        ) from None
    pump = threading.Thread(target=_tee_lines, args=(proc.stderr, tail), daemon=True)
    pump.start()
    with _forward_signals_to(name):
        exit_code = proc.wait()
        pump.join()
    _raise_if_docker_failed(exit_code, list(tail), kind)
    if exit_code not in (0, UserError.exit_code):  # a UserError's one line is already above
        print(
            f"reprotrain: container {name} ({kind}) exited with code {exit_code}; "
            f"last lines of its output:",
            file=sys.stderr,
        )
        for line in tail:
            print(f"  {line}", file=sys.stderr)
    return exit_code


def _tee_lines(stream, tail: deque[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line.rstrip("\n"))


@contextlib.contextmanager
def _forward_signals_to(name: str | None):
    """SIGTERM -> `docker stop` (tini passes it on, SIGKILL after the grace time); SIGINT ->
    `docker kill --signal SIGINT`; a second signal kills the container outright."""
    if name is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    helpers: list[subprocess.Popen] = []

    def forward(signum: int, _frame) -> None:
        if helpers:
            cmd = ["docker", "kill", name]
        elif signum == signal.SIGTERM:
            cmd = ["docker", "stop", "--time", str(STOP_GRACE_S), name]
        else:
            cmd = ["docker", "kill", "--signal", signal.Signals(signum).name, name]
        print(
            f"reprotrain: {signal.Signals(signum).name} received: {shlex.join(cmd)}",
            file=sys.stderr,
            flush=True,
        )
        # Not waited for here: the handler must return so proc.wait() can see the exit.
        helpers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for helper in helpers:
            helper.wait()


def _raise_if_docker_failed(exit_code: int, tail: list[str], kind: str) -> None:
    """Exit code 125 with a `docker:` line means Docker failed before the container ran."""
    text = "\n".join(tail)
    if TOOLKIT_MISSING in text:
        raise RuntimeEnvError(
            f"docker run --gpus all failed for the {kind} image: Docker cannot reach the "
            f"NVIDIA GPUs ({TOOLKIT_MISSING})",
            hint=TOOLKIT_HINT,
        )
    errors = [line for line in tail if line.startswith("docker: ")]
    if exit_code == 125 and errors:
        raise RuntimeEnvError(
            f"docker run failed before the container started: {errors[-1]}",
            hint="check the image tag and the docker run options above",
        )
