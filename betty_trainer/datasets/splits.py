"""Node splits: seeded random ones for datasets that ship none (MUSAE, Facebook100: LINKX-style 50/25/25), and
a user's own split from a file (config ``dataset.split``).

A split file is either

- an ``.npz`` holding the integer arrays ``train_idx``, ``val_idx`` and ``test_idx`` (read with
  ``allow_pickle=False``: an object array is refused, never unpickled), or
- an OGB-style split folder holding ``train.csv``, ``valid.csv`` and ``test.csv`` (each optionally gzipped,
  ``.csv.gz``), one node id per line, read as OGB's own splits are
  (:func:`~betty_trainer.datasets.ogb.read_split_ids`).

Its identity (:func:`split_sha256`) is recorded in a run's checkpoints, so that ``evaluate``, ``predict`` and
``--resume`` rebuild the same graph, or say that the file is missing or changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.download import sha256_of
from betty_trainer.datasets.ogb import SPLITS, read_split_ids, split_folder_files
from betty_trainer.errors import DatasetError


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


def split_files(path: Path) -> list[Path]:
    """The file(s) a ``dataset.split`` path stands for: the ``.npz`` itself, or a split folder's three CSVs.

    Raises:
        DatasetError: ``path`` does not exist, or a split folder lacks a part (named).
    """
    if path.is_dir():
        return split_folder_files(path)
    if not path.is_file():
        raise DatasetError(f"dataset.split: {path} does not exist; give an .npz with train_idx, val_idx and "
                           "test_idx, or a folder with train.csv, valid.csv and test.csv")
    return [path]


def split_sha256(path: Path) -> str:
    """The hex sha256 identifying a split file: the file's own for an ``.npz``; for a split folder, the sha256 of
    its files' ``<sha256>  <name>`` lines (``sha256sum`` format), so a change to any of them changes it.

    Raises:
        DatasetError: as :func:`split_files`.
    """
    files = split_files(path)
    if len(files) == 1 and files[0] == path:
        return sha256_of(path)
    listing = "".join(f"{sha256_of(file)}  {file.name}\n" for file in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def read_split(path: Path, num_nodes: int) -> dict[str, np.ndarray]:
    """The ``train_idx``, ``val_idx`` and ``test_idx`` arrays of a split file (see the module docstring).

    Returns:
        ``{"train_idx": ..., "val_idx": ..., "test_idx": ...}``, each ``(n,)`` int64, in file order.

    Raises:
        DatasetError: in one line naming the file: missing, unreadable, an array missing, not 1-D integer, or
            holding ids outside ``[0, num_nodes)``.
    """
    if path.is_dir():
        return {field: read_split_ids(file, num_nodes)
                for (field, _), file in zip(SPLITS, split_folder_files(path))}
    split_files(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DatasetError(f"dataset.split: {path} is one array, not an .npz holding train_idx, val_idx "
                               "and test_idx (np.savez(path, train_idx=..., val_idx=..., test_idx=...))")
        with loaded as archive:
            missing = [field for field, _ in SPLITS if field not in archive.files]
            if missing:
                raise DatasetError(f"dataset.split: {path} lacks the array {missing[0]!r} (it holds "
                                   f"{', '.join(archive.files) or 'nothing'}); an .npz split holds train_idx, "
                                   "val_idx and test_idx")
            arrays = {field: archive[field] for field, _ in SPLITS}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        reason = "it holds an object array, which is never unpickled" if "pickle" in str(error) else \
            (str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise DatasetError(f"dataset.split: cannot read {path} as an .npz of integer arrays ({reason})") from None
    for field, ids in arrays.items():
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DatasetError(f"dataset.split: {path}: {field} is {ids.dtype} of shape {ids.shape}, expected a "
                               "1-D array of integer node ids")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_nodes):
            bad = ids[(ids < 0) | (ids >= num_nodes)][0]
            raise DatasetError(f"dataset.split: {path}: {field} holds node {int(bad)}, outside [0, {num_nodes}) "
                               "of this dataset")
    return {field: ids.astype(np.int64) for field, ids in arrays.items()}


def apply_split(graph: Graph, path: Path) -> Graph:
    """``graph`` with the split of the file ``path`` (see the module docstring) in place of its own.

    Raises:
        DatasetError: as :func:`read_split`, or the split is refused by :class:`Graph` (a node in two splits
            or twice in one, an unlabelled node): the message names the file.
    """
    arrays = read_split(path, graph.num_nodes)
    try:
        return dataclasses.replace(graph, check_features=False,
                                   **{field: torch.from_numpy(ids) for field, ids in arrays.items()})
    except DatasetError as error:
        raise DatasetError(f"dataset.split: {path} does not fit {graph.name!r}: "
                           f"{str(error).split(': ', 1)[-1]}") from None
