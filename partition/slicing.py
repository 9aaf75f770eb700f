"""Micro-batch slicing of a multi-layer full batch (DESIGN.md › Micro-batch slicing; Betty §4.2.3)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class BlockStructure(Protocol):
    """The structure of one block (MFG) that partitioning needs.

    ``indptr`` is ``(num_dst + 1,)`` int64 and ``indices`` ``(E,)`` int64 local src
    positions; the first ``num_dst`` src positions are the dst nodes.
    """

    indptr: Tensor
    indices: Tensor

    @property
    def num_dst(self) -> int: ...

    @property
    def num_src(self) -> int: ...


@dataclass(frozen=True)
class LayerSlice:
    """One layer of a micro-batch, as positions into the full batch's block.

    Attributes:
        src_index: ``(n_src,)`` int64 positions into the parent block's src nodes;
            the first ``num_dst`` are the micro-batch's dst nodes.
        num_dst: number of dst nodes kept.
        indptr: ``(num_dst + 1,)`` int64 CSC pointer of the sliced block.
        indices: ``(e,)`` int64 positions into ``src_index`` (local src ids).
        edge_ids: ``(e,)`` int64 positions of the kept edges in the parent block,
            in the sliced block's CSC order.
    """

    src_index: Tensor
    num_dst: int
    indptr: Tensor
    indices: Tensor
    edge_ids: Tensor

    @property
    def num_src(self) -> int:
        return self.src_index.numel()


def slice_layers(blocks: Sequence[BlockStructure], output_index: Tensor) -> list[LayerSlice]:
    """Slice the sub-batch that computes the chosen output nodes, output layer to input layer.

    For each block, keeps the dst rows of the chosen nodes, all their in-edges,
    and the src nodes those edges touch (dst nodes first, then the other src
    nodes in the parent's order); those src nodes are the previous layer's dst
    nodes. The result holds exactly the parent's edges reachable from the
    outputs and nothing else, so a micro-batch computes the same math as the
    full batch for its outputs. Vectorised; no Python loop over nodes.

    Args:
        blocks: the full batch's blocks, input layer first. Consecutive blocks
            must chain: ``blocks[l].num_dst == blocks[l + 1].num_src``.
        output_index: ``(m,)`` int64 positions among the output block's dst nodes.

    Returns:
        One :class:`LayerSlice` per block, input layer first.

    Raises:
        ValueError: if the blocks do not chain or ``output_index`` is out of range.
    """
    for lower, upper in itertools.pairwise(blocks):
        if lower.num_dst != upper.num_src:
            raise ValueError(f"blocks do not chain: {lower.num_dst} dst nodes feed {upper.num_src} src nodes")
    dst = output_index.long()
    if dst.numel() and (int(dst.min()) < 0 or int(dst.max()) >= blocks[-1].num_dst):
        raise ValueError(f"output_index out of range [0, {blocks[-1].num_dst})")
    slices = []
    for block in reversed(blocks):
        layer = _slice_block(block, dst)
        slices.append(layer)
        dst = layer.src_index
    slices.reverse()
    return slices


def whole_batch(blocks: Sequence[BlockStructure]) -> list[LayerSlice]:
    """The slices of the whole batch (K = 1): every src node, dst node and edge of each block, in place.

    Equals :func:`slice_layers` of all outputs for blocks whose src nodes beyond the dst nodes are all
    touched by an edge (every sampled block), at the cost of two ``arange`` per block instead of a
    relabelling.
    """
    return [LayerSlice(torch.arange(b.num_src, device=b.indptr.device), b.num_dst, b.indptr, b.indices,
                       torch.arange(b.indices.numel(), device=b.indptr.device)) for b in blocks]


def _slice_block(block: BlockStructure, dst: Tensor) -> LayerSlice:
    new_indptr, edge_ids = gather_rows(block.indptr, dst)
    touched = block.indices[edge_ids]

    src_index, local = relabel_dst_first(dst, touched, block.num_src)
    return LayerSlice(src_index=src_index, num_dst=dst.numel(), indptr=new_indptr, indices=local, edge_ids=edge_ids)


def gather_rows(indptr: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The edges of the chosen rows of a CSC structure, vectorised.

    Args:
        indptr: ``(R + 1,)`` int64 pointer.
        rows: ``(n,)`` int64 chosen rows (destination nodes).

    Returns:
        ``pointer`` ``(n + 1,)`` int64 of the chosen rows' edges and ``edge_ids`` ``(e,)``
        int64 positions of those edges in the original structure, row by row.
    """
    start = indptr[rows]
    degree = indptr[rows + 1] - start
    pointer = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(degree, 0, out=pointer[1:])
    offset = torch.arange(int(pointer[-1]), device=rows.device) - torch.repeat_interleave(pointer[:-1], degree)
    return pointer, torch.repeat_interleave(start, degree) + offset


def relabel_dst_first(dst: Tensor, touched: Tensor, id_space: int | None = None) -> tuple[Tensor, Tensor]:
    """Number the src nodes of a block: ``dst`` first, then the other touched ids in ascending order.

    Without ``id_space``: one ``torch.unique`` with inverse over ``dst`` and
    ``touched``, work O((n + e) log(n + e)) and memory O(n + e) on ``dst.device``,
    nothing sized by the id space (global node ids). With ``id_space``: a dense
    scratch array of that size (faster when the id space is itself the batch, as
    for block-local positions in :func:`slice_layers`).

    Args:
        dst: ``(n,)`` int64 distinct ids of the dst nodes.
        touched: ``(e,)`` int64 ids of the edges' source endpoints.
        id_space: if given, every id is below it; pass it only when it is O(batch).

    Returns:
        ``src_ids`` ``(n + m,)`` int64 (``src_ids[:n] == dst``) and ``local`` ``(e,)`` int64,
        the position of each touched id in ``src_ids``.
    """
    n, device = dst.numel(), dst.device
    if id_space is not None:
        local = torch.full((id_space,), -1, dtype=torch.int64, device=device)
        local[dst] = torch.arange(n, device=device)
        extra = torch.unique(touched[local[touched] < 0])
        local[extra] = torch.arange(n, n + extra.numel(), device=device)
        return torch.cat([dst, extra]), local[touched]
    unique, inverse = torch.unique(torch.cat([dst, touched]), return_inverse=True)
    is_extra = torch.ones(unique.numel(), dtype=torch.bool, device=device)
    is_extra[inverse[:n]] = False
    extra = torch.nonzero(is_extra).flatten()
    label = torch.empty(unique.numel(), dtype=torch.int64, device=device)
    label[inverse[:n]] = torch.arange(n, device=device)
    label[extra] = torch.arange(n, n + extra.numel(), device=device)
    return torch.cat([dst, unique[extra]]), label[inverse[n:]]
