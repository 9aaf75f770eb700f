"""Facebook100 university friendship graphs (Traud, Mucha & Porter, Physica A 2012) from MATLAB ``.mat``
files, as LINKX uses them (Lim et al., "Large Scale Learning on Non-Homophilous Graphs", NeurIPS 2021).

Format (``../shared/datasets/facebook100/SOURCE.md``): ``A`` a symmetric sparse 0/1
adjacency, ``local_info`` ``(N, 7)`` uint16 categorical attributes (0 = missing): status,
gender, major, minor, dorm, year, high school. Label = gender − 1 (``-1`` = missing);
features = one-hot encodings of the six other columns (each column's distinct values,
"missing" included, as LINKX does). Read with :func:`scipy.io.loadmat` (MATLAB v5 data,
no code execution). No official split here: a seeded random 50/25/25 split of the
labelled nodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sp
import torch

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.splits import random_split
from betty_trainer.errors import DatasetError

SPLIT = (0.5, 0.25)
FEATURE_COLUMNS = (0, 2, 3, 4, 5, 6)
GENDER = 1


def load_facebook100(path: Path, name: str, split_seed: int = 0) -> Graph:
    """Load one Facebook100 ``.mat`` graph (see the module docstring).

    Args:
        path: the ``.mat`` file (e.g. ``Amherst41.mat``).
        name: graph name.
        split_seed: seed of the random split of the labelled nodes.

    Returns:
        A :class:`Graph`: undirected, no self loops; ``x`` ``(N, F)`` float32 one-hot
        (Amherst41: 2,235 nodes, 181,908 directed edges, F = 1,193), ``y`` in {-1, 0, 1}, 2 classes.

    Raises:
        DatasetError: missing, truncated or corrupt file, or arrays of the wrong kind.
    """
    try:
        mat = scipy.io.loadmat(str(path))
    except FileNotFoundError:
        raise DatasetError(f"missing dataset file {path}") from None
    except (ValueError, TypeError, OSError, EOFError, NotImplementedError) as error:
        raise DatasetError(f"{path} is truncated or not a MATLAB v5 file ({error})") from None
    adjacency, info = mat.get("A"), mat.get("local_info")
    if not sp.issparse(adjacency) or not isinstance(info, np.ndarray) or info.ndim != 2 or info.shape[1] != 7:
        raise DatasetError(f"{path} should hold a sparse 'A' and a (N, 7) 'local_info'")
    num_nodes = info.shape[0]
    if adjacency.shape != (num_nodes, num_nodes):
        raise DatasetError(f"{path}: A is {adjacency.shape} but local_info has {num_nodes} rows")
    blocks = []
    for column in FEATURE_COLUMNS:
        _, codes = np.unique(info[:, column], return_inverse=True)
        onehot = np.zeros((num_nodes, int(codes.max()) + 1), dtype=np.float32)
        onehot[np.arange(num_nodes), codes.reshape(-1)] = 1.0
        blocks.append(onehot)
    y = info[:, GENDER].astype(np.int64) - 1
    train_idx, val_idx, test_idx = random_split(np.flatnonzero(y >= 0), *SPLIT, split_seed)
    return Graph.from_scipy(adjacency, symmetric=True, drop_self_loops=True,
                            x=torch.from_numpy(np.concatenate(blocks, axis=1)), y=torch.from_numpy(y),
                            train_idx=train_idx, val_idx=val_idx, test_idx=test_idx, num_classes=2, name=name)
