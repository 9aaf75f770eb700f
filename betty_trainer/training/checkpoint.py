"""Atomic per-epoch checkpoints, loaded without unpickling arbitrary objects (``weights_only=True``)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from betty_trainer.errors import TrainingError
from betty_trainer.training.rundir import write_bytes

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` atomically (serialised in memory, then
    :func:`betty_trainer.training.rundir.write_bytes`: temp file, fsync, rename), so a crash, a full disk
    or a read-only file system mid-write leaves the previous checkpoint intact.

    Args:
        run_dir: the run directory.
        state: tensors, numbers, strings, lists and dicts only.

    Returns:
        The checkpoint path.

    Raises:
        RunDirError: the file cannot be written (the message names the path and the cause).
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)  # in memory: a failing disk then raises OSError with its errno, not torch's RuntimeError
    return write_bytes(Path(run_dir) / CHECKPOINT_NAME, buffer.getbuffer())


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
