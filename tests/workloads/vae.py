"""PyTorch's variational autoencoder example, on scikit-learn's digits drawn at MNIST's size.

    splits = digits_28()        # TensorDataset of one tensor: pixels [n, 1, 28, 28] in [0, 1]
    model = VAE()               # forward(x) -> (reconstruction [n, 784], mu [n, 20], logvar [n, 20])
    loss_function(recon_x, x, mu, logvar)    # a function, summed over the batch

`VAE` and `loss_function` are copied verbatim from github.com/pytorch/examples, vae/main.py
(BSD-3-Clause licence, Copyright (c) 2017 PyTorch contributors). No labels: the splits hold the
images alone, as an unsupervised dataset does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from reprotrain.data import Splits


def digits_28(val_fraction: float = 0.2, seed: int = 0, limit: int = 600) -> Splits:
    """scikit-learn's 8x8 digits (bundled, no download), scaled to [0, 1] and resized to
    28x28 as MNIST's; `limit` images in all."""
    images = load_digits().images[:limit].astype(np.float32) / 16.0
    pixels = F.interpolate(torch.from_numpy(images)[:, None], size=(28, 28), mode="bilinear")
    pixels = pixels.clamp(0, 1)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(pixels)))
    n_val = max(1, round(len(pixels) * val_fraction))
    return Splits(TensorDataset(pixels[order[n_val:]]), TensorDataset(pixels[order[:n_val]]))


# --- verbatim from pytorch/examples vae/main.py -------------------------------------------------
# fmt: off
class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()  # noqa: UP008

        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5*logvar)
        eps = torch.randn_like(std)
        return mu + eps*std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')

    # see Appendix B from VAE paper:
    # Kingma and Welling. Auto-Encoding Variational Bayes. ICLR, 2014
    # https://arxiv.org/abs/1312.6114
    # 0.5 * sum(1 + log(sigma^2) - mu^2 - sigma^2)
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())

    return BCE + KLD
# fmt: on
# --- end of the verbatim part -------------------------------------------------------------------
