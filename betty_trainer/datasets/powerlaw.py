"""A large synthetic power-law graph with class structure, generated straight into the on-disk cache.

The model is a degree-corrected planted partition (Karrer & Newman 2011) with Chung-Lu
expected degrees (Chung & Lu 2002): node ``i`` has weight ``w_i ∝ rank_i^(-1/(γ-1))``
(the expected-degree sequence of a power law with exponent ``γ``; ranks are a random
permutation of the nodes, weights clipped at :data:`MAX_DEGREE_FACTOR` times the mean so
hubs stay below ``N``), and a uniform class ``y_i``. Each undirected pair draws ``u ∝ w``;
with probability ``homophily`` its partner ``v`` is drawn ``∝ w`` among ``u``'s class, else
``∝ w`` among all nodes. Both directions are stored, duplicates and self loops removed,
so the graph has somewhat fewer than ``num_edges`` directed edges (duplicates concentrate
between hubs). Features are ``N(μ_y, I)`` with class means of per-coordinate scale
``feature_signal``, like :func:`~betty_trainer.datasets.synthetic.make_sbm`, so both the
graph and the features carry the class.

Everything is drawn from counter-keyed generators (``default_rng([seed, stream, chunk])``),
so a graph is a function of its parameters alone. Memory: the
edge list is built in chunks into two int32 arrays of ``num_edges / 2``, then
:func:`~betty_trainer.data.graph.csc_from_edges` (three int64 arrays of ``num_edges``);
features are written chunk by chunk into the cache's memory-mapped ``x.npy``. At 2M nodes
and 52M edges that is about 2 GB of RAM beyond the 0.8 GB feature file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from betty_trainer.data.graph import Graph, csc_from_edges
from betty_trainer.datasets.cache import CacheWriter, load_cached, processed_dir, read_back
from betty_trainer.errors import DatasetError

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1
MAX_DEGREE_FACTOR = 200  # expected degrees are clipped at this many times the mean
BLOCK = 1 << 20  # pairs (and feature values) per generator: memory per step, and the unit the draws are keyed by
_CLASSES, _WEIGHTS, _EDGES, _FEATURES, _SPLIT, _COMMUNITIES = range(6)  # generator streams


def _rng(seed: int, stream: int, chunk: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, chunk])


def expected_degrees(num_nodes: int, num_edges: int, exponent: float, seed: int) -> np.ndarray:
    """``(N,)`` float64 Chung-Lu weights: a clipped power law of mean ``num_edges / N``, randomly
    assigned to nodes (see the module docstring)."""
    mean = num_edges / num_nodes
    weights = np.arange(1, num_nodes + 1, dtype=np.float64) ** (-1.0 / (exponent - 1.0))
    weights *= mean / weights.mean()
    np.minimum(weights, MAX_DEGREE_FACTOR * mean, out=weights)
    weights *= mean / weights.mean()
    return weights[_rng(seed, _WEIGHTS).permutation(num_nodes)]


def write_powerlaw(target: Path, *, num_nodes: int, num_edges: int, num_classes: int, num_features: int,
                   exponent: float, homophily: float, feature_signal: float, train_fraction: float,
                   val_fraction: float, test_fraction: float, seed: int, num_communities: int = 0,
                   class_homophily: float = 0.0, source: object = None) -> Path:
    """Generate the graph (module docstring) into cache folder ``target``.

    Args:
        target: cache folder (replaced when complete).
        num_nodes: ``N``. num_edges: directed edges drawn (``num_edges // 2`` pairs, both directions).
        num_classes, num_features: ``C`` and ``F``.
        exponent: power-law exponent ``γ > 1`` of the expected degrees.
        homophily: probability that a pair stays inside its class.
        feature_signal: scale of the class means (noise has unit variance).
        train_fraction, val_fraction, test_fraction: disjoint random splits (shares of ``N``).
        seed: generator seed.
        num_communities: ``0``: the planted blocks are the classes. Otherwise ``num_communities``
            uniform blocks, block ``b`` of class ``b mod C``: edges stay inside the (smaller)
            block with probability ``homophily``, so the graph has the local structure of
            co-purchase or citation graphs (Betty's REG exploits it) and the labels stay
            homophilous.
        class_homophily: with ``num_communities``, the share of the pairs that leave their block
            which stay inside the block's class (the union of the blocks ``b ≡ c mod C``): a two-level
            planted partition, blocks nested in classes, like products nested in sub-categories and
            categories. ``0`` (default): a pair that leaves its block lands anywhere, as before (the
            same graph as without the parameter). Outside a block a pair thus lands in the class with
            probability ``class_homophily`` and anywhere otherwise.
        source: the ``meta.json`` source description.

    Returns:
        ``target``.

    Raises:
        DatasetError: the split shares add up to more than 1, or ``class_homophily`` is outside
            ``[0, 1]`` or set without ``num_communities``.
    """
    if not 0.0 <= class_homophily <= 1.0 or (class_homophily and not num_communities):
        raise DatasetError(f"powerlaw class_homophily={class_homophily} must lie in [0, 1] and needs "
                           "num_communities > 0; fix dataset.powerlaw.class_homophily")
    if train_fraction + val_fraction + test_fraction > 1:
        raise DatasetError(f"powerlaw split shares add up to {train_fraction + val_fraction + test_fraction} > 1; "
                           "lower dataset.powerlaw.train/val/test_fraction")
    if num_communities:
        block_of = _rng(seed, _COMMUNITIES).integers(num_communities, size=num_nodes)
        y = block_of % num_classes
    else:
        y = _rng(seed, _CLASSES).integers(num_classes, size=num_nodes)
        block_of = y
    num_blocks = num_communities or num_classes
    weights = expected_degrees(num_nodes, num_edges, exponent, seed)
    everyone = np.cumsum(weights)
    # nodes ordered by block (blocks of one class next to each other when pairs may stay in the class), so a
    # block's and a class's nodes are each one range of the cumulative weights
    nested = class_homophily > 0
    order_key = (block_of % num_classes) * num_blocks + block_of if nested else block_of
    by_class = np.argsort(order_key, kind="stable")
    in_class = np.cumsum(weights[by_class])
    block_rank = np.argsort(np.arange(num_blocks) % num_classes * num_blocks + np.arange(num_blocks), kind="stable") \
        if nested else np.arange(num_blocks)  # blocks in the order of order_key
    class_end = np.cumsum(np.bincount(block_of, minlength=num_blocks)[block_rank])
    ranked_high = in_class[np.maximum(class_end - 1, 0)]
    ranked_high[class_end == 0] = 0.0
    ranked_high = np.maximum.accumulate(ranked_high)
    ranked_low = np.concatenate([[0.0], ranked_high[:-1]])
    class_high, class_low = np.empty(num_blocks), np.empty(num_blocks)  # per block, its range of in_class
    class_high[block_rank], class_low[block_rank] = ranked_high, ranked_low
    if nested:  # per class, the range of its blocks
        first = np.searchsorted(np.arange(num_blocks)[block_rank] % num_classes, np.arange(num_classes), side="left")
        last = np.searchsorted(np.arange(num_blocks)[block_rank] % num_classes, np.arange(num_classes), side="right")
        family_low = np.where(last > first, ranked_low[np.minimum(first, num_blocks - 1)], 0.0)
        family_high = np.where(last > first, ranked_high[np.maximum(last - 1, 0)], 0.0)

    pairs = num_edges // 2
    index_type = np.int32 if num_nodes < 2**31 else np.int64
    src, dst = np.empty(pairs, index_type), np.empty(pairs, index_type)
    block = BLOCK
    for start in range(0, pairs, block):
        stop = min(start + block, pairs)
        rng = _rng(seed, _EDGES, start // block)
        count = stop - start
        u = np.minimum(np.searchsorted(everyone, rng.random(count) * everyone[-1], side="right"), num_nodes - 1)
        tier = rng.random(count)
        inside = tier < homophily
        pick = rng.random(count)
        c = block_of[u]
        local = class_low[c] + pick * (class_high[c] - class_low[c])
        v_inside = by_class[np.minimum(np.searchsorted(in_class, local, side="right"), num_nodes - 1)]
        v_any = np.minimum(np.searchsorted(everyone, pick * everyone[-1], side="right"), num_nodes - 1)
        src[start:stop] = u
        dst[start:stop] = np.where(inside, v_inside, v_any)
        if nested:  # of the pairs leaving the block, a class_homophily share stays in the class
            in_family = ~inside & ((tier - homophily) < class_homophily * (1.0 - homophily))
            f = c[in_family] % num_classes
            local = family_low[f] + pick[in_family] * (family_high[f] - family_low[f])
            dst[start:stop][in_family] = by_class[np.minimum(np.searchsorted(in_class, local, side="right"),
                                                             num_nodes - 1)]
    del everyone, in_class, by_class, weights
    indptr, indices = csc_from_edges(src, dst, num_nodes, symmetric=True, drop_self_loops=True)
    del src, dst

    with CacheWriter(target) as writer:
        writer.save("indptr", indptr)
        writer.save("indices", indices)
        del indices
        means = (_rng(seed, _FEATURES).standard_normal((num_classes, num_features)) * feature_signal).astype(np.float32)
        x = writer.open("x", (num_nodes, num_features), np.float32)
        rows = max(1, block // max(num_features, 1))
        for start in range(0, num_nodes, rows):
            stop = min(start + rows, num_nodes)
            noise = _rng(seed, _FEATURES, 1 + start // rows).standard_normal((stop - start, num_features),
                                                                               dtype=np.float32)
            x[start:stop] = means[y[start:stop]] + noise
        x.flush()
        del x
        writer.save("y", y.astype(np.int64))
        order = _rng(seed, _SPLIT).permutation(num_nodes)
        cuts = np.cumsum([int(train_fraction * num_nodes), int(val_fraction * num_nodes), int(test_fraction * num_nodes)])
        writer.save("train_idx", np.sort(order[: cuts[0]]))
        writer.save("val_idx", np.sort(order[cuts[0]: cuts[1]]))
        writer.save("test_idx", np.sort(order[cuts[1]: cuts[2]]))
        return writer.commit({"name": "powerlaw", "num_classes": num_classes, "source": source})


def make_powerlaw(*, mmap: bool = True, **params) -> Graph:
    """The power-law graph of ``params`` (the keys of :func:`write_powerlaw` from ``num_nodes`` to
    ``seed``; ``dataset.powerlaw`` in a config), generated into the cache on first use and
    memory-mapped from it afterwards.

    The cache folder is ``powerlaw/processed/<hash of the parameters>``; a folder built
    from other parameters or an older generator version is never reused.

    Returns:
        A :class:`Graph` whose ``x`` (``(N, F)`` float32) is a copy-on-write memory map when ``mmap``.

    Raises:
        DatasetError: inconsistent parameters.
    """
    # class_homophily = 0 is the graph from before the parameter existed: its cache keeps its name
    source = {"generator": "powerlaw", "version": GENERATOR_VERSION,
              **{key: value for key, value in params.items() if key != "class_homophily" or value}}
    variant = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    folder = processed_dir("powerlaw", variant)
    graph = load_cached(folder, source, mmap=mmap)
    if graph is None:
        log.info("generating the power-law graph %s into %s (once)", params, folder)
        write_powerlaw(folder, source=source, **params)
        graph = read_back(folder, source, mmap=mmap)
    return graph
