"""Workloads written elsewhere, on the Trainer in this process: a Hugging Face causal LM by its
own label convention, PyTorch's LSTM example trained with LBFGS on non-contiguous float64
views, a loss summed over the batch, a dataset that draws from Python's `random`, two inputs
in a dict against binary targets. Each figure is checked against an independent computation."""

from __future__ import annotations

import functools
import math
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torchmetrics
from sklearn.datasets import load_breast_cancer
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import reprotrain
from conftest import library_args
from reprotrain.checkpoint import load_checkpoint, save_checkpoint
from reprotrain.errors import ConfigError

TESTS = Path(__file__).resolve().parent
HF_SITE = TESTS.parent / ".venv" / "hf-site"


@pytest.fixture
def workloads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """tests/workloads importable, as a user's own package is; forgotten after the test, so
    that a later test's project copy of it is the one its runs import."""
    monkeypatch.syspath_prepend(str(TESTS))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "workloads" or name.startswith("workloads."):
            del sys.modules[name]


# -- a Hugging Face causal LM: labels = input_ids, shifted by the model itself ----------------


@pytest.fixture
def transformers_here(monkeypatch: pytest.MonkeyPatch, workloads: None) -> None:
    if not (HF_SITE / "transformers").is_dir():
        pytest.fail(f"transformers is not installed in {HF_SITE}: run scripts/setup.sh")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(HF_SITE))


def independent_lm_figures(model: nn.Module, data: Dataset) -> tuple[float, float]:
    """Token-mean cross-entropy and accuracy of logits[:, :-1] against labels[:, 1:] over the
    whole split, computed here without reprotrain."""
    model.eval()
    ids = torch.stack([data[i]["input_ids"] for i in range(len(data))])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    nexts = ids[:, 1:]
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), nexts.reshape(-1))
    accuracy = (logits.argmax(-1) == nexts).double().mean()
    return float(loss), float(accuracy)


def test_a_hugging_face_causal_lm_is_measured_on_the_tokens_it_predicts(
    transformers_here: None,
) -> None:
    from workloads.causal import causal_corpus, gpt2_lm

    splits = causal_corpus(num_tokens=4_000, seq_len=16, vocab=40)
    torch.manual_seed(0)
    model = gpt2_lm(vocab_size=40, n_positions=16)
    trainer = reprotrain.Trainer(
        model,
        functools.partial(torch.optim.AdamW, lr=3e-3),
        splits.train,
        val_data=splits.val,
        task=reprotrain.LanguageModel(),  # shift=auto
        metrics={
            "ppl": reprotrain_perplexity(),
            "accuracy": torchmetrics.classification.MulticlassAccuracy(
                num_classes=40, average="micro", ignore_index=-100
            ),
        },
        batch_size=16,
        val_batch_size=7,  # uneven batches: the figures are token means all the same
    )
    assert trainer.task.shifts is True  # decided from the model: it shifts its labels itself
    before = trainer.validate()
    trainer.fit(steps=30)
    after = trainer.validate()
    loss, accuracy = independent_lm_figures(trainer.model, splits.val)
    assert after["val/loss"] == pytest.approx(loss, rel=1e-5)
    assert after["val/accuracy"] == pytest.approx(accuracy, rel=1e-5)
    for figures in (before, after):  # perplexity is exp(the model's own token-mean loss)
        assert figures["val/ppl"] == pytest.approx(math.exp(figures["val/loss"]), rel=1e-4)
    assert after["val/accuracy"] > before["val/accuracy"]  # it learns the chain's transitions

    # The same model given reprotrain's next-token labels would learn two tokens ahead.
    nexts = causal_corpus(num_tokens=4_000, seq_len=16, vocab=40, next_tokens=True)
    batch = torch.utils.data.default_collate([nexts.train[i] for i in range(2)])
    with pytest.raises(ConfigError, match="already the next tokens") as refused:
        reprotrain.LanguageModel().bind(model).check_batch(batch)
    assert "task.shift=false" in refused.value.hint
    # An explicit choice is kept; a model that does not shift is not shifted.
    assert reprotrain.LanguageModel(shift=False).bind(model).shifts is False
    assert reprotrain.LanguageModel().bind(nn.Embedding(4, 4)).shifts is False
    with pytest.raises(ConfigError, match="task.shift='sometimes'"):
        reprotrain.LanguageModel(shift="sometimes")


def reprotrain_perplexity() -> torchmetrics.Metric:
    from reprotrain.perplexity import Perplexity

    return Perplexity(ignore_index=-100)


# -- PyTorch's LSTM example with LBFGS, on its own non-contiguous float64 views ----------------


