"""Layer-wise chunks: each block's dst nodes split into chunks that share few src nodes.

Betty's micro-batches split the *outputs* and carry every layer of their receptive field,
so a hidden node shared by several micro-batches is computed once per micro-batch.
Layer-wise execution instead runs one layer at a time over all of that layer's dst nodes,
a chunk at a time; every hidden node is computed once per pass. Its chunks are made here:
block by block, the dst nodes are partitioned by the same partitioners as the outputs
(REG or METIS on the block, :class:`~partition.partitioners.OutputSplitter`), so a chunk
gathers few src rows. A chunk keeps only its dst nodes and the shape of its one-layer
sub-block; the sub-block itself (O(its edges)) is sliced when the chunk runs, so a step holds
one chunk's slice at a time, not every chunk's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from partition.partitioners import OutputSplitter
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
        seconds: wall time of partitioning and slicing.
        host_outputs: keep the hidden layers' outputs ``h_l`` in host memory instead of on the device
            (the planner sets it when the device budget does not hold them; read by the executor,
            ``betty_trainer.execution.layerwise``).
    """

    layers: list[list[Chunk]]
    seconds: float = 0.0
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


def chunk_layers(blocks: Sequence[BlockStructure], k: int, partitioner: str = "metis", seed: int = 0) -> LayerChunks:
    """Split each block's dst nodes into ``min(k, num_dst)`` chunks (each sliced once, for its shape).

    Args:
        blocks: the batch's blocks, input layer first.
        k: chunks per layer (≥ 1).
        partitioner: a name in :data:`partition.PARTITIONERS` (``metis`` or ``reg`` keep the
            chunks' src sets small; ``range`` is contiguous ids).
        seed: partitioner seed.

    Returns:
        The :class:`LayerChunks`.

    Raises:
        ValueError: if ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"chunks per layer must be at least 1, got {k}")
    started = time.perf_counter()
    layers = []
    for block in blocks:
        parts = min(k, block.num_dst)
        if parts <= 1:
            groups = [torch.arange(block.num_dst)]
        else:
            groups = OutputSplitter(block, partitioner).split(parts, seed)
        pieces = []
        for group in groups:
            if group.numel():
                piece = slice_layers([block], group)[0]
                pieces.append(Chunk(group.long(), piece.num_src, piece.indptr))
        layers.append(pieces)
    return LayerChunks(layers, time.perf_counter() - started)
