"""LABOR sampling: LABOR-0 and LABOR-* with layer and batch dependency (docs/design.md › LABOR).

Layer-neighbour sampling (Balin & Çatalyürek, "Layer-Neighbor Sampling — Defusing
Neighborhood Explosion in GNNs", NeurIPS 2023; cooperative-minibatching paper A.1.2):
every source vertex ``t`` rolls **one** variate ``r_t ~ U(0, 1)`` that all dst nodes of
the layer share, and the edge ``t → s`` is kept iff ``r_t ≤ p_ts`` with

* LABOR-0: ``p_ts = min(1, k / d_s)``, ``k`` the fanout and ``d_s`` the in-degree of ``s``;
* LABOR-*: ``p_ts = min(1, c_s · π_t)``, importance probabilities ``π`` from fixed-point
  iterations that lower the expected number of sampled vertices, and ``c_s`` set so that
  the Horvitz–Thompson estimator of ``s``'s neighbourhood mean has the variance of
  sampling ``k`` neighbours uniformly: ``Σ_t 1 / min(1, c_s π_t) = d_s² / k``.

Because dst nodes share ``r_t``, a vertex is sampled once for all of them: LABOR-0 samples
fewer vertices than NS at the same fanout, LABOR-* fewer still (cooperative paper Fig. 3).

The variates are counter-based hashes (:mod:`betty_trainer.rng`) of ``(z, t)``, ``z`` a key
of ``(seed, batch group, layer)``: ``r_t`` does not depend on which other vertices share
the batch, their order, or the process that samples them (cooperative minibatching relies
on it). Batch dependency κ (A.7): batch ``i`` of the run lies in group ``j = ⌊i/κ⌋`` with
``c = (i mod κ)/κ``, and ``r_t = Φ(cos(cπ/2)·n_t(z_j) + sin(cπ/2)·n_t(z_{j+1}))`` with
``n_t(z)`` a hashed standard normal (Box–Muller on two hashed uniforms): the
neighbourhoods drift over κ batches, batches ``κ`` apart at a group start are independent,
``κ = 1`` is independent batches (``r_t`` the hashed uniform itself) and ``κ = ∞`` fixes
every ``r_t`` for the whole run.

Every kept edge carries the weight ``1 / p_ts`` in :attr:`Block.edge_weight` (the
Horvitz–Thompson weight): ``Σ_{kept} w_ts · h_t`` is an unbiased estimate of
``Σ_{t ∈ N(s)} h_t``, and dividing by ``d_s`` of the neighbourhood mean; an aggregator that
normalises by ``Σ w_ts`` (``mean_scale``) computes the ratio estimator DGL's ``fn.mean``
over its normalised weights computes.

On the CPU a numba kernel computes the sample (the same hashes and thresholds as the
tensor path, which runs on any device); ``kernel="tensor"`` forces the tensor path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.data.graph import Graph
from betty_trainer.rng import hash_id_scalar, jit, mix_key, uniforms
from betty_trainer.sampling.base import BlockSampler, SampleKey
from betty_trainer.sampling.neighbor import (
    _ROWS_PER_THREAD,
    Kernel,
    _check_fanout,
    _relabel,
    _thread_pool,
    _use_numba,
    sample_block,
)
from partition.slicing import relabel_dst_first

_LABOR_DOMAIN = 0x4C42  # "LB": keeps LABOR's variate keys apart from NS's and dropout's
_SECOND_UNIFORM = 0x68E31DA4  # xored into a key for Box–Muller's second uniform
_EPS = 1e-4  # relative tolerance of the c_s solve and of LABOR-*'s convergence (as DGL's labor_pick)
_MAX_SOLVE = 200  # fixed-point steps of one c_s solve, at most
_MAX_IMPORTANCE = 100  # importance iterations when run "until converged"
INF = math.inf


@dataclass(frozen=True)
class Variates:
    """How one layer's per-vertex variates ``r_t`` are drawn (cooperative paper A.7).

    ``smooth=False``: ``r_t`` is the hashed uniform of ``(key1, t)``. ``smooth=True``:
    ``r_t = Φ(cos_c · n_t(key1) + sin_c · n_t(key2))`` with hashed normals ``n_t``.

    Attributes:
        key1, key2: 32-bit keys of the group's two seeds ``z_j``, ``z_{j+1}``.
        cos_c, sin_c: ``cos(cπ/2)``, ``sin(cπ/2)`` for the position ``c`` in the group.
        smooth: whether the normal interpolation is used.
    """

    key1: int
    key2: int = 0
    cos_c: float = 1.0
    sin_c: float = 0.0
    smooth: bool = False

    def of(self, ids: Tensor) -> Tensor:
        """``(n,)`` float64 variates in ``(0, 1)`` of the vertices ``ids`` (int64, any device)."""
        if not self.smooth:
            return uniforms(self.key1, ids)
        x = self.cos_c * _normal(self.key1, ids) + self.sin_c * _normal(self.key2, ids)
        return torch.special.ndtr(x)


def _normal(key: int, ids: Tensor) -> Tensor:
    """A standard normal per id: Box–Muller (1958) on the hashed uniforms of ``key`` and ``key ^ C``."""
    u1, u2 = uniforms(key, ids), uniforms(key ^ _SECOND_UNIFORM, ids)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


class LaborSampler(BlockSampler):
    """LABOR-0 / LABOR-* sampling with per-layer fanouts (cooperative paper A.1.2, A.7).

    Args:
        graph: the graph (on any device; blocks come out on the same device).
        fanouts: one entry per layer, **input layer first**; ``None`` or ``-1`` keeps every in-edge.
        importance_iterations: LABOR-*'s fixed-point iterations: ``0`` = LABOR-0, ``n > 0`` =
            LABOR-n, ``-1`` = until an iteration lowers ``Σ_t min(1, π_t)`` (the importance values
            of the layer's candidate src vertices, capped at 1) by less than a relative 10⁻⁴, or
            raises it (at most 100 iterations).
        layer_dependency: the same ``r_t`` in every layer (DGL's ``layer_dependency``).
        batch_dependency: κ ≥ 1, or ``math.inf`` (static neighbourhoods).
        batches_per_epoch: batches in one epoch, so batch ``(epoch, step)`` is the run's batch
            ``epoch · batches_per_epoch + step`` and κ-groups run across epochs; ``None`` starts
            a new sequence of groups every epoch.
        kernel: ``"auto"`` (numba on CPU when installed), ``"tensor"`` or ``"numba"``; all give the
            same sample.

    Raises:
        ValueError: a fanout of 0 or below -1, ``importance_iterations < -1``,
            ``batch_dependency < 1``, or an unknown or unavailable kernel.
    """

    def __init__(self, graph: Graph, fanouts: Sequence[int | None], *, importance_iterations: int = 0,
                 layer_dependency: bool = False, batch_dependency: float = 1,
                 batches_per_epoch: int | None = None, kernel: Kernel = "auto") -> None:
        if importance_iterations < -1:
            raise ValueError(f"importance_iterations must be -1, 0 or positive; got {importance_iterations}")
        if not batch_dependency >= 1:
            raise ValueError(f"batch_dependency must be at least 1 or inf; got {batch_dependency}")
        if batch_dependency != INF and batch_dependency != int(batch_dependency):
            raise ValueError(f"batch_dependency must be an integer or inf; got {batch_dependency}")
        self.graph = graph
        self.fanouts = [_check_fanout(f) for f in fanouts]
        self.importance_iterations = int(importance_iterations)
        self.layer_dependency = bool(layer_dependency)
        self.batch_dependency = batch_dependency if batch_dependency == INF else int(batch_dependency)
        self.batches_per_epoch = batches_per_epoch
        _use_numba(kernel, graph.indptr)
        self.kernel = kernel

    def variates(self, key: SampleKey, layer: int) -> Variates:
        """The variates of block ``layer`` (input layer first) of the batch ``key`` (A.7)."""
        layer_part = 0 if self.layer_dependency else layer + 1
        if self.batch_dependency == INF:
            return Variates(mix_key(key.seed, _LABOR_DOMAIN, layer_part))
        epoch_part, index = key.position(self.batches_per_epoch)
        group, position = divmod(index, self.batch_dependency)
        key1 = mix_key(key.seed, _LABOR_DOMAIN, epoch_part, group, layer_part)
        if self.batch_dependency == 1:
            return Variates(key1)
        key2 = mix_key(key.seed, _LABOR_DOMAIN, epoch_part, group + 1, layer_part)
        angle = (position / self.batch_dependency) * (math.pi / 2)
        return Variates(key1, key2, math.cos(angle), math.sin(angle), smooth=True)

    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` of batch ``key`` (:func:`labor_block` with the layer's variates); a sampled
        layer's block carries ``edge_weight`` ``1 / p_ts`` (float32)."""
        return labor_block(self.graph, dst, self.fanouts[layer], self.variates(key, layer),
                           self.importance_iterations, kernel=self.kernel)

    def __repr__(self) -> str:
        kappa = "inf" if self.batch_dependency == INF else self.batch_dependency
        return (f"LaborSampler(fanouts={self.fanouts}, importance_iterations={self.importance_iterations}, "
                f"layer_dependency={self.layer_dependency}, batch_dependency={kappa})")


def labor_block(graph: Graph, dst: Tensor, fanout: int | None, variates: Variates, importance_iterations: int = 0,
                *, kernel: Kernel = "auto") -> Block:
    """One LABOR block whose dst nodes are ``dst`` (see :class:`LaborSampler`).

    Args:
        graph: the graph.
        dst: ``(n,)`` int64 distinct global ids of the dst nodes.
        fanout: ``k``; ``None`` keeps every in-edge (no weights).
        variates: the layer's :class:`Variates`.
        importance_iterations: ``0`` LABOR-0, ``n`` LABOR-n, ``-1`` until converged.
        kernel: ``"auto"``, ``"tensor"`` or ``"numba"``.

    Returns:
        A :class:`Block` with ``src_nodes[:n] == dst``, kept edges in CSC order, and
        ``edge_weight = 1 / p_ts`` (float32) when ``fanout`` is set.
    """
    dst = dst.long()
    if fanout is None:
        return sample_block(graph, dst, None, key=0, kernel=kernel)
    if _use_numba(kernel, graph.indptr):
        return _labor_numba(graph, dst, fanout, variates, importance_iterations)
    return _labor_tensor(graph, dst, fanout, variates, importance_iterations)


def inclusion_probabilities(graph: Graph, dst: Tensor, fanout: int, importance_iterations: int = 0,
                            *, kernel: Kernel = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Every in-edge of ``dst`` with its inclusion probability ``p_ts`` (A.1.2): ``min(1, k/d_s)``
    for LABOR-0, ``min(1, c_s π_t)`` for LABOR-*. The probabilities depend on ``dst`` and the
    graph only, not on the variates.

    Args:
        graph: the graph.
        dst: ``(n,)`` int64 distinct dst ids.
        fanout: ``k`` (positive).
        importance_iterations: as :class:`LaborSampler`.
        kernel: ``"auto"``, ``"tensor"`` or ``"numba"`` (the same values up to float64 rounding).

    Returns:
        ``pointer`` ``(n + 1,)`` int64 CSC pointer over ``dst``, ``src`` ``(Σ d_s,)`` int64 global
        source ids in CSC order, ``p`` ``(Σ d_s,)`` float64.
    """
    dst = dst.long()
    pointer, src = _candidates(graph, dst)
    degree = pointer[1:] - pointer[:-1]
    if importance_iterations == 0:
        p = torch.clamp(fanout / degree.double().clamp(min=1), max=1.0)
        return pointer, src, p.repeat_interleave(degree, output_size=src.numel())
    if _use_numba(kernel, graph.indptr):
        nodes, local = _relabel(dst.numpy(), src.numpy())
        c, pi = _importance(pointer.numpy(), local, nodes.size, fanout, importance_iterations)
        local = torch.from_numpy(local)
        c, pi = torch.from_numpy(c), torch.from_numpy(pi)
    else:
        _, local = torch.unique(src, return_inverse=True)
        c, pi = _importance_tensor(pointer, local, int(local.max()) + 1 if local.numel() else 0, fanout,
                                   importance_iterations)
    row = torch.repeat_interleave(torch.arange(dst.numel(), device=dst.device), degree, output_size=src.numel())
    return pointer, src, torch.clamp(c[row] * pi[local], max=1.0)


# ---------------------------------------------------------------- tensor path (any device)


def _candidates(graph: Graph, dst: Tensor) -> tuple[Tensor, Tensor]:
    """``(n + 1,)`` pointer and ``(Σ d_s,)`` int64 sources of every in-edge of ``dst``, CSC order."""
    start = graph.indptr[dst]
    degree = graph.indptr[dst + 1] - start
    pointer = torch.zeros(dst.numel() + 1, dtype=torch.int64, device=dst.device)
    torch.cumsum(degree, 0, out=pointer[1:])
    total = int(pointer[-1])
    edge_ids = torch.repeat_interleave(start - pointer[:-1], degree, output_size=total)
    edge_ids += torch.arange(total, device=dst.device)
    return pointer, graph.indices[edge_ids].long()


def _importance_tensor(pointer: Tensor, local: Tensor, num_src: int, fanout: int,
                       iterations: int) -> tuple[Tensor, Tensor]:
    """LABOR-*'s fixed point (Balin & Çatalyürek 2023, Eq. 22): ``c`` ``(n,)`` and ``π`` ``(num_src,)`` float64.

    Each iteration sets ``π_t ← π_t · max_{s ∋ t} c_s``, then solves every ``c_s`` of
    ``Σ_t 1 / min(1, c_s π_t) = d_s² / min(k, d_s)`` by the step ``c ← c · lhs / rhs``; it
    stops after ``iterations`` (``-1``: once an iteration lowers ``Σ_t min(1, π_t)`` by less than a relative
    10⁻⁴, or raises it; at most ``_MAX_IMPORTANCE``).
    """
    device = pointer.device
    n = pointer.numel() - 1
    degree = (pointer[1:] - pointer[:-1]).double()
    row = torch.repeat_interleave(torch.arange(n, device=device), (pointer[1:] - pointer[:-1]),
                                  output_size=local.numel())
    target = degree * degree / torch.clamp(degree, max=fanout).clamp(min=1)
    c = fanout / degree.clamp(min=1)
    pi = torch.ones(num_src, dtype=torch.float64, device=device)
    previous = INF
    steps = _MAX_IMPORTANCE if iterations < 0 else iterations
    for _ in range(steps):
        hop = torch.zeros(num_src, dtype=torch.float64, device=device)
        hop.scatter_reduce_(0, local, c[row], reduce="amax", include_self=True)
        pi = pi * hop
        pi_edge = pi[local]
        active = degree > 0
        for _ in range(_MAX_SOLVE):
            lhs = torch.zeros(n, dtype=torch.float64, device=device)
            lhs.index_add_(0, row, 1.0 / torch.clamp(c[row] * pi_edge, max=1.0))
            ratio = torch.minimum(lhs, target) / torch.maximum(lhs, target)
            moving = active & (ratio < 1 - _EPS)
            c = torch.where(active, c * lhs / torch.where(active, target, 1.0), c)
            active = moving
            if not bool(active.any()):
                break
        expected = float(torch.clamp(pi, max=1.0).sum())
        if expected / previous >= 1 - _EPS:
            break
        previous = expected
    return c, pi


def _labor_tensor(graph: Graph, dst: Tensor, fanout: int, variates: Variates, iterations: int) -> Block:
    pointer, src = _candidates(graph, dst)
    degree = pointer[1:] - pointer[:-1]
    row = torch.repeat_interleave(torch.arange(dst.numel(), device=dst.device), degree, output_size=src.numel())
    if iterations == 0:
        p = torch.clamp(fanout / degree.double().clamp(min=1), max=1.0)[row]
        r = variates.of(src)
    else:
        nodes, local = torch.unique(src, return_inverse=True)
        c, pi = _importance_tensor(pointer, local, nodes.numel(), fanout, iterations)
        p = torch.clamp(c[row] * pi[local], max=1.0)
        r = variates.of(nodes)[local]
    keep = r <= p
    kept_per_row = torch.zeros(dst.numel(), dtype=torch.int64, device=dst.device)
    kept_per_row.index_add_(0, row, keep.long())
    out_pointer = torch.zeros(dst.numel() + 1, dtype=torch.int64, device=dst.device)
    torch.cumsum(kept_per_row, 0, out=out_pointer[1:])
    src_nodes, local_src = relabel_dst_first(dst, src[keep])
    return Block(src_nodes, dst.numel(), out_pointer, local_src, (1.0 / p[keep]).float())


# ---------------------------------------------------------------- numba path (CPU)


def _labor_numba(graph: Graph, dst: Tensor, fanout: int, variates: Variates, iterations: int) -> Block:
    indptr, indices, ids = graph.indptr.numpy(), graph.indices.numpy(), dst.numpy()
    v = (variates.key1, variates.key2, variates.cos_c, variates.sin_c, variates.smooth)
    if iterations == 0 and not variates.smooth:
        pointer, src, weight = _labor0_rows(indptr, indices, ids, fanout, *v)
    else:  # one variate per distinct source: the smoothed variates cost two logs, cosines and an erfc each
        cand_pointer, cand = _gather_candidates(indptr, indices, ids)
        nodes, local = _relabel(ids, cand)
        if iterations == 0:  # LABOR-0 is c_s = k / d_s, π = 1
            c = fanout / np.maximum(np.diff(cand_pointer), 1).astype(np.float64)
            pi = np.ones(nodes.size, np.float64)
        else:
            c, pi = _importance(cand_pointer, local, nodes.size, fanout, iterations)
        r = _variates_of(nodes, *v)
        pointer, src, weight = _keep_importance(cand_pointer, local, nodes, c, pi, r)
    src_nodes, local_src = _relabel(ids, src)
    return Block(torch.from_numpy(src_nodes), dst.numel(), torch.from_numpy(pointer), torch.from_numpy(local_src),
                 torch.from_numpy(weight))


_TWO_POW_32 = 1.0 / 2**32
_TWO_PI = 2.0 * math.pi
_SQRT_HALF = math.sqrt(0.5)


@jit(inline="always")
def _uniform_scalar(key, t):
    return (np.float64(hash_id_scalar(key, t)) + 0.5) * _TWO_POW_32


@jit(inline="always")
def _variate_scalar(key1, key2, cos_c, sin_c, smooth, t):
    """:meth:`Variates.of` for one vertex (the same hashes and formulas)."""
    if not smooth:
        return _uniform_scalar(key1, t)
    n1 = math.sqrt(-2.0 * math.log(_uniform_scalar(key1, t))) * math.cos(
        _TWO_PI * _uniform_scalar(key1 ^ _SECOND_UNIFORM, t))
    n2 = math.sqrt(-2.0 * math.log(_uniform_scalar(key2, t))) * math.cos(
        _TWO_PI * _uniform_scalar(key2 ^ _SECOND_UNIFORM, t))
    return 0.5 * math.erfc(-(cos_c * n1 + sin_c * n2) * _SQRT_HALF)


@jit
def _variates_of(nodes, key1, key2, cos_c, sin_c, smooth):
    out = np.empty(nodes.shape[0], np.float64)
    for i in range(nodes.shape[0]):
        out[i] = _variate_scalar(key1, key2, cos_c, sin_c, smooth, nodes[i])
    return out


def _labor0_rows(indptr, indices, dst, fanout, key1, key2, cos_c, sin_c, smooth):
    """LABOR-0 over every row: keep ``t → s`` iff ``r_t ≤ min(1, k/d_s)``; returns pointer, sources, weights.
    Rows split over the sampler's Python threads (the kernels release the GIL), as NS does."""
    n = dst.shape[0]
    counts = np.zeros(n + 1, np.int64)
    threads = min(torch.get_num_threads(), n // _ROWS_PER_THREAD)
    bounds = np.linspace(0, n, max(threads, 1) + 1).astype(np.int64)
    keys = (key1, key2, cos_c, sin_c, smooth)

    def run(kernel, *arrays):
        if threads > 1:
            list(_thread_pool().map(lambda lo, hi: kernel(indptr, indices, dst, fanout, *keys, *arrays, lo, hi),
                                    bounds[:-1], bounds[1:]))
        else:
            kernel(indptr, indices, dst, fanout, *keys, *arrays, 0, n)

    run(_labor0_count, counts)
    pointer = np.cumsum(counts)
    src = np.empty(pointer[n], np.int64)
    weight = np.empty(pointer[n], np.float32)
    run(_labor0_fill, pointer, src, weight)
    return pointer, src, weight


@jit
def _labor0_count(indptr, indices, dst, fanout, key1, key2, cos_c, sin_c, smooth, counts, lo, hi):
    """``counts[r + 1]`` = kept in-edges of row ``r`` for rows ``lo … hi − 1``."""
    for r in range(lo, hi):
        start, end = indptr[dst[r]], indptr[dst[r] + 1]
        d = end - start
        if d <= fanout:
            counts[r + 1] = d
            continue
        p = fanout / d
        kept = 0
        for e in range(start, end):
            if _variate_scalar(key1, key2, cos_c, sin_c, smooth, indices[e]) <= p:
                kept += 1
        counts[r + 1] = kept


@jit
def _labor0_fill(indptr, indices, dst, fanout, key1, key2, cos_c, sin_c, smooth, pointer, src, weight, lo, hi):
    """Write the kept sources and weights ``1/p`` of rows ``lo … hi − 1`` at ``pointer[r]``."""
    for r in range(lo, hi):
        start, end = indptr[dst[r]], indptr[dst[r] + 1]
        d = end - start
        out = pointer[r]
        if d <= fanout:
            for e in range(start, end):
                src[out] = indices[e]
                weight[out] = 1.0
                out += 1
            continue
        p = fanout / d
        for e in range(start, end):
            t = indices[e]
            if _variate_scalar(key1, key2, cos_c, sin_c, smooth, t) <= p:
                src[out] = t
                weight[out] = 1.0 / p
                out += 1


@jit
def _gather_candidates(indptr, indices, dst):
    n = dst.shape[0]
    pointer = np.zeros(n + 1, np.int64)
    for r in range(n):
        pointer[r + 1] = pointer[r] + indptr[dst[r] + 1] - indptr[dst[r]]
    cand = np.empty(pointer[n], np.int64)
    for r in range(n):
        start = indptr[dst[r]]
        for e in range(pointer[r + 1] - pointer[r]):
            cand[pointer[r] + e] = indices[start + e]
    return pointer, cand


@jit
def _importance(pointer, local, num_src, fanout, iterations):
    """:func:`_importance_tensor` row by row (the same fixed point, steps and stopping rules)."""
    n = pointer.shape[0] - 1
    c = np.empty(n, np.float64)
    target = np.empty(n, np.float64)
    for r in range(n):
        d = pointer[r + 1] - pointer[r]
        c[r] = fanout / max(d, 1)
        target[r] = d * d / max(min(d, fanout), 1)
    pi = np.ones(num_src, np.float64)
    hop = np.empty(num_src, np.float64)
    previous = np.inf
    steps = _MAX_IMPORTANCE if iterations < 0 else iterations
    for _ in range(steps):
        hop[:] = 0.0
        for r in range(n):
            for e in range(pointer[r], pointer[r + 1]):
                if c[r] > hop[local[e]]:
                    hop[local[e]] = c[r]
        for t in range(num_src):
            pi[t] *= hop[t]
        for r in range(n):
            if pointer[r + 1] == pointer[r]:
                continue
            cr = c[r]
            for _ in range(_MAX_SOLVE):
                lhs = 0.0
                for e in range(pointer[r], pointer[r + 1]):
                    lhs += 1.0 / min(1.0, cr * pi[local[e]])
                ratio = min(lhs, target[r]) / max(lhs, target[r])
                cr *= lhs / target[r]
                if ratio >= 1 - _EPS:
                    break
            c[r] = cr
        expected = 0.0
        for t in range(num_src):
            expected += min(1.0, pi[t])
        if expected / previous >= 1 - _EPS:
            break
        previous = expected
    return c, pi


@jit
def _keep_importance(pointer, local, nodes, c, pi, r):
    """Keep candidate ``e`` of row ``s`` iff ``r_t ≤ min(1, c_s π_t)``; returns pointer, sources, weights."""
    n = pointer.shape[0] - 1
    out_pointer = np.zeros(n + 1, np.int64)
    for s in range(n):
        kept = 0
        for e in range(pointer[s], pointer[s + 1]):
            if r[local[e]] <= min(1.0, c[s] * pi[local[e]]):
                kept += 1
        out_pointer[s + 1] = out_pointer[s] + kept
    src = np.empty(out_pointer[n], np.int64)
    weight = np.empty(out_pointer[n], np.float32)
    out = 0
    for s in range(n):
        for e in range(pointer[s], pointer[s + 1]):
            p = min(1.0, c[s] * pi[local[e]])
            if r[local[e]] <= p:
                src[out] = nodes[local[e]]
                weight[out] = 1.0 / p
                out += 1
    return out_pointer, src, weight


__all__ = ["LaborSampler", "Variates", "inclusion_probabilities", "labor_block"]
