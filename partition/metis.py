"""K-way METIS through pymetis, with edge and vertex weights (Karypis & Kumar 1998)."""

from __future__ import annotations

import numpy as np
import pymetis
import scipy.sparse as sp


def metis_kway(adjacency: sp.csr_matrix, k: int, seed: int = 0, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """Partition a symmetric weighted graph into ``k`` parts minimising the weighted edge cut.

    Args:
        adjacency: ``(n, n)`` symmetric CSR matrix with positive integer weights and an
            empty diagonal; its values are passed to METIS as edge weights.
        k: number of parts, ``1 ≤ k ≤ n``.
        seed: METIS random seed (same seed, same partition).
        vertex_weights: optional ``(n,)`` positive integers to balance instead of counts.

    Returns:
        ``(n,)`` int64 part of each vertex in ``[0, k)``.

    Raises:
        ValueError: if ``k`` is out of range or the weights are not positive integers.
    """
    n = adjacency.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} vertices into {k} parts")
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    weights = adjacency.data
    if weights.size and (weights.min() < 1 or not np.issubdtype(weights.dtype, np.integer)):
        raise ValueError("METIS edge weights must be positive integers")
    options = pymetis.Options(seed=seed)
    _, parts = pymetis.part_graph(
        k,
        pymetis.CSRAdjacency(adjacency.indptr.astype(np.int64), adjacency.indices.astype(np.int64)),
        eweights=weights.astype(np.int64) if weights.size else None,
        vweights=None if vertex_weights is None else np.asarray(vertex_weights, dtype=np.int64),
        options=options,
    )
    return np.asarray(parts, dtype=np.int64)
