"""Partitioners that split a batch's output nodes into K micro-batches (Betty §4.3, Fig. 16 baselines).

Every partitioner has the signature ``(output_block, k, seed, vertex_weights) ->
(num_dst,) int64 part ids``; :data:`PARTITIONERS` maps names to them. ``vertex_weights``
(``(num_dst,)`` positive int64 or ``None``) is what METIS balances; range and random
balance output counts. The METIS-based ones partition a graph over the outputs
(:data:`GRAPHS`) that does not depend on K: :class:`OutputSplitter` builds it once per
batch and splits it for every K the planner tries. :class:`GraphPartition` instead partitions the
whole graph once per K for a run, and a sampled batch's outputs take their nodes' parts
(:class:`GraphSplitter`): no partitioning per batch. Both splitters are :class:`Splitter` s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from partition.metis import metis_kway
from partition.reg import build_reg, output_adjacency, symmetric_graph, symmetrised
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
    return symmetrised(output_adjacency(block)[:, : block.num_dst])


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
        return groups_of(parts, k)

    @property
    def num_outputs(self) -> int:
        """The outputs it splits: the output block's dst nodes."""
        return self.block.num_dst


def groups_of(parts: np.ndarray, k: int) -> list[Tensor]:
    """The outputs of each part: ``parts`` is ``(n,)`` int64 in ``[0, k)``; returns the non-empty parts' sorted
    ``int64`` positions, in part order."""
    # numpy's serial sort: torch's multi-threaded one can stall when other processes hold the cores (230k
    # outputs, 2 shared cores, load ~5: medians 0.010 s and 0.009 s, worst of 7 runs 0.24 s and 0.04 s;
    # it took 0.42 s in one profiled plan). As int16 (any k up to 32767) numpy's stable sort is a radix
    # sort: 0.04 ms against 0.18 ms as int64 for 8192 outputs in 8 parts.
    keys = parts.astype(np.int16) if k <= np.iinfo(np.int16).max else parts
    order = torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64, copy=False))
    counts = np.bincount(parts, minlength=k)
    return [group for group in torch.split(order, counts.tolist()) if group.numel()]


class GraphPartition:
    """The nodes of a whole graph partitioned once per K, for every batch of a run: a sampled batch's outputs are
    split by their nodes' parts (:meth:`splitter`), with no REG and no METIS per batch.

    Betty partitions each batch's REG (§4.3, Algorithm 1), which a full batch reused every epoch amortises but a
    sampled mini-batch pays at every step. Nodes close in the graph share in-neighbours, so a K-way METIS cut of
    the graph itself (symmetrised, unweighted, self loops dropped) keeps most of a batch's shared neighbourhoods
    inside one part, as the REG's cut does per batch; the planner measures what it costs in redundancy and
    estimated peak (and re-plans a batch with the REG where the estimate misses the budget). METIS balances
    the ``balanced`` nodes per part (vertex weight 1, the others 0): the training nodes, of which a batch's
    outputs are a sample, so its micro-batches get similar output counts.

    Args:
        indptr: ``(N + 1,)`` int64 CSC pointer of the graph.
        indices: ``(E,)`` int32 or int64 in-neighbour of each edge.
        balanced: ``(N,)`` bool, the nodes METIS balances; ``None``: all.

    Cost: METIS runs once per ``(K, seed)`` asked for, on the symmetrised graph built for it and freed after (0.6 s
    of CPU for a 100k-node, 1M-edge SBM, ``benchmarks/sampled_planning.py``; 4.5 s to symmetrise and 36 s of METIS
    at K = 8 for the 2M-node, 52M-edge power-law graph of ``configs/powerlaw-sage.yaml``, where the process peaked
    at 8.1 GB resident with the dataset loaded),
    and each part table (``(N,)`` int64) is kept for the run.
    """

    method = "graph"

    def __init__(self, indptr: Tensor, indices: Tensor, balanced: Tensor | None = None):
        self.num_nodes = indptr.numel() - 1
        self._structure = indptr.cpu().numpy(), indices.cpu().numpy()
        self._weights = None if balanced is None else balanced.cpu().numpy().astype(np.int64)
        self._parts: dict[tuple[int, int], np.ndarray] = {}
        # per (K, seed): the (N,) int8 halves (-1 until bisected) and the parts bisected so far
        self._halves: dict[tuple[int, int], tuple[np.ndarray, set[int]]] = {}
        self._all_nodes: GraphPartition | None = None  # of_all_nodes, once made

    @property
    def graph(self) -> sp.csr_matrix:
        """The ``(N, N)`` symmetric CSR graph METIS cuts: int64 weights 1, empty diagonal. Built when asked and not
        kept (``O(N + E)`` int64: about 1.2 GB for 2M nodes and 52M edges, remade in 4.5 s there), as a new
        ``(K, seed)`` is rare once a run has its K."""
        return symmetric_graph(*self._structure)

    def parts(self, k: int, seed: int = 0) -> np.ndarray:
        """``(N,)`` int64 part of every node in ``[0, k)``: METIS on :attr:`graph` (once per ``(k, seed)``).

        Raises:
            ValueError: ``k`` out of ``[1, N]``.
        """
        if (k, seed) not in self._parts:  # one part needs no graph
            self._parts[k, seed] = (metis_kway(self.graph, k, seed, self._weights) if k != 1 else
                                    np.zeros(self.num_nodes, dtype=np.int64))
        return self._parts[k, seed]

    def halves(self, k: int, seed: int, part: int) -> np.ndarray:
        """``(N,)`` int8: for the nodes of part ``part`` of the ``k``-way partition (:meth:`parts`), their half (0 or
        1) in a METIS bisection of the subgraph they induce (symmetrised, balancing the ``balanced`` nodes of the part
        where it has two or more, else all its nodes); -1 for nodes of parts not bisected yet. Each part is bisected
        once per ``(k, seed)``, on its own edges only (``O`` of the part's in-edges, and an ``(N,)`` int64 map while
        it runs), so the halves nest in the ``k`` parts, where a ``2k``-way partition of the graph would not: the
        planner cuts a micro-batch that misses its budget in two this way
        (:meth:`GraphSplitter.halves`, :func:`~partition.search.refine_split`).

        Raises:
            ValueError: ``part`` out of ``[0, k)``, or ``k`` out of ``[1, N]``.
        """
        if not 0 <= part < k:
            raise ValueError(f"part {part} is not one of the {k} parts")
        parts = self.parts(k, seed)
        if (k, seed) not in self._halves:
            self._halves[k, seed] = np.full(self.num_nodes, -1, dtype=np.int8), set()
        halves, bisected = self._halves[k, seed]
        if part not in bisected:  # a part's nodes are looked up (O(N)) once, when it is bisected
            nodes = np.flatnonzero(parts == part)
            halves[nodes] = self._bisect(nodes, seed)
            bisected.add(part)
        return halves

    def _bisect(self, nodes: np.ndarray, seed: int) -> np.ndarray:
        """``(n,)`` int64 half of each of ``nodes`` (sorted node ids) in a METIS bisection of the subgraph they
        induce (:meth:`halves`)."""
        if nodes.size < 2:
            return np.zeros(nodes.size, dtype=np.int64)
        weights = None if self._weights is None else self._weights[nodes]
        if weights is not None and weights.sum() < 2:
            weights = None
        if nodes.size == self.num_nodes:  # the whole graph (K = 1): its symmetric graph, without the edge lists
            return metis_kway(self.graph, 2, seed, weights)
        indptr, indices = self._structure
        local = np.full(self.num_nodes, -1, dtype=np.int64)
        local[nodes] = np.arange(nodes.size)
        starts, lengths = indptr[nodes], indptr[nodes + 1] - indptr[nodes]
        # every in-edge of the nodes, node by node: edge j of node i at starts[i] + j
        edges = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        sources, owners = local[indices[edges]], np.repeat(np.arange(nodes.size), lengths)
        inside = sources >= 0
        sub_indptr = np.concatenate([[0], np.cumsum(np.bincount(owners[inside], minlength=nodes.size))])
        return metis_kway(symmetric_graph(sub_indptr, sources[inside]), 2, seed, weights)

    def of_all_nodes(self) -> "GraphPartition":
        """The same graph partitioned balancing every node, not only the ``balanced`` ones: what splits a layer's dst
        nodes into layer-wise chunks, most of which are no training nodes. Itself where it balances every node; else
        made on the first call and kept (so planners sharing this partition share its part tables), sharing the
        structure arrays."""
        if self._weights is None:
            return self
        if self._all_nodes is None:
            indptr, indices = self._structure
            self._all_nodes = GraphPartition(torch.from_numpy(indptr), torch.from_numpy(indices))
        return self._all_nodes

    def splitter(self, output_nodes: Tensor) -> "GraphSplitter":
        """A :class:`Splitter` of a batch whose outputs are ``output_nodes`` (``(B,)`` int64 node ids of this
        graph)."""
        return GraphSplitter(self, output_nodes)


