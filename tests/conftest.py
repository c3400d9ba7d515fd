"""Shared fixtures: a real sqlite MLflow store in a temporary folder, and a helper that runs
`python -m reprotrain.train` as a real child process, the way a user does."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _capability_skip(reason: str) -> None:
    """Skip, unless CI asked for every capability it installed (then a missing one fails)."""
    if os.environ.get("REPROTRAIN_REQUIRE_ALL") == "1":
        pytest.fail(f"required capability missing: {reason}")
    pytest.skip(reason)


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: none is visible to torch here")


# Headless Chromium on a CI machine: no sandbox (root), no GPU, no network of its own.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        _capability_skip("needs Debian's chromium package (apt-get install chromium)")
    return path


class Store:
    """A sqlite MLflow store read back through MlflowClient."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "mlflow.db"
        self.uri = f"sqlite:///{self.path}"

    @property
    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)

    def runs(self, experiment: str = "reprotrain") -> list:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        return self.client.search_runs([exp.experiment_id], max_results=1000)

    def only_run(self):
        runs = self.runs()
        assert len(runs) == 1, [r.info.run_name for r in runs]
        return runs[0]

    def losses(self, run_id: str) -> list[tuple[int, float]]:
        history = self.client.get_metric_history(run_id, "train/loss")
        return sorted((m.step, m.value) for m in history)

    def statuses(self) -> list[str]:
        return [r.info.status for r in self.runs()]


