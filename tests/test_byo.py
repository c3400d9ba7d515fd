"""Bring your own model, data, loss, optimizer and scheduler: every piece is a `_target_`
config built with Hydra's instantiate (real torch, real sqlite MLflow stores). The scripts'
main() runs in this process (conftest.InProcess); the README's worked example runs its
commands as written, in a project of its own (e2e)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, InProcess, Store, make_project, run_app
from reprotrain.tracking import prepare_store
from userproject import user_project

WORKLOADS = ROOT / "tests" / "workloads"


def sigterm_at(folder: Path, step: int) -> list[str]:
    """A user's callback (tests/workloads/callbacks.py, copied into `folder`) that sends this
    process SIGTERM after `step`, once: a stop at a known step, as `kill` would make it."""
    if not (folder / "workloads").exists():
        shutil.copytree(
            WORKLOADS, folder / "workloads", ignore=shutil.ignore_patterns("__pycache__")
        )
    return [
        "+callbacks.sigterm._target_=workloads.callbacks.SigtermOnce",
        f"+callbacks.sigterm.step={step}",
        f"+callbacks.sigterm.marker={folder / 'stopped'}",
    ]


def losses_of(store: Store, run_id: str) -> list[float]:
    return [value for _, value in store.losses(run_id)]


def test_cnn_on_digit_images_trains(tmp_path: Path, store: Store, train_here) -> None:
    train_here(tmp_path, store, "model=cnn", "data=digits_images", "train.steps=120", "device=cpu")
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "smallcnn-adamw-cpu"
    tags = run.data.tags
    assert tags["model.class"] == "reprotrain.models.cnn.SmallCNN"
    assert tags["optimizer.class"] == "torch.optim.adamw.AdamW"
    assert tags["loss.class"] == "torch.nn.modules.loss.CrossEntropyLoss"
    assert int(tags["model.parameters"]) > 10_000
    assert run.data.params["model._target_"] == "reprotrain.models.SmallCNN"
    losses = losses_of(store, run.info.run_id)
    assert len(losses) == 120
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert run.data.metrics["val/accuracy"] > 0.8
    saved = __import__("torch").load(tmp_path / "results" / "model.pt", weights_only=True)
    assert saved["model"]["input_shape"] == [1, 8, 8] and saved["model"]["num_classes"] == 10


def test_user_model_and_data_from_the_project_folder_load_back_through_mlflow(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    """A model and a Dataset in the user's own package, configs on hydra.searchpath; then the
    logged MLflow Model, loaded again (the package imported afresh), predicts the accuracy the
    run recorded. (From a fresh process outside the project: test_tracking.)"""
    import mlflow.pytorch
    import torch

    from conftest import forget_user_packages, mlflow_tracking_uri

    project = user_project(tmp_path)
    here.train(
        project,
        store,
        f"hydra.searchpath=[file://{project / 'my_conf'}]",
        "model=tiny",
        "data=blobs",
        "train.steps=60",
        "train.batch_size=32",
        "device=cpu",
        "tracking.log_model=true",
    )
    run = store.only_run()
    assert run.data.tags["model.class"] == "my_project.models.TinyConvNet"
    assert run.info.run_name == "tinyconvnet-adamw-cpu"
    recorded = run.data.metrics["val/accuracy"]
    assert recorded > 0.9
    forget_user_packages(project / "my_project")  # what the run imported: loaded afresh below
    from my_project.data import blobs

    with mlflow_tracking_uri(store.uri):
        model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    val = blobs()["val"]
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(recorded, abs=1e-6)


def test_user_code_logs_to_the_runs_own_mlflow_run(
    tmp_path: Path, store: Store, train_here
) -> None:
    """The MLflow run is the training process's active run: a user's model calling plain
    mlflow.log_metric / log_text in forward() records into the same run, beside reprotrain's."""
    project = user_project(tmp_path)
    train_here(
        project,
        store,
        f"hydra.searchpath=[file://{project / 'my_conf'}]",
        "model=logging",
        "data=blobs",
        "train.steps=30",
    )
    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    calls = store.client.get_metric_history(run_id, "user/forward_calls")
    assert [(m.step, m.value) for m in calls] == [(10, 10.0), (20, 20.0), (30, 30.0)]
    assert len(store.losses(run_id)) == 30  # reprotrain's own points, in the same run
    saved = store.client.download_artifacts(run_id, "user/run_id.txt", str(tmp_path))
    assert Path(saved).read_text() == run_id


