"""Micro-batch slicing of a multi-layer full batch (docs/design.md › Micro-batch slicing; Betty §4.2.3)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

try:
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None

LOCAL_INDEX = torch.int32
"""dtype of a block's ``indices`` (local src positions: a block holds fewer than 2³¹ src nodes), half of int64's
bytes per edge; node ids and CSC pointers stay int64."""


class BlockStructure(Protocol):
    """The structure of one block (MFG) that partitioning needs.

    ``indptr`` is ``(num_dst + 1,)`` int64 and ``indices`` ``(E,)`` int32 (:data:`LOCAL_INDEX`) local src
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
        indices: ``(e,)`` int32 (:data:`LOCAL_INDEX`) positions into ``src_index`` (local src ids).
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

    @property
    def num_edges(self) -> int:
        return self.indices.numel()


@dataclass(frozen=True)
class SliceSize:
    """The sizes of one layer of a micro-batch (a :class:`LayerSlice`'s, or a whole block's): what a plan keeps of a
    micro-batch's layer between steps, its tensors being sliced again when the micro-batch runs.

    Attributes:
        num_src: src nodes (the dst nodes included).
        num_dst: dst nodes.
        num_edges: edges.
        degree_histogram: ``((L, B), …)``: ``B`` dst nodes have in-degree ``L`` (L ≥ 1), ascending in ``L`` (what
            the memory estimate needs besides the counts: Betty Eq. 5's buckets); ``None`` where not counted
            (:func:`count_layers` counts it).
    """

    num_src: int
    num_dst: int
    num_edges: int
    degree_histogram: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of(cls, block: BlockStructure) -> "SliceSize":
        """The sizes of a whole block."""
        return cls(block.num_src, block.num_dst, block.indices.numel())


def _check_chain(blocks: Sequence[BlockStructure]) -> None:
    """Raise ``ValueError`` unless each block's dst nodes are the next block's src nodes (input layer first)."""
    for lower, upper in itertools.pairwise(blocks):
        if lower.num_dst != upper.num_src:
            raise ValueError(f"blocks do not chain: {lower.num_dst} dst nodes feed {upper.num_src} src nodes")


def slice_layers(blocks: Sequence[BlockStructure], output_index: Tensor) -> list[LayerSlice]:
    """Slice the sub-batch that computes the chosen output nodes, output layer to input layer.

    For each block, keeps the dst rows of the chosen nodes, all their in-edges,
    and the src nodes those edges touch (dst nodes first, then the other src
    nodes in the parent's order); those src nodes are the previous layer's dst
    nodes. The result holds exactly the parent's edges reachable from the
    outputs and nothing else, so a micro-batch computes the same math as the
    full batch for its outputs. No Python loop over nodes: on the CPU two compiled
    passes per block (:func:`slice_block_compiled`; serial, so it does not stall when
    other processes hold the cores, as many small multi-threaded tensor ops do),
    elsewhere tensor ops (:func:`slice_block_tensors`, which run on GPUs); both give
    the same slices.

    Args:
        blocks: the full batch's blocks, input layer first. Consecutive blocks
            must chain: ``blocks[l].num_dst == blocks[l + 1].num_src``.
        output_index: ``(m,)`` int64 positions among the output block's dst nodes.

    Returns:
        One :class:`LayerSlice` per block, input layer first.

    Raises:
        ValueError: if the blocks do not chain or ``output_index`` is out of range.
    """
    _check_chain(blocks)
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


