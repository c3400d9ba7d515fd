"""PyTorch's time-sequence-prediction example: an LSTM that learns sine waves, trained with LBFGS.

    splits = sine_waves()          # input [N-3, L-1], target [N-3, L-1]: float64, views of one array
    model = DoubleSequence()       # Sequence().double(): forward(input) -> [batch, L-1]
    optimizer = functools.partial(torch.optim.LBFGS, lr=0.8)   # its step takes a closure

`Sequence` is copied verbatim from github.com/pytorch/examples, time_sequence_prediction/train.py
(BSD-3-Clause licence, Copyright (c) 2017 PyTorch contributors); `sine_waves` is its
generate_sine_wave.py made a function (fewer and shorter waves by default, so a test is quick).
The splits are the example's own: `torch.from_numpy(data[3:, :-1])` and the like, non-contiguous
float64 views of one array.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from reprotrain.data import Splits


def sine_waves(T: int = 20, L: int = 40, N: int = 16, seed: int = 2) -> Splits:
    """generate_sine_wave.py: N waves of L points, each shifted by a random phase; the first
    three are the example's test set."""
    np.random.seed(seed)
    x = np.empty((N, L), "int64")
    x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = np.sin(x / 1.0 / T).astype("float64")
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    return Splits(TensorDataset(input, target), TensorDataset(test_input, test_target))


# --- verbatim from pytorch/examples time_sequence_prediction/train.py -------------------------
# ruff: noqa: UP008, B007
# fmt: off
class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future = 0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):# if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs
# fmt: on
# --- end of the verbatim part ------------------------------------------------------------------


def mismatched_waves(T: int = 20, L: int = 24, N: int = 16, seed: int = 2) -> Splits:
    """sine_waves whose validation targets are one value per wave (not one per point): a split
    that validation cannot compare with the model's outputs."""
    splits = sine_waves(T, L, N, seed)
    inputs, targets = splits.val.tensors
    return Splits(splits.train, TensorDataset(inputs, targets[:, -1]))


class DoubleSequence(Sequence):
    """The example's model as it trains it (`seq.double()`), as a class a config can name."""

    def __init__(self) -> None:
        super().__init__()
        self.double()
