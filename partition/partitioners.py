"""Partitioners that split a batch's output nodes into K micro-batches (Betty §4.3, Fig. 16 baselines).

Every partitioner has the signature ``(output_block, k, seed, vertex_weights) ->
(num_dst,) int64 part ids``; :data:`PARTITIONERS` maps names to them. ``vertex_weights``
(``(num_dst,)`` positive int64 or ``None``) is what METIS balances; range and random
balance output counts. The METIS-based ones partition a graph over the outputs
(:data:`GRAPHS`) that does not depend on K: :class:`OutputSplitter` builds it once per
batch and splits it for every K the planner tries.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from partition.metis import metis_kway
from partition.reg import build_reg, drop_diagonal, output_adjacency
from partition.slicing import BlockStructure

Partitioner = Callable[[BlockStructure, int, int, "np.ndarray | None"], np.ndarray]


def range_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """Contiguous ranges of the outputs in batch order (Betty's "range" baseline)."""
    return (np.arange(block.num_dst) * k) // max(block.num_dst, 1)


def random_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """A uniformly random balanced assignment, deterministic from ``seed`` ("random" baseline)."""
    generator = torch.Generator().manual_seed(seed)
    parts = np.empty(block.num_dst, dtype=np.int64)
    parts[torch.randperm(block.num_dst, generator=generator).numpy()] = range_partition(block, k, seed)
    return parts


def induced_graph(block: BlockStructure) -> sp.csr_matrix:
    """The graph the output block's edges induce on its outputs: ``(num_dst, num_dst)`` symmetric
    CSR, int64 weights 1, empty diagonal. With full neighbourhoods it is the original graph
    induced on the outputs."""
    at = output_adjacency(block)[:, : block.num_dst]
    induced = drop_diagonal(((at + at.T) > 0).astype(np.int64).tocsr())
    induced.sort_indices()
    return induced


#: Per METIS-based partitioner, the graph over the outputs that METIS cuts (built once per batch).
GRAPHS: dict[str, Callable[[BlockStructure], sp.csr_matrix]] = {
    "reg": lambda block: build_reg(block, weighted=True, inverse_degree=True),
    "reg_unweighted": lambda block: build_reg(block, weighted=False),
    "metis": induced_graph,
}


def induced_metis_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the graph the output block's edges induce on the outputs ("metis" baseline)."""
    return metis_kway(induced_graph(block), k, seed, vertex_weights)


def reg_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the weighted REG (Betty Algorithm 1): hubs clipped, each shared in-neighbour read by ``d``
    outputs weighing ~1/(d − 1) (see :func:`partition.reg.build_reg`)."""
    return metis_kway(GRAPHS["reg"](block), k, seed, vertex_weights)


def unweighted_reg_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the REG with all weights 1 (what the paper's artifact ran; for comparison)."""
    return metis_kway(build_reg(block, weighted=False), k, seed, vertex_weights)


PARTITIONERS: dict[str, Partitioner] = {
    "reg": reg_partition,
    "reg_unweighted": unweighted_reg_partition,
    "metis": induced_metis_partition,
    "range": range_partition,
    "random": random_partition,
}


class OutputSplitter:
    """The output nodes of one batch, ready to be split into any number of micro-batches.

    A METIS-based method's graph over the outputs (:data:`GRAPHS`: the REG, or the
    induced graph) does not depend on K, so it is built at the first split with ``k > 1``
    and reused for every later K (Betty §4.4.3's search tries several).

    Args:
        output_block: the batch's last block.
        method: a key of :data:`PARTITIONERS`.
        graph: a ``(num_dst, num_dst)`` graph to cut instead of ``GRAPHS[method]`` (e.g. an
            unclipped REG, for comparison); only for METIS-based methods.

    Raises:
        ValueError: for an unknown method, or a graph for range/random.
    """

    def __init__(self, output_block: BlockStructure, method: str = "reg", graph: sp.csr_matrix | None = None):
        if method not in PARTITIONERS:
            raise ValueError(f"unknown partitioner {method!r}; choose one of {sorted(PARTITIONERS)}")
        if graph is not None and method not in GRAPHS:
            raise ValueError(f"partitioner {method!r} cuts no graph; give a graph only with {sorted(GRAPHS)}")
        self.block = output_block
        self.method = method
        self._graph = graph

    @property
    def graph(self) -> sp.csr_matrix | None:
        """The ``(num_dst, num_dst)`` graph METIS cuts (built on first use); ``None`` for range/random."""
        if self._graph is None and self.method in GRAPHS:
            self._graph = GRAPHS[self.method](self.block)
        return self._graph

    def split(self, k: int, seed: int = 0, vertex_weights: np.ndarray | None = None) -> list[Tensor]:
        """Split the outputs into ``k`` groups; see :func:`partition_outputs` for the arguments and result.

        Raises:
            ValueError: ``k`` out of range.
        """
        n = self.block.num_dst
        if not 1 <= k <= n:
            raise ValueError(f"cannot split {n} output nodes into {k} micro-batches")
        if k == 1:
            return [torch.arange(n)]
        if self.method in GRAPHS:
            parts = metis_kway(self.graph, k, seed, vertex_weights)
        else:
            parts = PARTITIONERS[self.method](self.block, k, seed, vertex_weights)
        # numpy's serial sort: torch's multi-threaded one can stall when other processes hold the cores (230k
        # outputs, 2 shared cores, load ~5: medians 0.010 s and 0.009 s, worst of 7 runs 0.24 s and 0.04 s;
        # it took 0.42 s in one profiled plan)
        order = torch.from_numpy(np.argsort(parts, kind="stable").astype(np.int64, copy=False))
        counts = np.bincount(parts, minlength=k)
        return [group for group in torch.split(order, counts.tolist()) if group.numel()]


def partition_outputs(output_block: BlockStructure, k: int, method: str = "reg", seed: int = 0,
                      vertex_weights: np.ndarray | None = None) -> list[Tensor]:
    """Split the output nodes of a batch into ``k`` groups.

    Args:
        output_block: the batch's last block.
        k: number of micro-batches, ``1 ≤ k ≤ num_dst``.
        method: a key of :data:`PARTITIONERS`.
        seed: seed of the partitioner's randomness.
        vertex_weights: optional ``(num_dst,)`` positive int64 costs METIS balances.

    Returns:
        Non-empty, sorted ``int64`` tensors of output positions, disjoint and covering
        ``range(num_dst)``; fewer than ``k`` only if METIS leaves a part empty.

    Raises:
        ValueError: for an unknown method or ``k`` out of range.
    """
    return OutputSplitter(output_block, method).split(k, seed, vertex_weights)
