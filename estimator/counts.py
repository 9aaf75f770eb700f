"""What the estimator needs to know about a micro-batch: node and edge counts per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

INDEX_BYTES = 8  # int64 node ids and CSC pointers
LOCAL_INDEX_BYTES = 4  # int32 local src positions: a block's indices (partition.slicing.LOCAL_INDEX)
SHORT_POSITIONS_MAX_DST = 2**15 - 1
"""The most dst nodes whose local positions a kept transpose holds as int16 (2 bytes an edge) instead of int32."""


def kept_transpose_bytes(c: "LayerCounts") -> int:
    """Bytes of a block's kept transpose (``betty_trainer.data.block.BlockTranspose``): its int32 pointer
    ``4·(S + 1)``, its dst positions, ``2·E`` (int16) up to :data:`SHORT_POSITIONS_MAX_DST` dst nodes and ``4·E``
    (int32) above, and with edge weights ``4·E`` float32."""
    position_bytes = 2 if c.num_dst <= SHORT_POSITIONS_MAX_DST else 4
    return (c.num_src + 1) * 4 + c.num_edges * position_bytes + (4 * c.num_edges if c.weighted else 0)


@dataclass(frozen=True)
class LayerCounts:
    """Sizes of one block (Betty Table 3: N, E, and the in-degree buckets L_i, B_i of Eq. 5).

    Attributes:
        num_src: src nodes (the dst nodes included).
        num_dst: dst nodes.
        num_edges: edges E.
        degree_histogram: ``((L, B), …)``: ``B`` dst nodes have in-degree ``L`` (L ≥ 1),
            ascending in ``L``.
        weighted: the block carries ``(E,)`` float32 edge weights (LABOR/GNS importance weights):
            they are resident with the block and change the mean's coefficients.
        transposed: the block keeps its transpose's CSR between steps (``betty_trainer.data.block.BlockTranspose``,
            :func:`kept_transpose_bytes`), resident with the block; the backward of its sparse aggregation gathers
            on it.
    """

    num_src: int
    num_dst: int
    num_edges: int
    degree_histogram: tuple[tuple[int, int], ...] = ()
    weighted: bool = False
    transposed: bool = False

    @classmethod
    def from_csc(cls, indptr: Tensor, num_src: int, weighted: bool = False, transposed: bool = False) -> "LayerCounts":
        """Counts of a block from its ``(num_dst + 1,)`` int64 CSC pointer (on any device) and src count.

        The histogram is a ``numpy.bincount`` of the degrees on the CPU (``O(num_dst + max degree)``): on 60k
        degrees, one thread, 0.1 ms against ``torch.unique``'s 2 ms alone, and ~0.1 s per call that
        ``torch.unique`` took between training steps (profiled planning of a 100k-node SBM's sampled batches),
        more than counting all the batch's micro-batches (:func:`partition.slicing.count_layers`)."""
        degrees = np.diff(indptr.cpu().numpy())
        counts = np.bincount(degrees)
        values = np.flatnonzero(counts[1:]) + 1
        return cls(num_src, indptr.numel() - 1, int(indptr[-1]), tuple(zip(values.tolist(), counts[values].tolist())),
                   weighted, transposed)


def counts_of(structures: Sequence[Any], weighted: Sequence[bool] | None = None) -> list[LayerCounts]:
    """:class:`LayerCounts` of each block or layer slice (anything with ``indptr`` and ``num_src``), or of each
    layer's sizes already counted (anything with ``num_src``, ``num_dst``, ``num_edges`` and a
    ``degree_histogram`` that is not ``None``: :func:`partition.slicing.count_layers`'s sizes).

    Args:
        structures: blocks, :class:`~partition.slicing.LayerSlice` s, :class:`~partition.chunks.Chunk` s or
            counted :class:`~partition.slicing.SliceSize` s, input layer first.
        weighted: per layer, whether the block carries edge weights; ``None`` reads each structure's
            ``edge_weight`` (a layer slice has none: pass the parent batch's answer).

    A block that keeps its transpose (its ``kept_transpose`` is not ``None``) counts as ``transposed``.
    """
    if weighted is None:
        weighted = [getattr(s, "edge_weight", None) is not None for s in structures]
    return [LayerCounts(s.num_src, s.num_dst, s.num_edges, s.degree_histogram, w)
            if getattr(s, "degree_histogram", None) is not None
            else LayerCounts.from_csc(s.indptr, s.num_src, w, getattr(s, "kept_transpose", None) is not None)
            for s, w in zip(structures, weighted)]


LEADING_RANGE_CHUNK = 1 << 16  # ids compared with an arange at a time (numpy scratch of 512 KiB at most)


def leading_range(node_ids: Tensor) -> bool:
    """Whether ``node_ids`` (``(n,)`` int64, any device) are ``0, 1, …, n − 1`` in order: the first ``n`` rows of
    any per-node tensor, a view of it (a full-graph batch whose outputs are every node in order has these input
    nodes). ``O(n)``, answered at once when the last id is not ``n − 1``; on the CPU compared in chunks of
    :data:`LEADING_RANGE_CHUNK` in numpy, so no torch tensor is allocated (the check runs inside measured steps)."""
    n = node_ids.numel()
    if n == 0 or int(node_ids[-1]) != n - 1:
        return False
    if node_ids.device.type != "cpu":
        return bool(torch.equal(node_ids, torch.arange(n, dtype=node_ids.dtype, device=node_ids.device)))
    ids = node_ids.numpy()
    return all(np.array_equal(ids[start:start + LEADING_RANGE_CHUNK], np.arange(start, min(n, start + LEADING_RANGE_CHUNK)))
               for start in range(0, n, LEADING_RANGE_CHUNK))


def reads_in_place(structure: Any) -> bool:
    """Whether a micro-batch whose input layer is ``structure`` reads its input rows in place, where the feature
    store hands them out (``ModelSpec.features_in_place``): a block (it has ``src_nodes``) whose src nodes are a
    :func:`leading_range`. A layer slice or counted sizes (the K search's candidates) say no: their estimate counts
    the gather, an upper bound for the rare micro-batch of several that would read in place."""
    src_nodes = getattr(structure, "src_nodes", None)
    return src_nodes is not None and leading_range(src_nodes)


def block_structure_bytes(layers: Sequence[LayerCounts]) -> int:
    """Bytes of the blocks' int64 src ids and CSC pointers and int32 indices, ``Σ_l 8·(S_l + D_l + 1) + 4·E_l``,
    plus ``4·E_l`` for float32 edge weights where a block has them, and a kept transpose's where it keeps one
    (``transposed``: :func:`kept_transpose_bytes`)."""
    return sum((c.num_src + c.num_dst + 1) * INDEX_BYTES + c.num_edges * LOCAL_INDEX_BYTES
               + (4 * c.num_edges if c.weighted else 0) + (kept_transpose_bytes(c) if c.transposed else 0)
               for c in layers)
