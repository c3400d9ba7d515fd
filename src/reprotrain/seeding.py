"""One seed for Python, NumPy and torch; deterministic algorithms when asked for.

    seed_everything(cfg.train.seed, cfg.train.deterministic, device)

With train.deterministic=true (the default) a run on the same torch build and device gives
the same losses bit for bit: cuBLAS's workspace is fixed and TF32 is off.

A checkpoint keeps all three generators' states (`rng_states`), so a resumed run draws what
an uninterrupted one would. What a dataset or collate function draws while a streamed batch
is read does not come from those streams: each step's batch is read `seeded(seed, rank,
step)` (data/batches.py), so it is the same whatever `train.num_workers`, after a resume, and
with or without validations in between (each validation reads `seeded(seed, rank, step,
VALIDATION_STREAM)`).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by cuBLAS determinism
    if "torch._inductor" in sys.modules or device.type != "cpu":
        torch.use_deterministic_algorithms(True)
    else:
        # The same switch through torch's other public setter: use_deterministic_algorithms
        # also imports torch's compiler (1.8 s here, 3.5-4.5 s on a loaded 2-core machine)
        # just to set a flag that only matters under torch.compile.
        torch.set_deterministic_debug_mode("error")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -- the RNG states a checkpoint keeps, and the seeds a batch is read with

# The stream a validation reads with: apart from every training step's (steps are >= 1).
VALIDATION_STREAM = 0


def rng_states() -> dict[str, Any]:
    """Python's, NumPy's global and torch's (CPU and every CUDA device's) RNG states, in types
    a weights-only checkpoint keeps (tuples, lists, ints, floats, tensors)."""
    numpy = np.random.get_state(legacy=False)
    return {
        "python_rng": random.getstate(),
        "numpy_rng": {
            "key": numpy["state"]["key"].tolist(),
            "pos": int(numpy["state"]["pos"]),
            "has_gauss": int(numpy["has_gauss"]),
            "gauss": float(numpy["gauss"]),
        },
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(state: dict[str, Any]) -> None:
    """Put back what rng_states() returned (a checkpoint written before Python's and NumPy's
    states were kept restores torch's only)."""
    if state.get("python_rng") is not None:
        random.setstate(_as_tuples(state["python_rng"]))
    numpy = state.get("numpy_rng")
    if numpy is not None:
        np.random.set_state(
            (
                "MT19937",
                np.asarray(numpy["key"], dtype=np.uint32),
                numpy["pos"],
                numpy["has_gauss"],
                numpy["gauss"],
            )
        )
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


@contextlib.contextmanager
def seeded(*entropy: int) -> Iterator[None]:
    """Python's `random`, NumPy's global generator and torch's CPU generator seeded from
    `entropy` (e.g. the run's seed, the rank and the step) inside the block, and put back as
    they were after it: what the block draws depends on `entropy` alone, and draws nothing
    from the streams around it."""
    kept = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    first, second = np.random.SeedSequence(list(entropy)).generate_state(2, np.uint32)
    random.seed(int(first))
    np.random.seed(int(first))
    torch.random.default_generator.manual_seed(int(first) << 32 | int(second))
    try:
        yield
    finally:
        random.setstate(kept[0])
        np.random.set_state(kept[1])
        torch.set_rng_state(kept[2])
