"""Atomic per-epoch checkpoints, loaded without unpickling arbitrary objects."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from betty_trainer.errors import TrainingError

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` atomically (temp file, fsync, rename),
    so a crash mid-write leaves the previous checkpoint intact.

    Args:
        run_dir: the run directory.
        state: tensors, numbers, strings, lists and dicts only.

    Returns:
        The checkpoint path.
    """
    path = run_dir / CHECKPOINT_NAME
    partial = path.with_suffix(".pt.partial")
    with open(partial, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """Read ``run_dir/checkpoint.pt`` with ``weights_only=True`` (no arbitrary code runs).

    Raises:
        TrainingError: if the file is missing or unreadable.
    """
    path = run_dir / CHECKPOINT_NAME
    if not path.is_file():
        raise TrainingError(f"no checkpoint to resume from in {run_dir}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as error:
        raise TrainingError(f"checkpoint {path} is corrupt or unreadable: {error}") from None
