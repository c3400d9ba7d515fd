"""The lesson's script under PyTorch Lightning with its MLflow logger: the same model, data and
optimizer as benchmarks/lesson.py, the loss logged to MLflow every step. Needs the `bench`
extra (pip install -e '.[bench]').

    python benchmarks/lesson_lightning.py --tracking-uri sqlite:///$PWD/lightning.db
    python benchmarks/lesson_lightning.py --steps 300 --device cuda --loss-csv losses.csv

Written as a Lightning user writes it, with the Trainer's extras the lesson has no counterpart
for switched off (checkpoints, progress bar, model summary), so that the comparison charges
Lightning for its loop and its logger, not for features the lesson lacks.
"""

import argparse
import csv
import logging
import os
import warnings

import lightning.pytorch as pl
import torch
from lesson import SimpleMLP, synthetic
from lightning.pytorch.loggers import MLFlowLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LessonModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = SimpleMLP()
        self.criterion = nn.CrossEntropyLoss()
        self.losses = []  # read once, after training: no extra sync per step

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = self.criterion(self.model(inputs), targets)
        self.log("train/loss", loss)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
        help="default: $MLFLOW_TRACKING_URI, else MLflow's own default, ./mlflow.db",
    )
    parser.add_argument("--out", default="lightning_model.pt", help="where the weights go")
    parser.add_argument("--loss-csv", help="also write step,loss for every step here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")  # advice ("num_workers"), not results
    torch.manual_seed(0)
    features, labels = synthetic()
    loader = DataLoader(TensorDataset(features, labels), batch_size=args.batch_size, shuffle=True)
    module = LessonModule()  # built after the seed, as the lesson builds its model: same weights
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=args.steps,
        logger=MLFlowLogger(experiment_name="lesson-lightning", tracking_uri=args.tracking_uri),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    torch.save(module.model.state_dict(), args.out)
    if args.loss_csv:
        losses = torch.stack(module.losses).cpu().tolist()
        with open(args.loss_csv, "w", newline="") as handle:
            csv.writer(handle).writerows([("step", "loss"), *enumerate(losses, 1)])


if __name__ == "__main__":
    main()
