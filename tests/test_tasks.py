"""Real code written elsewhere, unchanged, trained through reprotrain's tasks: a regression MLP
on scikit-learn's diabetes data, PyTorch's word-language-model LSTM (forward takes and returns
a hidden state, sequence first, log-probabilities) and Transformer, and a Hugging Face BERT
classifier built from its config (dict batches of varying length, padded by a collate
function; the model computes its own loss). Each trains with validation during training, is
stopped by SIGTERM (from a user's callback) and resumed, reproduces bit for bit, runs under a
2-process torchrun and through `dvc exp run`, and its MLflow Model loads and predicts.
Everything real: torch, transformers, torchmetrics, a sqlite MLflow store, torchrun, dvc (e2e).
Where a process of its own is not the point (the stop, resume, reproduction and loading of a
workload that needs no transformers), the scripts' main() runs in this process
(conftest.InProcess); transformers stays out of it (conftest.hf_env)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import (
    BIN,
    PYTHON,
    ROOT,
    InProcess,
    Store,
    child_env,
    forget_user_packages,
    hf_env,
    make_project,
    mlflow_tracking_uri,
    sh,
    train,
)

pytestmark = pytest.mark.e2e  # the four external workloads

WORKLOADS = ROOT / "tests" / "workloads"
STEPS, VAL_EVERY, STOP_AT = 60, 20, 30


@dataclass(frozen=True)
class Workload:
    experiment: str
    metrics: tuple[str, ...]  # val/* each validation records
    predict: str  # Python run in the project with `model` loaded through MLflow: prints "ok"
    hf: bool = False  # imports transformers (kept apart from the venv: conftest.hf_env)

    def env(self, **extra: str) -> dict[str, str]:
        return hf_env(**extra) if self.hf else child_env(**extra)


# Each snippet rebuilds the validation data the run used and checks what the model returns.
REGRESSION = Workload(
    "wl_regression",
    ("val/loss", "val/mae", "val/r2"),
    """
    from workloads.regression import diabetes
    x, y = diabetes().val.tensors
    out = model(x)
    assert out.shape == (len(y), 1), out.shape
    mse = float(((out.squeeze(1) - y) ** 2).mean())
    assert abs(mse - recorded["val/loss"]) < 1e-4, (mse, recorded)
    """,
)
RNN_LM = Workload(
    "wl_rnn_lm",
    ("val/loss", "val/ppl", "val/accuracy"),
    """
    from workloads.corpus import corpus
    val = corpus(num_tokens=12000, seq_len=16, batch_size=8, vocab=50).val
    x = torch.stack([val[i][0] for i in range(8)]).T  # [seq, batch], as the example feeds it
    out, hidden = model(x, model.init_hidden(8))  # the example's decoder output, flattened
    assert out.shape == (16 * 8, 50) and torch.isfinite(out).all(), out.shape
    """,
)
TRANSFORMER_LM = Workload(
    "wl_transformer_lm",
    ("val/loss", "val/ppl", "val/accuracy"),
    """
    from workloads.corpus import corpus
    val = corpus(num_tokens=12000, seq_len=16, batch_size=8, vocab=50).val
    x = torch.stack([val[i][0] for i in range(8)]).T
    out = model(x)
    assert out.shape == (16, 8, 50) and torch.isfinite(out).all(), out.shape
    """,
)
BERT = Workload(
    "wl_bert",
    ("val/loss", "val/accuracy"),
    """
    from workloads.hf import pad, sentences
    val = sentences(num_samples=256, vocab=64).val
    batch = pad([val[i] for i in range(8)])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert out.logits.shape == (8, 2), out.logits.shape
    """,
    hf=True,
)
ALL = {w.experiment: w for w in (REGRESSION, RNN_LM, TRANSFORMER_LM, BERT)}


def user_project(folder: Path) -> Path:
    """The workloads as a user's project folder: their package and their conf/ additions."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(WORKLOADS, folder / "workloads", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def settings(project: Path, workload: Workload) -> list[str]:
    return [
        f"hydra.searchpath=[file://{project / 'workloads' / 'conf'}]",
        f"experiment={workload.experiment}",
        f"train.steps={STEPS}",
        f"train.val_every={VAL_EVERY}",
    ]


