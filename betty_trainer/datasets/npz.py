"""Amazon Computers/Photo and Coauthor CS/Physics (Shchur et al.) from their gnn-benchmark ``.npz`` files.

Source: Shchur, Mumme, Bojchevski & Günnemann, "Pitfalls of Graph Neural Network
Evaluation", R2L @ NeurIPS 2018 (§4 data sets and evaluation protocol); the files are
the GraphGallery re-packaging (EdisonLeeeee/GraphData). Each ``.npz`` holds
``adj_matrix`` and ``node_attr`` as pickled 0-d object arrays wrapping a scipy CSR
matrix, and ``node_label`` as a plain int array. The pickles are read with the
Planetoid loader's :func:`~betty_trainer.datasets.safe_pickle.restricted_load` (numpy
arrays and dtypes, scipy CSR matrices only); ``np.load(..., allow_pickle=True)`` is
never called.

The graph is ``A = (A + Aᵀ) > 0`` without its diagonal (the Amazon files store one
direction only). No official split ships with these data sets; the split is Shchur et
al.'s: per class, a seeded random 20 nodes for training, 30 for validation, the rest
for testing (:func:`stratified_split`).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from numpy.lib import format as npy_format
from torch import Tensor

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.safe_pickle import restricted_load
from betty_trainer.errors import DatasetError

TRAIN_PER_CLASS = 20
VAL_PER_CLASS = 30


def open_archive(path: Path) -> zipfile.ZipFile:
    """``path`` opened as a zip (``.npz``) archive.

    Raises:
        DatasetError: the file is missing or not a readable zip (one line naming it).
    """
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise DatasetError(f"missing dataset file {path}") from None
    except (zipfile.BadZipFile, OSError) as error:
        raise DatasetError(f"{path} is not a readable .npz archive ({error}); re-download it") from None


def read_npz(path: Path) -> dict[str, object]:
    """Every array of an ``.npz`` file; object arrays are unpickled with the restricted unpickler.

    A 0-d object array is returned as the object it holds (``.item()``), e.g. a
    ``scipy.sparse.csr_matrix``; other arrays as ``np.ndarray``.

    Args:
        path: the ``.npz`` file (a zip of ``.npy`` files).

    Returns:
        Member name without ``.npy`` → value.

    Raises:
        DatasetError: the file is missing, not a zip, truncated, or a pickle in it asks
            for a global outside the allow-list (the message names the member).
    """
    arrays = {}
    with open_archive(path) as archive:
        for member in archive.namelist():
            source = f"{path}:{member}"
            try:
                data = archive.read(member)
            except (zipfile.BadZipFile, OSError, EOFError) as error:
                raise DatasetError(f"{source} is truncated or corrupt ({error})") from None
            arrays[member.removesuffix(".npy")] = _read_npy(data, source)
    return arrays


def _read_npy(data: bytes, source: str) -> object:
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(stream)
    except ValueError as error:
        raise DatasetError(f"{source} is not a valid .npy member ({error})") from None
    if dtype.hasobject:
        value = restricted_load(stream.read(), source)
        if not isinstance(value, np.ndarray) or value.shape != shape:
            raise DatasetError(f"{source} should hold an object array of shape {shape}")
        return value.item() if value.ndim == 0 else value
    count = int(np.prod(shape)) if shape else 1
    body = stream.read()
    if len(body) != count * dtype.itemsize:
        raise DatasetError(f"{source} is truncated or corrupt ({len(body)} data bytes, expected {count * dtype.itemsize})")
    return np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")


def stratified_split(labels: Tensor, num_classes: int, seed: int,
                     train_per_class: int = TRAIN_PER_CLASS, val_per_class: int = VAL_PER_CLASS,
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Shchur et al.'s random split: per class, ``train_per_class`` training nodes,
    ``val_per_class`` validation nodes, every other node of the class for testing.

    Each class's nodes are shuffled by ``torch.randperm`` with a generator seeded by
    ``seed`` (classes in order), so the split is a function of ``seed`` alone. A class
    with fewer nodes than ``train_per_class + val_per_class`` gives what it has to
    training first, then to validation, and nothing to test.

    Args:
        labels: ``(N,)`` int64 class ids in ``[0, num_classes)``.
        num_classes: ``C``.
        seed: split seed.
        train_per_class, val_per_class: nodes per class in training and validation.

    Returns:
        ``(train_idx, val_idx, test_idx)``: sorted int64 node ids, pairwise disjoint,
        covering all ``N`` nodes.
    """
    generator = torch.Generator().manual_seed(seed)
    parts: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    for c in range(num_classes):
        nodes = torch.nonzero(labels == c).flatten()
        nodes = nodes[torch.randperm(nodes.numel(), generator=generator)]
        cuts = (train_per_class, train_per_class + val_per_class)
        for part, chunk in zip(parts, (nodes[: cuts[0]], nodes[cuts[0]: cuts[1]], nodes[cuts[1]:])):
            part.append(chunk)
    return tuple(torch.sort(torch.cat(part)).values for part in parts)  # type: ignore[return-value]