class GraphSplitter:
    """The outputs of one batch split by a :class:`GraphPartition`: output ``i`` goes to the part of node
    ``output_nodes[i]`` in the graph's K-way partition (a lookup per output; METIS only for a ``(K, seed)`` the
    run has not partitioned yet). ``vertex_weights`` are ignored: the graph partition balances the training
    nodes, not this batch's receptive fields."""

    method = GraphPartition.method

    def __init__(self, partition: GraphPartition, output_nodes: Tensor):
        self.partition, self.output_nodes = partition, output_nodes.cpu().numpy()

    @property
    def num_outputs(self) -> int:
        return self.output_nodes.size

    def split(self, k: int, seed: int = 0, vertex_weights: np.ndarray | None = None) -> list[Tensor]:
        """The outputs in ``k`` groups (fewer where no output falls in a part); see :func:`partition_outputs` for
        the result.

        Raises:
            ValueError: ``k`` out of ``[1, num_outputs]``.
        """
        n = self.num_outputs
        if not 1 <= k <= n:
            raise ValueError(f"cannot split {n} output nodes into {k} micro-batches")
        if k == 1:
            return [torch.arange(n)]
        return groups_of(self.partition.parts(k, seed)[self.output_nodes], k)

    def halves(self, k: int, seed: int, group: Tensor) -> list[Tensor]:
        """``group`` (``(m,)`` int64 sorted positions of outputs in one part of the ``k``-way split) in two, by the
        METIS bisection of that part (:meth:`GraphPartition.halves`): ``[group]`` where all its outputs fall in one
        half, else its two halves' sorted positions.

        Raises:
            ValueError: ``group`` is empty or spans two parts.
        """
        nodes = self.output_nodes[group.numpy()]
        parts = self.partition.parts(k, seed)[nodes]
        if not nodes.size or (parts != parts[0]).any():
            raise ValueError("halving needs the outputs of one part of the graph's split")
        half = self.partition.halves(k, seed, int(parts[0]))[nodes].astype(np.int64)
        return [group[piece] for piece in groups_of(half, 2)]


class Splitter(Protocol):
    """What the K search (:func:`partition.make_split`) asks of a splitter: :class:`OutputSplitter` (per batch)
    or :class:`GraphSplitter` (per run)."""

    method: str

    @property
    def num_outputs(self) -> int: ...

    def split(self, k: int, seed: int = 0, vertex_weights: np.ndarray | None = None) -> list[Tensor]: ...


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
