"""Shared fixtures: a real sqlite MLflow store in a temporary folder; reprotrain's scripts
called in this process (`here`: InProcess, for the core tier); and helpers that run them as
real child processes, the way a user does (for the e2e tier).

Two tiers: `pytest -m "not e2e"` is the core, in this process (a core test that starts a
Python, a container or a browser fails: see STARTED); `pytest -m e2e` keeps what only a real
process or part shows (exit codes after signals, kill -9, torchrun, dvc, Docker, the servers,
the browser, the external workloads). `pytest` runs both."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


TEMP: list[pytest.TempPathFactory] = []  # this test process's tmp_path_factory
SCHEMA: list[Path] = []  # an empty store, made once per test process


@pytest.fixture(scope="session", autouse=True)
def _temp_folders(tmp_path_factory: pytest.TempPathFactory) -> None:
    TEMP.append(tmp_path_factory)


def empty_store_file() -> Path:
    """An empty sqlite store with MLflow's schema, made on first use (a fresh one takes a
    second or more: MLflow's migrations) and copied for each new store a test opens."""
    if not SCHEMA:
        from reprotrain.tracking import prepare_store

        template = Store(TEMP[0].mktemp("schema"))
        prepare_store(template.uri)
        SCHEMA.append(template.path)
    return SCHEMA[0]


class Store:
    """A sqlite MLflow store read back through MlflowClient."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "mlflow.db"
        self.uri = f"sqlite:///{self.path}"

    @property
    def client(self):
        """MLflow's client of the store; a store not made yet is made first, as MLflow makes
        it (a copy of an empty one: create_from)."""
        from mlflow.tracking import MlflowClient

        self.create_from(empty_store_file())
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

    def create_from(self, schema: Path) -> Store:
        """Make a new store as a copy of an empty one (empty_store_file): what MLflow would
        create on first use, without its migrations' seconds. An existing store is kept."""
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(schema, self.path)
        return self


# Module-scoped fixtures worth building once (a dvc repro in a container, servers, a trained
# project): under pytest-xdist (-n, --dist loadgroup) the tests that use one run in one worker.
SHARED_FIXTURES = {
    "docker_project": "docker-project",
    "team": "team-server",
    "s3": "s3-remote",
    "trained": "s3-remote",
    "one_process": "torchrun-reference",
}


# Markers whose tests always start a container or a browser: those tests are e2e too.
E2E_CAPABILITIES = ("docker", "browser")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        for group in sorted({SHARED_FIXTURES[name] for name in used if name in SHARED_FIXTURES}):
            item.add_marker(pytest.mark.xdist_group(group))
        if any(item.get_closest_marker(m) for m in E2E_CAPABILITIES):
            item.add_marker(pytest.mark.e2e)


# The core tier (every test not marked e2e) runs in this process. A core test that starts a
# Python interpreter (the app, torchrun, dvc, an mlflow server, ...), a container or a browser
# fails, naming what it started; tools the code under test calls (git, `docker version`) may run.
STARTED: list[list[str]] = []
CORE_TEST_RUNNING = False


def _starts_a_process_of_its_own(program: str, argv: list[str]) -> bool:
    path = shutil.which(program) or program
    name = Path(path).name
    if name.startswith("python") or name in ("chromium", "chromium-browser"):
        return True
    if name == "docker":
        return any(word in ("run", "build", "buildx", "create", "start", "exec") for word in argv)
    try:
        with open(path, "rb") as handle:
            return b"python" in handle.readline(200)  # a script run by Python (dvc, torchrun)
    except OSError:
        return False


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or not CORE_TEST_RUNNING:
        return
    executable, argv = args[0], args[1]
    argv = [argv] if isinstance(argv, str | bytes | os.PathLike) else list(argv)
    argv = [os.fsdecode(a) for a in argv]
    if argv and _starts_a_process_of_its_own(os.fsdecode(executable or argv[0]), argv):
        STARTED.append(argv)


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    global CORE_TEST_RUNNING
    STARTED.clear()
    CORE_TEST_RUNNING = item.get_closest_marker("e2e") is None  # its fixtures included
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    global CORE_TEST_RUNNING
    try:
        return (yield)
    finally:
        CORE_TEST_RUNNING = False
        if STARTED and item.get_closest_marker("e2e") is None:
            started = "; ".join(" ".join(argv)[:200] for argv in STARTED)
            STARTED.clear()
            pytest.fail(
                f"a core test runs in this process: mark it e2e, or start nothing: {started}"
            )


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


