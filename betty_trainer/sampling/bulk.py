"""Bulk sampling as sparse products specialised to selection matrices (matrix-based bulk sampling paper §4, Alg. 1).

``k`` mini-batches are sampled together, one layer at a time from the output layer, all ``k`` in one pass per
layer (§4.1.4 and §4.2.4, Eq. 1: the batches' ``Qᵢ``, ``Pᵢ`` and ``Aᵢ`` stacked). Alg. 1 per layer:

1. ``P = Q·A`` (line 2), ``A`` the in-adjacency in CSR (row ``v`` holds ``v``'s in-neighbours: the graph's
   ``indptr``/``indices``, shared, never copied). ``Q`` is a 0/1 *selection* matrix: row ``r`` has a single 1, in
   column ``dst[r]`` (GraphSAGE, §4.1.1), or batch ``i``'s row ``r`` selects dst node ``r`` of batch ``i`` (LADIES'
   row extraction ``Q_R``, §4.2.3). So the SpGEMM ``Q·A`` is exactly ``A``'s selected rows: its CSR is
   ``crow = (indptr[dst], indptr[dst + 1])`` (row begin and end offsets: the four-array CSR form) over ``A``'s own
   column indices, which is what is computed; a row's nonzeros are read only where a step needs them. (A
   ``torch.sparse_csr_tensor`` needs one monotone ``crow`` over its own column array, so it could hold this product
   only by copying every selected row's columns: the in-edges of every dst node, many times what NS keeps.)
2. NORM (line 3) and the draw (line 4, inverse transform sampling, §4.1.2 and §4.2.2), per sampler below.
3. EXTRACT (line 5, §4.1.3 and §4.2.3): each batch's kept nonzeros are its block; its empty columns are dropped
   by numbering its src nodes, dst nodes first, then the others ascending (as every sampler numbers them), for all
   ``k`` batches at once on ``batch · N + node`` keys.

Every random number is a counter-based hash of ``(seed, epoch, step, layer, node[, round])`` under the batch's
own key (:class:`~betty_trainer.sampling.base.SampleKeys`), so a batch is the same sampled alone or among ``k``.
The steps are tensor ops, so with ``device="cuda"`` they run on the GPU (the graph structure is copied there once);
on the CPU, NS's numba kernels compute the same per-row draw and the same extraction, one call per layer for the
whole stack (tensor ops there cost a pass over memory each, a kernel one pass for all of them).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.graph import Graph
from betty_trainer.rng import uniforms
from betty_trainer.sampling.base import BlockSampler, SampleKey, SampleKeys
from betty_trainer.sampling.neighbor import (
    Kernel,
    _check_fanout,
    _use_numba,
    kept_edges,
    kept_sources_numba,
    relabel_stack,
)
from partition.slicing import LOCAL_INDEX


class BulkSampler(BlockSampler):
    """What the bulk samplers share: ``bulk`` batches walked layer by layer as one stack (§4.1.4, Eq. 1).

    A subclass writes one stacked layer, :meth:`_sample_stack`. :meth:`sample_many` keeps the ``k`` batches stacked
    across layers (a layer's stacked src nodes are the next layer's stacked dst nodes) and splits them into
    :class:`Block` at the end; Python work per layer is a fixed number of tensor operations, whatever ``k``.

    Args:
        graph: the graph; blocks come out on its device.
        fanouts: one entry per layer, **input layer first**; ``None`` or ``-1``: no limit.
        bulk: batches the schedule hands :meth:`sample_many` at once (``sampling.bulk``).
        device: where the products and draws run (``sampling.device``): ``"cpu"`` or ``"cuda"``; the graph's
            ``indptr`` and ``indices`` are copied there once unless they are there already.
        kernel: ``"auto"`` (numba kernels on the CPU: NS's per-row draw for bulk-ns, the extraction for both;
            tensor ops elsewhere), ``"tensor"`` or ``"numba"``; all give the same sample.

    Raises:
        ValueError: a fanout of 0 or below -1, ``bulk < 1``, or ``kernel`` unknown or unavailable.
        RuntimeError: ``device`` is ``"cuda"`` and no CUDA device is available.
    """

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], bulk: int = 8,
                 device: torch.device | str = "cpu", kernel: Kernel = "auto") -> None:
        if bulk < 1:
            raise ValueError(f"bulk must be at least 1 batch, got {bulk}")
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("bulk sampling on 'cuda' needs a CUDA device, and torch sees none; use device 'cpu'")
        self.graph = graph
        self.fanouts = [_check_fanout(f) for f in fanouts]
        self.bulk = int(bulk)
        self.device = device
        self._indptr, self._indices = graph.indptr.to(device), graph.indices.to(device)
        self._numba = _use_numba(kernel, self._indptr)  # refuses an unknown or unavailable kernel now

    def sample_many(self, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]) -> list[Batch]:
        """The batches of ``seed_batches[i]`` under ``keys[i]``, all ``k`` sampled as one stack per layer.

        Args:
            seed_batches: ``k`` tensors of ``(B_i,)`` int64 distinct output node ids.
            keys: ``k`` :class:`SampleKey` (seeds below 2⁶³).

        Returns:
            ``k`` :class:`Batch` of ``len(fanouts) − first_layer`` blocks each, input layer first, on the graph's
            device; batch ``i`` is what :meth:`sample` gives for ``(seed_batches[i], keys[i])`` alone.

        Raises:
            ValueError: a key's seed of 2⁶³ or more.
        """
        layers = self._walk(seed_batches, keys, range(self.first_layer, len(self.fanouts)))
        return [Batch(list(blocks)) for blocks in zip(*layers, strict=True)] if layers else \
            [Batch([]) for _ in seed_batches]

    def sample(self, seeds: Tensor, key: SampleKey) -> Batch:
        """:meth:`sample_many` of one batch."""
        return self.sample_many([seeds], [key])[0]

    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` of batch ``key`` whose dst nodes are ``dst`` (a stack of one)."""
        return self._walk([dst], [key], [layer])[0][0]

    def _walk(self, dsts: Sequence[Tensor], keys: Sequence[SampleKey], layers: Sequence[int]) -> list[list[Block]]:
        """Blocks ``layers`` (input layer first) of each batch: one list of ``k`` blocks per layer."""
        counts = torch.tensor([d.numel() for d in dsts], dtype=torch.int64, device=self.device)
        dst = torch.cat([d.long() for d in dsts]).to(self.device) if dsts else counts.new_empty(0)
        stacked_keys = SampleKeys.of(keys, self.device)
        out = []
        for layer in reversed(layers):
            stack = self._sample_stack(dst, counts, layer, stacked_keys)
            out.append(stack.blocks(self.graph.indptr.device))
            dst, counts = stack.src_nodes, stack.src_counts
        out.reverse()
        return out

    @abstractmethod
    def _sample_stack(self, dst: Tensor, counts: Tensor, layer: int, keys: SampleKeys) -> StackedBlocks:
        """Block ``layer`` of every batch of the stack (``dst`` ``(R,)`` int64, batch ``i``'s rows being the
        ``counts[i]`` after batch ``i − 1``'s)."""


