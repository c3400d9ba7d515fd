"""A synthetic text for language modelling, no download: token ids from a seeded Markov chain.

Each token is followed mostly by a handful of likely successors and now and then by any token,
so a model can learn the transitions but never predict every next token: the best possible
loss is the chain's entropy rate (`entropy_rate`), well under log(vocab).

    splits = corpus(num_tokens=20_000, seq_len=32, batch_size=16, vocab=50)
    input_ids, next_ids = splits.train[0]           # LongTensor[seq_len] each, next_ids shifted by one

Items come in the order of PyTorch's word-language-model example (`batchify`): the token stream
is cut into `batch_size` parallel streams, and item `i * batch_size + b` is chunk `i` of stream
`b`. Read in order (no shuffling) with that batch size, row `b` of each batch continues row `b`
of the batch before, which a recurrent model that carries its hidden state across batches needs.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

from reprotrain.data import Splits

SUCCESSORS = 4  # likely next tokens per token
NOISE = 0.1  # probability mass spread over every token


def corpus(
    num_tokens: int = 20_000,
    seq_len: int = 32,
    batch_size: int = 16,
    vocab: int = 50,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Train and validation streams of one Markov text, each batchified for `batch_size` rows."""
    if vocab < SUCCESSORS + 1 or seq_len < 1 or batch_size < 1 or not 0 < val_fraction < 1:
        raise ValueError(
            f"vocab={vocab} must be > {SUCCESSORS}, seq_len={seq_len} and batch_size="
            f"{batch_size} >= 1, val_fraction={val_fraction} in (0, 1)"
        )
    tokens = markov_text(num_tokens, transitions(vocab, seed), seed)
    n_val = int(num_tokens * val_fraction)
    train = StreamChunks(tokens[: num_tokens - n_val], seq_len, batch_size)
    val = StreamChunks(tokens[num_tokens - n_val :], seq_len, batch_size)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(
            f"num_tokens={num_tokens} is too few for {batch_size} streams of at least "
            f"{seq_len + 1} tokens in both splits"
        )
    return Splits(train, val, num_classes=vocab)


def transitions(vocab: int, seed: int) -> np.ndarray:
    """`[vocab, vocab]` next-token probabilities: a few likely successors, plus uniform noise."""
    rng = np.random.default_rng(seed)
    table = np.full((vocab, vocab), NOISE / vocab)
    for token in range(vocab):
        successors = rng.choice(vocab, size=SUCCESSORS, replace=False)
        table[token, successors] += (1 - NOISE) * rng.dirichlet(np.ones(SUCCESSORS))
    return table


def entropy_rate(vocab: int = 50, seed: int = 0) -> float:
    """The chain's entropy per token in nats: the lowest mean NLL any model can reach."""
    table = transitions(vocab, seed)
    # The stationary distribution: the left eigenvector of the table for eigenvalue 1.
    values, vectors = np.linalg.eig(table.T)
    stationary = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    stationary /= stationary.sum()
    return float(-(stationary[:, None] * table * np.log(table)).sum())


def markov_text(num_tokens: int, table: np.ndarray, seed: int) -> torch.Tensor:
    """`num_tokens` token ids walked through `table` from a seeded start."""
    rng = np.random.default_rng(seed + 1)
    cumulative = [list(row) for row in np.cumsum(table, axis=1)]
    draws = rng.random(num_tokens)
    tokens = [int(rng.integers(len(table)))]
    for u in draws[1:]:
        row = cumulative[tokens[-1]]
        tokens.append(min(bisect.bisect_right(row, u * row[-1]), len(row) - 1))
    return torch.tensor(tokens, dtype=torch.long)


class StreamChunks(Dataset):
    """A token stream as `batch_size` parallel streams, read `seq_len` tokens at a time.

    Item `i * batch_size + b` is `(stream_b[i*seq_len : (i+1)*seq_len], the same shifted by one)`.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int) -> None:
        per_stream = len(tokens) // batch_size
        # Drop the tail that does not fill every stream, as batchify does.
        self.streams = tokens[: per_stream * batch_size].view(batch_size, per_stream)
        self.seq_len = seq_len
        self.chunks = max(0, (per_stream - 1) // seq_len)  # each chunk needs one token ahead

    def __len__(self) -> int:
        return self.chunks * self.streams.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} chunks")
        chunk, stream = divmod(index, self.streams.shape[0])
        start = chunk * self.seq_len
        window = self.streams[stream, start : start + self.seq_len + 1]
        return window[:-1], window[1:]