def lbfgs_trainer(workloads_splits, **knobs) -> reprotrain.Trainer:
    from workloads.time_sequence import DoubleSequence

    torch.manual_seed(0)
    return reprotrain.Trainer(
        DoubleSequence(),
        functools.partial(torch.optim.LBFGS, lr=0.8, max_iter=4),
        workloads_splits.train,
        val_data=workloads_splits.val,
        task=reprotrain.Regression(),
        loss_fn=nn.MSELoss(),
        metrics={"mse": torchmetrics.MeanSquaredError()},
        batch_size=13,  # the example's whole training set, one batch
        **knobs,
    )


def test_lbfgs_trains_the_lstm_example_and_resumes_bit_for_bit(workloads: None) -> None:
    from workloads.time_sequence import sine_waves

    splits = sine_waves(L=24)
    assert not splits.train.tensors[0].is_contiguous()  # the example's data[3:, :-1]
    straight = lbfgs_trainer(splits)
    first = straight.validate()["val/loss"]
    fitted = straight.fit(steps=4)
    assert fitted.losses[-1] < fitted.losses[0] / 4  # the closure's loss, before each update
    final = straight.validate()
    assert final["val/loss"] < first / 2
    with torch.no_grad():  # the metric took the views: it agrees with the loss
        prediction = straight.model(splits.val.tensors[0])
    independent = float(nn.functional.mse_loss(prediction, splits.val.tensors[1]))
    assert final["val/mse"] == pytest.approx(independent, rel=1e-6)  # float32 sums
    assert final["val/loss"] == pytest.approx(independent, rel=1e-6)

    # Stopped at step 2 (LBFGS's history and line-search state in the checkpoint), resumed.
    first_half = lbfgs_trainer(splits)
    first_half.fit(steps=2)
    state = first_half.state_dict()
    resumed = lbfgs_trainer(splits)
    resumed.load_state_dict(state)
    again = resumed.fit(steps=4)
    assert again.losses == fitted.losses
    for mine, theirs in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)

    clipped = lbfgs_trainer(splits, clip_grad_norm=1e-3).fit(steps=2)
    assert clipped.losses[0] == fitted.losses[0] and clipped.losses[1] != fitted.losses[1]
    with pytest.raises(ConfigError, match="GradScaler, which cannot step LBFGS"):
        lbfgs_trainer(splits, precision="fp16")


# -- a loss summed over the batch: val/loss on train/loss's scale --------------------------------