class BulkNeighborSampler(BulkSampler):
    """Uniform neighbour sampling of ``bulk`` batches at once (GraphSAGE as sparse products, bulk paper §4.1).

    Samples exactly what :class:`~betty_trainer.sampling.neighbor.NeighborSampler` samples (same fanouts, same
    keyed draws, same block numbering), so training with either is the same run; only the layout differs.

    Per layer (Alg. 1): ``P = Q·A`` is ``A``'s rows of the stacked dst nodes (module docstring); NORM divides row
    ``r`` by its sum, so every nonzero of it is ``1/deg(r)``: the row's distribution is carried by its offset and
    degree alone. ITS on it (§4.1.2) has a closed form: a uniform variate ``u`` searched in the prefix sums
    ``(i + 1)/d`` lands on nonzero ``⌊u·d⌋``. The ``s`` draws without replacement are Floyd's rounds
    (:func:`~betty_trainer.sampling.neighbor.floyd_offsets`, NS's: round ``i`` draws among the row's first
    ``d − s + i + 1`` nonzeros and keeps the draw or, if already kept, the last of them), with ``u`` NS's hash of the
    dst node under its own batch's round key; a row of degree at most ``s`` keeps all its nonzeros. Only the drawn
    positions' column ids are read from ``A``. EXTRACT (§4.1.3) numbers each batch's src nodes.

    Work and memory per layer O(kept edges + rows), plus :func:`extract`'s dense array over the node ids where it
    is small beside them (``N`` labels on the CPU, ``k·N`` flags with tensor ops).
    """

    def _sample_stack(self, dst: Tensor, counts: Tensor, layer: int, keys: SampleKeys) -> StackedBlocks:
        fanout = self.fanouts[layer]
        batch_of_row = _batch_of_rows(counts, dst.numel())
        round_keys = keys.round_keys(layer, 0 if fanout is None else fanout)
        if self._numba:  # NS's CPU kernel over the whole stack, each row under its batch's keys
            pointer, src = kept_sources_numba(self._indptr, self._indices, dst, fanout, round_keys, batch_of_row)
        else:
            pointer, edge_ids = kept_edges(self._indptr, dst, fanout, round_keys, batch_of_row)
            src = self._indices[edge_ids].long()
        return extract(dst, counts, batch_of_row, pointer, src, self.graph.num_nodes, numba=self._numba)


