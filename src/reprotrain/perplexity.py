"""Perplexity for the language_model task's flattened tokens (a metric's `_target_`).

    metrics:
      ppl:
        _target_: reprotrain.perplexity.Perplexity
        ignore_index: -100

torchmetrics' Perplexity takes `[batch, seq, vocab]` and `[batch, seq]`; the task hands over
`[tokens, vocab]` outputs (logits or log-probabilities: softmax gives the same either way)
and `[tokens]` targets. Its own module: importing torchmetrics takes a second, which a
process pays only when its config names a metric.
"""

from __future__ import annotations

import torch
from torchmetrics.text import Perplexity as TokenPerplexity


class Perplexity(TokenPerplexity):
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds.float().unsqueeze(0), target.unsqueeze(0))