# Module-scoped fixtures worth building once (a dvc repro in a container, servers, a trained
# project): under pytest-xdist (-n, --dist loadgroup) the tests that use one run in one worker.
SHARED_FIXTURES = {
    "docker_project": "docker-project",
    "team": "team-server",
    "s3": "s3-remote",
    "trained": "s3-remote",
    "one_process": "torchrun-reference",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        for group in sorted({SHARED_FIXTURES[name] for name in used if name in SHARED_FIXTURES}):
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """What a test (or a library it calls in-process) sets in os.environ ends with the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "HYDRA_"))}
    env.pop("REPROTRAIN_RUN_ID", None)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"  # mlflow server too: no traffic off this machine
    env.update(extra)
    return env


# transformers and what only it needs (requirements-hf.lock), installed by scripts/setup.sh apart
# from .venv: torchmetrics imports transformers whenever it can (torchmetrics issue #2242), which
# would slow the start of every training process.
HF_SITE = ROOT / ".venv" / "hf-site"


def hf_env(**extra: str) -> dict[str, str]:
    """child_env(**extra) for a process that imports transformers: HF_SITE after the PYTHONPATH
    it has (given or inherited), and the Hugging Face Hub offline (models come from configs)."""
    if not (HF_SITE / "transformers").is_dir():
        pytest.fail(f"transformers is not installed in {HF_SITE}: run scripts/setup.sh")
    env = child_env(**{"HF_HUB_OFFLINE": "1", **extra})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(HF_SITE)]))
    return env


def imported_modules(stderr: str) -> list[str]:
    """The modules named by `-X importtime` (or PYTHONPROFILEIMPORTTIME) lines in `stderr`."""
    return [
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]


def run_app(
    cwd: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m reprotrain.train ARGS` exactly as given (no overrides added), in cwd."""
    return subprocess.run(
        [PYTHON, "-m", "reprotrain.train", *args],
        cwd=cwd,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# What a training child gets unless the test names the key itself: no MLflow Model (its export
# takes seconds a run; the tests about the model ask for it) and one torch thread (the suite
# runs one test per core, side by side).
CHILD_DEFAULTS = {"tracking.log_model": "false", "train.threads": "1"}


def override_key(override: str) -> str:
    """The config key an override names: `+a.b=1`, `~a.b` and `a.b=1` all name `a.b`."""
    return override.lstrip("+~").split("=", 1)[0]


def with_child_defaults(overrides: tuple[str, ...] | list[str]) -> list[str]:
    named = {override_key(o) for o in overrides}
    return [*overrides, *(f"{k}={v}" for k, v in CHILD_DEFAULTS.items() if k not in named)]


def train_args(tmp_path: Path, uri: str, *overrides: str) -> list[str]:
    """`python -m reprotrain.train` here, on `uri`, writing under tmp_path/results, with the
    child defaults above."""
    return [
        PYTHON,
        "-m",
        "reprotrain.train",
        "runtime=local",
        f"tracking.uri={uri}",
        f"train.output_dir={tmp_path / 'results'}",
        *with_child_defaults(overrides),
    ]


def start_training(tmp_path: Path, uri: str, *overrides: str) -> subprocess.Popen:
    """The same as a child process that keeps running (for signals and outages), in a process
    group of its own (os.killpg ends it and any child it started)."""
    return subprocess.Popen(
        train_args(tmp_path, uri, *overrides),
        cwd=tmp_path,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_trainer(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL the training process (what the OOM killer does) and wait until it is gone."""
    proc.kill()
    proc.wait(timeout=timeout)


def wait_for_losses(store: Store, count: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Poll the store until the child's run has `count` losses (the child must keep running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        runs = store.runs() if store.path.exists() else []
        if runs and len(store.losses(runs[0].info.run_id)) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} losses recorded in time")


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll until `path` exists (the child must keep running)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended before it could be killed there"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def require_docker() -> None:
    """Skip without a usable Docker engine, or fail when REPROTRAIN_REQUIRE_DOCKER=1 (CI)."""
    from reprotrain.containers import engine_status

    status = engine_status()
    if not status.available:
        if os.environ.get("REPROTRAIN_REQUIRE_DOCKER") == "1":
            pytest.fail(f"REPROTRAIN_REQUIRE_DOCKER=1 but Docker is not usable: {status.reason}")
        pytest.skip(f"needs a Docker engine: {status.reason}")


def train(
    tmp_path: Path,
    store: Store,
    *overrides: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the Hydra app in tmp_path with its own store and output folder."""
    result = subprocess.run(
        train_args(tmp_path, store.uri, *overrides),
        cwd=tmp_path,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


BIN = Path(PYTHON).parent


def sh(
    repo: Path,
    *args: str,
    check: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run a command in `repo` with the project's venv first on PATH (as after activation)."""
    env = env or child_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", DVC_NO_ANALYTICS="1")
    result = subprocess.run(
        args, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def copy_project(dest: Path) -> Path:
    """The files git would hold (tracked and new, not ignored), without run outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() and not name.startswith(("results/", "data/")):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def compose_params(repo: Path, *overrides: str) -> None:
    """What `dvc exp run` does to params.yaml (DVC's own function), done once for the copy."""
    code = (
        "import sys; from dvc.utils.hydra import compose_and_dump; "
        "compose_and_dump('params.yaml', sys.argv[1], None, 'config', '', sys.argv[2:])"
    )
    sh(repo, PYTHON, "-c", code, str(repo / "conf"), *overrides)


def make_project(dest: Path, runtime: str, *, child_defaults: bool = True) -> Path:
    """A git repository copied from the project, set up for smoke-sized runs on `runtime`;
    with `child_defaults`, the copy's smoke preset also sets CHILD_DEFAULTS (no MLflow Model,
    one thread), so that `dvc repro` and `dvc exp run` get them too."""
    repo = copy_project(dest)
    config = repo / "conf" / "config.yaml"
    text = config.read_text().replace("  - runtime: auto", f"  - runtime: {runtime}")
    config.write_text(text.replace("  - experiment: null", "  - experiment: smoke"))
    if child_defaults:
        preset = repo / "conf" / "experiment" / "smoke.yaml"
        values = yaml.safe_load(preset.read_text())
        for key, value in CHILD_DEFAULTS.items():
            section, name = key.split(".")
            values.setdefault(section, {})[name] = yaml.safe_load(value)
        preset.write_text("# @package _global_\n" + yaml.safe_dump(values, sort_keys=False))
    compose_params(repo)
    sh(repo, "git", "init", "-q")
    sh(repo, "git", "config", "user.name", "reprotrain-test")
    sh(repo, "git", "config", "user.email", "test@reprotrain.invalid")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "project copy")
    return repo


@dataclass
class Exited:
    """How `python -m reprotrain.train` ended when this test's process ran its main()."""

    returncode: int
    stderr: str


@pytest.fixture
def app_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., Exited]]:
    """The training script's main() (the one `python -m reprotrain.train` runs), called in
    this process in tmp_path with the child defaults: for what a process shows before its
    first step (one-line errors), without an interpreter start-up per case. What the app
    sets for the rest of a process (torch threads and determinism, signal handlers, Hydra's
    global state and logging, sys.path, a user package imported from tmp_path) is put back
    afterwards."""
    import torch
    from hydra.core.global_hydra import GlobalHydra

    from reprotrain.cli import main

    monkeypatch.chdir(tmp_path)
    saved = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        list(sys.path),
        logging.root.level,
        list(logging.root.handlers),
    )

    def run(*args: str, defaults: bool = True) -> Exited:
        argv = with_child_defaults(args) if defaults else list(args)
        monkeypatch.setattr(sys, "argv", ["reprotrain.train", *argv])
        sys.path.insert(0, str(tmp_path))  # what `python -m` does with the working directory
        capfd.readouterr()
        try:
            main()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            GlobalHydra.instance().clear()
        return Exited(code, capfd.readouterr().err)

    yield run
    threads, deterministic, handlers, path, level, root_handlers = saved
    torch.set_num_threads(threads)
    if (
        torch.are_deterministic_algorithms_enabled() != deterministic
    ):  # the call imports torch's compiler
        torch.use_deterministic_algorithms(deterministic)
    for signum, handler in zip((signal.SIGINT, signal.SIGTERM), handlers, strict=True):
        signal.signal(signum, handler)
    sys.path[:] = path
    for name, module in list(sys.modules.items()):  # a user package of this test's folder
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    for handler in logging.root.handlers[:]:
        if handler not in root_handlers:
            logging.root.removeHandler(handler)
            handler.close()
    logging.root.setLevel(level)


@dataclass
class Reproduced:
    """A project copy (make_project, runtime=local) after its first `dvc repro`."""

    repo: Path
    repro: subprocess.CompletedProcess  # what that `dvc repro` printed

    def copy(self, dest: Path) -> Path:
        """The same project, pipeline state and DVC cache, for a test that changes it; without
        the MLflow store (a store's artifact paths name the folder that wrote it)."""
        shutil.copytree(
            self.repo, dest, symlinks=True, ignore=shutil.ignore_patterns("mlflow.db", "mlruns")
        )
        return dest


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory: pytest.TempPathFactory) -> Reproduced:
    """One `dvc repro` shared by the tests that only read its result (others copy it)."""
    repo = make_project(tmp_path_factory.mktemp("reproduced") / "project", runtime="local")
    return Reproduced(repo, sh(repo, "dvc", "repro"))
