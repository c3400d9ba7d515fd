"""A Hugging Face causal LM built from its config (no download) on the Markov-chain corpus, with
the Hugging Face convention for labels: `labels = input_ids`, shifted by the model itself.

    splits = causal_corpus(num_tokens=6_000, seq_len=16, vocab=40)
    splits.train[0]      # {"input_ids": LongTensor[16], "labels": the same tokens}
    model = gpt2_lm(vocab_size=40, n_positions=16)     # transformers.GPT2LMHeadModel
    model(**batch).loss  # its own ForCausalLMLoss: logits[:, :-1] against labels[:, 1:]
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from reprotrain.data import Splits
from workloads.corpus import markov_text, transitions


class Chunks(Dataset):
    """Consecutive `seq_len`-token chunks of a token stream, as a causal LM reads them."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, next_tokens: bool = False) -> None:
        self.tokens, self.seq_len, self.next_tokens = tokens, seq_len, next_tokens

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.seq_len
        ids = self.tokens[start : start + self.seq_len]
        # The Hugging Face convention: labels are the inputs (the model shifts them); with
        # next_tokens, reprotrain's own convention: each position's label is the next token.
        labels = self.tokens[start + 1 : start + self.seq_len + 1] if self.next_tokens else ids
        return {"input_ids": ids, "labels": labels.clone()}


def causal_corpus(
    num_tokens: int = 6_000,
    seq_len: int = 16,
    vocab: int = 40,
    val_fraction: float = 0.2,
    seed: int = 0,
    next_tokens: bool = False,
) -> Splits:
    text = markov_text(num_tokens, transitions(vocab, seed), seed)
    cut = int(len(text) * (1 - val_fraction))
    return Splits(
        Chunks(text[:cut], seq_len, next_tokens), Chunks(text[cut:], seq_len, next_tokens)
    )


def gpt2_lm(
    vocab_size: int = 40, n_positions: int = 16, n_embd: int = 32, n_layer: int = 2, n_head: int = 2
) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
