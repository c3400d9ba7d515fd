"""A config is code (reprotrain.trust): `reproduce` lists every `_target_` of a recorded config
and builds only trusted ones unless given --trust; every run checks a target's kind before it
calls it. A tampered artifact runs nothing and writes nothing. The scripts' main() runs in
this process (conftest.InProcess)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from conftest import InProcess, Store, process_state_kept
from reprotrain.reproduce import main as reproduce_main
from reprotrain.trust import recorded_targets

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
        "model.hidden_size._target_='builtins.open', which is not reprotrain's",
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
    }
    tree = {"section": [{"_target_": path} for path in expected]}
    judged = {target.path: target for target in recorded_targets(tree)}
    for path, why in expected.items():
        assert judged[path].trusted == (why is not None), judged[path]
        assert why is None or judged[path].why == why, judged[path]
    assert "mlruns" not in sys.modules


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
    assert not marker.exists()