def test_a_summed_loss_gives_val_loss_on_the_training_scale() -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(192, 6, generator=generator)
    data = TensorDataset(inputs, inputs[:, :2].sum(dim=1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    trainer = reprotrain.Trainer(
        model,
        functools.partial(torch.optim.SGD, lr=1e-3),
        data,
        val_data=data,  # the training split itself: no overfitting can explain a gap
        task=reprotrain.Regression(),
        loss_fn=nn.MSELoss(reduction="sum"),
        batch_size=32,
        shuffle=False,
    )
    trainer.fit(steps=6)  # one epoch, in order
    value = trainer.validate()["val/loss"]
    with torch.no_grad():  # the mean of the six batches' summed losses, as training sums them
        sums = [
            float(nn.functional.mse_loss(model(x).squeeze(-1), y, reduction="sum"))
            for x, y in zip(inputs.split(32), data.tensors[1].split(32), strict=True)
        ]
    assert value == pytest.approx(sum(sums) / len(sums), rel=1e-5)
    epoch_mean = sum(trainer.losses) / len(trainer.losses)
    assert 0.5 < value / epoch_mean < 2  # the same scale (was 128x with 4096-sample batches)


# -- a dataset that draws from Python's random: resume bit for bit -----------------------------


class RandomPairs(Dataset):
    """Each item a pair of samples drawn with Python's `random` (as contrastive datasets draw),
    labelled whether their classes agree; augmented with NumPy's global generator."""

    def __init__(self, n: int = 96) -> None:
        generator = torch.Generator().manual_seed(1)
        self.points = torch.randn(n, 4, generator=generator)
        self.labels = (self.points[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = random.randrange(len(self.points))
        noise = torch.from_numpy(np.random.normal(0, 0.1, 4).astype(np.float32))
        pair = torch.cat([self.points[i] + noise, self.points[j]])
        return pair, (self.labels[i] == self.labels[j]).long()


def pairs_trainer(**knobs) -> reprotrain.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    return reprotrain.Trainer(
        model,
        functools.partial(torch.optim.AdamW, lr=1e-2),
        RandomPairs(),
        val_data=RandomPairs(32),  # read by a DataLoader: the metric check after step 1 too
        metrics={"accuracy": torchmetrics.classification.MulticlassAccuracy(num_classes=2)},
        batch_size=16,
        **knobs,
    )


def test_data_drawn_from_python_random_resumes_bit_for_bit(tmp_path: Path) -> None:
    random.seed(0), np.random.seed(0)
    straight = pairs_trainer().fit(steps=16)
    random.seed(0), np.random.seed(0)
    half = pairs_trainer()
    half.fit(steps=7)
    path = save_checkpoint(
        tmp_path / "run.pt", half.state_dict(), run_id="run", fingerprint="f", model_class="m"
    )
    state = load_checkpoint(path, "f")  # weights only: the RNG states are plain values
    random.seed(123), np.random.seed(123), torch.manual_seed(123)  # anything may run between
    resumed = pairs_trainer()
    resumed.load_state_dict(state["trainer"])
    assert resumed.fit(steps=16).losses == straight.losses
    # Validations in between read with their own seeds: training's losses do not move.
    random.seed(0), np.random.seed(0)
    assert pairs_trainer(val_every=4).fit(steps=16).losses == straight.losses

    # Streamed (items read at every step, seeded from the step): worker processes draw what
    # this process draws, and a resume continues it bit for bit.
    streamed = pairs_trainer(resident_data=False).fit(steps=16).losses
    assert pairs_trainer(resident_data=False, num_workers=2).fit(steps=16).losses == streamed
    half = pairs_trainer(resident_data=False, num_workers=2)
    half.fit(steps=7)
    state = half.state_dict()  # where it stopped: the process's generators are part of it
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    resumed = pairs_trainer(resident_data=False)
    resumed.load_state_dict(state)
    assert resumed.fit(steps=16).losses == streamed


# -- two inputs in a dict, binary targets: task=binary -----------------------------------------


class TwoInputs(nn.Module):
    """forward(image=..., table=...): two inputs by keyword, one logit per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.table = nn.Linear(20, 8), nn.Linear(10, 8)
        self.head = nn.Linear(16, 1)

    def forward(self, image: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.image(image).relu(), self.table(table).relu()], dim=1)
        return self.head(joined)


class DictAndTarget(Dataset):
    """(inputs: dict, target) items: scikit-learn's breast cancer data, its 30 features split
    into two inputs, standardised; target 0/1 as floats."""

    def __init__(self, rows: np.ndarray, features: np.ndarray, target: np.ndarray) -> None:
        self.features = torch.from_numpy(features[rows].astype(np.float32))
        self.target = torch.from_numpy(target[rows].astype(np.float32))

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        row = self.features[i]
        return {"image": row[:20], "table": row[20:]}, self.target[i]


def test_two_inputs_in_a_dict_train_against_binary_targets() -> None:
    features, target = load_breast_cancer(return_X_y=True)
    features = (features - features.mean(0)) / features.std(0)
    order = np.random.default_rng(0).permutation(len(target))
    train = DictAndTarget(order[120:], features, target)
    val = DictAndTarget(order[:120], features, target)
    torch.manual_seed(0)
    trainer = reprotrain.Trainer(
        TwoInputs(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        train,
        val_data=val,
        task=reprotrain.Binary(),
        loss_fn=nn.BCEWithLogitsLoss(),
        metrics={
            "accuracy": torchmetrics.classification.BinaryAccuracy(),
            "auroc": torchmetrics.classification.BinaryAUROC(),
        },
        batch_size=32,
    )
    trainer.fit(steps=40)
    figures = trainer.validate()
    trainer.model.eval()
    with torch.no_grad():
        inputs = val.features
        logits = trainer.model(image=inputs[:, :20], table=inputs[:, 20:]).squeeze(-1)
    probabilities, truth = torch.sigmoid(logits).numpy(), val.target.numpy()
    assert figures["val/auroc"] == pytest.approx(roc_auc_score(truth, probabilities), rel=1e-5)
    accuracy = float(((probabilities > 0.5) == (truth > 0.5)).mean())
    assert figures["val/accuracy"] == pytest.approx(accuracy, rel=1e-6)
    loss = float(nn.functional.binary_cross_entropy_with_logits(logits, val.target))
    assert figures["val/loss"] == pytest.approx(loss, rel=1e-5)
    assert figures["val/accuracy"] > 0.9


# -- the same through a config: optimizer=lbfgs, the fit check on a validation batch -------------


def config_run(tmp_path: Path, *overrides: str) -> list[str]:
    return library_args(
        tmp_path, f"hydra.searchpath=[file://{TESTS / 'workloads' / 'conf'}]", *overrides
    )


def test_lbfgs_from_its_config_records_what_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workloads: None
) -> None:
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from workloads.time_sequence import sine_waves

    monkeypatch.chdir(tmp_path)
    result = reprotrain.train(
        config_run(
            tmp_path, "experiment=wl_lbfgs", "~metrics.r2", "tracking.log_model=true", "data.L=12"
        )
    )
    assert result.status == "FINISHED"
    run = MlflowClient(result.tracking_uri).get_run(result.run_id)
    # One array in, one tensor out: mlflow.pyfunc serves it, and no tag says otherwise.
    assert "reprotrain.model_error" not in run.data.tags
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(result.tracking_uri)  # where runs:/ looks
    try:
        served = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    finally:
        mlflow.set_tracking_uri(before)
    waves = sine_waves(L=12).val.tensors[0]
    assert served.predict(waves.numpy()).shape == (3, 11)
    assert run.data.tags["optimizer.class"] == "torch.optim.lbfgs.LBFGS"
    assert run.data.params["loss.source"] == "loss_fn"
    assert run.data.tags["loss.class"] == "torch.nn.modules.loss.MSELoss"
    losses = MlflowClient(result.tracking_uri).get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3, 4] and losses[-1].value < losses[0].value / 4
    assert math.isfinite(result.metrics["val/mae"])  # the metric took the example's views

    # A validation split whose items do not fit: one line before the first step, no run.
    with pytest.raises(reprotrain.UserError, match="validation samples 23 -> a scalar"):
        reprotrain.train(
            config_run(
                tmp_path,
                "experiment=wl_lbfgs",
                "data._target_=workloads.time_sequence.mismatched_waves",
            )
        )
    # The example's float64 data for a float32 model: both dtypes and the fix, in one line.
    with pytest.raises(
        ConfigError, match="inputs are float64 but the model MLP's weights are float32"
    ) as refused:
        reprotrain.train(
            config_run(tmp_path, "experiment=wl_lbfgs", "model=mlp", "+model.num_classes=23")
        )
    assert "astype('float32')" in refused.value.hint
    runs = MlflowClient(result.tracking_uri).search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [result.run_id]


# -- PyTorch's VAE: its loss function on the whole output, images without labels -----------------


def test_the_vae_examples_own_loss_function_trains_on_images_alone(
    here, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from reprotrain.seeding import VALIDATION_STREAM, seeded

    # As a user's project: its package beside the run (this project's own code).
    project = tmp_path / "project"
    shutil.copytree(TESTS / "workloads", project / "workloads")

    def ours() -> list[str]:
        return [n for n in sys.modules if n == "workloads" or n.startswith("workloads.")]

    for name in ours():  # the tests' copy: the run imports the project's own
        monkeypatch.delitem(sys.modules, name)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        ran = here.app(
            "runtime=local",
            f"hydra.searchpath=[file://{project / 'workloads' / 'conf'}]",
            f"tracking.uri={store}",
            f"train.output_dir={tmp_path / 'results'}",
            f"train.checkpoint_dir={tmp_path / 'checkpoints'}",
            "experiment=wl_vae",
            "tracking.log_model=true",
            cwd=project,
        )
        assert ran.returncode == 0, ran.stderr[-2000:]
        client = MlflowClient(store)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "FINISHED"
        assert run.data.params["task.loss_args"] == "['output.0', 'input', 'output.1', 'output.2']"
        assert run.data.params["loss.source"] == "loss_fn"
        # Its MLflow Model loads with mlflow.pytorch; the tag says why pyfunc cannot serve it.
        assert "returns a tuple, not one tensor" in run.data.tags["reprotrain.model_error"]
        losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
        val = [m.value for m in client.get_metric_history(run.info.run_id, "val/loss")]
        assert len(val) == 2 and val[-1] < val[0]
        assert 0.5 < val[-1] / losses[-1] < 2  # a summed loss: both per batch of 32

        # The same on the Trainer; val/loss checked against the loss function computed here.
        from workloads.vae import VAE, digits_28, loss_function

        splits = digits_28()
        torch.manual_seed(0)
        trainer = reprotrain.Trainer(
            VAE(),
            functools.partial(torch.optim.AdamW, lr=1e-3),
            splits.train,
            val_data=splits.val,
            task=reprotrain.WholeOutput(["output.0", "input", "output.1", "output.2"]),
            loss_fn=loss_function,
            batch_size=32,
        )
        trainer.fit(steps=10)
        figures = trainer.validate()
        total, count = 0.0, 0
        with torch.no_grad(), seeded(0, 0, trainer.step, VALIDATION_STREAM):  # its own draws
            trainer.model.eval()
            for images in splits.val.tensors[0].split(32):
                recon, mu, logvar = trainer.model(images)
                total += float(loss_function(recon, images, mu, logvar)) * len(images)
                count += len(images)
        assert figures["val/loss"] == pytest.approx(total / count, rel=1e-5)
        with pytest.raises(ConfigError, match="task.loss_args has 'outputs.0'"):
            reprotrain.WholeOutput(["outputs.0", "input"])
    finally:
        for name in ours():  # the project's copy goes; monkeypatch puts the tests' back
            del sys.modules[name]
