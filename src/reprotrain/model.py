"""The models and optimizers a config names.

    model = build_model(cfg.model, in_features=784, num_classes=10)   # MLP 784 -> 512 -> 10
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), device)

A new model: add a class here and a file in conf/model/. A new optimizer: a dataclass in
schema.py, a branch in build_optimizer, a file in conf/optimizer/.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from reprotrain.schema import AdamConfig, AdamWConfig, ModelConfig, SGDConfig


class MLP(nn.Module):
    """The course's SimpleMLP, generalised to `depth` hidden layers of `hidden_size` units."""

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_classes: int,
        depth: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden_size), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden_size
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model(cfg: ModelConfig, in_features: int, num_classes: int) -> MLP:
    return MLP(in_features, cfg.hidden_size, num_classes, depth=cfg.depth, dropout=cfg.dropout)


def build_optimizer(
    cfg: AdamWConfig | AdamConfig | SGDConfig,
    params: Iterable[nn.Parameter],
    device: torch.device,
    capturable: bool = False,
) -> torch.optim.Optimizer:
    """`capturable`: Adam(W) keeps its step count on the device, as CUDA graph capture needs."""
    params = list(params)
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    kind = torch.optim.AdamW if isinstance(cfg, AdamWConfig) else torch.optim.Adam
    # The default Adam(W) loops over tensors one kernel at a time; fused=True does the same
    # update in one kernel per step. On a small CPU step the loop costs more than forward
    # and backward together, so fused is the default wherever this torch supports it.
    fused = use_fused(device) if cfg.fused is None else cfg.fused
    return kind(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        capturable=capturable,
    )


def use_fused(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu", "mps")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def training_flops_per_sample(model: nn.Module) -> int:
    """Forward 2*in*out per Linear, backward twice that: 6 * weights per sample."""
    weights = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)
    )
    return 6 * weights