def library_args(tmp_path: Path, *overrides: str, progress: str = "off") -> list[str]:
    """Overrides for reprotrain.train(...) in this process: a sqlite store and checkpoints in
    tmp_path, no system metrics or MLflow Model (the tests about them ask for them)."""
    return [
        "runtime=local",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"train.checkpoint_dir={tmp_path / 'checkpoints'}",
        f"train.progress={progress}",
        "tracking.system_metrics=false",
        "tracking.log_model=false",
        *overrides,
    ]


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


def wait_for_losses(
    store: Store,
    count: int,
    proc: subprocess.Popen,
    timeout: float = 180,
    experiment: str | None = None,
) -> None:
    """Poll the store until the child's run (the one in `experiment`, when given) has `count`
    losses (the child must keep running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        if experiment is not None:
            runs = store.runs(experiment)
        else:
            runs = store.runs() if store.path.exists() else []
        if runs and len(store.losses(runs[0].info.run_id)) >= count:
            return
        time.sleep(0.1)
    where = f" in {experiment}" if experiment is not None else ""
    raise AssertionError(f"fewer than {count} losses recorded{where} in time")


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
        if source.is_file() and not name.startswith("results/"):
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
    """How `python -m reprotrain.<script>` ended when this test's process ran its main()."""

    returncode: int
    stderr: str
    stdout: str = ""


