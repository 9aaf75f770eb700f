"""Layer-wise chunks: each block's dst nodes split into chunks that share few src nodes.

Betty's micro-batches split the *outputs* and carry every layer of their receptive field,
so a hidden node shared by several micro-batches is computed once per micro-batch.
Layer-wise execution instead runs one layer at a time over all of that layer's dst nodes,
a chunk at a time; every hidden node is computed once per pass. Its chunks are made here:
block by block, the dst nodes are partitioned by the same partitioners as the outputs
(REG or METIS on the block, :class:`~partition.partitioners.OutputSplitter`; or, for a
sampled batch at a fixed count, the run's partition of the whole graph,
:class:`~partition.partitioners.GraphSplitter`), so a chunk gathers few src rows. A chunk
keeps only its dst nodes and the shape of its one-layer sub-block; the sub-block itself
(O(its edges)) is sliced when the chunk runs, so a step holds one chunk's slice at a time,
not every chunk's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from partition.partitioners import GraphPartition, OutputSplitter, Splitter
from partition.search import BudgetError
from partition.slicing import BlockStructure, LayerSlice, slice_layers


@dataclass(frozen=True, eq=False)
class Chunk:
    """One chunk of a layer: the dst nodes it computes and the shape of its one-layer sub-block.

    Attributes:
        dst: ``(d,)`` int64 positions among the block's dst nodes (its slice's ``src_index[:d]``).
        num_src: src nodes of its sub-block (its dst nodes included).
        indptr: ``(d + 1,)`` int64 CSC pointer of its sub-block (its edge count and in-degrees, for the
            estimate).

    The rest of the slice (int64 src positions and edge ids, int32 local indices: ``8·S + 12·E`` bytes) is made by
    :meth:`slice` when the chunk runs.
    """

    dst: Tensor
    num_src: int
    indptr: Tensor

    @property
    def num_dst(self) -> int:
        return self.dst.numel()

    @property
    def num_edges(self) -> int:
        return int(self.indptr[-1])

    def slice(self, block: BlockStructure) -> LayerSlice:
        """The chunk's :class:`LayerSlice` of ``block`` (:func:`partition.slicing.slice_layers`: on the CPU,
        :func:`partition.slicing.slice_block_compiled`)."""
        return slice_layers([block], self.dst)[0]


@dataclass
class LayerChunks:
    """The chunks of every layer of one batch.

    Attributes:
        layers: per block (input layer first), its :class:`Chunk` s (they partition the block's dst nodes).
        host_outputs: keep the hidden layers' outputs ``h_l`` in host memory instead of on the device
            (the planner sets it when the device budget does not hold them; read by the executor,
            ``betty_trainer.execution.layerwise``).
    """

    layers: list[list[Chunk]]
    host_outputs: bool = False

    @property
    def work(self) -> int:
        """Estimated work of layer-wise execution: ``4 · Σ_layers Σ_chunks (src rows + edges)`` (a forward
        without autograd, then the recomputed forward and its backward of about twice its cost; rows
        read by several chunks of a layer count once in each). Compared with
        :attr:`partition.Split.work` (Betty's micro-batches) by ``micro_batch.mode=auto``."""
        return 4 * sum(piece.num_src + piece.num_edges for layer in self.layers for piece in layer)

    @property
    def k(self) -> int:
        """Chunks per layer (the largest, when a small layer has fewer dst nodes than asked)."""
        return max(len(chunks) for chunks in self.layers)


def chunk_layers(blocks: Sequence[BlockStructure], k: int | Sequence[int], partitioner: str = "metis",
                 seed: int = 0) -> LayerChunks:
    """Split each block's dst nodes into ``min(k, num_dst)`` chunks (each sliced once, for its shape).

    Args:
        blocks: the batch's blocks, input layer first.
        k: chunks per layer (≥ 1): one count for every layer, or one per block.
        partitioner: a name in :data:`partition.PARTITIONERS` (``metis`` or ``reg`` keep the
            chunks' src sets small; ``range`` is contiguous ids).
        seed: partitioner seed.

    Returns:
        The :class:`LayerChunks`.

    Raises:
        ValueError: if a count is below 1, or there are not as many counts as blocks.
    """
    counts = [k] * len(blocks) if isinstance(k, int) else list(k)
    if len(counts) != len(blocks) or min(counts, default=1) < 1:
        raise ValueError(f"chunks per layer must be at least 1, one count or one per block; got {k}")
    return LayerChunks([chunk_block(block, parts, partitioner, seed) for block, parts in zip(blocks, counts)])


def chunk_block(block: BlockStructure, k: int, partitioner: str = "metis", seed: int = 0,
                splitter: Splitter | None = None) -> list[Chunk]:
    """One block's dst nodes in ``min(k, num_dst)`` chunks (:func:`chunk_layers` of one layer), each sliced once
    for its shape (:func:`partition.slicing.slice_layers`).

    Args:
        block, k, partitioner, seed: as :func:`chunk_layers`'s.
        splitter: splits the dst nodes instead of ``partitioner`` on the block (a
            :class:`~partition.partitioners.GraphSplitter` of the run's graph partition: a look-up per node).

    Returns:
        The :class:`Chunk` s, each with ``(d,)`` int64 dst positions and its ``(d + 1,)`` int64 CSC pointer; a
        partitioner may give fewer than asked (empty parts are dropped).

    Raises:
        ValueError: an unknown ``partitioner`` (:class:`~partition.partitioners.OutputSplitter`).
    """
    parts = min(k, block.num_dst)
    if parts <= 1:
        groups = [torch.arange(block.num_dst)]
    else:
        groups = (splitter or OutputSplitter(block, partitioner)).split(parts, seed)
    pieces = []
    for group in groups:
        if group.numel():
            piece = slice_layers([block], group)[0]
            pieces.append(Chunk(group.long(), piece.num_src, piece.indptr))
    return pieces


class ChunkEstimate(Protocol):
    """What the chunk search asks of an estimate of one batch run layer by layer (the estimator's
    ``LayerwiseEstimate``)."""

    def peak(self, chunks: Sequence[Sequence[Chunk]], host_outputs: bool) -> int:
        """Peak bytes of the step in ``chunks`` (per layer), ``h_l`` on the device or in host memory."""
        ...

    def floor(self, largest: Sequence[LayerSlice], host_outputs: bool) -> int:
        """Bytes below which no chunking goes, from each layer's one-node chunk of its largest dst node."""
        ...

    @property
    def ranged(self) -> Sequence[bool]:
        """Per layer, whether only the number of its chunks matters (the step runs it in as many contiguous dst
        row blocks): the search splits such a layer by ``range``, never by a graph partitioner."""
        ...


@dataclass
class ChunkSearch:
    """What :func:`search_chunks` chose, and what it tried.

    Attributes:
        chunks: the chosen :class:`LayerChunks` (``host_outputs`` set when ``h_l`` must live in host memory).
        partitioners: per layer (input layer first), what split its chunks: the partitioner asked, or ``range`` for
            a layer whose chunks' dst sets do not matter (:attr:`ChunkEstimate.ranged`) and for every layer at one
            dst node per chunk (when the partitioner asked fitted no budget).
        peak: their estimated peak, bytes (0 without an estimate).
        tried: ``(chunks per layer, estimated peak)`` for every chunking evaluated, in order.
        seconds: wall time of the search.
    """

    chunks: LayerChunks
    partitioners: list[str]
    peak: int
    tried: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0


def largest_chunks(blocks: Sequence[BlockStructure]) -> list[LayerSlice]:
    """Per block, the one-node chunk of its dst node of largest in-degree (the first such), whose in-edges no
    chunking splits: what a layer-wise floor is estimated from."""
    return [slice_layers([block], (block.indptr[1:] - block.indptr[:-1]).argmax().reshape(1))[0] for block in blocks]


def chunk_floor(blocks: Sequence[BlockStructure], estimate: ChunkEstimate, host_memory: bool) -> int:
    """Bytes below which no number of chunks per layer runs ``blocks`` layer by layer (``estimate.floor`` of
    :func:`largest_chunks`); with ``host_memory`` (a GPU, whose hidden layers' outputs may live in host memory) the
    lower of ``h_l`` on the device and in host memory."""
    largest = largest_chunks(blocks)
    kept = (False, True) if host_memory and len(blocks) > 1 else (False,)
    return min(estimate.floor(largest, host) for host in kept)


def search_chunks(blocks: Sequence[BlockStructure], estimate: ChunkEstimate | None, *, budget: int | None = None,
                  k: int = 1, min_k: int = 1, partitioner: str = "metis", seed: int = 0,
                  host_memory: bool = False, ceiling: int | None = None,
                  splitters: Sequence[Splitter] | None = None) -> ChunkSearch:
    """``max(k, min_k)`` chunks per layer, or under ``budget`` the fewest that fit: doubling from ``min_k`` to the
    first K that fits, then bisecting below it.

    A budget below :func:`chunk_floor` is refused before any chunking. Above it the doubling goes on (the peak
    falls unevenly as the chunk boundaries move around the hub nodes, whose chunks hold the most src rows) until
    doubling the request gives the partitioner's split no more chunks (REG and METIS stop short of one node per
    chunk) or every dst node would be its own chunk; then one dst node per chunk (``range`` at the largest layer's
    dst count, whose estimate is the floor plus 8 bytes per chunk past each layer's first) is tried, so a budget at
    least that is never refused. A K fits with the hidden layers' outputs ``h_l`` on the device or, when those do
    not fit and ``host_memory`` (a GPU: on the CPU host memory is the device's own), with ``h_l`` in host memory
    (``LayerChunks.host_outputs``; a step then copies each chunk's rows of ``h_{l−1}`` to the device). Under a
    budget (and not re-planning, ``min_k`` 1) each layer's count is then lowered on its own to the fewest that keep
    the step within the budget (a bisection per layer, input layer first), so a narrow layer does not run in as
    many chunks as the widest one needs.

    Args:
        blocks: the batch's blocks, input layer first.
        estimate: the batch's layer-wise estimate; ``None`` without one (then only ``k`` is possible).
        budget: bytes a step may use; ``None`` for ``k``.
        k: chunks per layer without a budget.
        min_k: never fewer (re-planning after an out-of-memory error).
        partitioner, seed: as :func:`chunk_layers`'s.
        host_memory: ``h_l`` may be kept in host memory.
        ceiling: under a budget above it, the search runs under it first, so that no chunking is chosen above it
            where one below it exists: the whole batch's estimate in one micro-batch, which needs less work (one
            layer-wise chunk per layer holds every layer's output and recomputes). Without a budget ``k`` stands.
        splitters: with ``partitioner="graph"``, per block the splitter of its dst nodes (a
            :class:`~partition.partitioners.GraphSplitter`: the run's graph partition looked up, no partitioning
            per batch).

    Raises:
        BudgetError: no chunking fits ``budget``, or a budget without an estimate (with the numbers).
    """
    if (partitioner == GraphPartition.method) != (splitters is not None):
        raise ValueError("the graph partitioner splits with the run's graph partition: give its splitters, one per "
                         "block (and splitters only with it)")
    made: dict[tuple[int, int, str], list[Chunk]] = {}  # (layer, parts, partitioner) → its chunks: each made once
    if ceiling is not None and estimate is not None and budget is not None and ceiling < budget:
        try:
            return _search_chunks(blocks, estimate, ceiling, k, min_k, partitioner, seed, host_memory, made, splitters)
        except BudgetError:
            pass  # no chunking goes below the ceiling: the budget's own search, with the chunks made so far
    return _search_chunks(blocks, estimate, budget, k, min_k, partitioner, seed, host_memory, made, splitters)


def _search_chunks(blocks: Sequence[BlockStructure], estimate: ChunkEstimate | None, budget: int | None, k: int,
                   min_k: int, partitioner: str, seed: int, host_memory: bool,
                   made: dict[tuple[int, int, str], list[Chunk]],
                   splitters: Sequence[Splitter] | None = None) -> ChunkSearch:
    """:func:`search_chunks` under ``budget`` alone (no ceiling); ``made`` holds each layer's chunks by count and
    partitioner, filled as they are made (shared with an earlier search of the same blocks)."""
    started, tried = time.perf_counter(), []
    most = max(block.num_dst for block in blocks)

    ranged = estimate.ranged if estimate is not None else [False] * len(blocks)

    def chunked(index: int, parts: int, method: str) -> list[Chunk]:
        method = layer_methods(ranged, method)[index]
        if (index, parts, method) not in made:
            splitter = splitters[index] if method == GraphPartition.method else None
            made[index, parts, method] = chunk_block(blocks[index], parts, method, seed, splitter)
        return made[index, parts, method]

    def attempt(parts: int, method: str) -> tuple[LayerChunks, int]:
        chunks = LayerChunks([chunked(index, parts, method) for index in range(len(blocks))])
        peak = estimate.peak(chunks.layers, False) if estimate is not None else 0
        if budget is not None and peak > budget and host_memory and len(blocks) > 1:
            on_host = estimate.peak(chunks.layers, True)
            if on_host <= budget:
                chunks.host_outputs, peak = True, on_host
            else:  # neither fits: the lower peak is what more chunks can still improve on (the floor check)
                peak = min(peak, on_host)
        tried.append((chunks.k, peak))
        return chunks, peak

    if budget is None:
        chosen, peak = attempt(max(min_k, k), partitioner)
        return ChunkSearch(chosen, layer_methods(ranged, partitioner), peak, tried, time.perf_counter() - started)
    if estimate is None:
        raise BudgetError("a layer-wise plan under a budget needs a built-in model's estimate")
    floor = chunk_floor(blocks, estimate, host_memory)
    if floor > budget:
        raise BudgetError(
            f"memory budget {budget} bytes is impossible layer by layer: at any number of chunks per "
            f"layer a step needs at least {floor} bytes (the model state, the batch's structure, the whole "
            "layers a backward holds at once and the in-edges of the node of largest in-degree); raise the budget")
    below, parts = max(min_k, 1) - 1, max(min_k, 1)
    chosen, peak = attempt(parts, partitioner)
    saturated = False  # the last doubling of the request gave no more chunks
    while peak > budget:
        if parts >= most or saturated:  # no more, smaller chunks from this partitioner
            partitioner, below, parts = "range", most, most
            chosen, peak = attempt(most, partitioner)  # one dst node per chunk
            if peak > budget:
                least_k, least = min(tried, key=lambda entry: entry[1])
                raise BudgetError(
                    f"memory budget {budget} bytes is impossible layer by layer: the least any chunking "
                    f"tried needs is {least} bytes ({least_k} chunks per layer), above the floor of {floor} "
                    "bytes that no chunking goes below; raise the budget")
            break
        below, parts, had = parts, min(2 * parts, most), chosen.k
        chosen, peak = attempt(parts, partitioner)
        saturated = chosen.k <= had
    while parts - below > 1:
        middle = (below + parts) // 2
        candidate, middle_peak = attempt(middle, partitioner)
        if middle_peak <= budget:
            chosen, peak, parts = candidate, middle_peak, middle
        else:
            below = middle
    if min_k <= 1:  # a re-plan after an out-of-memory error keeps every layer at min_k or more
        peak = _fewer_per_layer(chosen, peak, lambda index, parts: chunked(index, parts, partitioner), estimate,
                                budget)
    return ChunkSearch(chosen, layer_methods(ranged, partitioner), peak, tried, time.perf_counter() - started)


def layer_methods(ranged: Sequence[bool], method: str) -> list[str]:
    """Per layer, what splits its chunks when ``method`` is asked: ``range`` for a layer whose chunks' dst sets do not
    matter (``ranged``: :attr:`ChunkEstimate.ranged`; no partitioner's work for nothing), else ``method``."""
    return ["range" if only_count else method for only_count in ranged]


def _fewer_per_layer(chosen: LayerChunks, peak: int, chunked: Callable[[int, int], list[Chunk]],
                     estimate: ChunkEstimate, budget: int) -> int:
    """Lower each layer's chunk count in ``chosen`` (in place), input layer first, to the fewest that keep the
    step's estimated peak within ``budget`` with the other layers as they are: doubling from one chunk, then
    bisecting below the first count that fits (the uniform search's own sequence, so ``chunked``, which makes a
    layer's chunks once per count, has most of them already). Returns the peak of the result.

    The uniform search sizes every layer for the layer whose chunks hold the most (the input layer's wide feature
    rows, typically); a narrow layer then runs in as many chunks for nothing, and each chunk costs a recompute and
    its own small kernels (on Amazon Computers at a quarter of the K = 1 peak, 331 chunks per layer, where the
    64-wide layer needs 19: benchmarks/README.md › layerwise.py)."""
    layers = chosen.layers

    def fits(index: int, parts: int) -> int | None:
        candidate = chunked(index, parts)
        trial = estimate.peak(layers[:index] + [candidate] + layers[index + 1:], chosen.host_outputs)
        if trial > budget:
            return None
        fitting[parts] = trial
        return trial

    for index in range(len(layers)):
        current, fitting = len(layers[index]), {}  # fitting: this layer's counts that fit → the step's peak
        below, parts = 0, 1
        while parts < current and fits(index, parts) is None:
            below, parts = parts, min(2 * parts, current)
        while parts - below > 1:
            middle = (below + parts) // 2
            if fits(index, middle) is None:
                below = middle
            else:
                parts = middle
        if parts < current:
            layers[index], peak = chunked(index, parts), fitting[parts]
    return peak
