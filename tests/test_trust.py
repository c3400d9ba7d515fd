"""A config is code (reprotrain.trust): `reproduce` lists every `_target_` of a recorded config
and builds only trusted ones unless given --trust; every run checks a target's kind before it
calls it. A tampered artifact runs nothing and writes nothing. The scripts' main() runs in
this process (conftest.InProcess)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from hydra.utils import get_object

from conftest import InProcess, Store, process_state_kept
from reprotrain.reproduce import main as reproduce_main
from reprotrain.trust import BUILT_FUNCTIONS, BUILT_KINDS, Judge, recorded_targets

# The tests share one recorded run: one worker runs them all, one after another.
pytestmark = pytest.mark.xdist_group("recorded-run")


@dataclass
class Recorded:
    """One smoke run in its own store, and the config.yaml it recorded."""

    folder: Path
    store: Store
    run_id: str
    config: dict[str, Any]

    def tamper(self, edit: Callable[[dict[str, Any]], None], name: str) -> None:
        """What someone with write access to the run's artifacts does: edit config.yaml and
        upload it over the recorded one (MLflow's public client)."""
        config = yaml.safe_load(yaml.safe_dump(self.config))  # from the original every time
        edit(config)
        path = self.folder / name / "config.yaml"
        path.parent.mkdir()
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.store.client.log_artifact(self.run_id, str(path))

    def upload(self, path: Path) -> Path:
        """Put a file among the run's artifacts; its path on this machine."""
        self.store.client.log_artifact(self.run_id, str(path))
        return Path(self.store.client.get_run(self.run_id).info.artifact_uri) / path.name

    def run_count(self) -> int:
        return len(self.store.runs())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    folder = tmp_path_factory.mktemp("recorded")
    store = Store(folder)
    with pytest.MonkeyPatch.context() as monkeypatch, process_state_kept(folder):
        InProcess(folder, monkeypatch).train(folder, store, "experiment=smoke", "device=cpu")
    run_id = store.only_run().info.run_id
    path = store.client.download_artifacts(run_id, "config.yaml", str(folder))
    return Recorded(folder, store, run_id, yaml.safe_load(Path(path).read_text()))


def reproduce_here(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch, capfd, *flags: str
) -> tuple[int, str, str]:
    """`python -m reprotrain.reproduce <run id>` (its main) in this process, in the store's
    folder: (exit code, stdout, stderr)."""
    monkeypatch.chdir(recorded.folder)
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the project folder first
    capfd.readouterr()
    try:
        reproduce_main([recorded.run_id, "--tracking-uri", recorded.store.uri, *flags])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_line(code: int, stderr: str, expected: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert code == 2 and len(errors) == 1, stderr[-3000:]
    assert expected in errors[0] and "Traceback" not in stderr, errors[0]
    return errors[0]


class Payload:
    """Unpickling it writes `marker` (what any code a pickle carries could do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_reproduce_of_a_pickle_payload_runs_nothing(
    recorded: Recorded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    marker = tmp_path / "payload-ran"
    source = tmp_path / "weights.pkl"
    source.write_bytes(pickle.dumps(Payload(marker)))
    payload = recorded.upload(source)
    model = {"_target_": "numpy.load", "file": str(payload), "allow_pickle": True}
    recorded.tamper(lambda config: config.update(model=model), "pickle")
    runs = recorded.run_count()
    code, stdout, stderr = reproduce_here(recorded, monkeypatch, capfd)
    error = assert_one_line(
        code,
        stderr,
        "the recorded config names model._target_='numpy.load', which is not reprotrain's, "
        "torch's or this project's code (1 untrusted _target_ of ",
    )
    assert "pass --trust" in error
    assert "  model._target_: numpy.load (NOT TRUSTED" in stdout  # every target listed
    assert "  optimizer._target_: torch.optim.AdamW (named in conf/)" in stdout
    assert not marker.exists() and recorded.run_count() == runs
    np.load(payload, allow_pickle=True)  # the payload is live: loaded, it runs
    assert marker.read_text() == "ran"


def nested_open(config: dict[str, Any], marker: Path) -> None:
    config["model"]["hidden_size"] = {"_target_": "builtins.open", "file": str(marker), "mode": "w"}


def without_train(config: dict[str, Any], marker: Path) -> None:
    del config["train"]


TAMPERED = {
    "a builtin that writes a file": (
        lambda config, marker: config.update(
            data={"_target_": "builtins.open", "file": str(marker), "mode": "w"}
        ),
        "data._target_='builtins.open', which is not reprotrain's, torch's or this project's",
    ),
    # torch is not trusted whole: torch.save writes, torch.load unpickles, torch.hub.load runs
    "a torch function that writes a file": (
        lambda config, marker: config.update(
            loss={"_target_": "torch.save", "obj": 1, "f": str(marker)}
        ),
        "loss._target_='torch.save', which is a torch callable that is not a module, optimizer",
    ),
    "a target nested in a section": (
        nested_open,
        "model.hidden_size._target_='builtins.open', which is under a key that builds nothing",
    ),
    "a recorded config missing a section": (
        without_train,
        "config.yaml artifact has no 'train' section (got None)",
    ),
}


@pytest.mark.parametrize("case", TAMPERED.values(), ids=TAMPERED.keys())
def test_a_tampered_recorded_config_is_one_line_and_writes_nothing(
    recorded: Recorded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, case
) -> None:
    edit, expected = case
    marker = tmp_path / "written"
    recorded.tamper(lambda config: edit(config, marker), tmp_path.name)
    runs = recorded.run_count()
    code, _, stderr = reproduce_here(recorded, monkeypatch, capfd)
    assert_one_line(code, stderr, expected)
    assert not marker.exists() and recorded.run_count() == runs


def test_reproduce_with_trust_builds_a_target_from_elsewhere(
    recorded: Recorded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, here: InProcess
) -> None:
    elsewhere = tmp_path / "elsewhere"  # on the import path, but no project's code
    elsewhere.mkdir()
    (elsewhere / "vouched.py").write_text("from torch.nn import CrossEntropyLoss as Loss\n")
    loss = {"_target_": "vouched.Loss", "label_smoothing": 0.0}
    recorded.tamper(lambda config: config.update(loss=loss), "vouched")
    monkeypatch.syspath_prepend(str(elsewhere))
    code, _, stderr = reproduce_here(recorded, monkeypatch, capfd)
    assert_one_line(code, stderr, "loss._target_='vouched.Loss', which is not reprotrain's")
    result = here.module(
        "reproduce", recorded.run_id, "--tracking-uri", recorded.store.uri, "--trust",
        cwd=recorded.folder,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  loss._target_: vouched.Loss (NOT TRUSTED" in result.stdout
    assert (  # --trust says what it builds that is not trusted
        "reproduce: --trust: building 1 untrusted _target_ as the recorded config names: "
        "loss._target_=vouched.Loss" in result.stdout
    )
    assert "losses match bit for bit (20 steps)" in result.stdout


def test_what_is_trusted_in_a_config_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The project's own packages, what its conf/ names and the modules its pyproject.toml
    lists; of torch and reprotrain, what reprotrain builds. Judged on real files."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "config.yaml").write_text("defaults:\n  - model: theirs\n")
    (tmp_path / "conf" / "model" / "theirs.yaml").write_text("_target_: somelib.Net\n")
    (tmp_path / "pyproject.toml").write_text('[tool.reprotrain]\ntrusted = ["vouched"]\n')
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "models.py").write_text(
        "import sys\n\nimport numpy as np\nimport torch\nfrom torch import save\n\n\n"
        "class Net(torch.nn.Module):\n    pass\n\n\nload = np.load\n"
    )
    (tmp_path / "vouched.py").write_text("def anything():\n    return None\n")
    artifacts = tmp_path / "mlruns" / "abc" / "artifacts"  # the default store's artifacts
    artifacts.mkdir(parents=True)
    (artifacts / "evil.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {
        "my_project.models.Net": "this project's code",
        "somelib.Net": "named in conf/",
        "vouched.anything": "a listed module",
        "torch.optim.Adagrad": "a torch class",  # one no conf/ names
        "torch.nn.functional.cross_entropy": "a torch function",
        "reprotrain.data.builtin.split": "a reprotrain function",  # one no conf/ names
        "mlruns.abc.artifacts.evil.run": None,  # a folder in the project is not its code
        "numpy.load": None,
        "torch.hub.load": None,  # runs a folder's hubconf.py
        "torch.serialization.pickle.loads": None,  # pickle's, reached through torch
        "torch.utils.data.datapipes.iter.RoutedDecoder": None,  # unpickles *.pickle files
        "torch.nn.modules.batchnorm._BatchNorm": None,  # a module, but a private name
        "reprotrain.outputs.write_text": None,
        # Judged by what the name resolves to, never by its prefix:
        "torch.nn.functional.np.bytes_.tofile": None,  # NumPy, imported by torch
        "my_project.models.torch.save": None,  # torch's save, imported by the project
        "my_project.models.save": None,  # the same, bound to a name of the project's module
        "my_project.models.load": None,  # numpy.load under a project name
        "my_project.models.sys.path.insert": None,
        "torch.UntypedStorage.from_file": None,  # a method of a torch class
        "torch.nn.Linear.register_forward_hook": None,
        "numpy.ndarray.tofile": None,  # a C method: it names no module
    }
    judged = {path: recorded_targets({"model": {"_target_": path}})[0] for path in expected}
    for path, why in expected.items():
        assert judged[path].trusted == (why is not None), judged[path]
        assert why is None or judged[path].why == why, judged[path]
    assert "mlruns" not in sys.modules
    assert "reached through torch.nn.functional, where module numpy" in (
        judged["torch.nn.functional.np.bytes_.tofile"].why
    )

    # Only a builder's key may hold a _target_: not a task's argument, nor _args_.
    nested = {
        "task": {
            "_target_": "reprotrain.tasks.Classification",
            "target_key": {"_target_": "torch.nn.Linear"},
            "_args_": [{"_target_": "torch.nn.Linear"}],
        },
        "metrics": {"accuracy": {"_target_": "torch.nn.Linear"}},
    }
    verdicts = {t.key: t.trusted for t in recorded_targets(nested)}
    assert verdicts == {
        "task._target_": True,
        "task.target_key._target_": False,
        "task._args_.0._target_": False,
        "metrics.accuracy._target_": True,
    }


TRUSTED_ROOTS = ("torch", "torch.nn", "torch.nn.functional", "torch.optim", "reprotrain")


def attribute_paths(root: str) -> list[str]:
    """Every public attribute path from `root`: three names deep through modules, two
    through classes."""
    found: list[str] = []

    def walk(prefix: str, obj: object, depth: int) -> None:
        for name in dir(obj):
            if name.startswith("__"):
                continue
            try:
                value = getattr(obj, name)
            except Exception:
                continue
            path = f"{prefix}.{name}"
            found.append(path)
            if (
                depth < 3
                and isinstance(value, types.ModuleType)
                or depth < 2
                and inspect.isclass(value)
            ):
                walk(path, value, depth + 1)

    walk(root, importlib.import_module(root), 1)
    return found


@pytest.mark.filterwarnings("ignore")  # deprecated torch names warn when read
def test_no_attribute_path_from_trusted_code_reaches_anything_else() -> None:
    """Walk every attribute path from torch and reprotrain (some 200,000): each one the trust
    check accepts must resolve, step by step as Hydra resolves it, through torch's and
    reprotrain's own modules only, to a class of a kind reprotrain builds or a function of
    BUILT_FUNCTIONS defined there."""
    judge = Judge(set(), (), [])
    paths = [path for root in TRUSTED_ROOTS for path in attribute_paths(root)]
    accepted = [path for path in paths if judge(path)[0]]
    assert len(paths) > 100_000 and len(accepted) > 100  # the walk reached them
    for path in accepted:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            step = get_object(prefix)
            if isinstance(step, types.ModuleType):
                assert step.__name__ == prefix, path  # a module reached as itself
        target = get_object(path)
        module = target.__module__
        assert module.split(".")[0] in ("torch", "reprotrain"), path
        assert (inspect.isclass(target) and issubclass(target, BUILT_KINDS)) or (
            inspect.isroutine(target) and module.startswith(BUILT_FUNCTIONS)
        ), path


def test_a_model_function_from_untrusted_code_is_refused_before_it_runs(
    tmp_path: Path, store: Store, app_in_process
) -> None:
    """In any run: a function's result is known only after it ran (here a file opened for
    writing), so the model's must come from trusted code; nothing is written."""
    result = app_in_process(
        "runtime=local",
        f"tracking.uri={store.uri}",
        "experiment=smoke",
        "model._target_=builtins.open",
        "~model.hidden_size",
        "~model.depth",
        "~model.dropout",
        "+model.file=written.txt",
        "+model.mode=w",
    )
    error = assert_one_line(
        result.returncode,
        result.stderr,
        "model._target_='builtins.open' is a function of io, which cannot be checked to build "
        "a torch.nn.Module before it runs",
    )
    assert "[tool.reprotrain] trusted" in error
    assert not (tmp_path / "written.txt").exists()
    assert not store.path.exists() or store.runs() == []


def test_evaluate_refuses_a_model_file_whose_configs_name_untrusted_code(
    tmp_path: Path, here: InProcess
) -> None:
    """model.pt carries the configs that rebuild its model (it may come from a DVC remote):
    evaluate builds them only where trusted, so a file-writing target there writes nothing."""
    marker = tmp_path / "written-by-the-model-file"
    saved = {
        "format": 3,
        "state_dict": {},
        "model": {"_target_": "numpy.savetxt", "fname": str(marker), "X": [1.0]},
        "loss": {"_target_": "torch.nn.CrossEntropyLoss"},
    }
    torch.save(saved, tmp_path / "model.pt")
    result = here.module("evaluate", "--model", str(tmp_path / "model.pt"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model._target_='numpy.savetxt'" in result.stderr and "Traceback" not in result.stderr
    assert "--trust" not in result.stderr  # evaluate has no such option: the fix is pyproject's
    assert not marker.exists()