def load_npz_graph(path: Path, name: str, normalize_features: bool = True, split_seed: int = 0) -> Graph:
    """Load one gnn-benchmark ``.npz`` (Amazon Computers/Photo, Coauthor CS/Physics) as an undirected graph.

    ``A = (A + Aᵀ) > 0`` with the diagonal removed (``Graph.from_edges`` with
    ``drop_self_loops=True``); features are the dense ``node_attr``
    (binary bag-of-words for Amazon, keyword counts for Coauthor), row-normalised if
    ``normalize_features``; the split is :func:`stratified_split` with ``split_seed``.

    Args:
        path: the ``.npz`` file.
        name: dataset name for the graph.
        normalize_features: divide each feature row by its sum (rows summing to 0 stay 0).
        split_seed: seed of the random split.

    Returns:
        A :class:`Graph`: float32 ``x`` ``(N, F)``, int64 ``y``; e.g. Amazon Computers
        13,752 nodes, 491,722 directed edges, 767 features, 10 classes.

    Raises:
        DatasetError: the file is missing, corrupt, refused by the restricted unpickler,
            or its arrays are inconsistent.
    """
    arrays = read_npz(path)
    missing = [key for key in ("adj_matrix", "node_attr", "node_label") if key not in arrays]
    if missing:
        raise DatasetError(f"{path} lacks the array(s) {', '.join(missing)}; is it a gnn-benchmark .npz file?")
    adjacency, features, labels = arrays["adj_matrix"], arrays["node_attr"], arrays["node_label"]
    if not sp.issparse(adjacency) or not sp.issparse(features):
        raise DatasetError(f"{path}: adj_matrix and node_attr should hold scipy sparse matrices")
    if not isinstance(labels, np.ndarray) or labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DatasetError(f"{path}: node_label should be a 1-D integer array")
    num_nodes = labels.shape[0]
    if adjacency.shape != (num_nodes, num_nodes) or features.shape[0] != num_nodes:
        raise DatasetError(f"{path}: adj_matrix {adjacency.shape}, node_attr {features.shape} and "
                           f"{num_nodes} labels disagree")
    if num_nodes and labels.min() < 0:
        raise DatasetError(f"{path}: negative class ids in node_label")

    symmetric = (adjacency + adjacency.T).tocoo()
    keep = symmetric.data > 0
    features = sp.csr_matrix(features, dtype=np.float32)
    if normalize_features:
        row_sum = np.asarray(features.sum(1)).ravel()
        row_sum[row_sum == 0] = 1
        features = sp.diags((1.0 / row_sum).astype(np.float32)).dot(features).astype(np.float32)
    y = torch.from_numpy(labels.astype(np.int64))
    num_classes = int(labels.max()) + 1 if num_nodes else 0
    train_idx, val_idx, test_idx = stratified_split(y, num_classes, split_seed)
    return Graph.from_edges(
        torch.from_numpy(symmetric.row[keep].astype(np.int64)),
        torch.from_numpy(symmetric.col[keep].astype(np.int64)),
        num_nodes,
        symmetric=False,
        drop_self_loops=True,
        x=torch.from_numpy(features.toarray()),
        y=y,
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        num_classes=num_classes,
        name=name,
    )