class InProcess:
    """reprotrain's command-line entry points called in this process, the way their
    `python -m` runs them: the training script's main() (`app`, `train`) and the other
    scripts' main(argv) (`module`). What a call sets for the rest of a process (torch threads
    and determinism, signal handlers, Hydra's global state and logging, sys.path, the working
    directory, a user package imported from the test's folders) is put back when the test
    ends; the environment is the one a child gets (child_env), restored by
    environment_restored. `train` is the one place to switch to the library's
    reprotrain.train(overrides) (a Result back, ConfigError raised instead of an exit)."""

    def __init__(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str] | None = None,
    ) -> None:
        """`capfd`: what a call prints is its Exited's stdout and stderr (else left printed)."""
        self.tmp_path, self.monkeypatch, self.capfd = tmp_path, monkeypatch, capfd
        for name in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_", "HYDRA_"))]:
            monkeypatch.delenv(name)  # what child_env() leaves out
        monkeypatch.delenv("REPROTRAIN_RUN_ID", raising=False)
        monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        monkeypatch.chdir(tmp_path)

    def call(self, function: Callable[[], object], cwd: Path | None = None) -> Exited:
        """function() in `cwd` (tmp_path), with `python -m`'s working directory on sys.path;
        a SystemExit is its exit code, anything else raised goes to the test."""
        from hydra.core.global_hydra import GlobalHydra

        folder = Path(cwd or self.tmp_path)
        self.monkeypatch.chdir(folder)
        sys.path.insert(0, str(folder))  # what `python -m` does with the working directory
        forget_user_packages(folder)  # a package of the same name from another folder
        if self.capfd is not None:
            self.capfd.readouterr()
        try:
            function()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:
            GlobalHydra.instance().clear()
        out, err = self.capfd.readouterr() if self.capfd is not None else ("", "")
        if not FROZEN:  # after the first call, torch, MLflow and Hydra are imported
            freeze_what_is_imported()
        return Exited(code, err, out)

    def app(self, *args: str, defaults: bool = True, cwd: Path | None = None) -> Exited:
        """`python -m reprotrain.train ARGS` (with CHILD_DEFAULTS unless `defaults=False`)."""
        argv = with_child_defaults(args) if defaults else list(args)
        self.monkeypatch.setattr(sys, "argv", ["reprotrain.train", *argv])
        return self.call(importlib.import_module("reprotrain.train").main, cwd)

    def train(
        self,
        folder: Path,
        store: Store,
        *overrides: str,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> Exited:
        """conftest.train in this process: the Hydra app in `folder` on `store` (its schema
        copied in when the file is new), writing under folder/results, with the child
        defaults; `env` is added to the environment."""
        self.prepare(store)
        for name, value in (env or {}).items():
            self.monkeypatch.setenv(name, value)
        args = train_args(folder, store.uri, *overrides)[3:]  # without `python -m reprotrain.train`
        result = self.app(*args, defaults=False, cwd=folder)
        if check:
            assert result.returncode == 0, result.stderr[-3000:]
        return result

    def prepare(self, store: Store) -> Store:
        """`store` with MLflow's schema, as the first run on it leaves it (Store.create_from)."""
        return store.create_from(empty_store_file())

    def module(self, name: str, *args: str, cwd: Path | None = None) -> Exited:
        """`python -m reprotrain.NAME ARGS` (runs, replay, reproduce, evaluate, prepare)."""
        main = importlib.import_module(f"reprotrain.{name}").main
        return self.call(lambda: main(list(args)), cwd)


FROZEN: list[bool] = []


def freeze_what_is_imported() -> None:
    """Leave the objects the imports made (torch, MLflow, Hydra: millions) out of Python's
    later full garbage collections, as the app does at exit (cli.main: gc.freeze): each
    in-process run would otherwise walk them again (about a tenth of the core tier's time)."""
    gc.collect()
    gc.freeze()
    FROZEN.append(True)


def forget_user_packages(*folders: Path) -> None:
    """Drop imported modules that a user's folder holds (the test's folders, and the temporary
    folders MLflow loads a model's code from): the next import finds the package of the folder
    a run starts in. reprotrain's and the tests' own modules stay."""
    places = [str(folder) for folder in folders] + [tempfile.gettempdir()]
    for name, module in list(sys.modules.items()):
        file = str(getattr(module, "__file__", None) or "")
        if file.startswith(tuple(places)) and not file.startswith(str(ROOT)):
            del sys.modules[name]


@contextmanager
def process_state_kept(folder: Path) -> Iterator[None]:
    """What the scripts set for the rest of a process, put back at the end: torch threads and
    determinism, SIGINT and SIGTERM handlers, sys.path, the root logger, MLflow's tracking URI,
    and the modules imported from `folder` (a user package)."""
    import torch
    from mlflow.tracking._tracking_service import utils as mlflow_tracking

    # A run ended with $MLFLOW_TRACKING_URI set leaves MLflow's process-wide URI set to that
    # value (TrackedRun "restores" what mlflow.get_tracking_uri() said), which would outlive
    # the variable; MLflow has no public call that unsets it.
    tracking_uri = mlflow_tracking._tracking_uri

    saved = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        list(sys.path),
        logging.root.level,
        list(logging.root.handlers),
    )
    try:
        yield
    finally:
        threads, deterministic, handlers, path, level, root_handlers = saved
        torch.set_num_threads(threads)
        if torch.are_deterministic_algorithms_enabled() != deterministic:
            torch.use_deterministic_algorithms(deterministic)  # imports torch's compiler
        for signum, handler in zip((signal.SIGINT, signal.SIGTERM), handlers, strict=True):
            signal.signal(signum, handler)
        sys.path[:] = path
        forget_user_packages(folder)  # every module imported from under `folder`
        for handler in logging.root.handlers[:]:
            if handler not in root_handlers:
                logging.root.removeHandler(handler)
                handler.close()
        logging.root.setLevel(level)
        mlflow_tracking._tracking_uri = tracking_uri


@contextmanager
def mlflow_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI set to `uri` for a block (what `runs:/...` URIs are
    resolved with, e.g. by mlflow.pytorch.load_model), then put back as it was."""
    import mlflow
    from mlflow.tracking._tracking_service import utils as mlflow_tracking

    before = mlflow_tracking._tracking_uri  # None: not set (no public call unsets it)
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow_tracking._tracking_uri = before


@pytest.fixture
def here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Iterator[InProcess]:
    """reprotrain's scripts in this process, in tmp_path (InProcess)."""
    with process_state_kept(tmp_path):
        yield InProcess(tmp_path, monkeypatch, capfd)


@pytest.fixture
def app_in_process(here: InProcess) -> Callable[..., Exited]:
    """The training script's main() (the one `python -m reprotrain.train` runs), called in
    this process in tmp_path with the child defaults (InProcess.app)."""
    return here.app


@pytest.fixture
def train_here(here: InProcess) -> Callable[..., Exited]:
    """conftest.train, in this process (InProcess.train): `train_here(folder, store, *overrides)`."""
    return here.train


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
