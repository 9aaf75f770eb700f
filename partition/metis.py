"""K-way METIS through pymetis, with edge and vertex weights (Karypis & Kumar 1998)."""

from __future__ import annotations

import numpy as np
import pymetis
import scipy.sparse as sp

#: METIS refinement passes per uncoarsening level (its ``niter`` option) for graphs with more than
#: :data:`LARGE_GRAPH_ENTRIES` stored entries; smaller graphs get METIS's own default, 10. Measured at K = 16:
#: on the 2M-node power-law batch of ``benchmarks/reg_scale.py`` (REG of 3.9·10⁶ entries) 3 passes cut
#: METIS's time from ~3.5 s to ~2.2 s for +0.03% input redundancy (induced graph: 1.1 s → 0.4 s, +0.03%);
#: on full-neighbourhood Amazon Computers and Coauthor Physics (REG of 1.9·10⁶ and 2.6·10⁶ entries) the
#: redundancy moves by under 0.05%; on Cora's (9·10⁴ entries) it rose 2.4% at K = 4, hence the size rule.
REFINEMENT_ITERATIONS = 3
LARGE_GRAPH_ENTRIES = 1_000_000
#: Above this many stored entries METIS always partitions k-way (``METIS_PartGraphKway``); at most that many,
#: pymetis's default: recursive bisection for ``k ≤ 8``, k-way above. Measured on the nested-block 2M-node
#: power-law batch of ``benchmarks/table6.py`` (REG of 4.5·10⁶ entries, 200k outputs, 3 passes): at K = 8
#: k-way took 1.03 s of CPU against 1.46 s and left 3.48M input nodes against 3.59M (K = 4: 1.09 s against
#: 1.20 s, 3.11M against 3.19M).
KWAY_ENTRIES = 1_000_000


def metis_kway(adjacency: sp.csr_matrix, k: int, seed: int = 0, vertex_weights: np.ndarray | None = None,
               *, niter: int | None = None) -> np.ndarray:
    """Partition a symmetric weighted graph into ``k`` parts minimising the weighted edge cut.

    Args:
        adjacency: ``(n, n)`` symmetric CSR matrix with positive integer weights and an
            empty diagonal; its values are passed to METIS as edge weights.
        k: number of parts, ``1 ≤ k ≤ n``.
        seed: METIS random seed (same seed, same partition).
        vertex_weights: optional ``(n,)`` positive integers to balance instead of counts.
        niter: refinement passes per level; ``None``: :data:`REFINEMENT_ITERATIONS` above
            :data:`LARGE_GRAPH_ENTRIES` stored entries, else METIS's default (10).

    Graphs above :data:`KWAY_ENTRIES` stored entries are partitioned k-way for every ``k``; smaller ones
    by recursive bisection for ``k ≤ 8``, as pymetis does by default.

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
    if niter is None:
        niter = REFINEMENT_ITERATIONS if adjacency.nnz > LARGE_GRAPH_ENTRIES else 10
    options = pymetis.Options(seed=seed, niter=niter)
    _, parts = pymetis.part_graph(
        k,
        pymetis.CSRAdjacency(adjacency.indptr.astype(np.int64), adjacency.indices.astype(np.int64)),
        eweights=weights.astype(np.int64) if weights.size else None,
        vweights=None if vertex_weights is None else np.asarray(vertex_weights, dtype=np.int64),
        options=options,
        recursive=None if adjacency.nnz <= KWAY_ENTRIES else False,
    )
    return np.asarray(parts, dtype=np.int64)
