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

import logging
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

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
    ns_fanouts,
    relabel_stack,
)
from partition.slicing import LOCAL_INDEX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BulkDraw:
    """How a bulk sampler draws an epoch's batches, and the memory that takes (``plan.json``'s ``sampling``).

    Attributes:
        bulk: ``k``, the batches drawn at once (``sampling.bulk``, resolved).
        bulk_memory: the cap ``k`` was fitted to (``sampling.bulk_memory``, bytes) under ``sampling.bulk: auto``;
            ``None`` for an explicit ``k``.
        batch_size: seed nodes per batch the bound assumes (``sampling.batch_size``; the training nodes for the
            full batch).
        draw_bytes: :meth:`BulkSampler.draw_bytes` of ``k`` such batches: bytes on ``device`` while a draw runs.
        structure_bytes: the graph's ``indptr`` and ``indices`` copied to ``device`` for the whole run (0 where
            they are there already).
        device: where the draws run (``sampling.device``), ``"cpu"`` or ``"cuda"``.
    """

    bulk: int
    bulk_memory: int | None
    batch_size: int
    draw_bytes: int
    structure_bytes: int
    device: str

    @property
    def device_bytes(self) -> int:
        """What sampling holds on a CUDA device beside the training step (its structure and a draw's peak), which
        the step's budget leaves room for; 0 when sampling runs on the CPU (its bytes are host memory)."""
        return self.structure_bytes + self.draw_bytes if self.device == "cuda" else 0

    def report(self) -> dict:
        """The fields and ``device_bytes``, as ``plan.json`` holds them."""
        return {**asdict(self), "device_bytes": self.device_bytes}


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
        self._degrees: Tensor | None = None  # in-degrees, descending (draw_bytes' bound), made on use, freed by fit
        self._sizes: dict[tuple[int, int], list[_Sizes]] = {}  # by (batch_size, first_layer)

    def fit(self, bulk: int | str, batch_size: int, batches: int, cap: int) -> BulkDraw:
        """Set :attr:`bulk` to ``bulk``, or under ``"auto"`` to the most of the epoch's ``batches`` whose draw fits
        ``cap`` (:meth:`bulk_for_cap`; 1, with a warning, where one batch's is over it), and say what it draws.

        Args:
            bulk: ``k`` or ``"auto"`` (``sampling.bulk``).
            batch_size: seed nodes per batch; ``batches``: batches per epoch (``≥ 1``); ``cap``: bytes.

        Returns:
            The :class:`BulkDraw` (its ``bulk_memory`` is ``cap`` under ``auto``, else ``None``).
        """
        auto = bulk == "auto"
        if auto:
            bulk = self.bulk_for_cap(cap, batch_size, batches)
            if bulk == 0:
                bulk = 1
                logger.warning("sampling.bulk=auto: one batch's draw may take %d bytes, above sampling.bulk_memory "
                               "(%d bytes); drawing one batch at a time", self.draw_bytes(1, batch_size), cap)
        self.bulk = int(bulk)
        moved = [t for t, source in ((self._indptr, self.graph.indptr), (self._indices, self.graph.indices))
                 if t is not source]
        draw = BulkDraw(self.bulk, cap if auto else None, batch_size, self.draw_bytes(self.bulk, batch_size),
                        sum(t.numel() * t.element_size() for t in moved), self.device.type)
        self._degrees = None  # the (N,) sorted in-degrees the bound read: not kept for the run
        return draw

    def draw_bytes(self, k: int, batch_size: int) -> int:
        """An upper bound of the bytes :meth:`sample_many` allocates on ``device`` for ``k`` batches of at most
        ``batch_size`` seeds each, **any** seeds: the peak, over the draw, of its live tensors (the blocks it has
        made so far, held to the end, and the layer in progress with every intermediate of ``P = Q·A``, the draw
        and :func:`extract`), not counting the graph, the copy of its structure on ``device`` or the seeds passed in.
        The blocks are counted on ``device`` even where they are copied to the graph's (``cuda``: an overcount).

        Units: bytes, as requested from the allocator (torch's for tensor ops; the numba kernels' arrays, which
        CPython's allocator gives numba's runtime, on the CPU).

        Where it is an upper bound, and why it is sound:

        * **Counts** (:meth:`_batch_sizes`): per batch and layer, ``n`` rows, the in-edges read and kept and the src
          nodes are bounded by the worst seeds there are: the rows are the ``n`` nodes of highest in-degree (each
          row keeping ``min(degree, fanout)``), every kept source a new src node, at most ``N`` of them.
        * **Bytes per element** (:meth:`_layer_bytes`, :func:`_extract_bytes`): the int64/int32/bool/float tensors
          of the code, read off it; where a step's temporaries are freed before the next is made, its phase's live
          set, else the sum of its allocations. The extraction's dense-array branch (``k·N`` flags) and its sort
          branch are both counted where the bounds cannot rule one out. Sorts, ``unique`` and ``argsort`` are
          counted by what torch's CPU implementations allocate (outputs and temporaries: ``unique`` with inverse
          and counts six int64 per element, a stable ``argsort`` three); on CUDA their temporaries are of the same
          order (sorts double-buffer keys and values), which is not measured here.
        * A fixed :data:`_SLACK_BYTES` (scalars, the keys, the Python-side lists) per draw and per batch.

        Source: the tensors of the bulk paper's Alg. 1 (§4.1, §4.1.4 Eq. 1: ``P = Q·A``, NORM, ITS, extraction; §4.2
        for LADIES) as this module computes them.

        Its looseness is mostly in the counts: ``tests/test_bulk_draw.py`` measures draws at
        ``measured ≤ stated ≤ 3.5 × measured`` on a graph whose counts the bound reaches; on skewed graphs the
        highest-degree rows it assumes are far from a random batch's (ego-Twitter, 1024 seeds, fanouts 10, 10, 10:
        2.5× with the numba kernels, 3.2× with tensor ops; LADIES, which reads every in-edge of its rows, 4–5×).

        Args:
            k: batches drawn at once, ``k ≥ 1``.
            batch_size: seed nodes per batch (``sampling.batch_size``; the epoch's last batch may have fewer).

        Returns:
            Bytes (int).
        """
        index = self._indices.element_size()
        nodes = self.graph.num_nodes
        retained = 8 * k * batch_size  # the stacked seeds
        peak = 0
        for layer, size in zip(reversed(range(self.first_layer, len(self.fanouts))), self._batch_sizes(batch_size),
                               strict=True):
            stack = _Stack(k, nodes, size, self.fanouts[layer])
            peak = max(peak, retained + self._layer_bytes(stack, index))
            retained += stack.block_bytes(self._WEIGHTED)
        return max(peak, retained) + _SLACK_BYTES + k * _SLACK_PER_BATCH

    def bulk_for_cap(self, cap: int, batch_size: int, batches: int) -> int:
        """The largest ``k ≤ batches`` whose :meth:`draw_bytes` fit ``cap`` bytes (a binary search: the bound
        grows with ``k``), or 0 when one batch's draw is over it.

        Args:
            cap: bytes (``sampling.bulk_memory``).
            batch_size: seed nodes per batch; ``batches``: the epoch's batch count, ``≥ 1``.
        """
        low, high = 0, batches  # draw_bytes(low) fits (0: nothing drawn), high + 1 is out of bounds
        while low < high:
            middle = (low + high + 1) // 2
            if self.draw_bytes(middle, batch_size) <= cap:
                low = middle
            else:
                high = middle - 1
        return low

    def _batch_sizes(self, batch_size: int) -> list[_Sizes]:
        """Upper bounds of one batch's counts per sampled layer, **output layer first** (:meth:`draw_bytes`)."""
        if (batch_size, self.first_layer) not in self._sizes:
            if self._degrees is None:
                self._degrees = torch.sort(self.graph.in_degrees().cpu(), descending=True).values
            nodes, rows, sizes = self.graph.num_nodes, batch_size, []
            for layer in reversed(range(self.first_layer, len(self.fanouts))):
                size = self._layer_size(min(rows, nodes), self.fanouts[layer], self._degrees)
                sizes.append(size)
                rows = size.src
            self._sizes[batch_size, self.first_layer] = sizes
        return self._sizes[batch_size, self.first_layer]

    _WEIGHTED = False
    """Whether the blocks carry ``(E,)`` float32 edge weights."""

    @staticmethod
    @abstractmethod
    def _layer_size(rows: int, fanout: int | None, degrees: Tensor) -> _Sizes:
        """One batch's counts in a layer of ``rows`` dst nodes (``degrees``: the graph's, descending)."""

    @abstractmethod
    def _layer_bytes(self, stack: _Stack, index: int) -> int:
        """The most bytes live at once while :meth:`_sample_stack` makes ``stack``'s layer, beyond the dst nodes it
        is handed and the blocks made before (``index``: the bytes of one of the graph's ``indices``)."""

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

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], bulk: int = 8,
                 device: torch.device | str = "cpu", kernel: Kernel = "auto") -> None:
        super().__init__(graph, ns_fanouts(graph, fanouts), bulk, device, kernel)  # NS's fanouts, as NS takes them

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

    @staticmethod
    def _layer_size(rows: int, fanout: int | None, degrees: Tensor) -> _Sizes:
        """Each row keeps ``min(degree, fanout)`` in-edges: at most the ``rows`` highest in-degrees' sum, so clipped."""
        top = degrees[:rows]
        kept = int((top if fanout is None else top.clamp(max=fanout)).sum())
        return _Sizes(rows, kept, 0, kept, min(degrees.numel(), rows + kept))

    def _layer_bytes(self, stack: _Stack, index: int) -> int:
        """int64 unless said (``R`` rows, ``E`` kept edges): ``batch_of_row`` (``R``) and the ``(k, fanout)`` round
        keys (4 at once while made) throughout, then the largest phase. Numba: the kernel's ``(R + 1)`` pointer and
        ``E`` sources, then :func:`extract`. Tensor ops: :func:`~betty_trainer.sampling.neighbor.kept_edges`, every
        ``R``-sized allocation summed (25: ``start``, ``degree``, ``kept``, ``pointer``, the rows above the fanout,
        their ids, degrees and keys, Floyd's per-round temporaries) and at most 41 bytes per kept edge live
        (``edge_ids``, and for the rows above the fanout, ``(rows, fanout)`` keys, Floyd's ``chosen``, the sort's
        values and indices, its compare mask); then the kept edges' sources gathered from ``indices`` and widened to
        int64 (``edge_ids`` still live); then :func:`extract` with ``pointer``, ``edge_ids`` and the sources live."""
        rows, edges = stack.rows, stack.kept
        always = 8 * rows + 32 * stack.k * (stack.fanout or 0)
        if self._numba:
            return always + 8 * (rows + 1) + 8 * edges + _extract_bytes(stack, numba=True)
        draw = 200 * rows + (41 if stack.fanout is not None else 16) * edges
        gather = 8 * rows + 16 * edges + (index * edges if index < 8 else 0)
        return always + max(draw, gather, 8 * rows + 16 * edges + _extract_bytes(stack, numba=False))


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

    _WEIGHTED = True

    @staticmethod
    def _layer_size(rows: int, fanout: int | None, degrees: Tensor) -> _Sizes:
        """Every in-edge of the rows is read (at most the ``rows`` highest in-degrees' sum); ``P``'s nonzeros are
        at most those and ``N``; ``s`` of them sampled, each keeping at most one edge per row; the src nodes are the
        rows and the sampled vertices."""
        nodes = degrees.numel()
        read = int(degrees[:rows].sum())
        pairs = min(read, nodes)
        sampled = pairs if fanout is None else min(fanout, pairs)
        return _Sizes(rows, read, pairs, min(read, rows * sampled), min(nodes, rows + sampled))

    def _layer_bytes(self, stack: _Stack, index: int) -> int:
        """int64 unless said (``R`` rows, ``A`` in-edges read, ``M`` nonzeros of ``P``, ``E`` kept edges); the largest
        of three phases. :meth:`_distribution`: its ``R``-sized allocations summed (12), and live either ``edge_ids``,
        ``edge_keys`` and ``unique``'s outputs and temporaries (48 bytes per edge), or after it ``edge_ids``,
        ``edge_keys``, ``pair_of_edge``, ``row_of_edge`` and six ``M``-sized (pairs, counts, batch, node, a
        temporary, weight). Then ``P`` (``8R + 16A + 32M``) stays live to the end. The race: the mask (``M`` bool) and
        at most 65 bytes per nonzero (the hashes, the variates, two stable ``argsort`` of three each, the ranks).
        Then :func:`extract`, with ``P``, the variates, race and ranks, the mask, ``kept`` (``A`` bool), five
        ``R``-sized (per-row counts, pointer, weights' temporaries), the weights (``E`` float32) and the sources with
        their temporaries (``3E``) live."""
        rows, read, pairs, edges = stack.rows, stack.read, stack.pairs, stack.kept
        distribution = 96 * rows + max(64 * read, 32 * read + 48 * pairs) + (index * read if index < 8 else 0)
        p = 8 * rows + 16 * read + 32 * pairs
        drawn = stack.fanout is not None
        race = p + 65 * pairs if drawn else 0
        last = (p + (24 * pairs if drawn else 0) + pairs + read + 40 * rows + 28 * edges
                + _extract_bytes(stack, numba=self._numba))
        return max(distribution, race, last)

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