def test_a_model_mlflow_cannot_log_is_a_warning_and_a_tag_not_a_lost_run(
    tmp_path: Path, store: Store, train_here
) -> None:
    project = user_project(tmp_path)
    result = train_here(
        project,
        store,
        f"hydra.searchpath=[file://{project / 'my_conf'}]",
        "model=uncopyable",
        "data=blobs",
        "train.steps=10",
        "tracking.log_model=true",
    )
    run = store.only_run()
    assert run.info.status == "FINISHED" and len(store.losses(run.info.run_id)) == 10
    reason = "TypeError: UncopyableNet holds a handle that cannot be copied"
    assert run.data.tags["reprotrain.model_error"] == reason
    assert f"the MLflow Model of run {run.info.run_id} was not logged: {reason}" in result.stderr
    assert (tmp_path / "results" / "model.pt").is_file() and "Traceback" not in result.stderr


def test_config_dir_of_the_user(tmp_path: Path, store: Store, train_here) -> None:
    """--config-dir: the user's folder is searched first; reprotrain's conf/ supplies the rest."""
    project = user_project(tmp_path)
    train_here(
        project,
        store,
        "--config-dir",
        str(project / "my_conf"),
        "model=tiny",
        "data=blobs",
        "train.steps=20",
        "device=cpu",
    )
    assert store.only_run().data.tags["model.class"] == "my_project.models.TinyConvNet"


def test_optimizer_and_scheduler_from_yaml_log_the_learning_rate(
    tmp_path: Path, store: Store, train_here
) -> None:
    train_here(
        tmp_path,
        store,
        "experiment=smoke",
        "optimizer=rmsprop",
        "scheduler=cosine",
        "train.steps=40",
        "device=cpu",
    )
    run = store.only_run()
    assert run.data.tags["optimizer.class"] == "torch.optim.rmsprop.RMSprop"
    assert run.data.tags["scheduler.class"] == "torch.optim.lr_scheduler.CosineAnnealingLR"
    lrs = sorted(
        (m.step, m.value) for m in store.client.get_metric_history(run.info.run_id, "train/lr")
    )
    assert [step for step, _ in lrs] == list(range(5, 41, 5))
    values = [value for _, value in lrs]
    assert values == sorted(values, reverse=True) and values[-1] < 1e-6  # cosine to eta_min


def test_streamed_batches_equal_resident_batches(tmp_path: Path, train_here) -> None:
    """DataLoader (with worker processes) or the whole split on the device: same batches,
    same losses, bit for bit on a CPU."""
    results = {}
    for name, overrides in {
        "resident": ["train.resident_data=true"],
        "streamed": ["train.resident_data=false"],
        "workers": ["train.num_workers=2", "train.persistent_workers=true"],
    }.items():
        store = Store(tmp_path / name)
        store.path.parent.mkdir()
        train_here(
            tmp_path / name,
            store,
            "model=cnn",
            "data=digits_images",
            "train.steps=60",
            "device=cpu",
            *overrides,
        )
        results[name] = losses_of(store, store.only_run().info.run_id)
    assert results["resident"] == results["streamed"] == results["workers"]


def test_cnn_with_scheduler_resumes_bit_for_bit_and_reproduces(
    tmp_path: Path, here: InProcess
) -> None:
    settings = ["model=cnn", "data=digits_images", "scheduler=cosine", "train.steps=60"]
    settings += ["device=cpu", "train.checkpoint_every=20", "tracking.flush_every_s=0.1"]
    whole = Store(tmp_path / "whole")
    whole.path.parent.mkdir()
    here.train(tmp_path / "whole", whole, *settings)
    expected = losses_of(whole, whole.only_run().info.run_id)

    folder = tmp_path / "stopped"
    store = Store(folder)
    folder.mkdir()
    stop = sigterm_at(folder, 27)  # between two checkpoints
    assert here.train(folder, store, *settings, *stop, check=False).returncode == 143
    assert store.only_run().info.status == "KILLED"
    here.train(folder, store, *settings, *stop, "train.resume=last")
    run = store.only_run()
    assert run.info.status == "FINISHED"
    assert losses_of(store, run.info.run_id) == expected

    here.monkeypatch.setenv("MLFLOW_TRACKING_URI", whole.uri)
    reproduced = here.module("reproduce", whole.only_run().info.run_id, cwd=tmp_path / "whole")
    assert reproduced.returncode == 0, reproduced.stderr[-3000:]
    assert "losses match bit for bit (60 steps)" in reproduced.stdout


