"""The Planetoid citation datasets (Cora, CiteSeer, PubMed) in their raw ``ind.<name>.*`` format.

Format and split: Yang, Cohen & Salakhutdinov, "Revisiting Semi-Supervised Learning
with Graph Embeddings", ICML 2016; assembly as in Kipf & Welling's GCN code.
The files are Python-2 pickles; they are read with
:func:`~betty_trainer.datasets.safe_pickle.restricted_load`, which allows only the
numpy/scipy/builtin types those files need.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.safe_pickle import restricted_load
from betty_trainer.errors import DatasetError

PICKLED_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph")
PARTS = PICKLED_PARTS + ("test.index",)


def load_planetoid(name: str, folder: Path, normalize_features: bool = True) -> Graph:
    """Assemble a Planetoid dataset from ``folder/ind.<name>.*`` with the public split.

    Split: train = the first ``len(y)`` nodes (20 per class), val = the next 500,
    test = the ids in ``test.index``. CiteSeer lists 1,000 test ids over a span of
    1,015; the 15 missing ids are isolated nodes with no feature/label rows and get
    zero rows (as in the GCN code), giving 3,327 nodes; they are in no split.
    Duplicate edges and self loops are dropped; the graph is made undirected.

    Args:
        name: ``cora``, ``citeseer`` or ``pubmed``.
        folder: folder holding the eight files.
        normalize_features: divide each feature row by its sum (as DGL and GCN do).

    Returns:
        A :class:`Graph`: float32 ``x``, int64 ``y``.

    Raises:
        DatasetError: a file is missing, refused, truncated, or inconsistent.
    """
    parts = {}
    for part in PICKLED_PARTS:
        path = folder / f"ind.{name}.{part}"
        parts[part] = restricted_load(_read(path), str(path))
    index_path = folder / f"ind.{name}.test.index"
    try:
        test_ids = np.array([int(line) for line in _read(index_path).decode("ascii").split()], dtype=np.int64)
    except (UnicodeDecodeError, ValueError):
        raise DatasetError(f"{index_path} is corrupt: expected one integer node id per line") from None

    _check_types(name, parts)
    x, y, tx, ty, allx, ally, adjacency = (parts[p] for p in PICKLED_PARTS)
    if tx.shape[0] != test_ids.size or ty.shape[0] != test_ids.size:
        raise DatasetError(f"{name}: {test_ids.size} test ids but {tx.shape[0]} tx rows and {ty.shape[0]} ty rows")
    if allx.shape[0] != ally.shape[0] or x.shape[0] > allx.shape[0]:
        raise DatasetError(f"{name}: allx/ally/x row counts disagree ({allx.shape[0]}, {ally.shape[0]}, {x.shape[0]})")
    _check_agreement(name, parts)

    span = np.arange(test_ids.min(), test_ids.max() + 1)
    tx_full = sp.lil_matrix((span.size, tx.shape[1]), dtype=np.float32)
    ty_full = np.zeros((span.size, ty.shape[1]), dtype=np.float32)
    tx_full[test_ids - span[0], :] = tx
    ty_full[test_ids - span[0], :] = ty
    features = sp.vstack([allx, tx_full.tocsr()]).tocsr().astype(np.float32)
    onehot = np.vstack([ally, ty_full])
    num_nodes = features.shape[0]
    if span[0] != allx.shape[0]:
        raise DatasetError(f"{name}: test ids start at {span[0]}, expected {allx.shape[0]} (rows of allx)")

    if normalize_features:
        row_sum = np.asarray(features.sum(1)).ravel()
        row_sum[row_sum == 0] = 1
        features = sp.diags(1.0 / row_sum).dot(features).astype(np.float32)

    src, dst = _edge_list(adjacency, num_nodes, name)
    labels = torch.from_numpy(onehot.argmax(1).astype(np.int64))
    num_train = x.shape[0]
    return Graph.from_edges(
        torch.from_numpy(src),
        torch.from_numpy(dst),
        num_nodes,
        x=torch.from_numpy(features.toarray()),
        y=labels,
        train_idx=torch.arange(num_train),
        val_idx=torch.arange(num_train, num_train + 500),
        test_idx=torch.from_numpy(np.sort(test_ids)),
        num_classes=onehot.shape[1],
        name=name,
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"missing dataset file {path}") from None
    except OSError as error:
        raise DatasetError(f"cannot read {path}: {error.strerror}") from None


def _check_types(name: str, parts: dict) -> None:
    for part in ("x", "tx", "allx"):
        if not sp.issparse(parts[part]):
            raise DatasetError(f"ind.{name}.{part} should hold a sparse matrix, found {type(parts[part]).__name__}")
    for part in ("y", "ty", "ally"):
        if not isinstance(parts[part], np.ndarray) or parts[part].ndim != 2:
            raise DatasetError(f"ind.{name}.{part} should hold a 2-D numpy array")
    if not isinstance(parts["graph"], dict):
        raise DatasetError(f"ind.{name}.graph should hold a dict of adjacency lists")


def _check_agreement(name: str, parts: dict) -> None:
    """The arrays describe one dataset, whether or not their checksums were verified: ``x``, ``tx`` and ``allx``
    have the same feature columns, ``y``, ``ty`` and ``ally`` the same classes, ``x``/``y`` are the first rows of
    ``allx``/``ally`` (the training nodes), and the 500 validation rows follow them within ``allx``.

    Raises:
        DatasetError: naming the files that disagree and their shapes.
    """
    for group in (("x", "tx", "allx"), ("y", "ty", "ally")):
        widths = {part: parts[part].shape[1] for part in group}
        if len(set(widths.values())) > 1:
            what = "feature columns" if group[0] == "x" else "classes"
            raise DatasetError(f"{name}: {what} disagree ({', '.join(f'ind.{name}.{p}: {w}' for p, w in widths.items())}"
                               "); the files come from different datasets")
    x, y, allx, ally = parts["x"], parts["y"], parts["allx"], parts["ally"]
    rows = x.shape[0]
    if y.shape[0] != rows or rows + 500 > allx.shape[0]:
        raise DatasetError(f"{name}: ind.{name}.x has {rows} rows, ind.{name}.y {y.shape[0]} and ind.{name}.allx "
                           f"{allx.shape[0]} (expected x and y alike, and 500 validation rows after them in allx)")
    if (x != allx[:rows]).nnz or not np.array_equal(y, ally[:rows]):
        raise DatasetError(f"{name}: ind.{name}.x/y are not the first {rows} rows of ind.{name}.allx/ally; the files "
                           "come from different versions of the dataset")


def _edge_list(adjacency: dict, num_nodes: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        src = np.concatenate([np.full(len(nbrs), node, dtype=np.int64) for node, nbrs in adjacency.items()])
        dst = np.concatenate([np.asarray(nbrs, dtype=np.int64) for nbrs in adjacency.values()])
    except (TypeError, ValueError):
        raise DatasetError(f"ind.{name}.graph is corrupt: adjacency lists must hold integer node ids") from None
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
        raise DatasetError(f"ind.{name}.graph names nodes outside [0, {num_nodes})")
    return src, dst