@pytest.mark.parametrize("name", list(ALL))
def test_workload_validates_resumes_reproduces_and_its_model_loads(
    tmp_path: Path, name: str, here: InProcess
) -> None:
    workload = ALL[name]
    project = user_project(tmp_path / "project")
    store = Store(project)
    run_settings = [
        *settings(project, workload),
        "tracking.log_model=true",
        "+callbacks.sigterm._target_=workloads.callbacks.SigtermOnce",
        f"+callbacks.sigterm.step={STOP_AT}",
        f"+callbacks.sigterm.marker={tmp_path / 'stopped'}",
    ]

    def trained(*overrides: str, check: bool = True):
        if workload.hf:  # transformers only in a process of its own
            return train(project, store, *overrides, check=check, env=workload.env())
        return here.train(project, store, *overrides, check=check)

    stopped = trained(*run_settings, check=False)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert store.only_run().info.status == "KILLED"
    trained(*run_settings, "train.resume=last")

    run = store.only_run()
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert [step for step, _ in store.losses(run_id)] == list(range(1, STEPS + 1))
    for key in workload.metrics:  # every validation's figures, at its step, once
        history = store.client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == [20, 40, 60], (key, history)
    assert store.client.get_metric_history(run_id, "callback/sigterm_at")[0].value == STOP_AT
    recorded = {key: run.data.metrics[key] for key in workload.metrics}
    assert recorded["val/loss"] < store.losses(run_id)[0][1]  # it learned

    # The store: $MLFLOW_TRACKING_URI in a new process, MLflow's own setting in this one.
    check = "import mlflow, mlflow.pytorch, torch\n" + textwrap.dedent(
        f"""
        recorded = {recorded!r}
        model = mlflow.pytorch.load_model("runs:/{run_id}/model")
        with torch.no_grad():
        """
    )
    check += textwrap.indent(textwrap.dedent(workload.predict), "    ") + "print('ok')\n"
    if workload.hf:  # reproduce's main(), then the check, in one process of their own
        reproduce = f"from reprotrain import reproduce\nreproduce.main([{run_id!r}])\n"
        done = subprocess.run(
            [PYTHON, "-c", reproduce + check],
            cwd=project,
            env=workload.env(MLFLOW_TRACKING_URI=store.uri),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"losses match bit for bit ({STEPS} steps)" in done.stdout
        assert done.stdout.strip().endswith("ok")
        return
    here.monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    reproduced = here.module("reproduce", run_id, cwd=project)
    assert reproduced.returncode == 0, reproduced.stdout[-2000:] + reproduced.stderr[-3000:]
    assert f"losses match bit for bit ({STEPS} steps)" in reproduced.stdout
    # the workload's package imported afresh from the project, as a new process would
    forget_user_packages(project / "workloads")
    with mlflow_tracking_uri(store.uri):
        loaded = here.call(lambda: exec(check, {}), cwd=project)
    assert loaded.returncode == 0 and loaded.stdout.strip().endswith("ok"), loaded.stderr


@pytest.mark.parametrize("name", list(ALL))
def test_workload_under_torchrun(tmp_path: Path, name: str) -> None:
    workload = ALL[name]
    project = user_project(tmp_path)
    store = Store(project)
    streams = ["data.batch_size=16"] if "lm" in name else []  # each rank continues its rows
    result = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "reprotrain.train",
            *settings(project, workload),
            *streams,
            "train.steps=20",
            "train.val_every=10",
            "runtime=local",
            "train.progress=off",
            "train.threads=1",
            "tracking.log_model=false",
            f"tracking.uri={store.uri}",
            f"train.output_dir={project / 'results'}",
        ],
        cwd=project,
        env=workload.env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = store.only_run()
    assert run.info.status == "FINISHED" and run.data.tags["dist.world_size"] == "2"
    for key in workload.metrics:
        steps = [m.step for m in store.client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [10, 20], (key, steps)
    written = json.loads((project / "results" / "metrics.json").read_text())
    assert all(written[f"val_{k.removeprefix('val/')}"] is not None for k in workload.metrics)


def test_workload_through_dvc_exp_run(tmp_path: Path) -> None:
    """The pipeline with the workloads' package and configs in the project, one `dvc exp run`
    a workload: prepare keeps token ids integers (and pads dict items with the collate
    function), evaluate writes the task's figures with no NaN, and the confusion matrix only
    for a classifier (the classifier last: no stage removes the file)."""
    repo = make_project(tmp_path / "repo", "local")
    shutil.copytree(
        WORKLOADS, repo / "workloads", ignore=shutil.ignore_patterns("__pycache__", "conf")
    )
    for group in ("model", "data", "experiment"):
        for config in (WORKLOADS / "conf" / group).glob("*.yaml"):
            shutil.copy2(config, repo / "conf" / group / config.name)
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "the workloads")
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    assert list(ALL)[-1] == "wl_bert"
    seen: set[str] = set()
    for name, workload in ALL.items():
        sh(
            repo,
            "dvc",
            "exp",
            "run",
            "-S",
            "code=workloads",  # the stages depend on the user's code (and run only it)
            "-S",
            f"experiment={workload.experiment}",
            "-S",
            "train.steps=20",
            "-S",
            "train.val_every=10",
            "-S",
            "tracking.log_model=false",
            "-S",
            "train.threads=1",
            env=workload.env(PATH=path, DVC_NO_ANALYTICS="1"),
        )
        params = yaml.safe_load((repo / "params.yaml").read_text())
        assert params["task"]["_target_"].startswith("reprotrain.tasks."), name
        trained = json.loads((repo / "results" / "metrics.json").read_text())
        evaluated = json.loads((repo / "results" / "eval.json").read_text())
        assert trained["run_id"] not in seen, name  # this workload's own run
        seen.add(trained["run_id"])
        for key in workload.metrics:
            name_ = key.removeprefix("val/")
            assert trained[f"val_{name_}"] is not None, (name, key)
            assert evaluated[f"eval_{name_}"] == pytest.approx(trained[f"val_{name_}"], rel=1e-4), (
                name,
                key,
            )
        assert "NaN" not in (repo / "results" / "eval.json").read_text(), name
        assert (repo / "results" / "confusion.csv").exists() == (name == "wl_bert"), name
