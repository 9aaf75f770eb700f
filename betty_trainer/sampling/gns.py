"""Global neighbour sampling (GNS; Dong et al., "Global Neighbor Sampling for Mixed CPU-GPU
Training on Giant Graphs", KDD 2021, §3; docs/design.md › GNS).

Every ``refresh_every`` batches a **global node cache** ``C`` of ``⌈cache_fraction · N⌉``
nodes is sampled with probability ``p_t``: ∝ degree (§3.2, Eq. 6; on a directed graph the number
of dst nodes whose in-neighbours include ``t``), or from short random
walks from the training nodes (Eq. 7–9) when those are a small part of the graph. The
cache's features are meant to live on the training device: :meth:`GNSSampler.cache_nodes`
hands out the node set a GPU feature cache holds, so the two are one and the same.

Neighbour sampling (§3.3) then takes, for a dst node ``s`` of in-degree ``d_s > k``, up to
``k`` of its cached neighbours uniformly, and tops up uniformly from its other neighbours;
optionally the input layer takes cached neighbours only. Importance weights (§3.4) scale
each kept edge by about the inverse of its chance to be kept: with ``c_s`` cached neighbours
and ``m_s = min(k, c_s)`` of them sampled,

* only cached neighbours sampled (``c_s ≥ k``, or the cache-only input layer): edge
  ``t → s`` is kept with probability about ``π_t · m_s / c_s``, with ``π_t`` the probability
  that ``t`` is in the cache (Eq. 11; :func:`cache_inclusion`), and weighs
  ``c_s / (m_s · π_t)`` (Eq. 10, 12);
* all ``c_s < k`` cached neighbours and ``k − c_s`` of the ``d_s − c_s`` others: given the
  cache, a cached edge weighs ``1`` and a topped-up one ``(d_s − c_s) / (k − c_s)``
  (the inverse of its inclusion probability).

Rows with ``d_s ≤ k`` keep every in-edge with weight ``1`` (except in the cache-only layer).

**What is unbiased, and what is not.** Given the cache, a topped-up row's weighted sum
``Σ w_ts h_t`` is exactly unbiased. Across caches it is not, because the regime a row uses
depends on the cache and a cache holding ``t`` more often gives ``s`` at least ``k`` cached
neighbours: ``E[w_ts · 1{t → s kept}] = P(c_s ≥ k | t ∈ C) + P(c_s < k)``, above 1 where ``t``
being cached makes ``c_s ≥ k`` likelier (rows that use both regimes). The weighted **sum**
(GCN's aggregation) is therefore biased upward on those rows; the **self-normalised mean**
``Σ w h / Σ w`` (SAGE's mean) cancels each row's common factors and is close to unbiased (a
ratio estimator: consistent, not exact). Measured on Amazon Computers (degree cache drawn for
every batch, ``k = 10``, 300 dst rows with ``d_s > 30``, 600 batches; a row is "off" past 4.65
standard errors, Bonferroni at 10⁻³; ``python benchmarks/sampling.py --gns-bias --graph
amazon-computers --fanouts 10 --threads 1``), at 1% and 5% caches:

* weighted sum: 27/300 and 33/300 rows off, by +11% and +14% (median of those); the rows using
  both regimes 20–80% of the time (19 and 43 of them) +12.8% and +12.7% (median);
* ``GCNConv``'s output: 6/300 and 13/300 rows off, by +16% (median of those);
* weighted mean: 0/300 and 2/300 rows off (−4.5%, median of those); median |relative bias| 0.6%.

Correcting the sum would take, per edge, ``P(c_s ≥ k | t ∈ C)``, which depends on the joint
draw of ``s``'s neighbours; nothing here computes it.

Eq. 12 read literally gives every sampled edge ``1/p = m_s / (k · π_t)``. Where only cached
neighbours are sampled that is ours times the row constant ``m_s² / (c_s · k)``, which a weighted
mean cancels and a weighted sum does not. On topped-up rows the literal ``1/p`` weighs uncached
nodes by their tiny ``1/π_t``: on Amazon Computers (1% cache, fanout 10, 286 rows, 200 caches)
its neighbour mean is off by 42% (median row; ours 0.3%, within its standard error; measured
with Eq. 11's ``p^C`` for ``π``).

The uniform choices rank the candidates of a row by a counter-based hash of
``(key, s, t)`` (:mod:`betty_trainer.rng`), so a dst node's sample does not depend on the
other seeds of its batch. The cache is a pure function of ``(seed, refresh index)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.data.cache import NodeSource, ceil_fraction
from betty_trainer.data.graph import Graph
from betty_trainer.rng import hash_id_scalar, hash_ids, jit, mix_key
from betty_trainer.sampling.base import BlockSampler, SampleKey
from betty_trainer.sampling.labor import _candidates
from betty_trainer.sampling.neighbor import Kernel, _check_fanout, _relabel, _use_numba, sample_block
from partition.slicing import relabel_dst_first

CacheProbability = Literal["auto", "degree", "random_walk"]
_GNS_DOMAIN = 0x474E  # "GN"
_POSITION_MASK = (1 << 30) - 1  # a candidate's position within its row, in the kernel's heap keys


@dataclass(frozen=True)
class NodeCache:
    """One sample of GNS's global node cache (§3.2).

    Attributes:
        nodes: ``(|C|,)`` int64 cached node ids, ascending.
        mask: ``(N,)`` bool, ``mask[v]`` iff ``v`` is cached.
        inclusion: ``(N,)`` float64 ``π_v``, the probability that ``v`` is in a cache of this size
            (Eq. 11's ``p^C``, for a draw without replacement: :func:`cache_inclusion`).
        refresh: the refresh index ``(sequence, ⌊index / refresh_every⌋)`` it was drawn for.
    """

    nodes: Tensor
    mask: Tensor
    inclusion: Tensor
    refresh: tuple[int, int]


def gns_cache_size(cache_fraction: float, num_nodes: int) -> int:
    """Nodes in the GNS cache: ``max(1, ⌈cache_fraction · N⌉)`` (GNS §3.1), the ceiling taken exactly on the
    decimal fraction (:func:`~betty_trainer.data.cache.ceil_fraction`: 7 nodes for 0.07 of 100)."""
    return max(1, ceil_fraction(cache_fraction, num_nodes))


class GNSSampler(BlockSampler):
    """Cache-first neighbour sampling with importance weights (GNS §3, Alg. 1).

    The weights make a self-normalised weighted mean (SAGE) close to unbiased, not a weighted sum:
    GCN's sum is biased upward on rows whose cached-neighbour count crosses the fanout from cache
    to cache (on Amazon Computers at a 5% cache and ``k = 10``, 43 of 300 rows with ``d_s > 30``,
    +12.7% at the median); see the module docstring.

    Args:
        graph: the graph (any device; blocks come out on the same device).
        fanouts: one entry per layer, **input layer first**; ``None``/``-1`` keeps every in-edge.
        cache_fraction: cache size as a fraction of the nodes, in ``(0, 1]`` (paper: 1%).
        refresh_every: the cache is sampled again every this many batches (``P``).
        cache_only_input_layer: the input layer (block 0) samples cached neighbours only.
        cache_probability: ``"degree"`` (Eq. 6), ``"random_walk"`` (Eq. 7–9), or ``"auto"``:
            degree when the training nodes are at least half the graph, else random walks.
        training_nodes: ``(|V_S|,)`` int64 ids of the training nodes V_S the batches' seeds come from
            (Eq. 9 starts the walks there; ``auto`` compares ``|V_S|`` with ``N``); default
            ``graph.train_idx``.
        batches_per_epoch: as :class:`~betty_trainer.sampling.labor.LaborSampler` (refreshes run
            across epochs when given; else every epoch starts with a fresh cache).
        kernel: ``"auto"``, ``"tensor"`` or ``"numba"``; all give the same sample.

    Raises:
        ValueError: a bad fanout, ``cache_fraction`` outside ``(0, 1]``, ``refresh_every < 1``,
            an unknown ``cache_probability`` or kernel; ``random_walk`` (or ``auto`` choosing it)
            without training nodes, which would leave Eq. 9's ``P⁰`` undefined.
    """

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], *, cache_fraction: float = 0.01,
                 refresh_every: int = 100, cache_only_input_layer: bool = False,
                 cache_probability: CacheProbability = "auto", batches_per_epoch: int | None = None,
                 kernel: Kernel = "auto", training_nodes: Tensor | None = None) -> None:
        if not 0 < cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1]; got {cache_fraction}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be at least 1; got {refresh_every}")
        if cache_probability not in ("auto", "degree", "random_walk"):
            raise ValueError(f"cache_probability must be auto, degree or random_walk; got {cache_probability!r}")
        _use_numba(kernel, graph.indptr)  # an unusable kernel is refused with the other arguments
        self.graph = graph
        self.fanouts = [_check_fanout(f) for f in fanouts]
        self.cache_size = gns_cache_size(cache_fraction, graph.num_nodes)
        self.refresh_every = int(refresh_every)
        self.cache_only_input_layer = bool(cache_only_input_layer)
        self.training_nodes = graph.train_idx if training_nodes is None else training_nodes.long()
        if cache_probability == "auto":
            cache_probability = "degree" if 2 * self.training_nodes.numel() >= graph.num_nodes else "random_walk"
        if cache_probability == "random_walk" and self.training_nodes.numel() == 0:
            raise ValueError("random-walk cache probability needs training nodes (Eq. 9) and the graph has none; "
                             "pass training_nodes (the seeds' pool) or cache_probability='degree'")
        self.cache_probability = cache_probability
        self.batches_per_epoch = batches_per_epoch
        self.kernel = kernel
        self._probability: Tensor | None = None
        self._cache: NodeCache | None = None
        self._inclusion: tuple[int, Tensor] | None = None

    def probability(self) -> Tensor:
        """``(N,)`` float64 cache sampling probability ``p`` (sums to 1): Eq. 6 or Eq. 7–9.

        Eq. 6's ``deg(v)`` counts the in-neighbour lists that hold ``v`` (the dst nodes that can sample it):
        its out-degree, equal to its degree on an undirected graph; on a directed one it is ``v``'s one-step
        reach, what Eq. 8 gives from a uniform ``P`` with ``d = 1``.
        """
        if self._probability is None:
            if self.cache_probability == "degree":
                weight = self.graph.out_degrees().double()
            else:
                weight = random_walk_probability(self.graph, self.training_nodes, self.fanouts)
            self._probability = weight / weight.sum()
        return self._probability

    def cache(self, key: SampleKey) -> NodeCache:
        """The node cache batch ``key`` samples with (drawn again every ``refresh_every`` batches).

        ``|C|`` distinct nodes are drawn without replacement with probabilities ∝ ``p``
        (Efraimidis & Spirakis, IPL 97(5), 2006: the largest ``log(u_v) / p_v`` with ``u_v`` a
        hashed uniform of ``(seed, refresh index, v)``). A node with ``p_v = 0`` is never drawn: when
        fewer than ``|C|`` nodes have ``p_v > 0`` (walks that reach few nodes) the cache holds just those.
        """
        sequence, index = key.position(self.batches_per_epoch)
        refresh = (sequence, index // self.refresh_every)
        if self._cache is None or self._cache.refresh != refresh:
            p = self.probability()
            n = p.numel()
            ids = torch.arange(n, device=p.device)
            u = (hash_ids(mix_key(key.seed, _GNS_DOMAIN, *refresh), ids).double() + 0.5) / 2**32
            score = torch.where(p > 0, torch.log(u) / p, -math.inf)
            top = torch.topk(score, min(self.cache_size, n))
            nodes = torch.sort(top.indices[top.values > -math.inf]).values
            mask = torch.zeros(n, dtype=torch.bool, device=p.device)
            mask[nodes] = True
            if self._inclusion is None or self._inclusion[0] != nodes.numel():  # the same for every cache of |C|
                self._inclusion = (nodes.numel(), cache_inclusion(p, nodes.numel()))
            inclusion = self._inclusion[1]
            self._cache = NodeCache(nodes, mask, inclusion, refresh)
        return self._cache

    def cache_nodes(self, key: SampleKey) -> Tensor:
        """``(|C|,)`` int64 ascending ids of the cache batch ``key`` samples with: the node set whose
        features a device cache should hold (GNS §3.1)."""
        return self.cache(key).nodes

    @property
    def node_cache(self) -> NodeSource:
        """The node sets a device feature cache holds (:meth:`cache_nodes`, at most ``cache_size`` nodes)."""
        return NodeSource(self.cache_nodes, self.cache_size)

    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` of batch ``key`` (:func:`gns_block` with the batch's cache; the input layer samples
        cached neighbours only with ``cache_only_input_layer``); a sampled layer's block carries float32
        ``edge_weight`` (see the module docstring)."""
        only_cached = self.cache_only_input_layer and layer == 0
        return gns_block(self.graph, dst, self.fanouts[layer], self.cache(key), key.layer_key(layer) ^ _GNS_DOMAIN,
                         only_cached, kernel=self.kernel)

    def __repr__(self) -> str:
        return (f"GNSSampler(fanouts={self.fanouts}, cache_size={self.cache_size}, refresh_every={self.refresh_every}, "
                f"cache_only_input_layer={self.cache_only_input_layer}, "
                f"cache_probability={self.cache_probability!r})")


def cache_inclusion(p: Tensor, size: int) -> Tensor:
    """``(N,)`` float64 probability ``π_v`` that node ``v`` is in a cache of ``size`` distinct nodes drawn
    without replacement with probabilities ∝ ``p`` (what :meth:`GNSSampler.cache` draws; GNS §3.2).

    Eq. 11's ``1 − (1 − p_v)^{|C|}`` is the chance of ``v`` in ``|C|`` draws *with* replacement; its sum
    falls short of ``|C|`` (by 2% for a 1% degree cache of Amazon Computers, 10% for a 5% one), so every
    cached node's weight ``1/π`` came out that much too large. The without-replacement draw is successive
    sampling, whose inclusion probabilities are ``π_v ≈ 1 − exp(−τ p_v)`` with ``τ`` set so that
    ``Σ_v π_v = |C|`` (Rosén, Ann. Math. Statist. 43(2), 1972); ``τ`` is found by Newton's method, which on this
    concave increasing sum climbs to the root monotonically from ``τ = |C|``. On Amazon Computers the
    cached frequencies of 2,000 caches match it per degree band within 1.6 binomial standard errors at 1%,
    5% and 30% caches (Eq. 11: up to 5.8 at 1%, 60 at 5%); ``tests/test_gns.py`` checks it.

    Args:
        p: ``(N,)`` float64 cache probabilities, non-negative, summing to 1.
        size: ``|C|``, the distinct nodes drawn.

    Returns:
        ``(N,)`` float64 ``π`` in ``[0, 1]``; ``π_v = 0`` where ``p_v = 0``, and ``π_v = 1`` for every ``p_v > 0``
        when ``size`` is at least their number (the cache then holds them all).
    """
    positive = p > 0
    if size >= int(positive.sum()):
        return positive.double()
    tau = float(size)
    for _ in range(200):
        total = float(-torch.expm1(-tau * p).sum())
        if total >= size * (1 - 1e-10):
            break
        tau += (size - total) / float((p * torch.exp(-tau * p)).sum())
    return -torch.expm1(-tau * p)


def random_walk_probability(graph: Graph, train_idx: Tensor, fanouts: Sequence[int | None]) -> Tensor:
    """GNS's random-walk cache probability (§3.2, Eq. 7–9), unnormalised ``(N,)`` float64.

    ``P⁰`` is uniform on the training nodes (Eq. 9); each layer, output side first, passes
    ``P_s · d_s`` from every dst node ``s`` to each of its in-neighbours, with
    ``d_s = min(k, deg s) / deg s`` the chance NS keeps one of ``s``'s in-edges (Eq. 7), and
    keeps ``P`` itself: ``P^ℓ = (DA + I) P^{ℓ−1}`` (Eq. 8). Returns ``P^L``.

    The product is taken as ``A·D`` (``P_t += Σ_s A_ts d_s P_s``, ``d`` of the node the walk leaves):
    NS keeps each in-edge of ``s`` with probability ``d_s``, which is what Eq. 7's ``d`` describes; Eq. 8's
    ``DA`` written literally would scale ``t``'s arrivals by ``t``'s own fraction instead.
    """
    n = graph.num_nodes
    degree = graph.in_degrees()
    dst_of_edge = torch.repeat_interleave(torch.arange(n, device=degree.device), degree)
    p = torch.zeros(n, dtype=torch.float64, device=degree.device)
    p[train_idx] = 1.0 / max(train_idx.numel(), 1)
    for fanout in reversed(list(fanouts)):
        keep = torch.ones(n, dtype=torch.float64, device=degree.device) if fanout is None else \
            torch.clamp(fanout / degree.double().clamp(min=1), max=1.0)
        flow = (p * keep)[dst_of_edge]
        p = p.clone()
        p.index_add_(0, graph.indices.long(), flow)
    return p


def gns_block(graph: Graph, dst: Tensor, fanout: int | None, cache: NodeCache, key: int, only_cached: bool = False,
              *, kernel: Kernel = "auto") -> Block:
    """One GNS block whose dst nodes are ``dst`` (see the module docstring).

    Args:
        graph: the graph.
        dst: ``(n,)`` int64 distinct dst ids.
        fanout: ``k``; ``None`` keeps every in-edge (no weights) unless ``only_cached``.
        cache: the batch's :class:`NodeCache`.
        key: the layer's 32-bit key.
        only_cached: sample cached neighbours only (the cache-only input layer).
        kernel: ``"auto"``, ``"tensor"`` or ``"numba"``.

    Returns:
        A :class:`Block` (kept edges in CSC order) with float32 ``edge_weight`` when sampled.
    """
    dst = dst.long()
    if fanout is None and not only_cached:
        return sample_block(graph, dst, None, key=0, kernel=kernel)
    k = -1 if fanout is None else fanout
    if _use_numba(kernel, graph.indptr):
        pointer, src, weight = _gns_rows(graph.indptr.numpy(), graph.indices.numpy(), dst.numpy(), k,
                                         cache.mask.numpy(), cache.inclusion.numpy(), key, only_cached)
        src_nodes, local = _relabel(dst.numpy(), src)
        return Block(torch.from_numpy(src_nodes), dst.numel(), torch.from_numpy(pointer), torch.from_numpy(local),
                     torch.from_numpy(weight))
    return _gns_tensor(graph, dst, k, cache, key, only_cached)


def _gns_tensor(graph: Graph, dst: Tensor, k: int, cache: NodeCache, key: int, only_cached: bool) -> Block:
    device = dst.device
    n, num_nodes = dst.numel(), graph.num_nodes
    pointer, src = _candidates(graph, dst)
    degree = pointer[1:] - pointer[:-1]
    total = src.numel()
    row = torch.repeat_interleave(torch.arange(n, device=device), degree, output_size=total)
    cached = cache.mask[src]
    cached_count = torch.zeros(n, dtype=torch.int64, device=device)
    cached_count.index_add_(0, row, cached.long())
    k_row = degree if k < 0 else torch.full_like(degree, k)
    # rank each row's candidates: cached first, then by the hash of (key, s, t)
    priority = hash_ids(key, dst[row] * num_nodes + src)
    order = torch.argsort(row * 2**33 + (~cached).long() * 2**32 + priority, stable=True)
    rank = torch.empty(total, dtype=torch.int64, device=device)
    rank[order] = torch.arange(total, device=device) - pointer[:-1][row[order]]
    whole = (degree <= k_row)[row] & ~torch.tensor(only_cached, device=device)
    keep = whole | (rank < k_row[row])
    if only_cached:
        keep &= cached
    c = cached_count[row].double()
    m = torch.minimum(k_row[row], cached_count[row]).double()
    d, kk = degree[row].double(), k_row[row].double()
    cached_only_regime = only_cached | (cached_count >= k_row)[row]
    weight = torch.where(
        whole, 1.0,
        torch.where(cached_only_regime, c / (m.clamp(min=1) * cache.inclusion[src]),
                    torch.where(cached, 1.0, (d - c) / (kk - c).clamp(min=1))))
    kept_per_row = torch.zeros(n, dtype=torch.int64, device=device)
    kept_per_row.index_add_(0, row, keep.long())
    out_pointer = torch.zeros(n + 1, dtype=torch.int64, device=device)
    torch.cumsum(kept_per_row, 0, out=out_pointer[1:])
    src_nodes, local = relabel_dst_first(dst, src[keep])
    return Block(src_nodes, n, out_pointer, local, weight[keep].float())


@jit
def _gns_rows(indptr, indices, dst, k, mask, inclusion, key, only_cached):
    """:func:`_gns_tensor` row by row: the same ranks, kept edges and weights."""
    n = dst.shape[0]
    pointer = np.zeros(n + 1, np.int64)
    cached_count = np.zeros(n, np.int64)
    for r in range(n):
        start, end = indptr[dst[r]], indptr[dst[r] + 1]
        c = _count_cached(indices, start, end, mask)
        cached_count[r] = c
        kr = end - start if k < 0 else k
        pointer[r + 1] = pointer[r] + min(kr, c if only_cached else end - start)
    src = np.empty(pointer[n], np.int64)
    weight = np.empty(pointer[n], np.float32)
    for r in range(n):
        _fill_row(indptr, indices, dst, r, k, mask, inclusion, key, only_cached, cached_count[r], pointer[r], src,
                  weight)
    return pointer, src, weight


@jit
def _count_cached(indices, start, end, mask):
    """How many of the in-neighbours ``indices[start:end]`` are cached."""
    c = 0
    for e in range(start, end):
        if mask[indices[e]]:
            c += 1
    return c


@jit
def _fill_row(indptr, indices, dst, r, k, mask, inclusion, key, only_cached, c, out, src, weight):
    """Write row ``r``'s kept in-neighbours and weights into ``src``/``weight`` from position ``out``: every
    in-edge when the row keeps all, else the ``min(k, d)`` smallest keys (uncached flag, hash, position)."""
    start, end = indptr[dst[r]], indptr[dst[r] + 1]
    d = end - start
    kr = d if k < 0 else k
    if d <= kr and not only_cached:
        for e in range(start, end):
            src[out] = indices[e]
            weight[out] = 1.0
            out += 1
        return
    num_nodes = indptr.shape[0] - 1
    heap = np.empty(min(kr, d), np.int64)  # a bounded max-heap of the smallest keys, O(d log k)
    filled = 0
    for e in range(start, end):
        t = indices[e]
        h = np.int64(hash_id_scalar(key, dst[r] * num_nodes + t))
        filled = _offer(heap, filled, ((np.int64(0) if mask[t] else np.int64(1)) << 62) | (h << 30) | np.int64(e - start))
    chosen = np.zeros(d, np.bool_)
    for q in range(filled):
        chosen[heap[q] & _POSITION_MASK] = True
    m = min(kr, c)
    cached_only_regime = only_cached or c >= kr
    for e in range(start, end):
        t = indices[e]
        if not chosen[e - start] or (only_cached and not mask[t]):
            continue
        src[out] = t
        if cached_only_regime:
            weight[out] = c / (max(m, 1) * inclusion[t])
        elif mask[t]:
            weight[out] = 1.0
        else:
            weight[out] = (d - c) / max(kr - c, 1)
        out += 1


@jit
def _offer(heap, filled, item):
    """Keep the ``len(heap)`` smallest items offered in the max-heap ``heap`` (its first ``filled`` slots):
    push ``item`` while there is room (sift up), else replace the largest when ``item`` is smaller (sift
    down). Returns the new fill."""
    size = heap.shape[0]
    if filled < size:
        q = filled
        while q > 0 and heap[(q - 1) // 2] < item:
            heap[q] = heap[(q - 1) // 2]
            q = (q - 1) // 2
        heap[q] = item
        return filled + 1
    if size == 0 or item >= heap[0]:
        return filled
    q = 0
    while True:
        child = 2 * q + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] > heap[child]:
            child += 1
        if heap[child] <= item:
            break
        heap[q] = heap[child]
        q = child
    heap[q] = item
    return filled
