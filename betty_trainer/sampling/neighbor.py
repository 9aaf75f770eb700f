"""Neighbour sampling into blocks: full neighbourhood or uniform per-layer fanouts (docs/design.md › NS, › Seams).

A sampled block costs what it keeps, not what the graph holds: a dst node whose
in-degree is at most the fanout keeps all its in-edges (no randomness, no sort);
a node of degree ``d > k`` draws ``k`` distinct offsets in ``[0, d)`` with Floyd's
algorithm (Bentley & Floyd, "A sample of brilliance", CACM 30(9), 1987), ``k``
vectorised rounds over such rows, so its ``d`` in-edges are never read. Every
random number is a counter-based hash (:mod:`betty_trainer.rng`) of
``(seed, epoch, step, layer, dst node, round)``: the neighbours drawn for a node
do not depend on which other seeds share its batch, nor on their order.

The same code runs with tensor ops on any device; on CPU a numba kernel computes
the identical sample (same hashes, same offsets) and relabels through a hash
table sized by the batch, because tensor ops there are dominated by per-op and
sorting costs. ``kernel="tensor"`` forces the tensor path everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.graph import Graph
from betty_trainer.rng import hash_id_scalar, hash_ids, jit, mix_key
from betty_trainer.sampling.base import BlockSampler, SampleKey
from partition.slicing import relabel_dst_first

try:  # the CPU kernel; the tensor path below needs nothing beyond torch
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None

Kernel = Literal["auto", "tensor", "numba"]


class NeighborSampler(BlockSampler):
    """Uniform neighbour sampling with per-layer fanouts (GraphSAGE, Hamilton et al. 2017, Alg. 2).

    Each dst node keeps all its in-edges if its in-degree is at most the layer's
    fanout, else ``fanout`` of them uniformly without replacement; all fanouts
    ``None`` is the full neighbourhood ("full" sampler). Kept edges are in CSC
    order. Cost per block: O(kept edges + dst nodes), independent of ``N``,
    ``E`` and of the degree of sampled hubs.

    Args:
        graph: the graph (on any device; the blocks come out on the same device).
        fanouts: one entry per layer, **input layer first** (DGL's convention);
            ``None`` or ``-1`` means the full neighbourhood.
        kernel: ``"auto"`` (numba on CPU when installed, tensor ops elsewhere),
            ``"tensor"`` or ``"numba"``; all give the same sample.

    Raises:
        ValueError: if a fanout is 0 or below -1, or ``kernel`` is unknown or unavailable.
    """

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], kernel: Kernel = "auto") -> None:
        self.graph = graph
        self.fanouts = ns_fanouts(graph, fanouts)
        _use_numba(kernel, graph.indptr)  # refuses an unknown or unavailable kernel now, not at the first batch
        self.kernel = kernel
        self._last_full: tuple[Tensor, Batch] | None = None  # (seeds, batch): the last full-neighbourhood batch

    def sample(self, seeds: Tensor, key: SampleKey) -> Batch:
        """The batch of ``seeds`` (:meth:`BlockSampler.sample`). With every fanout ``None`` (the full neighbourhood)
        the batch depends on the seeds alone, not on ``key``: the last such batch is kept and handed out again for
        equal seeds, so full-batch training samples its batch once per run instead of once per epoch (10 ms of a
        110 ms step on Amazon Computers: ``benchmarks/versus_dgl.py``). It costs no memory in training, whose planner
        keeps the last batch with its plan (``Planner.plan``), plus a copy of the seeds (``(B,)`` int64)."""
        if any(fanout is not None for fanout in self.fanouts):
            return super().sample(seeds, key)
        last = self._last_full
        if last is not None and last[0].shape == seeds.shape and last[0].device == seeds.device \
                and torch.equal(last[0], seeds):
            return last[1]
        batch = super().sample(seeds, key)
        self._last_full = (seeds.clone(), batch)
        return batch

    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` of batch ``key`` (:func:`sample_block` with the layer's fanout and key)."""
        return sample_block(self.graph, dst, self.fanouts[layer], key=key.layer_key(layer), kernel=self.kernel)

    def __repr__(self) -> str:
        return f"NeighborSampler(fanouts={self.fanouts}, kernel={self.kernel!r})"


def sample_batch(
    graph: Graph,
    seeds: Tensor,
    fanouts: Sequence[int | None],
    generator: torch.Generator | None = None,
    *,
    key: SampleKey | None = None,
) -> Batch:
    """Sample the multi-layer batch that computes ``seeds``, output layer first (see :class:`NeighborSampler`).

    Args:
        graph: the graph.
        seeds: ``(B,)`` int64 output node ids (distinct).
        fanouts: one entry per layer, **input layer first**; ``None`` or ``-1`` means
            the full neighbourhood.
        generator: used only when ``key`` is ``None`` and some fanout samples: one
            draw from it (the global RNG if ``None``) seeds the key, so the same
            generator state gives the same batch.
        key: the batch's :class:`SampleKey` (preferred: keyed randomness).

    Returns:
        A :class:`Batch` of ``len(fanouts)`` blocks, input layer first.

    Raises:
        ValueError: if a fanout is 0 or below -1.
    """
    sampler = NeighborSampler(graph, fanouts)
    if key is None:
        key = SampleKey(0) if all(f is None for f in sampler.fanouts) else SampleKey.draw(generator)
    return sampler.sample(seeds, key)


def sample_block(
    graph: Graph,
    dst: Tensor,
    fanout: int | None,
    generator: torch.Generator | None = None,
    *,
    key: int | None = None,
    kernel: Kernel = "auto",
) -> Block:
    """Sample one block whose dst nodes are ``dst`` (see :class:`NeighborSampler`).

    The ``k`` offsets of a row of degree ``d > k`` come from Floyd's algorithm:
    round ``i`` draws ``t`` uniform in ``[0, j]`` with ``j = d − k + i`` and keeps
    ``t``, or ``j`` if ``t`` was already kept, which yields every ``k``-subset with
    probability ``1 / C(d, k)``. ``t = ⌊h · (j + 1) / 2³²⌋`` for the 32-bit hash
    ``h`` of the dst node under round ``i``'s key (Lemire, ACM TOMACS 2019; bias
    below ``d / 2³²``). Offsets are then sorted, so kept edges stay in CSC order.

    Args:
        graph: the graph.
        dst: ``(n,)`` int64 distinct global ids of the dst nodes, on the graph's device.
        fanout: at most this many in-edges per dst node; ``None`` keeps all.
        generator: when ``key`` is ``None``, one draw from it (or the global RNG) makes the key.
        key: the 32-bit layer key (:meth:`SampleKey.layer_key`).
        kernel: ``"auto"``, ``"tensor"`` or ``"numba"`` (see :class:`NeighborSampler`).

    Returns:
        A :class:`Block` with ``src_nodes[:n] == dst``; int64 ``src_nodes`` and ``indptr``, int32 ``indices``.

    Raises:
        ValueError: if ``fanout`` is 0 or below -1, or ``kernel`` is unknown or unavailable.
    """
    fanout = _check_fanout(fanout)
    if key is None:
        key = 0 if fanout is None else SampleKey.draw(generator).layer_key(0)
    dst = dst.long()
    round_keys = [] if fanout is None else [mix_key(key, i) for i in range(fanout)]
    if _use_numba(kernel, graph.indptr):
        return _sample_block_numba(graph, dst, fanout, round_keys)
    return _sample_block_tensor(graph, dst, fanout, round_keys)


def ns_fanouts(graph: Graph, fanouts: Sequence[int | None]) -> list[int | None]:
    """NS's fanouts on ``graph``, each checked (:func:`sample_block`'s rule) and at most the graph's largest
    in-degree (:attr:`Graph.max_in_degree <betty_trainer.data.graph.Graph.max_in_degree>`, computed once per graph):
    a larger fanout keeps every in-edge of every node, as the largest in-degree does, so the batches are the same,
    and a draw makes one round key per round up to the fanout (a fanout of 2³² would make 2³² of them). Source: the
    per-layer sample sizes of GraphSAGE's Alg. 2 (Hamilton et al. 2017), which a node of smaller degree meets in full.

    Args:
        graph: the graph sampled.
        fanouts: one per layer, input layer first; ``None`` or ``-1`` for the full neighbourhood.

    Returns:
        The fanouts, ``None`` for a full neighbourhood, each int at most ``max(1, graph.max_in_degree)``.

    Raises:
        ValueError: a fanout of 0 or below -1.
    """
    checked = [_check_fanout(f) for f in fanouts]
    if all(f is None for f in checked):
        return checked
    largest = max(1, graph.max_in_degree)
    return [None if f is None else min(f, largest) for f in checked]


def _check_fanout(fanout: int | None) -> int | None:
    if fanout is not None and (fanout == 0 or fanout < -1):
        raise ValueError(f"fanout must be positive, or -1/None for the full neighbourhood; got {fanout}")
    return None if fanout in (None, -1) else int(fanout)


def _use_numba(kernel: Kernel, tensor: Tensor) -> bool:
    if kernel not in ("auto", "tensor", "numba"):
        raise ValueError(f"kernel must be 'auto', 'tensor' or 'numba'; got {kernel!r}")
    on_cpu = tensor.device.type == "cpu"
    if kernel == "numba" and (numba is None or not on_cpu):
        raise ValueError("kernel='numba' needs the numba package and a graph on the CPU; use kernel='tensor'")
    return kernel == "numba" or (kernel == "auto" and numba is not None and on_cpu)


# ---------------------------------------------------------------- tensor path (any device)


def _sample_block_tensor(graph: Graph, dst: Tensor, fanout: int | None, round_keys: list[int]) -> Block:
    keys = torch.tensor(round_keys, dtype=torch.int64, device=dst.device)
    pointer, edge_ids = kept_edges(graph.indptr, dst, fanout, keys)
    src_nodes, local = relabel_dst_first(dst, graph.indices[edge_ids].long())
    return Block(src_nodes, dst.numel(), pointer, local)


def kept_edges(indptr: Tensor, dst: Tensor, fanout: int | None, round_keys: Tensor | None = None,
               key_of_row: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The in-edges NS keeps for the rows ``dst``: all of a row of degree at most ``fanout``, else Floyd's
    ``fanout`` offsets (:func:`floyd_offsets`), read from ``indptr`` alone (no in-edge list is touched).

    Args:
        indptr: ``(N + 1,)`` int64 CSC pointer of the graph.
        dst: ``(R,)`` int64 global ids of the rows (the hash counters).
        fanout: at most this many in-edges per row; ``None`` keeps all.
        round_keys: ``(fanout,)`` int64 32-bit round keys shared by every row, or ``(k, fanout)`` with
            ``key_of_row``; needed only when ``fanout`` is not ``None``.
        key_of_row: ``(R,)`` int64: which row of ``round_keys`` keys each row (the bulk sampler's batch of a row).

    Returns:
        ``pointer`` ``(R + 1,)`` int64 (row ``r`` keeps ``pointer[r + 1] − pointer[r]`` edges) and ``edge_ids``
        ``(pointer[-1],)`` int64 positions in the graph's ``indices``, in CSC order within each row.
    """
    device = dst.device
    start = indptr[dst]
    degree = indptr[dst + 1] - start
    kept = degree if fanout is None else torch.clamp(degree, max=fanout)
    pointer = torch.zeros(dst.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(kept, 0, out=pointer[1:])
    total = int(pointer[-1])
    # edge e of row r is start[r] + (e − pointer[r]): all in-edges of rows kept whole
    edge_ids = torch.repeat_interleave(start - pointer[:-1], kept, output_size=total)
    edge_ids += torch.arange(total, device=device)
    if fanout is not None:
        big = torch.nonzero(degree > fanout).flatten()
        if big.numel():
            keys = round_keys if key_of_row is None else round_keys[key_of_row[big]]
            offsets = floyd_offsets(dst[big], degree[big], keys)
            steps = torch.arange(fanout, device=device)
            edge_ids[(pointer[big][:, None] + steps).flatten()] = (start[big][:, None] + offsets).flatten()
    return pointer, edge_ids


def floyd_offsets(ids: Tensor, degree: Tensor, round_keys: Sequence[int] | Tensor) -> Tensor:
    """``k`` distinct sorted offsets in ``[0, degree)`` per row, keyed by ``ids``.

    Floyd's algorithm (Bentley & Floyd, CACM 1987), one vectorised round per kept
    offset; see :func:`sample_block`. Work and memory O(R · k²) / O(R · k).

    Args:
        ids: ``(R,)`` int64 global node ids of the rows (the hash counters).
        degree: ``(R,)`` int64 row degrees, each greater than ``k``.
        round_keys: ``k`` 32-bit keys, one per round (a sequence or a ``(k,)`` int64 tensor), or an ``(R, k)``
            int64 tensor of each row's own round keys.

    Returns:
        ``(R, k)`` int64 offsets, strictly increasing along each row.
    """
    round_keys = torch.as_tensor(round_keys, dtype=torch.int64, device=ids.device)
    k = round_keys.shape[-1]
    chosen = torch.empty((ids.numel(), k), dtype=torch.int64, device=ids.device)
    for i in range(k):
        j = degree - (k - i)  # the round's upper bound, inclusive
        t = (hash_ids(round_keys[..., i], ids) * (j + 1)) >> 32
        if i:
            t = torch.where((chosen[:, :i] == t[:, None]).any(1), j, t)
        chosen[:, i] = t
    return torch.sort(chosen, dim=1).values


# ---------------------------------------------------------------- numba path (CPU)


def _sample_block_numba(graph: Graph, dst: Tensor, fanout: int | None, round_keys: list[int]) -> Block:
    keys = torch.tensor([round_keys], dtype=torch.int64)
    pointer, src = kept_sources_numba(graph.indptr, graph.indices, dst, fanout, keys, torch.empty(0, dtype=torch.int64))
    src_nodes, local = _relabel(dst.numpy(), src.numpy())
    return Block(torch.from_numpy(src_nodes), dst.numel(), pointer, torch.from_numpy(local))


def kept_sources_numba(indptr: Tensor, indices: Tensor, dst: Tensor, fanout: int | None, round_keys: Tensor,
                       key_of_row: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`kept_edges`'s sample by the CPU kernel, the kept edges' sources read in the same pass.

    Args:
        indptr, indices: the graph's CSC (CPU tensors).
        dst: ``(R,)`` int64 global ids of the rows.
        fanout: at most this many in-edges per row; ``None`` keeps all.
        round_keys: ``(k, fanout)`` int64 round keys (``(1, fanout)`` or ``(1, 0)`` when every row shares them).
        key_of_row: ``(R,)`` int64 the row of ``round_keys`` keying each row, or empty: row 0 for every row.

    Returns:
        ``pointer`` ``(R + 1,)`` int64 and ``src`` ``(pointer[-1],)`` int64 the kept edges' source ids, in CSC
        order within each row: ``indices[kept_edges(...)[1]]``.
    """
    indptr, indices, ids, keys, key_row = (t.numpy() for t in (indptr, indices, dst, round_keys, key_of_row))
    fanout = -1 if fanout is None else fanout
    pointer = _kept_pointer(indptr, ids, fanout)
    src = np.empty(int(pointer[-1]), np.int64)
    threads = min(torch.get_num_threads(), ids.size // _ROWS_PER_THREAD)
    if threads > 1:  # the kernel releases the GIL: rows split over Python threads, no second OpenMP pool
        bounds = np.linspace(0, ids.size, threads + 1).astype(np.int64)
        pool = _thread_pool()
        list(pool.map(lambda lo, hi: _sample_rows(indptr, indices, ids, fanout, keys, key_row, pointer, src, lo, hi),
                      bounds[:-1], bounds[1:]))
    else:
        _sample_rows(indptr, indices, ids, fanout, keys, key_row, pointer, src, 0, ids.size)
    return torch.from_numpy(pointer), torch.from_numpy(src)


_ROWS_PER_THREAD = 4096  # below this a thread's share is not worth the hand-off
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _thread_pool() -> ThreadPoolExecutor:
    """The sampler's worker threads, as many as torch's intra-op threads (made on first use)."""
    threads = torch.get_num_threads()
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="betty-sampling")
    return _POOLS[threads]


_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2⁶⁴ / golden ratio: multiplicative hashing (Knuth, TAOCP 6.4)


@jit
def _kept_pointer(indptr, dst, fanout):
    """``(n + 1,)`` int64 CSC pointer of the sampled block: ``min(degree, fanout)`` per row (all if ``fanout < 0``)."""
    n = dst.shape[0]
    pointer = np.zeros(n + 1, np.int64)
    for r in range(n):
        d = indptr[dst[r] + 1] - indptr[dst[r]]
        pointer[r + 1] = pointer[r] + (d if fanout < 0 or d <= fanout else fanout)
    return pointer


@jit
def _sample_rows(indptr, indices, dst, fanout, keys, key_row, pointer, src, lo, hi):
    """Rows ``lo … hi − 1``: write the kept sources of row ``r`` into ``src[pointer[r]:pointer[r + 1]]``,
    the same offsets as the tensor path (:func:`floyd_offsets`), under round keys ``keys[key_row[r]]``
    (``keys[0]`` when ``key_row`` is empty)."""
    chosen = np.empty(max(fanout, 1), np.int64)
    for r in range(lo, hi):
        start = indptr[dst[r]]
        d = indptr[dst[r] + 1] - start
        out = pointer[r]
        if fanout < 0 or d <= fanout:
            for e in range(d):
                src[out + e] = indices[start + e]
            continue
        row_keys = key_row[r] if key_row.shape[0] else 0
        for i in range(fanout):  # Floyd's algorithm: t uniform in [0, j], or j if t is taken
            j = d - (fanout - i)
            t = np.int64((hash_id_scalar(keys[row_keys, i], dst[r]) * np.uint64(j + 1)) >> np.uint64(32))
            for q in range(i):
                if chosen[q] == t:
                    t = j
                    break
            q = i  # insertion keeps chosen[:i + 1] sorted
            while q > 0 and chosen[q - 1] > t:
                chosen[q] = chosen[q - 1]
                q -= 1
            chosen[q] = t
        for i in range(fanout):
            src[out + i] = indices[start + chosen[i]]


@jit(inline="always")
def _slot(table_id, node, shift, slot_mask):
    """The slot holding ``node`` in a linear-probing table, or the empty slot where it goes."""
    s = np.int64((np.uint64(node) * _FIBONACCI) >> shift)
    while table_id[s] != node and table_id[s] != -1:
        s = (s + 1) & slot_mask
    return s


@jit
def _insert(table_id, table_label, src, e, extra, m, local, n):
    """Label ``src[e:]`` in order until the table would pass half full; returns ``(e, m)`` reached."""
    bits = 63 - int(np.log2(np.float64(table_id.shape[0]))) + 1  # 64 − log2(size)
    shift, slot_mask = np.uint64(bits), table_id.shape[0] - 1
    limit = table_id.shape[0] // 2 - n
    while e < src.shape[0]:
        s = _slot(table_id, src[e], shift, slot_mask)
        if table_id[s] == -1:
            if m + 1 > limit:
                return e, m
            table_id[s] = src[e]
            table_label[s] = n + m
            extra[m] = src[e]
            m += 1
        local[e] = table_label[s]
        e += 1
    return e, m


@jit
def _table(size, ids, labels):
    """A linear-probing table of ``size`` slots (a power of two) holding ``ids → labels``."""
    table_id = np.full(size, -1, np.int64)
    table_label = np.empty(size, np.int64)
    shift = np.uint64(64 - int(np.log2(np.float64(size))))
    for q in range(ids.shape[0]):
        s = _slot(table_id, ids[q], shift, size - 1)
        table_id[s] = ids[q]
        table_label[s] = labels[q]
    return table_id, table_label


@jit
def _radix_sort(values):
    """Non-negative int64 ``values`` sorted ascending: LSD radix sort, 11-bit digits, as many passes as the
    largest value needs (2 below 2²², 3 below 2³³). O(passes · (len + 2048)), unlike numba's quicksort."""
    out = values.copy()
    buffer = np.empty_like(out)
    top = out.max() if out.shape[0] else 0
    shift = 0
    while (top >> shift) > 0:
        count = np.zeros(2049, np.int64)
        for v in out:
            count[((v >> shift) & 2047) + 1] += 1
        for d in range(2048):
            count[d + 1] += count[d]
        for v in out:
            d = (v >> shift) & 2047
            buffer[count[d]] = v
            count[d] += 1
        out, buffer = buffer, out
        shift += 11
    return out


@jit
def relabel_stack(dst, counts, pointer, src, nodes, dense):
    """:func:`partition.slicing.relabel_dst_first` of each batch of a stack, in one call (the bulk samplers).

    Batch ``b``'s rows are the ``counts[b]`` after batch ``b − 1``'s, its edges ``pointer[first row]`` to
    ``pointer[last row + 1]``. With ``dense``, one ``(nodes,)`` int32 label array serves every batch in turn (two
    passes over a batch's edges, its new ids radix-sorted, only its touched labels reset), else each batch gets
    :func:`_relabel`'s hash table.

    Returns:
        ``(src_nodes, src_counts, local)``: ``(S,)`` int64 the batches' src nodes one after the other, each
        batch's dst nodes first then its other ids ascending; ``(k,)`` int64 src nodes per batch; ``(E,)`` int32
        each edge's position in its own batch's src nodes.
    """
    k, total = counts.shape[0], src.shape[0]
    local = np.empty(total, np.int32)
    src_nodes = np.empty(dst.shape[0] + min(total, k * nodes), np.int64)  # every row, and each edge or node once
    src_counts = np.empty(k, np.int64)
    label = np.full(nodes if dense else 0, -1, np.int32)
    r0, w = 0, 0
    for b in range(k):
        r1 = r0 + counts[b]
        e0, e1, n = pointer[r0], pointer[r1], r1 - r0
        if dense:
            for i in range(n):
                label[dst[r0 + i]] = i
            m = 0
            for e in range(e0, e1):  # new ids, once each (-2: seen)
                if label[src[e]] == -1:
                    label[src[e]] = -2
                    src_nodes[w + n + m] = src[e]
                    m += 1
            ascending = _radix_sort(src_nodes[w + n:w + n + m])
            for i in range(m):
                label[ascending[i]] = n + i
                src_nodes[w + n + i] = ascending[i]
            for e in range(e0, e1):
                local[e] = label[src[e]]
            for i in range(n + m):  # reset what this batch touched
                label[src_nodes[w + i] if i >= n else dst[r0 + i]] = -1
            src_nodes[w:w + n] = dst[r0:r1]
        else:
            ids, part = _relabel(dst[r0:r1], src[e0:e1])
            local[e0:e1] = part
            m = ids.shape[0] - n
            src_nodes[w:w + n + m] = ids
        src_counts[b] = n + m
        r0, w = r1, w + n + m
    return src_nodes[:w].copy(), src_counts, local  # a copy: the blocks must not hold the (rows + E,) buffer


@jit
def _relabel(dst, src):
    """``relabel_dst_first`` with a hash table of O(n + distinct ids) slots: returns ``(src_nodes, local)``.

    Linear probing, multiplicative hashing, the table doubled whenever half full;
    dst get labels ``0..n-1``, a new id the provisional label ``n + (order of first
    sight)``, renumbered in ascending id order at the end.
    """
    n = dst.shape[0]
    total = src.shape[0]
    size = 1024
    while size < 4 * n:
        size *= 2
    extra = np.empty(total, np.int64)
    local = np.empty(total, np.int32)  # a block's local positions (partition.slicing.LOCAL_INDEX)
    table_id, table_label = _table(size, dst, np.arange(n))
    e, m = _insert(table_id, table_label, src, 0, extra, 0, local, n)
    while e < total:
        size *= 2
        ids = np.concatenate((dst, extra[:m]))
        table_id, table_label = _table(size, ids, np.arange(n + m))
        e, m = _insert(table_id, table_label, src, e, extra, m, local, n)
    shift, slot_mask = np.uint64(64 - int(np.log2(np.float64(size)))), size - 1
    ascending = _radix_sort(extra[:m])
    final = np.empty(m, np.int64)
    for i in range(m):
        final[table_label[_slot(table_id, ascending[i], shift, slot_mask)] - n] = n + i
    for e in range(total):
        if local[e] >= n:
            local[e] = final[local[e] - n]
    src_nodes = np.empty(n + m, np.int64)
    src_nodes[:n] = dst
    src_nodes[n:] = ascending
    return src_nodes, local
