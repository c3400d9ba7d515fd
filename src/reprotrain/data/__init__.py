"""Data: what a `data` config builds, and the batches the loop walks.

    splits = instantiate(cfg.data)      # Splits(train, val, num_classes): map-style Datasets
    batches = make_batches(splits.train, train_cfg, device)   # resident, or a DataLoader

Built-in sources need no download: `synthetic` (a learnable problem made from a seed) and
`digits` (the 8x8 handwritten digits inside scikit-learn; as vectors or as 1x8x8 images).
`prepare` writes any source to an .npz that DVC versions; `data.file` reads it back.
"""

from reprotrain.data.batches import EpochBatches, LoaderBatches, ResidentBatches, make_batches
from reprotrain.data.builtin import digits, synthetic
from reprotrain.data.prepared import file_md5, read_npz, write_npz
from reprotrain.data.splits import Splits, as_splits, sample_of, to_tensors

__all__ = [
    "EpochBatches",
    "LoaderBatches",
    "ResidentBatches",
    "Splits",
    "as_splits",
    "digits",
    "file_md5",
    "make_batches",
    "read_npz",
    "sample_of",
    "synthetic",
    "to_tensors",
    "write_npz",
]