@dataclass(frozen=True)
class _Sizes:
    """Upper bounds of one batch's counts in one layer (:meth:`BulkSampler._batch_sizes`)."""

    rows: int  # dst nodes
    read: int  # in-edges read: the kept ones (NS), all of the rows' (LADIES' P = Q·A)
    pairs: int  # LADIES: nonzeros of P, distinct vertices of the aggregated neighbourhood; NS: 0
    kept: int  # edges of the block
    src: int  # src nodes, the next layer's rows


@dataclass(frozen=True)
class _Stack:
    """The bounds of a layer's stack of ``k`` batches (:meth:`BulkSampler.draw_bytes`): counts are ``k`` times a
    batch's."""

    k: int
    nodes: int  # N
    batch: _Sizes
    fanout: int | None

    rows = property(lambda self: self.k * self.batch.rows)
    read = property(lambda self: self.k * self.batch.read)
    pairs = property(lambda self: self.k * self.batch.pairs)
    kept = property(lambda self: self.k * self.batch.kept)
    src = property(lambda self: self.k * self.batch.src)

    def block_bytes(self, weighted: bool) -> int:
        """What the layer's blocks hold to the end of the draw: src nodes (int64), local indices (int32), edge
        weights (float32) if ``weighted``, the stacked pointer and each block's own (int64, ``R + k`` each)."""
        return 8 * self.src + (8 if weighted else 4) * self.kept + 16 * (self.rows + self.k)


