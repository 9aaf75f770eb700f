"""LABOR sampling (cooperative-minibatching paper A.1.2, A.7) on a real graph: inclusion probabilities,
unbiased weighted means, fewer sampled vertices than NS, and batch dependency κ."""

from __future__ import annotations

import math

import pytest
import torch

from betty_trainer.sampling import LaborSampler, NeighborSampler, SampleKey
from betty_trainer.sampling.labor import Variates, inclusion_probabilities, labor_block

FANOUT = 10


def dst_nodes(graph, count, seed=0):
    return torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(seed))[:count]


def bonferroni_z(tests: int, alpha: float = 1e-3) -> float:
    """|z| a standard normal exceeds with probability alpha / tests (a family-wise error of alpha)."""
    return -float(torch.special.ndtri(torch.tensor(alpha / (2 * tests), dtype=torch.float64)))


def edge_frequencies(graph, dst, iterations, repetitions):
    """How often each in-edge of ``dst`` is kept over ``repetitions`` independent variates."""
    pointer, src, p = inclusion_probabilities(graph, dst, FANOUT, iterations)
    row = torch.repeat_interleave(torch.arange(dst.numel()), pointer[1:] - pointer[:-1])
    edge_key = row * graph.num_nodes + src
    counts = torch.zeros(src.numel(), dtype=torch.float64)
    for rep in range(repetitions):
        block = labor_block(graph, dst, FANOUT, Variates(1000 + rep), iterations)
        kept = torch.repeat_interleave(torch.arange(dst.numel()), block.in_degrees()) * graph.num_nodes \
            + block.src_nodes[block.indices]
        counts[torch.searchsorted(edge_key, kept)] += 1  # edge keys ascend: CSC order, sources sorted
    return p, counts / repetitions


@pytest.mark.parametrize("iterations", [0, 1, -1], ids=["LABOR-0", "LABOR-1", "LABOR-*"])
def test_edge_inclusion_probability_is_min_one_c_pi(computers, iterations):
    """Each edge t → s is kept with probability min(1, c_s π_t) (A.1.2): the frequency over R samples is
    within a Bonferroni bound of R-sample binomial z-scores, and the z² average near 1."""
    repetitions = 200
    p, frequency = edge_frequencies(computers, dst_nodes(computers, 120), iterations, repetitions)
    certain = p >= 1
    assert bool((frequency[certain] == 1).all())  # p = 1 edges are always kept
    p, frequency = p[~certain], frequency[~certain]
    z = (frequency - p) / torch.sqrt(p * (1 - p) / repetitions)
    assert float(z.abs().max()) < bonferroni_z(p.numel()), float(z.abs().max())
    # chi-square with M degrees of freedom / M: mean 1, sd sqrt(2/M) for independent edges (the shared
    # r_t correlates edges of one source, so allow 6 sd)
    assert abs(float((z * z).mean()) - 1) < 6 * math.sqrt(2 / p.numel())


def test_importance_probabilities_differ_from_labor0(computers):
    """Guards the test above: LABOR-*'s probabilities are not LABOR-0's, and a LABOR-0 sample fails the
    LABOR-* inclusion check."""
    dst = dst_nodes(computers, 120)
    _, _, p0 = inclusion_probabilities(computers, dst, FANOUT, 0)
    p_star, frequency = edge_frequencies(computers, dst, 0, 200)
    _, _, p_star = inclusion_probabilities(computers, dst, FANOUT, -1)
    assert float((p0 - p_star).abs().max()) > 0.1  # a difference 200 repetitions resolve (sd ≤ 0.035)
    uncertain = (p_star < 1) & (p_star > 0)
    z = (frequency - p_star)[uncertain] / torch.sqrt(p_star * (1 - p_star) / 200)[uncertain]
    assert float(z.abs().max()) > bonferroni_z(int(uncertain.sum()))


