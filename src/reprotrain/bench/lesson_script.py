"""The course's training script as written, for the whole-process comparison in
`python -m reprotrain.bench` (run by its path, so nothing of reprotrain is imported):

    python src/reprotrain/bench/lesson_script.py --steps 3000 --batch-size 64

The same problem as reprotrain's default (`data=synthetic`: 8192 samples of 784 features in
10 Gaussian classes, 80% for training; the SimpleMLP 784->512->10; AdamW lr 1e-3; cross
entropy), written the way the lesson writes it: a TensorDataset and a shuffling DataLoader,
`.to(device)` on every batch, forward, loss, zero_grad, backward, step, `loss.item()` for the
running loss, a line per epoch, and the weights saved at the end.
"""

import argparse

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
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((num_classes, num_features), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=num_samples)
    draws = rng.standard_normal((labels.size, num_features), dtype=np.float32)
    features = (centres[labels] + noise * draws) / np.float32(np.sqrt(1.0 + noise**2))
    train = int(num_samples * 0.8)
    return torch.from_numpy(features[:train]), torch.from_numpy(labels[:train])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="lesson_model.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    features, labels = synthetic()
    loader = DataLoader(TensorDataset(features, labels), batch_size=args.batch_size, shuffle=True)
    model = SimpleMLP().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

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
            running_loss += loss.item()
            step += 1
            if step == args.steps:
                break
        epoch += 1
        print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