def count_layers(blocks: Sequence[BlockStructure], groups: Sequence[Tensor]) -> list[list[SliceSize]]:
    """The sizes of every group's micro-batch, as :func:`slice_layers` would slice it, without slicing.

    Equal, layer by layer, to ``slice_layers(blocks, group)``'s counts (src, dst and edge counts and the dst
    in-degree histogram), for all groups in one compiled pass per block (:func:`_count_kernel`): a node's
    membership in the groups is a bit set (``⌈K / 64⌉`` uint64 words), each src node gets the union of its
    readers' sets, and per group the counts are sums over the nodes whose set holds it. Work
    ``O(W·E + M + S·⌈K / 8⌉ + 256·K)`` per block for ``W`` words, ``E`` edges, ``M`` memberships of dst nodes
    in groups and ``S`` src nodes, against ``O(redundancy · E)`` and ``K`` slices' allocations for slicing each
    group (0.6 ms against ~3 ms for a 1024-output SBM batch at K = 8, fanouts 10,25); the K search counts every
    candidate split this way (Betty §4.4.3) and slices a micro-batch only when it runs.

    Args:
        blocks: the batch's blocks, input layer first, chaining as in :func:`slice_layers`.
        groups: per micro-batch, ``(m_k,)`` int64 distinct positions among the output block's dst nodes.

    Returns:
        Per group, one :class:`SliceSize` per block (input layer first) with its ``degree_histogram``.

    Raises:
        ValueError: if the blocks do not chain or a group is out of range.
    """
    _check_chain(blocks)
    k, num_outputs = len(groups), blocks[-1].num_dst
    positions = torch.cat([group.long().cpu() for group in groups]).numpy() if k else np.zeros(0, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= num_outputs):
        raise ValueError(f"a group is out of range [0, {num_outputs})")
    sizes = np.array([group.numel() for group in groups], dtype=np.int64)
    member = _group_bits(num_outputs, k, positions, sizes)  # bit g of a node: it is in group g's layer
    layers: list[list[SliceSize]] = []
    for block in reversed(blocks):
        member, num_src, num_dst, num_edges, distinct, histogram = _count_kernel(
            block.indptr.cpu().numpy(), block.indices.cpu().numpy(), block.num_src, member, k)
        group_of, columns = np.nonzero(histogram)  # row-major: each group's degrees ascending
        degrees, counts = distinct[columns].tolist(), histogram[group_of, columns].tolist()
        bounds = np.searchsorted(group_of, np.arange(k + 1)).tolist()
        layers.append([SliceSize(src, dst, edges, tuple(zip(degrees[start:end], counts[start:end])))
                       for src, dst, edges, start, end in zip(num_src.tolist(), num_dst.tolist(), num_edges.tolist(),
                                                              bounds[:-1], bounds[1:])])
    layers.reverse()
    return [list(group_layers) for group_layers in zip(*layers)]


def _slice_block(block: BlockStructure, dst: Tensor) -> LayerSlice:
    if numba is not None and block.indptr.device.type == "cpu":
        return slice_block_compiled(block, dst)
    return slice_block_tensors(block, dst)


def slice_block_tensors(block: BlockStructure, dst: Tensor) -> LayerSlice:
    """One block of :func:`slice_layers` by tensor ops, on the block's device (any, GPUs included).

    Args:
        block: the parent block.
        dst: ``(n,)`` int64 distinct dst positions to keep, on the block's device.

    Returns:
        The :class:`LayerSlice` of those rows: src nodes numbered dst first, then the other touched
        src positions in ascending order; edges row by row in the parent's order.
    """
    new_indptr, edge_ids = gather_rows(block.indptr, dst)
    touched = block.indices.index_select(0, edge_ids)
    src_index, local = relabel_dst_first(dst, touched, block.num_src)
    return LayerSlice(src_index=src_index, num_dst=dst.numel(), indptr=new_indptr, indices=local, edge_ids=edge_ids)


def slice_block_compiled(block: BlockStructure, dst: Tensor) -> LayerSlice:
    """:func:`slice_block_tensors` by two compiled passes over the kept edges (CPU tensors; needs numba): the
    first writes the pointer and marks the touched src positions, the second writes the slice.

    Work O(e + num_src) for ``e`` kept edges, the ``num_src`` part a fill of the scratch labels (the touched
    src positions are sorted from the kept edges when that is cheaper than scanning the block's src nodes,
    as for a small chunk of a large block: :func:`_fill_kernel`). Allocated by torch (so a profiled step counts them:
    :mod:`estimator.measure`), in this order: a ``(num_src,)`` int32 scratch array (int64 from 2³¹ src
    nodes; freed on return), the ``(n + 1,)`` pointer, the ``(e,)`` edge ids, the ``(e,)`` local indices and
    the src positions. The result equals :func:`slice_block_tensors`'s, tensor for tensor.

    Why a serial kernel on the CPU: the tensor path is ~15 small multi-threaded ops per block, and each
    waits for its slowest thread, so on a machine whose cores other processes hold it stalls. Slicing
    the 16 micro-batches of ``benchmarks/reg_scale.py``'s 20k-output batch took 0.17 s here against
    4.1 s by tensor ops (2 shared cores, load average 6.6); quiet, the 2M-node case's took 0.41 s against
    0.27 s. On an idle 16-core machine the tensor ops are the faster (a synthetic 200k-output batch:
    0.45 s against 0.74 s); on a GPU they take 0.017 s.
    """
    n = dst.numel()
    label = torch.empty(block.num_src, dtype=torch.int32 if block.num_src < 2**31 else torch.int64)  # scratch
    pointer = torch.empty(n + 1, dtype=torch.int64)
    indptr, indices, dst_ids = block.indptr.numpy(), block.indices.numpy(), dst.numpy()
    extra = _mark_kernel(indptr, indices, dst_ids, label.numpy(), pointer.numpy())
    # the outputs are allocated by torch (not inside the kernel), so a profiled step sees them (estimator.measure)
    edge_ids = torch.empty(int(pointer[-1]), dtype=torch.int64)
    local = torch.empty(edge_ids.numel(), dtype=LOCAL_INDEX)
    src_index = torch.empty(n + extra, dtype=torch.int64)
    _fill_kernel(indptr, indices, dst_ids, label.numpy(), edge_ids.numpy(), local.numpy(), src_index.numpy())
    return LayerSlice(src_index=src_index, num_dst=n, indptr=pointer, indices=local, edge_ids=edge_ids)