def weighted_means(graph, dst, h, iterations, repetitions, weighted=True):
    """``(R, n)``: per sample, the Horvitz–Thompson mean (1/d_s) Σ_kept w_ts h_t of every dst node."""
    degree = (graph.indptr[dst + 1] - graph.indptr[dst]).double()
    out = torch.empty(repetitions, dst.numel(), dtype=torch.float64)
    for rep in range(repetitions):
        block = labor_block(graph, dst, FANOUT, Variates(5000 + rep), iterations)
        weight = block.edge_weight.double() if weighted else torch.ones(block.num_edges, dtype=torch.float64)
        sums = torch.zeros(dst.numel(), dtype=torch.float64)
        sums.index_add_(0, block.edge_dst(), weight * h[block.src_nodes[block.indices]])
        out[rep] = sums / (degree if weighted else block.in_degrees().double())
    return out


@pytest.mark.parametrize("iterations", [0, -1], ids=["LABOR-0", "LABOR-*"])
def test_weighted_mean_is_unbiased(computers, iterations):
    """The blocks' weights 1/p_ts make (1/d_s) Σ_kept w_ts h_t unbiased for the full-neighbour mean: the mean
    over R samples is within a Bonferroni bound of its standard error, for every dst node."""
    dst = dst_nodes(computers, 300, seed=1)
    h = computers.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10  # a non-constant signal
    degree = computers.indptr[dst + 1] - computers.indptr[dst]
    sampled = degree > FANOUT
    full = torch.stack([h[computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()].mean() for s in dst])
    repetitions = 250
    estimates = weighted_means(computers, dst, h, iterations, repetitions)
    error = estimates.std(0) / math.sqrt(repetitions)
    z = (estimates.mean(0) - full)[sampled] / error[sampled]
    assert float(z.abs().max()) < bonferroni_z(int(sampled.sum())), float(z.abs().max())
    whole = ~sampled & (degree > 0)
    assert torch.allclose(estimates[:, whole], full[whole].expand(repetitions, -1))  # whole rows: exact


def test_unweighted_labor_star_mean_is_biased(computers):
    """Guards the test above: without the weights, LABOR-*'s sampled mean is biased (the check fails)."""
    dst = dst_nodes(computers, 300, seed=1)
    h = computers.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10
    degree = computers.indptr[dst + 1] - computers.indptr[dst]
    sampled = degree > FANOUT
    full = torch.stack([h[computers.indices[computers.indptr[s]:computers.indptr[s + 1]].long()].mean() for s in dst])
    estimates = weighted_means(computers, dst, h, 1, 100, weighted=False)
    z = (estimates.mean(0) - full)[sampled] / (estimates.std(0)[sampled] / 10)
    assert float(z.abs().max()) > bonferroni_z(int(sampled.sum()))


def test_sampled_vertices_labor_star_below_labor0_below_ns(computers):
    """Expected sampled vertices per layer at equal fanout: LABOR-* ≤ LABOR-0 ≤ NS (cooperative paper Fig. 3),
    each gap many standard errors wide; LABOR-0's first-layer mean matches its closed form
    E|S| = |dst| + Σ_{t ∉ dst} max_s min(1, k/d_s)."""
    seeds = dst_nodes(computers, 1024, seed=2)
    fanouts = [FANOUT, FANOUT, FANOUT]
    samplers = {
        "ns": NeighborSampler(computers, fanouts),
        "labor0": LaborSampler(computers, fanouts),
        "labor*": LaborSampler(computers, fanouts, importance_iterations=-1),
    }
    repetitions = 8
    counts = {name: torch.tensor([[b.num_src for b in sampler.sample(seeds, SampleKey(7, 0, step)).blocks]
                                  for step in range(repetitions)], dtype=torch.float64)
              for name, sampler in samplers.items()}
    mean = {name: c.mean(0) for name, c in counts.items()}
    error = {name: c.std(0) / math.sqrt(repetitions) for name, c in counts.items()}
    for small, large in (("labor*", "labor0"), ("labor0", "ns")):
        gap = mean[large] - mean[small]
        assert bool((gap > 5 * torch.sqrt(error[large] ** 2 + error[small] ** 2)).all()), (small, large, gap)
    # closed form of the output layer's expectation for LABOR-0
    pointer, src, p = inclusion_probabilities(computers, seeds, FANOUT, 0)
    best = torch.zeros(computers.num_nodes, dtype=torch.float64)
    best.scatter_reduce_(0, src, p, reduce="amax")
    best[seeds] = 1.0
    expected = float(best.sum())
    # 5 standard errors of the mean; the floor of 1 node covers a standard error that rounds to 0
    assert abs(float(mean["labor0"][-1]) - expected) < 5 * max(float(error["labor0"][-1]), 1.0)


