"""Checkpoints: everything needed to continue a run exactly where it stopped.

    save_checkpoint(path, step=..., model=..., optimizer=..., losses=..., run_id=..., fingerprint=...)
    python -m reprotrain.train train.resume=last          # or train.resume=<MLflow run id>

A checkpoint holds the model and optimizer state, the step, torch's RNG state and the losses
so far; the batch order is re-derived from the seed, so on CPU the continued losses equal an
uninterrupted run's bit for bit. It is written every `train.checkpoint_every` steps and when
the run is stopped (Ctrl-C, SIGTERM, docker stop), always atomically.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from reprotrain.errors import ConfigError, DataError
from reprotrain.outputs import write_atomic
from reprotrain.schema import Config, as_dict

FORMAT = 1


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_path(output_dir: str | Path, run_id: str) -> Path:
    return checkpoint_dir(output_dir) / f"{run_id or 'untracked'}.pt"


def fingerprint(config: Config) -> str:
    """What must match to continue: model, optimizer, data, batch size, seed (not the step count)."""
    tree = as_dict(config)
    kept = {k: tree[k] for k in ("model", "optimizer", "data")}
    # precision and tf32 change the arithmetic; compile and cuda_graphs do not.
    same_math = ("batch_size", "seed", "deterministic", "precision", "tf32")
    kept["train"] = {k: tree["train"][k] for k in same_math}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(
    path: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    losses: list[float],
    run_id: str,
    fingerprint: str,
) -> Path:
    state = {
        "format": FORMAT,
        "step": step,
        "run_id": run_id,
        "fingerprint": fingerprint,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "losses": losses,
    }
    return write_atomic(path, lambda handle: torch.save(state, handle))


def find_checkpoint(output_dir: str | Path, resume: str) -> Path:
    folder = checkpoint_dir(output_dir)
    if resume == "last":
        found = (
            sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        )
        if not found:
            raise ConfigError(
                f"train.resume=last but {str(folder)!r} holds no checkpoint",
                hint="run without train.resume first, or give the run id to resume",
            )
        return found[-1]
    path = folder / f"{resume}.pt"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.pt")) if folder.is_dir() else []
        raise ConfigError(
            f"train.resume={resume!r}: no checkpoint {str(path)!r}; "
            f"checkpoints here: {', '.join(known) or 'none'}",
            hint="give one of those run ids, or train.resume=last",
        )
    return path


def load_checkpoint(path: Path, expected_fingerprint: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError) as error:
        raise DataError(
            f"checkpoint {str(path)!r} is corrupt or truncated ({type(error).__name__})",
            hint="delete it and start again, or resume another run",
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise DataError(
            f"checkpoint {str(path)!r} is not a reprotrain checkpoint (format {FORMAT})"
        )
    if state["fingerprint"] != expected_fingerprint:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written with another model/optimizer/data/batch config "
            f"(fingerprint {state['fingerprint']}, this config {expected_fingerprint})",
            hint="resume with the same config as the stopped run (only train.steps may grow)",
        )
    return state
