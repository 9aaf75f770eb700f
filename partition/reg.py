"""Redundancy-embedded graph (REG) construction (Betty §4.3.2, Algorithm 1, Eq. 2–4), with hub clipping.

``C = AᵀA`` over the output block's binary adjacency ``A`` (src × dst) counts, for every
pair of outputs, the in-neighbours they share. A src node read by ``d`` outputs adds
``d²`` entries to ``C``, so on power-law graphs a few hubs make ``C`` dense (a node of
in-degree 2·10⁵ read by 10⁴ outputs of a batch alone adds 10⁸ entries). Hub clipping
drops those columns before the product; see :func:`hub_threshold` for the rule and why
it costs little redundancy.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from partition.slicing import BlockStructure

#: Default bound on the output pairs ``Σ d(d − 1)`` the kept src nodes form (see :func:`hub_threshold`):
#: about 2·10⁶ REG entries, 24 MB as an int64 CSR (more where the src nodes read by at most
#: :data:`MIN_HUB_DEGREE` outputs alone form more pairs). Measured on the 230k-output batch (fanouts 10,25)
#: of ``benchmarks/table6.py``'s nested-block power-law graph (53M edges): 4·10⁶ pairs with
#: ``MIN_HUB_DEGREE = 8`` kept 5.1·10⁶ entries (REG 0.84 s of CPU, METIS at K = 8 1.28 s, 3.92M input
#: nodes); 3·10⁶ with 6 keep 4.0·10⁶ (0.61 s, 0.91 s, 4.00M: +2.2%; K = 64 +2.7%); 2·10⁶ with 4 keep
#: 2.6·10⁶ (0.59 s, 0.70 s, 4.05M: +3.3%; K = 64 +5.0%). On the class-block graph (52M edges, 204k
#: outputs) the three give 6.58M, 6.61M and 7.00M input nodes at K = 8 (METIS 2.90, 2.46, 1.98 s). The
#: smallest is the default: REG and METIS run on one core while training uses all, so on a quiet machine
#: 3·10⁶ took ~9% of the nested graph's epoch at K = 8 (1.6 s of CPU against ~17 s), too near the 10% aim.
MAX_PAIRS = 2_000_000
#: Src nodes read by at most this many outputs are never clipped, whatever the pair bound.
MIN_HUB_DEGREE = 4
#: With ``inverse_degree``, a src node read by ``d`` outputs weighs ``round(INVERSE_DEGREE_SCALE / (d − 1))``
#: (at least 1) on each pair of its readers.
INVERSE_DEGREE_SCALE = 64


def output_adjacency(block: BlockStructure) -> sp.csr_matrix:
    """The transposed binary adjacency ``Aᵀ`` of a block: ``(num_dst, num_src)`` CSR, int64 ones.

    Row ``d`` holds the src positions of dst ``d``'s in-edges; this is the block's
    CSC read as CSR, so no copy of the structure is sorted or transposed.
    """
    indptr = block.indptr.cpu().numpy()
    indices = block.indices.cpu().numpy()
    ones = np.ones(indices.shape[0], dtype=np.int64)
    return sp.csr_matrix((ones, indices, indptr), shape=(block.num_dst, block.num_src))


def reader_counts(block: BlockStructure) -> np.ndarray:
    """Per src node of the block, how many of its dst nodes read it (its out-degree in the block).

    Returns:
        ``(num_src,)`` int64.
    """
    return np.bincount(block.indices.cpu().numpy(), minlength=block.num_src).astype(np.int64)


def hub_threshold(readers: np.ndarray, max_pairs: int, min_degree: int = MIN_HUB_DEGREE) -> int:
    """The largest reader count ``t`` whose src nodes the REG keeps; nodes read by more are hubs.

    The rule: keep src nodes in increasing order of their reader count ``d`` while the
    ordered output pairs they form, ``Σ d(d − 1)`` (the work of ``AᵀA`` and the most
    entries it can have off the diagonal), stay within ``max_pairs``; never clip a node
    read by ``min_degree`` outputs or fewer. The bound sets the REG's cost; the order (the
    most-read nodes go first) is what keeps its redundancy, as follows.

    Why the most-read nodes go first: a src node read by ``d`` outputs that land in
    ``p`` micro-batches is gathered ``p`` times, so it adds at most ``min(d, K) − 1`` to
    the redundancy, whereas in ``C`` it puts weight 1 on each of its ``d(d − 1)/2`` output
    pairs, of which a K-way cut splits about ``1 − 1/K`` unless its readers stay
    together. Per entry of ``C`` it is worth ~``2(min(d, K) − 1) / d²`` of redundancy: the
    most-read nodes are worth the least (those read by more outputs than a micro-batch
    holds are in several micro-batches whatever the cut), yet their ``d²`` pairs would
    dominate METIS's objective over the other nodes' real savings. Dropping them first
    keeps the informative pairs (``benchmarks/reg_scale.py`` measures the redundancy).

    Args:
        readers: ``(num_src,)`` int64 reader counts (:func:`reader_counts`).
        max_pairs: bound on ``Σ d(d − 1)`` over kept nodes.
        min_degree: nodes with ``d ≤ min_degree`` are always kept.

    Returns:
        ``t`` ≥ ``min_degree``, the largest reader count kept (``readers.max()`` when nothing
        is clipped); all nodes read by the same number of outputs are kept or clipped together.
    """
    small = readers[readers <= min_degree].astype(np.float64)
    ordered = np.sort(readers[readers > min_degree]).astype(np.float64)
    if ordered.size == 0:
        return int(min_degree)
    pairs = float((small * (small - 1)).sum()) + np.cumsum(ordered * (ordered - 1))
    within = np.searchsorted(pairs, float(max_pairs), side="right")
    if within == ordered.size:
        return int(ordered[-1])
    # whole reader-count classes only: the class that does not fit entirely is clipped entirely
    first_clipped = np.searchsorted(ordered, ordered[within], side="left")
    return int(ordered[first_clipped - 1]) if first_clipped > 0 else int(min_degree)


def build_reg(block: BlockStructure, weighted: bool = True, *, max_hub_degree: int | None = None,
              clip_hubs: bool = True, inverse_degree: bool = False) -> sp.csr_matrix:
    """Build the REG of a batch's output block: ``C = AᵀA`` without diagonal, hub columns clipped.

    ``c_ij`` counts the in-neighbours that outputs ``i`` and ``j`` share (Eq. 4), i.e.
    the input rows that are duplicated if ``i`` and ``j`` land in different
    micro-batches. Rows and columns are the output block's dst nodes only, which is
    Algorithm 1's "remove non-output nodes" (lines 5–6). Src nodes read by more than
    ``max_hub_degree`` outputs (hubs) are left out of the product, so ``c_ij`` counts the
    shared non-hub in-neighbours and is exact for every pair that shares no hub
    (see :func:`hub_threshold` for the rule and why it costs little redundancy).

    Args:
        block: the output block (last layer) of the full batch.
        weighted: keep the shared-neighbour counts as edge weights (Betty's intent);
            ``False`` sets every weight to 1, which is what the paper's artifact
            effectively partitioned (its METIS call dropped edge weights).
        max_hub_degree: src nodes read by more outputs are clipped; ``None`` picks it with
            :func:`hub_threshold` and ``max_pairs=MAX_PAIRS``.
        clip_hubs: ``False`` gives the paper's unclipped ``AᵀA`` (for comparison; it can
            need ``Σ d²`` memory).
        inverse_degree: weigh a shared src node read by ``d`` outputs
            ``w = max(1, round(INVERSE_DEGREE_SCALE / (d − 1)))`` instead of 1, so
            ``C = Aᵀ diag(w) A``: the clique expansion used for hypergraph partitioning, where
            each src node's pairs weigh ~``INVERSE_DEGREE_SCALE · d`` in all, in proportion to
            the ≤ ``d − 1`` extra copies it can cost, not to its ``d²`` pairs
            (``benchmarks/reg_scale.py`` measures the redundancy it gives).

    Returns:
        ``(num_dst, num_dst)`` symmetric CSR matrix, int64 weights ≥ 1, empty diagonal,
        sorted indices. Outputs that share no non-hub in-neighbour have empty rows.
    """
    readers = reader_counts(block)
    kept = readers >= 2  # a src node read by one output adds only to the diagonal
    if clip_hubs:
        if max_hub_degree is None:
            max_hub_degree = hub_threshold(readers, MAX_PAIRS)
        kept &= readers <= max_hub_degree
    at = _kept_columns(block, kept)
    right = at.T
    if inverse_degree:
        weights = np.maximum(1, np.rint(INVERSE_DEGREE_SCALE / np.maximum(readers[kept] - 1, 1))).astype(np.int64)
        right = sp.csr_matrix((weights[at.indices], at.indices, at.indptr), shape=at.shape).T
    reg = drop_diagonal((at @ right).tocsr())
    if not weighted:
        reg.data[:] = 1
    reg.sort_indices()
    return reg


def _kept_columns(block: BlockStructure, kept: np.ndarray) -> sp.csr_matrix:
    """``Aᵀ`` (:func:`output_adjacency`) restricted to the src nodes in the ``(num_src,)`` bool mask ``kept``,
    renumbered in order: ``(num_dst, kept.sum())`` CSR of int64 ones, built from the block's edges in one
    pass (a CSR column selection would first build the whole ``Aᵀ``)."""
    indptr, indices = block.indptr.cpu().numpy(), block.indices.cpu().numpy()
    edge_kept = kept[indices]
    position = np.zeros(indices.size + 1, dtype=np.int64)
    np.cumsum(edge_kept, out=position[1:])
    rank = np.cumsum(kept) - 1  # new column of each kept src node
    columns = rank[indices[edge_kept]]
    return sp.csr_matrix((np.ones(columns.size, dtype=np.int64), columns, position[indptr]),
                         shape=(block.num_dst, int(kept.sum())))


def drop_diagonal(matrix: sp.csr_matrix) -> sp.csr_matrix:
    """``matrix`` without its diagonal entries (and explicit zeros), by a mask on the stored entries.

    ``setdiag(0)`` would insert the missing diagonal entries through scipy's slow path;
    this keeps the stored entries with ``row != col`` and rebuilds the pointer.

    Args:
        matrix: ``(n, m)`` CSR.

    Returns:
        A new ``(n, m)`` CSR of the same dtype.
    """
    rows = np.repeat(np.arange(matrix.shape[0], dtype=matrix.indices.dtype), np.diff(matrix.indptr))
    keep = (matrix.indices != rows) & (matrix.data != 0)
    indptr = np.zeros(matrix.shape[0] + 1, dtype=matrix.indptr.dtype)
    np.cumsum(np.bincount(rows[keep], minlength=matrix.shape[0]), out=indptr[1:])
    return sp.csr_matrix((matrix.data[keep], matrix.indices[keep], indptr), shape=matrix.shape)


def symmetrised(matrix: sp.csr_matrix) -> sp.csr_matrix:
    """``(matrix + matrixᵀ) > 0`` as int64 ones without the diagonal, indices sorted: the symmetric, unweighted graph
    METIS cuts (it needs one), from a square ``(n, n)`` sparse ``matrix``. Returns a new ``(n, n)`` CSR."""
    graph = drop_diagonal(((matrix + matrix.T) > 0).astype(np.int64).tocsr())
    graph.sort_indices()
    return graph


def symmetric_graph(indptr: np.ndarray, indices: np.ndarray) -> sp.csr_matrix:
    """:func:`symmetrised` of a whole graph given as its CSC ``(N + 1,)`` pointer and ``(E,)`` int32/int64
    in-neighbours (read as the CSR of ``Aᵀ``; the symmetrisation does not care which): ``(N, N)`` int64 CSR,
    ``O(N + E)``."""
    n = indptr.size - 1
    return symmetrised(sp.csr_matrix((np.ones(indices.size, dtype=np.int64), indices, indptr), shape=(n, n)))
