"""GNS (Dong et al. 2021, §3): the global node cache, cache-first neighbour sampling, importance weights."""

from __future__ import annotations

import math

import pytest
import torch

from betty_trainer.data.graph import Graph
from betty_trainer.sampling import GNSSampler, NeighborSampler, SampleKey
from betty_trainer.sampling.gns import gns_cache_size, random_walk_probability

FANOUT = 10


def seeds_of(graph, count, seed=0):
    return torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(seed))[:count]


def test_cache_size_refresh_and_determinism(computers):
    """|C| = ⌈fraction · N⌉ distinct nodes; the same cache for every batch of a refresh window, a new one
    after ``refresh_every`` batches (also across epochs when batches_per_epoch is known)."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=0.02, refresh_every=5, batches_per_epoch=8)
    first = sampler.cache_nodes(SampleKey(1, 0, 0))
    assert first.numel() == math.ceil(0.02 * computers.num_nodes) == torch.unique(first).numel()
    assert torch.equal(first, sampler.cache_nodes(SampleKey(1, 0, 4)))
    fifth = sampler.cache_nodes(SampleKey(1, 0, 5))
    assert not torch.equal(first, fifth)
    assert torch.equal(fifth, sampler.cache_nodes(SampleKey(1, 1, 1)))  # run batch 9 is in window 1, with batch 5
    again = GNSSampler(computers, [FANOUT], cache_fraction=0.02, refresh_every=5, batches_per_epoch=8)
    assert torch.equal(first, again.cache_nodes(SampleKey(1, 0, 3)))


def test_cache_size_is_the_exact_ceiling_of_the_decimal_fraction():
    """⌈0.07 · 100⌉ = 7, not the 8 that the float product 7.000000000000001 rounds up to."""
    for fraction, nodes in ((0.07, 7), (0.14, 14), (0.56, 56), (0.0001, 1), (1.0, 100)):
        assert gns_cache_size(fraction, 100) == nodes, fraction


def test_degree_cache_favours_high_degree_nodes(computers):
    """Eq. 6: a node's chance to be cached grows with its degree. Over 40 caches, the top-decile-degree nodes
    are cached far more often than the bottom half, and the inclusion probabilities sum to about |C| (per degree
    band against the sampled frequencies: the next test)."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=0.01, refresh_every=1, cache_probability="degree")
    counts = torch.zeros(computers.num_nodes)
    draws = 40
    for step in range(draws):
        counts[sampler.cache_nodes(SampleKey(2, 0, step))] += 1
    degree = computers.in_degrees().double()
    order = torch.argsort(degree)
    bottom, top = order[: computers.num_nodes // 2], order[-computers.num_nodes // 10:]
    assert float(counts[top].mean()) > 10 * float(counts[bottom].mean())
    inclusion = sampler.cache(SampleKey(2, 0, 0)).inclusion
    assert torch.allclose(sampler.probability(), degree / degree.sum())
    # Σ_v frequency_v = |C| exactly, and Σ_v π_v = |C| by the choice of τ (cache_inclusion, Newton's method to
    # float64 precision); Eq. 11's 1 − (1 − p_v)^{|C|} ≤ |C|·p_v sums to less (134.9 for |C| = 138 here)
    assert abs(float(inclusion.sum()) - sampler.cache_size) < 1e-6


@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_cached_frequencies_match_the_inclusion_probabilities_per_degree_band(computers, fraction):
    """The inclusion probabilities the weights divide by (``NodeCache.inclusion``, :func:`cache_inclusion`) are
    the caches' frequencies: over R = 1,000 caches, the number of cached nodes of each out-degree band is within
    4.5 standard errors of R · Σ_band π_v. Eq. 11's 1 − (1 − p_v)^{|C|} (draws with replacement) fails it."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=fraction, refresh_every=1, cache_probability="degree")
    draws = 1000
    bands = [0, 20, 100, 300, 1000, 3000, computers.num_nodes // 2, computers.num_nodes]
    order = torch.argsort(computers.out_degrees(), descending=True, stable=True)
    band_of = torch.empty(computers.num_nodes, dtype=torch.int64)
    for b, (lo, hi) in enumerate(zip(bands, bands[1:])):
        band_of[order[lo:hi]] = b
    per_draw = torch.zeros(draws, len(bands) - 1, dtype=torch.float64)  # cached nodes of each band, per cache
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 1,000 draws of small ops: threads on a shared CPU only contend
    try:
        for step in range(draws):
            per_draw[step] = torch.bincount(band_of[sampler.cache_nodes(SampleKey(10, 0, step))],
                                            minlength=len(bands) - 1).double()
    finally:
        torch.set_num_threads(threads)
    inclusion = sampler.cache(SampleKey(10, 0, 0)).inclusion
    assert abs(float(inclusion.sum()) - sampler.cache_size) < 1e-6
    # A band's count in one cache has variance Var X (not Σ π(1 − π): a fixed-size draw correlates inclusions),
    # estimated from the R draws; the R caches are independent, so the total has standard error √(R · Var X).
    # 7 bands × 2 fractions = 14 two-sided tests at z = 4.5 (P ≈ 6.8e-6 each): a correct π fails one with
    # probability ≈ 1e-4 (Bonferroni). Measured: |z| ≤ 2.5 for π; Eq. 11 up to 6.0 (1%) and 48 (5%).
    standard_error = (draws * per_draw.var(0)).sqrt()
    observed = per_draw.sum(0)

    def z_scores(pi):
        expected = draws * torch.zeros(len(bands) - 1, dtype=torch.float64).index_add_(0, band_of, pi)
        return (observed - expected) / standard_error

    assert float(z_scores(inclusion).abs().max()) < 4.5
    p = sampler.probability()
    assert float(z_scores(-torch.expm1(sampler.cache_size * torch.log1p(-p))).abs().max()) > 4.5


def test_degree_on_a_directed_graph_counts_the_neighbour_lists_holding_a_node():
    """Eq. 6's deg(i) on a directed graph: how many dst nodes have ``i`` among the in-neighbours sampling draws
    from (its out-degree), the node's one-step reach, as Eq. 8 with P uniform and d = 1 gives; its in-degree
    says nothing about being sampled. On an undirected graph the two are equal (test above)."""
    src = torch.tensor([0, 0, 0, 1, 2, 3])
    dst = torch.tensor([1, 2, 3, 2, 3, 0])  # node 0: 3 out-edges, 1 in-edge; node 3: 1 out-edge, 2 in-edges
    n = 4
    graph = Graph.from_edges(src, dst, n, symmetric=False, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.int64),
                             train_idx=torch.arange(n), val_idx=torch.arange(0), test_idx=torch.arange(0),
                             num_classes=1)
    sampler = GNSSampler(graph, [1], cache_probability="degree")
    assert torch.equal(sampler.probability(), torch.tensor([3.0, 1, 1, 1], dtype=torch.float64) / 6)


def test_random_walk_probability_is_eq_8():
    """P^ℓ = (DA + I) P^{ℓ−1} with d_s = min(k, deg s)/deg s and P⁰ uniform on the training nodes (Eq. 7–9),
    against dense matrices on a small graph."""
    src = torch.tensor([0, 1, 1, 2, 3, 4, 4, 5, 0])
    dst = torch.tensor([1, 2, 3, 3, 4, 5, 0, 0, 3])
    n = 6
    graph = Graph.from_edges(src, dst, n, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.int64),
                             train_idx=torch.tensor([0, 3]), val_idx=torch.arange(0), test_idx=torch.arange(0),
                             num_classes=1)
    adjacency = torch.zeros(n, n, dtype=torch.float64)  # adjacency[t, s] = 1 for an in-edge t → s
    for s in range(n):
        adjacency[graph.indices[graph.indptr[s]:graph.indptr[s + 1]].long(), s] = 1
    degree = adjacency.sum(0)
    p = torch.zeros(n, dtype=torch.float64)
    p[[0, 3]] = 0.5
    for k in (1, 2):  # output layer first: fanouts [2, 1] input layer first
        p = adjacency @ (torch.clamp(k / degree, max=1) * p) + p
    assert torch.allclose(random_walk_probability(graph, graph.train_idx, [2, 1]), p)


def test_cached_neighbours_come_first(computers):
    """§3.3: a dst node with at least k cached neighbours takes k of them and nothing else; one with fewer
    takes all of them and tops up to k from the others; a node of degree ≤ k keeps every in-edge."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=0.05, cache_probability="degree")
    key = SampleKey(3, 0, 0)
    cache = sampler.cache(key)
    dst = seeds_of(computers, 500)
    block = sampler.sample(dst, key).blocks[0]
    cases = set()
    for row, s in enumerate(dst.tolist()):
        neighbours = computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()
        kept = block.src_nodes[block.indices[block.indptr[row]:block.indptr[row + 1]]]
        cached = int(cache.mask[neighbours].sum())
        if neighbours.numel() <= FANOUT:
            assert torch.equal(kept, neighbours)
            cases.add("whole")
        elif cached >= FANOUT:
            assert kept.numel() == FANOUT and bool(cache.mask[kept].all())
            cases.add("cached only")
        else:
            assert kept.numel() == FANOUT and int(cache.mask[kept].sum()) == cached
            cases.add("topped up")
    assert cases == {"whole", "cached only", "topped up"}


def test_cache_only_input_layer_reads_only_cached_neighbours(computers):
    sampler = GNSSampler(computers, [FANOUT, FANOUT], cache_fraction=0.02, cache_only_input_layer=True)
    key = SampleKey(4, 0, 0)
    batch = sampler.sample(seeds_of(computers, 256), key)
    first = batch.blocks[0]
    new_inputs = first.src_nodes[first.num_dst:]
    assert new_inputs.numel() > 0 and bool(sampler.cache(key).mask[new_inputs].all())
    sources = first.src_nodes[first.indices]
    assert bool(sampler.cache(key).mask[sources].all())


def test_topped_up_weights_are_unbiased_given_the_cache(computers):
    """Given the cache, rows that top up (c_s < k < d_s) estimate their neighbourhood sum without bias:
    Σ_kept w_ts h_t averaged over R samples is within a Bonferroni bound of its standard error."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=0.01, refresh_every=10_000, cache_probability="degree")
    cache = sampler.cache(SampleKey(5, 0, 0))
    dst = seeds_of(computers, 300, seed=1)
    degree = computers.indptr[dst + 1] - computers.indptr[dst]
    cached = torch.tensor([int(cache.mask[computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()].sum())
                           for s in dst.tolist()])
    topping = (degree > FANOUT) & (cached < FANOUT)
    h = computers.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10
    full = torch.stack([h[computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()].sum() for s in dst])
    repetitions = 200
    estimates = torch.empty(repetitions, dst.numel(), dtype=torch.float64)
    for rep in range(repetitions):
        block = sampler.sample(dst, SampleKey(5, 0, rep)).blocks[0]
        sums = torch.zeros(dst.numel(), dtype=torch.float64)
        sums.index_add_(0, block.edge_dst(), block.edge_weight.double() * h[block.src_nodes[block.indices]])
        estimates[rep] = sums
    z = (estimates.mean(0) - full)[topping] / (estimates.std(0)[topping] / math.sqrt(repetitions))
    tests = int(topping.sum())
    assert tests > 50
    assert float(z.abs().max()) < -float(torch.special.ndtri(torch.tensor(1e-3 / (2 * tests), dtype=torch.float64)))


def test_weighted_mean_is_close_to_unbiased_across_caches_and_the_sum_is_not(computers):
    """Across caches (a 1% cache drawn per batch), the self-normalised weighted mean Σ w h / Σ w (SAGE) of each
    of 300 rows with d_s > 3k is within a Bonferroni bound (4.65) of its standard error of the full
    neighbourhood mean over R = 300 batches (measured max |z| 2.7–3.8 over three key seeds); the weighted sum
    Σ w h (GCN) of the same samples is not: 7–8 rows beyond the bound, those whose cached-neighbour count
    crosses k from cache to cache (module docstring: E[w · 1{kept}] = P(c ≥ k | t ∈ C) + P(c < k)).
    Only close to unbiased: the mean is a ratio estimator, and at a 5% cache the same check finds one row
    beyond the bound (−8.1%, |z| 6.4; median |relative bias| 1.1%), which is why this test runs at 1%."""
    sampler = GNSSampler(computers, [FANOUT], cache_fraction=0.01, refresh_every=1, cache_probability="degree")
    degree = computers.in_degrees()
    dst = torch.nonzero(degree > 3 * FANOUT).flatten()
    dst = dst[torch.randperm(dst.numel(), generator=torch.Generator().manual_seed(5))[:300]]
    h = computers.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10
    full_sum = torch.stack([h[computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()].sum()
                            for s in dst.tolist()])
    full_mean = full_sum / degree[dst].double()
    repetitions = 300
    sums = torch.empty(repetitions, dst.numel(), dtype=torch.float64)
    totals = torch.empty_like(sums)
    for rep in range(repetitions):
        block = sampler.sample(dst, SampleKey(11, 0, rep)).blocks[0]
        weight = block.edge_weight.double()
        sums[rep] = torch.zeros(dst.numel(), dtype=torch.float64).index_add_(
            0, block.edge_dst(), weight * h[block.src_nodes[block.indices]])
        totals[rep] = torch.zeros(dst.numel(), dtype=torch.float64).index_add_(0, block.edge_dst(), weight)
    bound = -float(torch.special.ndtri(torch.tensor(1e-3 / (2 * dst.numel()), dtype=torch.float64)))

    def z_scores(estimates, full):
        return (estimates.mean(0) - full) / (estimates.std(0) / math.sqrt(repetitions))

    assert float(z_scores(sums / totals, full_mean).abs().max()) < bound
    assert int((z_scores(sums, full_sum).abs() > bound).sum()) >= 3  # the same check resolves the sum's bias


@pytest.mark.parametrize("only_cached", [False, True])
@pytest.mark.parametrize("probability", ["degree", "random_walk"])
def test_numba_and_tensor_kernels_sample_the_same_block(computers, only_cached, probability):
    seeds = seeds_of(computers, 200, seed=2)
    batches = [GNSSampler(computers, [FANOUT, 5], cache_fraction=0.02, cache_only_input_layer=only_cached,
                          cache_probability=probability, kernel=kernel).sample(seeds, SampleKey(6, 0, 1))
               for kernel in ("tensor", "numba")]
    for a, b in zip(*(batch.blocks for batch in batches)):
        assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indptr, b.indptr)
        assert torch.equal(a.indices, b.indices)
        assert torch.allclose(a.edge_weight, b.edge_weight, rtol=1e-6)  # float32 weights, two kernels' op order


def test_gns_samples_fewer_uncached_inputs_than_ns(computers):
    """With the input layer cache-only, a GNS batch reads fewer input nodes outside its cache than NS reads
    in all (the nodes whose features cross PCIe when the cache is on the device)."""
    seeds = seeds_of(computers, 256, seed=3)
    fanouts = [FANOUT, FANOUT]
    gns = GNSSampler(computers, fanouts, cache_fraction=0.05, cache_only_input_layer=True)
    key = SampleKey(7, 0, 0)
    inputs = gns.sample(seeds, key).input_nodes
    uncached = int((~gns.cache(key).mask[inputs]).sum())
    ns_inputs = NeighborSampler(computers, fanouts).sample(seeds, key).input_nodes.numel()
    assert uncached < 0.5 * ns_inputs, (uncached, ns_inputs)


def _without_training_nodes(graph):
    from dataclasses import replace

    return replace(graph, train_idx=torch.zeros(0, dtype=torch.int64))


def test_random_walks_need_training_nodes(computers):
    """Eq. 9 starts the walks from the training nodes V_S: a graph without any (ego-Twitter as loaded) has no
    random-walk probability, so ``auto`` and ``random_walk`` are refused instead of drawing a cache from 0/0
    (a NaN probability once made the cache nodes 0..|C|−1 and every weight NaN)."""
    bare = _without_training_nodes(computers)
    for probability in ("auto", "random_walk"):
        with pytest.raises(ValueError, match="training_nodes"):
            GNSSampler(bare, [FANOUT], cache_probability=probability)
    assert GNSSampler(bare, [FANOUT], cache_probability="degree").cache_probability == "degree"


def test_training_nodes_argument_is_v_s(computers):
    """``training_nodes`` is V_S of Eq. 9 and of the auto rule (§3.2: degree when the training nodes are the
    majority of the graph): every node given → degree; a tenth → walks from exactly those nodes, equal to
    :func:`random_walk_probability` from them; the cache and the weights are finite."""
    bare = _without_training_nodes(computers)
    everyone = GNSSampler(bare, [FANOUT], training_nodes=torch.arange(bare.num_nodes))
    assert everyone.cache_probability == "degree"
    tenth = seeds_of(bare, bare.num_nodes // 10, seed=4)
    walks = GNSSampler(bare, [FANOUT, 5], training_nodes=tenth, cache_fraction=0.01)
    assert walks.cache_probability == "random_walk"
    expected = random_walk_probability(bare, tenth, [FANOUT, 5])
    assert torch.allclose(walks.probability(), expected / expected.sum())
    key = SampleKey(8, 0, 0)
    assert bool(torch.isfinite(walks.cache(key).inclusion).all())
    batch = walks.sample(tenth[:256], key)
    assert all(bool(torch.isfinite(block.edge_weight).all()) for block in batch.blocks)


def test_cache_holds_only_nodes_the_walks_reach():
    """A node with p_v = 0 is never drawn (§3.2 samples the cache from P): when fewer than |C| nodes have
    p_v > 0 the cache holds just those, so no cached node has p^C = 0 and an infinite weight."""
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    dst = torch.tensor([1, 2, 3, 0, 5, 6, 7, 4])  # two directed 4-cycles: 0→1→2→3→0 and 4→5→6→7→4
    n = 8
    graph = Graph.from_edges(src, dst, n, symmetric=False, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.int64),
                             train_idx=torch.tensor([0]), val_idx=torch.arange(0), test_idx=torch.arange(0),
                             num_classes=1)
    sampler = GNSSampler(graph, [1], cache_fraction=0.5, cache_probability="random_walk")  # |C| = 4; P reaches 0, 3
    assert sampler.cache_size == 4
    cache = sampler.cache(SampleKey(9, 0, 0))
    assert cache.nodes.tolist() == [0, 3]
    assert bool(torch.isfinite(sampler.sample(torch.tensor([0]), SampleKey(9, 0, 0)).blocks[0].edge_weight).all())


def test_bad_arguments_are_refused(computers):
    with pytest.raises(ValueError, match="cache_fraction"):
        GNSSampler(computers, [5], cache_fraction=0)
    with pytest.raises(ValueError, match="refresh_every"):
        GNSSampler(computers, [5], refresh_every=0)
    with pytest.raises(ValueError, match="cache_probability"):
        GNSSampler(computers, [5], cache_probability="pagerank")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensor_path_on_cuda_samples_the_cpu_block(computers):
    from dataclasses import replace

    on_gpu = replace(computers, indptr=computers.indptr.cuda(), indices=computers.indices.cuda(),
                     train_idx=computers.train_idx.cuda())
    seeds = seeds_of(computers, 1024, seed=9)
    key = SampleKey(4, 0, 3)
    cpu = GNSSampler(computers, [FANOUT, FANOUT], cache_fraction=0.02, kernel="numba").sample(seeds, key)
    sampler = GNSSampler(on_gpu, [FANOUT, FANOUT], cache_fraction=0.02, kernel="tensor")
    gpu = sampler.sample(seeds.cuda(), key)
    assert sampler.cache_nodes(key).is_cuda
    for a, b in zip(cpu.blocks, gpu.blocks):
        assert torch.equal(a.src_nodes, b.src_nodes.cpu()) and torch.equal(a.indices, b.indices.cpu())
        assert torch.allclose(a.edge_weight, b.edge_weight.cpu(), rtol=1e-6)  # float32 weights, two devices' op order