def _jit(function):
    """numba's ``njit`` (compiled on first call, cached on disk); ``function`` itself without numba."""
    return function if numba is None else numba.njit(cache=True, nogil=True)(function)


@_jit
def _mark_kernel(indptr, indices, dst, label, pointer):  # pragma: no cover - compiled
    """The sliced CSC pointer into ``pointer``; ``label``: the dst nodes' new positions, -2 at the other
    touched src positions, -1 elsewhere. Returns the number of those other touched src positions."""
    n = dst.shape[0]
    pointer[0] = 0
    for i in range(n):
        pointer[i + 1] = pointer[i] + indptr[dst[i] + 1] - indptr[dst[i]]
    label[:] = -1
    for i in range(n):
        label[dst[i]] = i
    extra = 0
    for i in range(n):
        for edge in range(indptr[dst[i]], indptr[dst[i] + 1]):
            if label[indices[edge]] == -1:
                label[indices[edge]] = -2
                extra += 1
    return extra


@_jit
def _fill_kernel(indptr, indices, dst, label, edge_ids, local, src_index):  # pragma: no cover - compiled
    """The slice's src positions (dst first, then the other touched ones ascending), edge ids and local
    indices, from :func:`_mark_kernel`'s labels. The ``x`` other touched positions are found by a scan of the
    block's src nodes, or, when ``x·log₂x`` is smaller (a small chunk of a large block), collected from the
    kept edges and sorted, so many small chunks do not each pay for the whole block."""
    n, num_src = dst.shape[0], label.shape[0]
    extra = src_index.shape[0] - n
    src_index[:n] = dst
    if extra * np.log2(extra + 1) < num_src:
        count = n
        for i in range(n):
            for edge in range(indptr[dst[i]], indptr[dst[i] + 1]):
                if label[indices[edge]] == -2:
                    label[indices[edge]] = -3  # collected
                    src_index[count] = indices[edge]
                    count += 1
        src_index[n:].sort()
    else:
        count = n
        for src in range(num_src):
            if label[src] == -2:
                src_index[count] = src
                count += 1
    for position in range(n, n + extra):
        label[src_index[position]] = position
    position = 0
    for i in range(n):
        for edge in range(indptr[dst[i]], indptr[dst[i] + 1]):
            edge_ids[position] = edge
            local[position] = label[indices[edge]]
            position += 1


_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
#: bit index of a power of two ``p`` at ``(p · _DE_BRUIJN mod 2⁶⁴) >> 58`` (a de Bruijn sequence: each 6-bit window
#: occurs once), so a set bit's index is one multiplication and one look-up
_BIT_INDEX = np.zeros(64, dtype=np.int64)
_BIT_INDEX[[((1 << bit) * int(_DE_BRUIJN) % 2**64) >> 58 for bit in range(64)]] = np.arange(64)