def test_model_is_registered_under_a_name(tmp_path: Path, store: Store, train_here) -> None:
    train_here(
        tmp_path,
        store,
        "experiment=smoke",
        "device=cpu",
        "tracking.log_model=true",
        "tracking.register_as=digits-mlp",
    )
    versions = store.client.search_model_versions("name='digits-mlp'")
    assert [int(v.version) for v in versions] == [1]
    assert versions[0].run_id == store.only_run().info.run_id


def test_evaluate_rebuilds_any_model_from_model_pt(
    tmp_path: Path, store: Store, here: InProcess
) -> None:
    from reprotrain.data import digits, write_npz

    prepared = tmp_path / "dataset.npz"
    write_npz(digits(images=True), prepared)
    here.train(
        tmp_path,
        store,
        "model=cnn",
        "data=digits_images",
        f"data.file={prepared}",
        "train.steps=60",
    )
    result = here.module(
        "evaluate",
        "--model",
        str(tmp_path / "results" / "model.pt"),
        "--data",
        str(prepared),
        "--out-dir",
        str(tmp_path / "eval"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    recorded = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert evaluated["eval_accuracy"] == pytest.approx(recorded["val_accuracy"], abs=1e-9)
    assert store.only_run().data.metrics["val/eval_accuracy"] == pytest.approx(
        recorded["val_accuracy"]
    )
    run_id = store.only_run().info.run_id
    assert f"added to run {run_id} as val/eval_*" in result.stdout

    # Another run's model evaluated here: its figures go to its own run, never to the run
    # results/metrics.json names (a pipeline's).
    other = tmp_path / "other"
    other.mkdir()
    here.train(other, store, "model=cnn", "data=digits_images", f"data.file={prepared}",
               "train.steps=20")  # fmt: skip
    (other_run,) = [r for r in store.runs() if r.info.run_id != run_id]
    again = here.module(
        "evaluate",
        "--model",
        str(other / "results" / "model.pt"),
        "--data",
        str(prepared),
        "--out-dir",
        str(tmp_path / "eval-other"),
        cwd=tmp_path,  # where results/metrics.json names the first run
    )
    assert again.returncode == 0, again.stderr[-3000:]
    history = store.client.get_metric_history
    assert len(history(run_id, "val/eval_loss")) == 1  # the first evaluate's only
    assert len(history(other_run.info.run_id, "val/eval_loss")) == 1

    # Data of another shape: one line naming both.
    from reprotrain.data import synthetic

    write_npz(synthetic(num_samples=64), tmp_path / "flat.npz")
    misfit = here.module(
        "evaluate", "--model", str(tmp_path / "results" / "model.pt"),
        "--data", str(tmp_path / "flat.npz"), "--out-dir", str(tmp_path / "eval-flat"),
    )  # fmt: skip
    assert misfit.returncode == 2 and "Traceback" not in misfit.stderr, misfit.stderr[-2000:]
    assert len(misfit.stderr.strip().splitlines()) == 1
    assert "it was trained on batches of (2x1x8x8, 2), these are (2x" in misfit.stderr


BAD = {
    # overrides: a substring the one-line message must contain
    "target that does not import": (
        ["model._target_=my_project.nosuch.Net"],
        "model._target_='my_project.nosuch.Net' cannot be imported",
    ),
    "model target that is not a module": (
        ["model._target_=torch.optim.SGD"],
        "is a torch.optim.sgd.SGD, not a torch.nn.modules.module.Module",
    ),
    "optimizer target that is not an optimizer": (
        ["optimizer._target_=torch.nn.Linear"],
        "not a torch.optim.optimizer.Optimizer",
    ),
    "output does not fit the loss": (
        ["+model.num_classes=3"],
        "the model outputs 3 values per sample but the data has 10 classes",
    ),
    "data target returning something else": (
        [
            "data._target_=my_project.data.not_splits",
            "~data.num_samples",
            "~data.num_features",
            "~data.num_classes",
            "~data.noise",
            "~data.val_fraction",
            "~data.seed",
        ],
        "returned a int, not train and validation data",
    ),
    "train and validation shapes differ": (
        [
            "data._target_=my_project.data.mismatched",
            "~data.num_samples",
            "~data.num_features",
            "~data.num_classes",
            "~data.noise",
            "~data.val_fraction",
            "~data.seed",
        ],
        "train samples are 1x6x6 -> a scalar but validation samples 1x5x5",
    ),
    "scheduler with no optimizer to wrap": (
        ["+scheduler._target_=torch.optim.lr_scheduler.StepLR", "+scheduler.step_size=1"],
        "scheduler._partial_=None: reprotrain passes the optimizer",
    ),
    "key the scheduler does not take": (
        ["scheduler=cosine", "+scheduler.foo=bar"],
        "scheduler.foo='bar' is not a parameter of torch.optim.lr_scheduler.CosineAnnealingLR",
    ),
    "unknown top-level key": (["+unknown=1"], "unknown=1 is not a config section or key"),
    "model name that is not a parameter": (
        ["model.name=cnn"],
        "'model.name' is not a config key",
    ),
    "added model key the model does not take": (
        ["+model.name=cnn"],
        "model.name='cnn' is not a parameter of reprotrain.models.MLP",
    ),
    "model size out of range": (["model.hidden_size=0"], "hidden_size=0 must be an integer >= 1"),
    "negative seed": (["train.seed=-5"], "train.seed=-5 is out of range"),
    "seed beyond 32 bits": ([f"train.seed={2**32}"], "train.seed=4294967296 is out of range"),
}


@pytest.mark.parametrize("overrides,expected", BAD.values(), ids=BAD.keys())
def test_bad_pieces_are_one_clear_line(
    tmp_path: Path, store: Store, app_in_process, overrides, expected
) -> None:
    user_project(tmp_path)  # the app runs in tmp_path (conftest.app_in_process)
    result = app_in_process(
        "runtime=local",
        f"tracking.uri={store.uri}",
        f"train.output_dir={tmp_path / 'results'}",
        "experiment=smoke",
        *overrides,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not store.path.exists() or "RUNNING" not in store.statuses()


def test_checkpoint_of_another_model_class_is_refused_on_resume(
    tmp_path: Path, store: Store, train_here
) -> None:
    stop = sigterm_at(tmp_path, 50)
    stopped = train_here(tmp_path, store, "train.steps=3000", "device=cpu", *stop, check=False)
    assert stopped.returncode == 143
    result = train_here(
        tmp_path, store, "model=cnn", "data=digits_images", "train.resume=last", check=False
    )
    assert result.returncode == 2
    assert "model reprotrain.models.mlp.MLP" in result.stderr
    assert "this config reprotrain.models.SmallCNN" in result.stderr
    assert "Traceback" not in result.stderr


def readme_block(language: str, first_line: str) -> str:
    """The README's code block in `language` whose first line is `first_line`."""
    readme = (ROOT / "README.md").read_text()
    for block in re.findall(rf"```{language}\n(.*?)```", readme, flags=re.S):
        if block.splitlines()[0].strip() == first_line:
            return block
    raise AssertionError(f"no ```{language} block starting {first_line!r} in the README")


@pytest.mark.e2e  # the README's commands as written, in a project folder of their own
def test_readme_bring_your_own_model_example(tmp_path: Path) -> None:
    """The README's worked example, as written: its model file and YAML in a project, then its
    commands (the project's default runtime set to local, as on a machine without Docker)."""
    repo = make_project(tmp_path / "project", runtime="local")
    (repo / "my_project").mkdir()
    (repo / "my_project" / "__init__.py").write_text("")
    (repo / "my_project" / "models.py").write_text(readme_block("python", "# my_project/models.py"))
    (repo / "conf" / "model" / "tiny.yaml").write_text(
        readme_block("yaml", "# conf/model/tiny.yaml")
    )
    store = Store(repo)
    prepare_store(store.uri)
    for command in (
        "python -m reprotrain.train model=tiny data=digits_images",
        "python -m reprotrain.train optimizer._target_=torch.optim.NAdam",
        "python -m reprotrain.train loss.label_smoothing=0.1",
    ):
        result = run_app(repo, *shlex.split(command)[3:], timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    runs = {r.data.tags["model.class"]: r for r in store.runs()}
    tiny = runs["my_project.models.TinyConvNet"]
    assert tiny.info.run_name == "tinyconvnet-adamw-cpu" and tiny.info.status == "FINISHED"
    classes = sorted(r.data.tags["optimizer.class"] for r in store.runs())
    assert classes == [
        "torch.optim.adamw.AdamW",
        "torch.optim.adamw.AdamW",
        "torch.optim.nadam.NAdam",
    ]
    smoothed = [r for r in store.runs() if r.data.params.get("loss.label_smoothing") == "0.1"]
    assert len(smoothed) == 1