class BulkLadiesSampler(BulkSampler):
    """LADIES (layer-dependent importance sampling, Zou et al. 2019) of ``bulk`` batches at once, as sparse
    products (bulk paper §4.2).

    ``fanouts[l]`` is ``s``, the vertices a batch samples for layer ``l`` (``None``: every vertex of its
    aggregated neighbourhood). Per batch and layer (Alg. 1):

    * **Probabilities** (§4.2.1, §2.2): batch ``i``'s ``Q`` has one row with a 1 in the column of each of its
      dst nodes ``S``, so its ``P = Q·A`` is one row whose column ``v`` holds ``e_v``, the number of ``S``'s
      nodes ``v`` is an in-neighbour of. The column probabilities are the squared column norms of the
      row-normalised ``P`` (§2.2's LADIES distribution): ``p_v = (e_v/Σe)² / Σ_u (e_u/Σe)² = e_v² / Σ_u e_u²``.
      The row sum cancels, so they are computed as that quotient of integers, exactly (one float64 rounding).
      Computing ``P`` reads every in-edge of ``S``: the distribution is over the whole aggregated neighbourhood.
    * **Draw** (§4.2.2): ``s`` distinct vertices without replacement, as §4.1.2's ITS does (each draw by ITS from
      ``p``, repeated until ``s`` are distinct: successive sampling). That distribution over ordered samples is
      drawn in one pass by exponential races (Efraimidis & Spirakis, IPL 97(5), 2006): vertex ``v`` gets
      ``E_v / p_v`` with ``E_v = −ln u_v`` (ITS of an exponential variate), ``u_v`` the hash of ``v`` under the
      batch's layer key, and the ``s`` smallest win. Fewer than ``s`` candidates: all are taken.
    * **Extraction** (§4.2.3–4.2.4): the block is ``Q_R·A·Q_C``, every edge from a sampled vertex to a dst node
      of the batch, row-normalised: each edge of a dst node with ``c`` of them weighs ``1/c`` (``edge_weight``).
      Its src nodes are the dst nodes then the other sampled vertices (the block convention keeps the dst nodes
      for their own rows; as LADIES' implementation does, they are the next layer's dst nodes with the sampled
      ones). The paper's extraction carries no ``1/p`` importance factor, and neither does this block.

    Work and memory per layer O(in-edges of the dst nodes) (with a sort of the batches' distinct
    ``(batch, vertex)`` pairs), independent of ``N`` except for the flags of :func:`extract`.
    """

    def _sample_stack(self, dst: Tensor, counts: Tensor, layer: int, keys: SampleKeys) -> StackedBlocks:
        p = self._distribution(dst, counts)
        fanout = self.fanouts[layer]
        sampled = torch.ones(p.pairs.numel(), dtype=torch.bool, device=dst.device)
        if fanout is not None:
            variates = uniforms(keys.layer_keys(layer)[p.batch], p.node)
            race = torch.argsort(-variates.log() / p.weight, stable=True)  # E_v / p_v up to the batch's Σe²
            race = race[torch.argsort(p.batch[race], stable=True)]  # batch by batch, each in race order
            first = torch.cumsum(p.batch_pairs, 0) - p.batch_pairs
            rank = torch.arange(race.numel(), device=dst.device) - first[p.batch[race]]
            sampled[race] = rank < fanout
        kept = sampled[p.pair_of_edge]
        per_row = torch.bincount(p.row_of_edge[kept], minlength=dst.numel())
        pointer = torch.zeros(dst.numel() + 1, dtype=torch.int64, device=dst.device)
        torch.cumsum(per_row, 0, out=pointer[1:])
        weight = torch.repeat_interleave(1.0 / per_row.clamp(min=1).float(), per_row, output_size=int(pointer[-1]))
        return extract(dst, counts, p.batch_of_row, pointer, p.node[p.pair_of_edge[kept]], self.graph.num_nodes,
                       weight, numba=self._numba)

    def column_probabilities(self, dsts: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """LADIES' column probabilities of each batch whose dst nodes are ``dsts[i]`` (the class docstring).

        Args:
            dsts: ``k`` tensors of ``(n_i,)`` int64 distinct global ids.

        Returns:
            Per batch, ``(nodes, p)``: ``(m_i,)`` int64 the vertices of its aggregated neighbourhood, ascending,
            and ``(m_i,)`` float64 their probabilities ``e_v² / Σ_u e_u²`` (summing to 1), on the sampling device.
        """
        counts = torch.tensor([d.numel() for d in dsts], dtype=torch.int64, device=self.device)
        p = self._distribution(torch.cat([d.long() for d in dsts]).to(self.device), counts)
        total = torch.zeros(counts.numel(), dtype=torch.int64, device=self.device).index_add_(0, p.batch, p.weight)
        probability = p.weight.double() / total[p.batch].double()
        sizes = p.batch_pairs.tolist()
        return list(zip(p.node.split(sizes), probability.split(sizes), strict=True))

    def _distribution(self, dst: Tensor, counts: Tensor) -> _Distribution:
        """``P = Q·A`` of every batch of the stack: its nonzeros ``(batch, v, e_v)`` and where each in-edge lands."""
        nodes = self.graph.num_nodes
        batch_of_row = _batch_of_rows(counts, dst.numel())
        pointer, edge_ids = kept_edges(self._indptr, dst, None)
        edge_keys = self._indices[edge_ids].long()
        edge_keys += torch.repeat_interleave(batch_of_row * nodes, pointer.diff(), output_size=edge_keys.numel())
        pairs, pair_of_edge, e = torch.unique(edge_keys, return_inverse=True, return_counts=True)
        batch = torch.div(pairs, nodes, rounding_mode="floor")
        row_of_edge = torch.repeat_interleave(torch.arange(dst.numel(), device=dst.device), pointer.diff(),
                                              output_size=edge_keys.numel())
        return _Distribution(batch_of_row, pairs, batch, pairs - batch * nodes, e * e,
                             torch.bincount(batch, minlength=counts.numel()), pair_of_edge, row_of_edge)


@dataclass
class _Distribution:
    """LADIES' ``P`` of a stack (:meth:`BulkLadiesSampler._distribution`): ``R`` rows, ``E`` in-edges, ``M``
    nonzeros (distinct ``(batch, v)`` pairs, ascending by ``batch · N + v``), all int64."""

    batch_of_row: Tensor  # (R,) the batch of each dst row
    pairs: Tensor  # (M,) batch · N + v
    batch: Tensor  # (M,) the pair's batch
    node: Tensor  # (M,) the pair's vertex v
    weight: Tensor  # (M,) e_v², proportional to p_v within the batch
    batch_pairs: Tensor  # (k,) nonzeros per batch
    pair_of_edge: Tensor  # (E,) the pair each in-edge adds 1 to
    row_of_edge: Tensor  # (E,) the dst row of each in-edge (CSC order)


@dataclass
class StackedBlocks:
    """One layer's blocks of ``k`` batches, stacked (batch ``i``'s parts follow batch ``i − 1``'s).

    Attributes:
        src_nodes: ``(S,)`` int64 global ids: batch ``i``'s ``src_counts[i]`` src nodes, dst nodes first.
        src_counts: ``(k,)`` int64.
        dst_counts: ``(k,)`` int64 dst nodes (rows) per batch.
        pointer: ``(R + 1,)`` int64 CSC pointer over the stacked rows and edges.
        local: ``(E,)`` int32 each edge's src position within its own batch's block.
        weight: ``(E,)`` float32 edge weights, or ``None``.
    """

    src_nodes: Tensor
    src_counts: Tensor
    dst_counts: Tensor
    pointer: Tensor
    local: Tensor
    weight: Tensor | None = None

    def blocks(self, device: torch.device) -> list[Block]:
        """The ``k`` :class:`Block` on ``device`` (one copy of the stack when it is elsewhere)."""
        parts = [t.to(device) for t in (self.src_nodes, self.pointer, self.local)]
        src_nodes, pointer, local = parts
        weight = None if self.weight is None else self.weight.to(device)
        rows = [0, *torch.cumsum(self.dst_counts, 0).tolist()]
        edges = pointer[rows].tolist()
        src = src_nodes.split(self.src_counts.tolist())
        return [Block(src[i], rows[i + 1] - rows[i], pointer[rows[i]:rows[i + 1] + 1] - edges[i],
                      local[edges[i]:edges[i + 1]], None if weight is None else weight[edges[i]:edges[i + 1]])
                for i in range(len(src))]


def _batch_of_rows(counts: Tensor, rows: int) -> Tensor:
    """``(rows,)`` int64: the batch of each stacked row."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=rows)


_DENSE_RELABEL = 4
""":func:`extract` uses a dense array over the node ids (the tensor path: a flag per ``(batch, node)``, ``k·N``; the
CPU kernel: a label per node, ``N``) when it is at most this many per kept edge and row, else sorts (tensor path)
or hashes (kernel) each batch's touched ids."""


def extract(dst: Tensor, counts: Tensor, batch_of_row: Tensor, pointer: Tensor, src: Tensor, nodes: int,
            weight: Tensor | None = None, *, numba: bool) -> StackedBlocks:
    """EXTRACT (bulk paper §4.1.3): drop each batch's empty columns by numbering its src nodes, its dst nodes
    first, then its other touched vertices ascending (:func:`partition.slicing.relabel_dst_first`'s numbering of
    one batch), for all ``k`` batches in one pass: with ``numba`` (CPU tensors) one kernel call
    (:func:`~betty_trainer.sampling.neighbor.relabel_stack`), else tensor ops on ``batch · N + node`` keys.

    Args:
        dst: ``(R,)`` int64 the stacked dst nodes.
        counts: ``(k,)`` int64 rows per batch.
        batch_of_row: ``(R,)`` int64 each row's batch.
        pointer: ``(R + 1,)`` int64 CSC pointer of the kept edges.
        src: ``(E,)`` int64 each kept edge's source id.
        nodes: ``N``.
        weight: ``(E,)`` float32 edge weights, or ``None``.
        numba: whether to use the CPU kernel.

    Returns:
        The :class:`StackedBlocks`; the same on either path.
    """
    device, rows, k = dst.device, dst.numel(), counts.numel()
    work = _DENSE_RELABEL * (rows + src.numel())
    if numba:
        src_nodes, src_counts, local = relabel_stack(dst.numpy(), counts.numpy(), pointer.numpy(), src.numpy(), nodes,
                                                     nodes <= work)
        return StackedBlocks(torch.from_numpy(src_nodes), torch.from_numpy(src_counts), counts, pointer,
                             torch.from_numpy(local), weight)
    dst_keys = batch_of_row * nodes + dst
    src_keys = src + torch.repeat_interleave(batch_of_row * nodes, pointer.diff(), output_size=src.numel())
    if k * nodes <= work:  # a flag per (batch, node): no sort
        slots = k * nodes
        is_extra = torch.zeros(slots, dtype=torch.bool, device=device)
        is_extra[src_keys] = True
        is_extra[dst_keys] = False
        dst_slots, src_slots = dst_keys, src_keys
        extra = extra_slots = torch.nonzero(is_extra).flatten()
    else:  # one sort of the touched keys
        unique, inverse = torch.unique(torch.cat([dst_keys, src_keys]), return_inverse=True)
        slots, dst_slots, src_slots = unique.numel(), inverse[:rows], inverse[rows:]
        is_extra = torch.ones(slots, dtype=torch.bool, device=device)
        is_extra[dst_slots] = False
        extra_slots = torch.nonzero(is_extra).flatten()
        extra = unique[extra_slots]
    extra_batch = torch.div(extra, nodes, rounding_mode="floor")
    extra_counts = torch.bincount(extra_batch, minlength=k)
    src_counts = counts + extra_counts
    dst_local = torch.arange(rows, device=device) - (torch.cumsum(counts, 0) - counts)[batch_of_row]
    extra_local = torch.arange(extra.numel(), device=device) + (counts - torch.cumsum(extra_counts, 0)
                                                                + extra_counts)[extra_batch]
    label = torch.empty(slots, dtype=LOCAL_INDEX, device=device)
    label[dst_slots] = dst_local.to(LOCAL_INDEX)
    label[extra_slots] = extra_local.to(LOCAL_INDEX)
    src_offset = torch.cumsum(src_counts, 0) - src_counts
    src_nodes = torch.empty(int(src_counts.sum()), dtype=torch.int64, device=device)
    src_nodes[src_offset[batch_of_row] + dst_local] = dst
    src_nodes[src_offset[extra_batch] + extra_local] = extra - extra_batch * nodes
    return StackedBlocks(src_nodes, src_counts, counts, pointer, label[src_slots], weight)