@_jit
def _group_bits(num_outputs, k, positions, sizes):  # pragma: no cover - compiled
    """``(num_outputs, ⌈k / 64⌉)`` uint64 bit sets: bit ``g`` of output ``p`` set where group ``g`` holds it
    (``positions``: the groups' positions one after another, ``sizes[g]`` of them for group ``g``)."""
    member = np.zeros((num_outputs, max(1, (k + 63) // 64)), dtype=np.uint64)
    start = 0
    for group in range(k):
        bit = np.uint64(1) << np.uint64(group % 64)
        for position in positions[start:start + sizes[group]]:
            member[position, group // 64] |= bit
        start += sizes[group]
    return member


@_jit
def _count_kernel(indptr, indices, num_src, member, k):  # pragma: no cover - compiled
    """One block of :func:`count_layers`: from the dst nodes' group bit sets ``member`` (``(num_dst, W)`` uint64),
    the src nodes' bit sets (``(num_src, W)``; the dst nodes, the first ``num_dst`` src positions, keep their
    own) and per group its src, dst and edge counts (``(k,)`` int64 each), the in-degrees that occur
    (``(D,)`` int64, ascending) and its dst nodes' histogram over them (``(k, D)`` int64). A dst node's groups
    are visited by their set bits only (lowest first, :data:`_BIT_INDEX`), so its cost is the number of groups
    that hold it, not K; the src nodes are counted by the values of their bit sets' bytes (``⌈K / 8⌉``
    increments per node)."""
    n, words = member.shape
    column = np.zeros(1 + max(0, np.max(indptr[1:] - indptr[:-1])) if n else 1, dtype=np.int64)
    for v in range(n):  # column[d] = 1 where some dst node has in-degree d ≥ 1, then the histogram's columns
        column[indptr[v + 1] - indptr[v]] = 1
    column[0] = 0
    distinct = np.flatnonzero(column)
    column = np.cumsum(column) - 1
    num_src_out, num_dst_out, num_edges_out = np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64)
    histogram = np.zeros((k, distinct.size), dtype=np.int64)
    src = np.zeros((num_src, words), dtype=np.uint64)
    src[:n] = member
    one, shift = np.uint64(1), np.uint64(58)
    for v in range(n):
        degree = indptr[v + 1] - indptr[v]
        for word in range(words):
            bits = member[v, word]
            if bits == 0:
                continue
            for edge in range(indptr[v], indptr[v + 1]):
                src[np.uint64(indices[edge]), word] |= bits  # unsigned: no check for a negative index
            while bits:
                lowest = bits & (~bits + one)
                group = 64 * word + _BIT_INDEX[(lowest * _DE_BRUIJN) >> shift]
                num_dst_out[group] += 1
                num_edges_out[group] += degree
                if degree > 0:
                    histogram[group, column[degree]] += 1
                bits ^= lowest
    # src counts by byte: how many src nodes hold each value of each byte of the bit sets, then per group the
    # values with its bit (one increment per node and byte instead of one per group holding it)
    num_bytes = (k + 7) // 8
    by_byte = np.zeros((num_bytes, 256), dtype=np.int64)
    for u in range(num_src):
        for byte in range(num_bytes):
            by_byte[byte, (src[u, byte // 8] >> np.uint64(8 * (byte % 8))) & np.uint64(255)] += 1
    for group in range(k):
        for value in range(256):
            if (value >> (group % 8)) & 1:
                num_src_out[group] += by_byte[group // 8, value]
    return src, num_src_out, num_dst_out, num_edges_out, distinct, histogram


def gather_rows(indptr: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The edges of the chosen rows of a CSC structure, vectorised.

    Args:
        indptr: ``(R + 1,)`` int64 pointer.
        rows: ``(n,)`` int64 chosen rows (destination nodes).

    Returns:
        ``pointer`` ``(n + 1,)`` int64 of the chosen rows' edges and ``edge_ids`` ``(e,)``
        int64 positions of those edges in the original structure, row by row.
    """
    start = indptr.index_select(0, rows)  # index_select: a faster CPU kernel than advanced indexing
    degree = indptr.index_select(0, rows + 1) - start
    pointer = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(degree, 0, out=pointer[1:])
    total = int(pointer[-1])
    # edge j of row i sits at start[i] + (j - pointer[i]): one repeat of the per-row shift, plus an arange
    edge_ids = torch.repeat_interleave(start - pointer[:-1], degree, output_size=total)
    edge_ids += torch.arange(total, device=rows.device)
    return pointer, edge_ids


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
        ``src_ids`` ``(n + m,)`` int64 (``src_ids[:n] == dst``) and ``local`` ``(e,)`` int32
        (:data:`LOCAL_INDEX`), the position of each touched id in ``src_ids``.
    """
    n, device = dst.numel(), dst.device
    if id_space is not None:
        # mark the touched ids, unmark the dst ids: the others, in ascending order, without a sort
        seen = torch.zeros(id_space, dtype=torch.bool, device=device)
        seen[touched] = True  # index_fill_ takes int64 ids only, and touched may be int32 local positions
        seen.index_fill_(0, dst, False)
        extra = torch.nonzero(seen).flatten()
        local = torch.empty(id_space, dtype=LOCAL_INDEX, device=device)  # read only at dst and extra ids
        local.index_copy_(0, dst, torch.arange(n, dtype=LOCAL_INDEX, device=device))
        local.index_copy_(0, extra, torch.arange(n, n + extra.numel(), dtype=LOCAL_INDEX, device=device))
        return torch.cat([dst, extra]), local.index_select(0, touched)
    unique, inverse = torch.unique(torch.cat([dst, touched]), return_inverse=True)
    is_extra = torch.ones(unique.numel(), dtype=torch.bool, device=device)
    is_extra[inverse[:n]] = False
    extra = torch.nonzero(is_extra).flatten()
    label = torch.empty(unique.numel(), dtype=LOCAL_INDEX, device=device)
    label[inverse[:n]] = torch.arange(n, dtype=LOCAL_INDEX, device=device)
    label[extra] = torch.arange(n, n + extra.numel(), dtype=LOCAL_INDEX, device=device)
    return torch.cat([dst, unique[extra]]), label[inverse[n:]]
