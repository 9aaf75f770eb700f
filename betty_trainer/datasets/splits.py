"""Seeded random node splits for datasets that ship none (MUSAE, Facebook100: LINKX-style 50/25/25)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def random_split(candidates: np.ndarray, train: float, val: float, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split ``candidates`` (node ids) at random: the first ``⌊train·n⌋`` of a seeded permutation
    for training, the next ``⌊val·n⌋`` for validation, the rest for testing.

    Args:
        candidates: ``(n,)`` integer node ids (e.g. the labelled nodes).
        train, val: shares of ``n`` (``train + val ≤ 1``).
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        ``(train_idx, val_idx, test_idx)``: sorted int64 tensors, disjoint, covering ``candidates``.
    """
    candidates = np.asarray(candidates, dtype=np.int64)
    order = candidates[np.random.default_rng(seed).permutation(candidates.size)]
    cut_train = int(train * candidates.size)
    cut_val = cut_train + int(val * candidates.size)
    parts = order[:cut_train], order[cut_train:cut_val], order[cut_val:]
    return tuple(torch.from_numpy(np.sort(part)) for part in parts)  # type: ignore[return-value]


def row_normalize(features: np.ndarray) -> np.ndarray:
    """Divide each row of a dense ``(N, F)`` float32 matrix by its sum in place (zero rows stay zero)."""
    sums = features.sum(1, keepdims=True)
    sums[sums == 0] = 1
    features /= sums
    return features
