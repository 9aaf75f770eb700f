"""Redundancy-embedded graph (REG) construction (Betty §4.3.2, Algorithm 1, Eq. 2–4)."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from partition.slicing import BlockStructure


def output_adjacency(block: BlockStructure) -> sp.csr_matrix:
    """The transposed binary adjacency ``Aᵀ`` of a block: ``(num_dst, num_src)`` CSR, int64 ones.

    Row ``d`` holds the src positions of dst ``d``'s in-edges; this is the block's
    CSC read as CSR, so no copy of the structure is sorted or transposed.
    """
    indptr = block.indptr.cpu().numpy()
    indices = block.indices.cpu().numpy()
    ones = np.ones(indices.shape[0], dtype=np.int64)
    return sp.csr_matrix((ones, indices, indptr), shape=(block.num_dst, block.num_src))


def build_reg(block: BlockStructure, weighted: bool = True) -> sp.csr_matrix:
    """Build the REG of a batch's output block: ``C = AᵀA`` with the diagonal removed.

    ``c_ij`` counts the in-neighbours that outputs ``i`` and ``j`` share (Eq. 4), i.e.
    the input rows that are duplicated if ``i`` and ``j`` land in different
    micro-batches. Rows and columns are the output block's dst nodes only, which is
    Algorithm 1's "remove non-output nodes" (lines 5–6).

    Args:
        block: the output block (last layer) of the full batch.
        weighted: keep the shared-neighbour counts as edge weights (Betty's intent);
            ``False`` sets every weight to 1, which is what the paper's artifact
            effectively partitioned (its METIS call dropped edge weights).

    Returns:
        ``(num_dst, num_dst)`` symmetric CSR matrix, int64 weights ≥ 1, empty diagonal.
    """
    at = output_adjacency(block)
    reg = (at @ at.T).tocsr()
    reg.setdiag(0)
    reg.eliminate_zeros()
    if not weighted:
        reg.data[:] = 1
    reg.sort_indices()
    return reg