def test_kappa_inf_gives_identical_variates_and_batches(computers):
    """κ = ∞: the same r_t in every batch of the run, so the same seeds give the same batch."""
    sampler = LaborSampler(computers, [FANOUT, FANOUT], batch_dependency=math.inf)
    ids = torch.arange(computers.num_nodes)
    first = sampler.variates(SampleKey(3, 0, 0), 1).of(ids)
    assert torch.equal(first, sampler.variates(SampleKey(3, 5, 17), 1).of(ids))
    seeds = dst_nodes(computers, 256)
    a, b = sampler.sample(seeds, SampleKey(3, 0, 0)), sampler.sample(seeds, SampleKey(3, 9, 2))
    for x, y in zip(a.blocks, b.blocks):
        assert torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indices, y.indices)
    assert not torch.equal(first, sampler.variates(SampleKey(4, 0, 0), 1).of(ids))  # another run seed differs


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize("kappa", [4, 16])
def test_variates_drift_and_are_independent_after_kappa_batches(kappa):
    """A.7: within a group the variates drift (consecutive batches correlate strongly); batches κ apart at a
    group start and any batches 2κ apart are uncorrelated (|ρ| < 5/√n); every batch's r_t is U(0, 1)
    (Kolmogorov–Smirnov distance below its 0.1% critical value 1.95/√n)."""
    n = 100_000
    ids = torch.arange(n)
    sampler = LaborSampler(_tiny_graph(), [FANOUT], batch_dependency=kappa)
    steps = {0, 1, kappa // 2, kappa - 1, kappa, kappa // 2 + kappa, 2 * kappa, kappa // 2 + 2 * kappa}
    r = {step: sampler.variates(SampleKey(11, 0, step), 0).of(ids) for step in steps}
    bound = 5 / math.sqrt(n)
    assert abs(correlation(r[0], r[kappa])) < bound
    assert abs(correlation(r[0], r[2 * kappa])) < bound
    assert abs(correlation(r[kappa // 2], r[kappa // 2 + 2 * kappa])) < bound
    assert correlation(r[0], r[1]) > 0.9  # a qualitative floor: consecutive batches drift a little (measured ~1)
    assert correlation(r[kappa // 2], r[kappa // 2 + kappa]) > 0.2  # mid-group: shares z_{j+1} with the next
    grid = torch.linspace(0, 1, 1001, dtype=torch.float64)
    for step in (0, 1, kappa // 2, kappa - 1):
        empirical = torch.searchsorted(torch.sort(r[step]).values, grid).double() / n
        assert float((empirical - grid).abs().max()) < 1.95 / math.sqrt(n)


def _tiny_graph():
    from betty_trainer.data.graph import Graph

    n = 4
    return Graph.from_edges(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), n, x=torch.zeros(n, 1),
                            y=torch.zeros(n, dtype=torch.int64), train_idx=torch.arange(n),
                            val_idx=torch.arange(0), test_idx=torch.arange(0), num_classes=1)


def test_overlap_of_consecutive_batches_rises_with_kappa(computers):
    """Consecutive mini-batches (different seeds, as in an epoch) share more input nodes as κ grows
    (A.7, §4.2): mean Jaccard overlap over 6 consecutive pairs, κ = 1 < 16 < 256 < ∞."""
    order = torch.randperm(computers.num_nodes, generator=torch.Generator().manual_seed(4))
    batches = order[: 7 * 256].split(256)
    overlaps = []
    for kappa in (1, 16, 256, math.inf):
        sampler = LaborSampler(computers, [5, 5], batch_dependency=kappa, batches_per_epoch=len(batches))
        inputs = [set(sampler.sample(seeds, SampleKey(1, 0, step)).input_nodes.tolist())
                  for step, seeds in enumerate(batches)]
        overlaps.append(sum(len(a & b) / len(a | b) for a, b in zip(inputs, inputs[1:])) / (len(inputs) - 1))
    assert overlaps == sorted(overlaps) and overlaps[-1] - overlaps[0] > 0.05, overlaps


def test_layer_dependency_shares_variates_across_layers(computers):
    sampler = LaborSampler(computers, [FANOUT, FANOUT, FANOUT], layer_dependency=True)
    ids = torch.arange(1000)
    key = SampleKey(2, 1, 3)
    assert torch.equal(sampler.variates(key, 0).of(ids), sampler.variates(key, 2).of(ids))
    independent = LaborSampler(computers, [FANOUT, FANOUT, FANOUT])
    assert not torch.equal(independent.variates(key, 0).of(ids), independent.variates(key, 2).of(ids))


@pytest.mark.parametrize("iterations,kappa", [(0, 1), (0, 16), (-1, 1), (2, math.inf)])
def test_numba_and_tensor_kernels_sample_the_same_block(computers, iterations, kappa):
    seeds = dst_nodes(computers, 100, seed=5)
    batches = [LaborSampler(computers, [FANOUT, 5], importance_iterations=iterations, batch_dependency=kappa,
                            kernel=kernel).sample(seeds, SampleKey(9, 0, 5)) for kernel in ("tensor", "numba")]
    for a, b in zip(*(batch.blocks for batch in batches)):
        assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indptr, b.indptr)
        assert torch.equal(a.indices, b.indices)
        assert torch.allclose(a.edge_weight, b.edge_weight, rtol=1e-6)  # float32 weights, two kernels' op order


def test_variates_do_not_depend_on_batch_composition(computers):
    """r_t is a hash of (z, t): a seed sampled alone keeps exactly the in-edges it keeps inside a batch
    (LABOR-0: p_ts depends on s alone), whatever the other seeds and their order."""
    seeds = dst_nodes(computers, 64, seed=6)
    sampler = LaborSampler(computers, [FANOUT])
    key = SampleKey(5, 2, 8)
    batch = sampler.sample(seeds.flip(0), key).blocks[0]
    for position, seed in enumerate(seeds.flip(0)[:16].tolist()):
        alone = sampler.sample(torch.tensor([seed]), key).blocks[0]
        in_batch = batch.src_nodes[batch.indices[batch.indptr[position]:batch.indptr[position + 1]]]
        assert torch.equal(alone.src_nodes[alone.indices], in_batch)


def test_bad_arguments_are_refused(computers):
    with pytest.raises(ValueError, match="importance_iterations"):
        LaborSampler(computers, [5], importance_iterations=-2)
    with pytest.raises(ValueError, match="batch_dependency"):
        LaborSampler(computers, [5], batch_dependency=0)


def test_threaded_numba_rows_equal_the_tensor_path(computers):
    """Above 2 × 4096 dst rows the LABOR-0 kernel splits rows over threads; the block is unchanged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dst = dst_nodes(computers, 10_000, seed=8)
        a, b = (labor_block(computers, dst, FANOUT, Variates(77), 0, kernel=kernel) for kernel in ("tensor", "numba"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indptr, b.indptr)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.edge_weight, b.edge_weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("iterations,kappa", [(0, 1), (0, 16), (-1, 4)])
def test_tensor_path_on_cuda_samples_the_cpu_block(computers, iterations, kappa):
    """The tensor path on a GPU draws the same variates and keeps the same edges as the CPU kernel."""
    from dataclasses import replace

    on_gpu = replace(computers, indptr=computers.indptr.cuda(), indices=computers.indices.cuda())
    seeds = dst_nodes(computers, 1024, seed=9)
    key = SampleKey(4, 0, 3)
    cpu = LaborSampler(computers, [FANOUT, FANOUT], importance_iterations=iterations, batch_dependency=kappa,
                       kernel="numba").sample(seeds, key)
    gpu = LaborSampler(on_gpu, [FANOUT, FANOUT], importance_iterations=iterations, batch_dependency=kappa,
                       kernel="tensor").sample(seeds.cuda(), key)
    for a, b in zip(cpu.blocks, gpu.blocks):
        assert b.src_nodes.is_cuda
        assert torch.equal(a.src_nodes, b.src_nodes.cpu()) and torch.equal(a.indices, b.indices.cpu())
        assert torch.allclose(a.edge_weight, b.edge_weight.cpu(), rtol=1e-6)  # float32 weights, two devices' op order