_SLACK_BYTES = 64 * 2**10
_SLACK_PER_BATCH = 2 * 2**10
""":meth:`BulkSampler.draw_bytes`' allowance for the scalars, the ``(k,)`` counts and keys and the Python lists of a
draw (bytes), and per batch."""


def _extract_bytes(stack: _Stack, *, numba: bool) -> int:
    """An upper bound of the bytes :func:`extract` allocates for ``stack`` (its inputs not counted).

    Numba (:func:`~betty_trainer.sampling.neighbor.relabel_stack`): local indices (int32, ``E``), the ``R + min(E,
    k·N)`` int64 src buffer and its final copy (``S``), the ``N`` int32 labels where the dense branch is possible
    (``N ≤ 4(R + E)``), and the largest batch's own arrays: the dense branch's radix sort (two int64 per new id), or
    the hash branch's (int64 new ids and int32 local indices per edge, two int64 per slot of a table of at most
    ``8 s + 2048`` slots and the half-size one it replaces, the radix sort, the renumbering and the batch's src
    nodes).

    Tensor ops: every ``R``-sized (11) and ``S``-sized (13) int64 allocation summed, the keys of the edges (two
    int64 live) and the local indices (int32); then the branch: the dense flags and labels (``k·N`` bool and int32)
    where ``k·N ≤ 4(R + E)`` is possible, or the sort of the ``R + E`` keys (the concatenation and ``unique``'s
    four int64 with inverse, then flags and int32 labels per distinct key), which runs only below ``k·N / 4`` keys.
    """
    rows, edges, src, k, nodes = stack.rows, stack.kept, stack.src, stack.k, stack.nodes
    if numba:
        batch = stack.batch
        dense = 4 * nodes if nodes <= _DENSE_RELABEL * (rows + edges) else 0
        largest = max(16 * batch.src, 12 * batch.kept + 24 * (8 * batch.src + 2048) + 40 * batch.src)
        return 4 * edges + 8 * (rows + min(edges, k * nodes)) + 8 * k + dense + largest + 8 * src
    keys = rows + edges
    flags = 5 * k * nodes if k * nodes <= _DENSE_RELABEL * keys else 0
    sort = 45 * (keys if _DENSE_RELABEL * keys < k * nodes else -(-k * nodes // _DENSE_RELABEL))  # fewer keys run
    return 88 * rows + 104 * src + 20 * edges + max(flags, sort)


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
