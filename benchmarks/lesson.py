"""The lesson's training script: the course's loop as written, the one reference every
benchmark compares reprotrain with. Nothing of reprotrain is imported.

    python benchmarks/lesson.py                                  # 3000 steps at batch 64
    python benchmarks/lesson.py --steps 300 --device cuda --loss-csv losses.csv

The problem is reprotrain's default (`data=synthetic`, `model=mlp`, `optimizer=adamw`): the
same 8192 samples of 784 features in 10 Gaussian classes with the same training split, the
SimpleMLP 784->512->10, AdamW lr 1e-3, cross entropy. The loop is the lesson's: a
TensorDataset and a shuffling DataLoader, `.to(device)` on every batch, forward, loss,
zero_grad, backward, step, `loss.item()` for the running loss, a line per epoch, the weights
saved at the end.
"""

import argparse
import csv

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SimpleMLP(nn.Module):
    def __init__(self, in_features=784, hidden=512, num_classes=10):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.layers(x)


def synthetic(num_samples=8192, num_features=784, num_classes=10, noise=8.0, seed=0):
    """The training split of reprotrain's `data=synthetic` (conf/data/synthetic.yaml), sample
    for sample: the same draws, and the same 20% held out, so every comparison trains on the
    same data."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((num_classes, num_features), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=num_samples)
    draws = rng.standard_normal((labels.size, num_features), dtype=np.float32)
    features = (centres[labels] + noise * draws) / np.float32(np.sqrt(1.0 + noise**2))
    order = np.random.default_rng(seed + 1).permutation(num_samples)
    train = order[round(num_samples * 0.2) :]
    return torch.from_numpy(features[train]), torch.from_numpy(labels[train].astype(np.int64))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="lesson_model.pt", help="where the weights go")
    parser.add_argument("--loss-csv", help="also write step,loss for every step here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    features, labels = synthetic()
    loader = DataLoader(TensorDataset(features, labels), batch_size=args.batch_size, shuffle=True)
    model = SimpleMLP().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    losses = []
    step, epoch = 0, 0
    while step < args.steps:
        model.train()
        running_loss = 0.0
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # sync point: the lesson reads the loss every step
            running_loss += losses[-1]
            step += 1
            if step == args.steps:
                break
        epoch += 1
        print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")
    torch.save(model.state_dict(), args.out)
    if args.loss_csv:
        with open(args.loss_csv, "w", newline="") as handle:
            csv.writer(handle).writerows([("step", "loss"), *enumerate(losses, 1)])


if __name__ == "__main__":
    main()
