"""A Hugging Face sequence classifier's workload: token sequences of varying length, no download.

    splits = sentences(num_samples=512, vocab=64)   # items: {"input_ids", "attention_mask", "labels"}
    batch = pad([splits.train[i] for i in range(8)])  # padded to the batch's longest item
    model = bert_classifier(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                            num_labels=2, max_len=32)
    model(**batch).loss, model(**batch).logits        # logits: [batch, 2]

Each sequence reads like a tokenizer's output: [CLS] words... [SEP]. Every word has a hidden
polarity (+1 or -1); a sentence's label is 1 when its words sum above zero (ties: the first
word decides), a rule a classifier can learn from the tokens alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification

from reprotrain.data import Splits

PAD, CLS, SEP = 0, 1, 2  # BERT's pad_token_id is 0; words are ids 3..vocab-1


def sentences(
    num_samples: int = 512,
    vocab: int = 64,
    min_len: int = 4,
    max_len: int = 16,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Labelled sentences of `min_len`..`max_len` words (plus [CLS] and [SEP]), two classes."""
    if vocab < 5 or not 1 <= min_len <= max_len or not 0 < val_fraction < 1 or num_samples < 2:
        raise ValueError(
            f"vocab={vocab} must be >= 5, 1 <= min_len={min_len} <= max_len={max_len}, "
            f"val_fraction={val_fraction} in (0, 1), num_samples={num_samples} >= 2"
        )
    rng = np.random.default_rng(seed)
    # Half the words positive, half negative, so the two classes come out about even.
    polarity = np.zeros(vocab, dtype=np.int64)
    polarity[SEP + 1 :] = rng.permutation(np.resize([1, -1], vocab - SEP - 1))
    items = [_sentence(rng, polarity, vocab, min_len, max_len) for _ in range(num_samples)]
    n_val = max(1, round(num_samples * val_fraction))
    return Splits(Sentences(items[n_val:]), Sentences(items[:n_val]), num_classes=2)


def _sentence(
    rng: np.random.Generator, polarity: np.ndarray, vocab: int, min_len: int, max_len: int
) -> dict[str, torch.Tensor]:
    words = rng.integers(SEP + 1, vocab, size=rng.integers(min_len, max_len + 1))
    score = polarity[words].sum()
    label = int(score > 0 or (score == 0 and polarity[words[0]] > 0))
    ids = torch.tensor([CLS, *words.tolist(), SEP], dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor(label, dtype=torch.long),
    }


class Sentences(Dataset):
    """A list of tokenised sentences, one dict per item."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def pad(items: list[dict[str, torch.Tensor]], pad_id: int = PAD) -> dict[str, torch.Tensor]:
    """A DataLoader collate_fn: pad input_ids (with pad_id) and attention_mask (with 0) to the
    batch's longest item; stack the labels."""
    return {
        "input_ids": pad_sequence(
            [item["input_ids"] for item in items], batch_first=True, padding_value=pad_id
        ),
        "attention_mask": pad_sequence(
            [item["attention_mask"] for item in items], batch_first=True, padding_value=0
        ),
        "labels": torch.stack([item["labels"] for item in items]),
    }


def bert_classifier(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_labels: int,
    max_len: int,
) -> BertForSequenceClassification:
    """A small BERT built from its config (random weights, nothing downloaded)."""
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max_len,
        num_labels=num_labels,
        pad_token_id=PAD,
    )
    return BertForSequenceClassification(config)
