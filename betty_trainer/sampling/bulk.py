"""Bulk neighbour sampling as sparse matrix products (matrix-based bulk sampling paper §4.1, Alg. 1, Eq. 1).

``k`` mini-batches are sampled together, one layer at a time, output layer first:

1. **Probabilities** (§4.1.1, Alg. 1 lines 2–3): the stacked selection matrix ``Q`` (one row per dst node of
   every batch, a single 1 in the node's column; Eq. 1 stacks the batches' ``Qᵢ``) times the in-adjacency
   ``A`` (CSR: row ``v`` holds ``v``'s in-neighbours) gives ``P = Q·A``, whose row ``r`` is the neighbourhood
   of dst node ``r``; NORM divides each row by its sum, so the row is the uniform distribution ``1/|N(v)|``.
2. **Draw** (§4.1.2): inverse transform sampling (ITS) of ``s`` distinct nonzeros per row whose degree exceeds
   the fanout ``s`` (the others keep their whole row): a uniform variate is searched in the row's prefix sum,
   and the ``s`` draws without replacement are Floyd's (Bentley & Floyd, CACM 1987), exactly as
   :func:`~betty_trainer.sampling.neighbor.sample_block` draws them: round ``i`` draws among the row's first
   ``j + 1 = d − s + i + 1`` nonzeros, keeps the draw or, if it was already kept, nonzero ``j``. The variate of
   round ``i`` of dst node ``v`` is NS's hash of ``v`` under the round key of *its own* batch's
   ``(seed, epoch, step, layer)``, so every batch is identical to the one
   :class:`~betty_trainer.sampling.neighbor.NeighborSampler` gives for the same seeds and key, whether sampled
   alone or among ``k``.
3. **Extraction** (§4.1.3): the kept nonzeros of batch ``i``'s rows are its block; its empty columns are
   removed by numbering the block's src nodes (dst nodes first, then the others in ascending id order, as
   every sampler numbers them), for all batches in one ``torch.unique`` over ``(batch, node)`` keys.

NORM is carried as the row sum rather than divided in: ITS scales the variate by the row's total weight and
searches the integer prefix sum of the weights, which is the search in the normalised prefix sum without its
floating-point rounding, so the draw is exact. ``torch.sparse`` CSR runs the product on the graph's device (CPU
or GPU alike).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.data.graph import Graph
from betty_trainer.rng import hash_ids, mix_key
from betty_trainer.sampling.base import BlockSampler, SampleKey
from betty_trainer.sampling.neighbor import _check_fanout


class BulkNeighborSampler(BlockSampler):
    """Uniform neighbour sampling of ``bulk`` batches at once as stacked sparse products (bulk-sampling paper §4.1.4).

    Samples exactly what :class:`~betty_trainer.sampling.neighbor.NeighborSampler` samples (same fanouts, same
    keyed draws, same block numbering), so training with either is the same run; only how the work is laid out
    differs: one SpGEMM ``P = Q·A``, one ITS pass and one relabelling per layer for all ``bulk`` batches.

    Args:
        graph: the graph (blocks come out on its device).
        fanouts: one entry per layer, **input layer first**; ``None`` or ``-1``: the full neighbourhood.
        bulk: batches the schedule hands :meth:`sample_many` at once (``sampling.bulk``, default 8).

    Memory and work: the stacked ``P`` holds every in-edge of every dst node of the ``bulk`` batches of a layer,
    not only the kept ones (about 28 bytes each: int64 column, float32 value, int64 prefix sum, int64 weight),
    besides ``A``'s float32 values (4 bytes per edge of the graph, made once). On a graph with hubs that is many
    times the sampled edges (ego-Twitter, fanouts 10: 2.66M nonzeros per batch of 1,024 seeds for 371k kept
    edges, about 75 MB per batch), which NS, drawing offsets without reading a row, never touches.

    Raises:
        ValueError: a fanout of 0 or below -1, or ``bulk < 1``.
    """

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], bulk: int = 8) -> None:
        if bulk < 1:
            raise ValueError(f"bulk must be at least 1 batch, got {bulk}")
        self.graph = graph
        self.fanouts = [_check_fanout(f) for f in fanouts]
        self.bulk = int(bulk)
        self._adjacency = _csr(graph.indptr, graph.indices.long(),
                               torch.ones(graph.indices.numel(), device=graph.indptr.device),
                               (graph.num_nodes, graph.num_nodes))

    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` of batch ``key`` (:meth:`sample_layers` of one batch)."""
        return self.sample_layers([dst], layer, [key])[0]

    def sample_layers(self, dsts: Sequence[Tensor], layer: int, keys: Sequence[SampleKey]) -> list[Block]:
        """Block ``layer`` of each batch ``keys[i]`` whose dst nodes are ``dsts[i]``, all from one stacked product.

        Args:
            dsts: ``k`` tensors of ``(n_i,)`` int64 distinct global ids, on the graph's device.
            layer: the blocks' index, ``0`` the input layer.
            keys: ``k`` :class:`SampleKey`.

        Returns:
            ``k`` :class:`Block`, each with ``src_nodes[:n_i] == dsts[i]``.
        """
        device, nodes = self._adjacency.device, self.graph.num_nodes
        counts = torch.tensor([dst.numel() for dst in dsts], dtype=torch.int64, device=device)
        rows = int(counts.sum())
        stacked = torch.cat([dst.long() for dst in dsts]) if dsts else torch.empty(0, dtype=torch.int64)
        batch_of_row = torch.repeat_interleave(torch.arange(len(dsts), device=device), counts, output_size=rows)
        # 1. P = Q·A (Eq. 1: the batches' Q stacked); NORM's row sums are the weights' prefix sums at row ends
        q = _csr(torch.arange(rows + 1, device=device), stacked, torch.ones(rows, device=device), (rows, nodes))
        p = q @ self._adjacency
        p_pointer, p_columns = p.crow_indices(), p.col_indices()
        weight_prefix = torch.cumsum(p.values().long(), 0)  # integer weights: exact, unlike a float prefix sum
        # 2. the per-row draw (ITS, Floyd's rounds), keyed per batch as NS keys it
        kept = self._draw(p_pointer, weight_prefix, stacked, batch_of_row, self.fanouts[layer], layer, keys)
        pointer = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        if kept is None:  # every nonzero is kept
            pointer, src = p_pointer.long(), p_columns
            edge_batch = torch.repeat_interleave(batch_of_row, pointer.diff(), output_size=src.numel())
        else:
            positions, per_row = kept
            torch.cumsum(per_row, 0, out=pointer[1:])
            src = p_columns[positions]
            edge_batch = torch.repeat_interleave(batch_of_row, per_row, output_size=src.numel())
        # 3. extraction: number each batch's src nodes, dst nodes first, the others ascending
        return _extract(stacked, counts, batch_of_row, pointer, src, edge_batch, nodes)

    def _draw(self, pointer: Tensor, weight_prefix: Tensor, stacked: Tensor, batch_of_row: Tensor,
              fanout: int | None, layer: int, keys: Sequence[SampleKey]) -> tuple[Tensor, Tensor] | None:
        """The kept nonzeros of ``P``: ``(positions, per_row)`` (positions into ``P``'s nonzeros, in CSR order,
        and how many each row keeps), or ``None`` when every row keeps all of them (full neighbourhood)."""
        if fanout is None:
            return None
        device = pointer.device
        start, end = pointer[:-1].long(), pointer[1:].long()
        prefix = torch.cat([weight_prefix.new_zeros(1), weight_prefix])  # prefix[i]: the weight before nonzero i
        degree = end - start
        per_row = torch.clamp(degree, max=fanout)
        out = torch.zeros(degree.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(per_row, 0, out=out[1:])
        positions = torch.repeat_interleave(start - out[:-1], per_row, output_size=int(out[-1]))
        positions += torch.arange(positions.numel(), device=device)  # rows kept whole: all their nonzeros
        big = torch.nonzero(degree > fanout).flatten()
        if big.numel():
            round_keys = torch.tensor([[mix_key(key.layer_key(layer), i) for i in range(fanout)] for key in keys],
                                      dtype=torch.int64, device=device)[batch_of_row[big]]
            rows_start = start[big]
            # NORM: a row's sum is prefix[end] − prefix[start]; ITS searches in prefix units instead of dividing
            chosen = _floyd_its(stacked[big], prefix, rows_start, prefix[end[big]] - prefix[rows_start], round_keys)
            steps = torch.arange(fanout, device=device)
            positions[(out[:-1][big][:, None] + steps).flatten()] = (rows_start[:, None] + chosen).flatten()
        return positions, per_row


def _csr(pointer: Tensor, columns: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    """A ``torch.sparse`` CSR matrix from valid parts (no invariant check; torch's "beta" notice silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(pointer, columns, values, size, check_invariants=False)


def _floyd_its(ids: Tensor, prefix: Tensor, start: Tensor, total: Tensor, round_keys: Tensor) -> Tensor:
    """``s`` distinct sorted nonzero offsets per row by ITS in Floyd's rounds (see the module docstring).

    Round ``i`` restricts the row to its first ``j + 1`` nonzeros (``j = d − s + i``; their weight ``W``),
    scales the variate ``h / 2³²`` by ``W`` and binary-searches it in the prefix sum of the weights; a nonzero
    already kept is replaced by nonzero ``j`` (sampling without replacement). With unit weights the search
    returns ``⌊h · (j + 1) / 2³²⌋``, NS's offset (:func:`~betty_trainer.sampling.neighbor.floyd_offsets`).

    Args:
        ids: ``(R,)`` int64 global ids of the rows' dst nodes (the hash counters).
        prefix: ``(nnz + 1,)`` int64 exclusive prefix sum of ``P``'s weights (all rows), ``prefix[0] = 0``.
        start: ``(R,)`` int64 the rows' first nonzero.
        total: ``(R,)`` int64 the rows' sums, each greater than ``s`` (unit weights: their degrees).
        round_keys: ``(R, s)`` int64 32-bit keys: row ``r``'s round ``i`` key (its own batch's).

    Returns:
        ``(R, s)`` int64 offsets within each row, strictly increasing along a row.
    """
    s = round_keys.shape[1]
    before = prefix[start]
    j = total[:, None] - torch.arange(s, 0, -1, device=ids.device)  # round i's last eligible nonzero, (R, s)
    weight = prefix[start[:, None] + j + 1] - before[:, None]  # the weight of nonzeros 0 … j
    h = hash_ids(round_keys, ids[:, None])  # NS's hash of each row's dst node under its own batch's round keys
    target = before[:, None] + ((h * weight) >> 32)  # each variate scaled by its eligible weight, in prefix units
    drawn = torch.searchsorted(prefix, target.flatten(), right=True).view_as(target) - 1 - start[:, None]
    chosen = torch.empty_like(drawn)
    for i in range(s):  # the draws are independent; Floyd's rule (a kept draw becomes j) runs in round order
        t = drawn[:, i]
        if i:
            t = torch.where((chosen[:, :i] == t[:, None]).any(1), j[:, i], t)
        chosen[:, i] = t
    return torch.sort(chosen, dim=1).values  # CSC order


_DENSE_RELABEL = 4
"""Extraction numbers src nodes with a flag per ``(batch, node)`` when there are at most this many such pairs per
sampled row and edge (O(k·N) memory and work, no sort), else with one ``torch.unique`` of the touched pairs."""


def _extract(stacked: Tensor, counts: Tensor, batch_of_row: Tensor, pointer: Tensor, src: Tensor,
             edge_batch: Tensor, nodes: int) -> list[Block]:
    """Split the stacked sampled rows into one :class:`Block` per batch (§4.1.3: drop the empty columns).

    Each batch's src nodes are its dst nodes, then its other sampled ids ascending
    (:func:`partition.slicing.relabel_dst_first`), computed for every batch at once on ``batch · N + node`` keys.
    """
    device, rows = stacked.device, stacked.numel()
    k = counts.numel()
    dst_keys, src_keys = batch_of_row * nodes + stacked, edge_batch * nodes + src
    if k * nodes <= _DENSE_RELABEL * (rows + src.numel()):  # a flag per (batch, node): no sort
        is_extra = torch.zeros(k * nodes, dtype=torch.bool, device=device)
        is_extra[src_keys] = True
        is_extra[dst_keys] = False
        dst_slots, src_slots = dst_keys, src_keys
        extra_slots = torch.nonzero(is_extra).flatten()
        extra = extra_slots
    else:  # one sort of the touched keys
        unique, inverse = torch.unique(torch.cat([dst_keys, src_keys]), return_inverse=True)
        dst_slots, src_slots = inverse[:rows], inverse[rows:]
        is_extra = torch.ones(unique.numel(), dtype=torch.bool, device=device)
        is_extra[dst_slots] = False
        extra_slots = torch.nonzero(is_extra).flatten()
        extra = unique[extra_slots]
    row_offset = torch.cumsum(counts, 0) - counts
    label = torch.empty(is_extra.numel(), dtype=torch.int64, device=device)
    label[dst_slots] = torch.arange(rows, device=device) - row_offset[batch_of_row]
    extra_batch = torch.div(extra, nodes, rounding_mode="floor")
    extra_counts = torch.bincount(extra_batch, minlength=k)
    extra_offset = torch.cumsum(extra_counts, 0) - extra_counts
    label[extra_slots] = counts[extra_batch] + torch.arange(extra.numel(), device=device) - extra_offset[extra_batch]
    local = label[src_slots]
    extra_nodes = (extra - extra_batch * nodes).split(extra_counts.tolist())
    blocks = []
    row_bounds, edge_bounds = row_offset.tolist() + [rows], pointer[torch.cat([row_offset, counts.sum()[None]])].tolist()
    for b in range(k):
        lo, hi = row_bounds[b], row_bounds[b + 1]
        blocks.append(Block(torch.cat([stacked[lo:hi], extra_nodes[b]]), hi - lo, pointer[lo:hi + 1] - pointer[lo],
                            local[edge_bounds[b]:edge_bounds[b + 1]]))
    return blocks

