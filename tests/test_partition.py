"""Micro-batch slicing invariants, REG construction and redundancy (Betty §4.2.3, §4.3)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty_trainer import Block, plan_micro_batches, sample_batch
from betty_trainer.datasets import make_sbm
from betty_trainer.execution.micro_batches import MicroBatches
from estimator.counts import LayerCounts
from partition import PARTITIONERS, GraphPartition, build_reg, make_split, partition_outputs, redundancy
from partition.metis import metis_kway
from partition.reg import drop_diagonal, hub_threshold
from partition.slicing import count_layers, slice_layers
from tests.test_sampling import global_edges


def reachable_edges(batch, outputs):
    """Reference slicing by plain set traversal: per layer, the full batch's edges reachable from ``outputs``."""
    per_layer, frontier = [], set(outputs)
    for block in reversed(batch.blocks):
        kept = {(s, d) for s, d in global_edges(block) if d in frontier}
        per_layer.append(kept)
        frontier = frontier | {s for s, _ in kept}
    return per_layer[::-1]


@pytest.mark.parametrize("fanouts", [[None, None], [3, 5]])
@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_micro_batches_partition_outputs_and_hold_exactly_reachable_edges(cora, fanouts, partitioner):
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, 4, partitioner, seed=0)
    outputs = torch.cat([mb.output_nodes for mb in micro_batches])
    assert sorted(outputs.tolist()) == sorted(batch.output_nodes.tolist()), "each output in exactly one micro-batch"
    for mb in micro_batches:
        expected = reachable_edges(batch, set(mb.output_nodes.tolist()))
        for layer, block in enumerate(mb.blocks):
            assert global_edges(block) == expected[layer]
            assert block.num_edges == len(expected[layer]), "no duplicate edges"
            endpoints = {s for s, _ in expected[layer]} | set(block.dst_nodes.tolist())
            assert set(block.src_nodes.tolist()) == endpoints, "src nodes: the dst nodes and the edges' sources only"
        for lower, upper in zip(mb.blocks[:-1], mb.blocks[1:]):
            assert torch.equal(lower.dst_nodes, upper.src_nodes)


def test_reg_counts_shared_in_neighbours():
    # dst 0 <- {2, 3, 4}; dst 1 <- {3, 4}; dst 2 <- {4} (src positions; dst nodes are src 0..2)
    block = Block(torch.arange(5), 3, torch.tensor([0, 3, 5, 6]), torch.tensor([2, 3, 4, 3, 4, 4]))
    reg = build_reg(block).toarray()
    assert reg.tolist() == [[0, 2, 1], [2, 0, 1], [1, 1, 0]]
    assert build_reg(block, weighted=False).toarray().tolist() == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]


def cycle_with_weights(weights):
    """Symmetric CSR of the 4-cycle 0-1-2-3-0 with the given weights of edges 01, 12, 23, 30."""
    edges = [(0, 1), (1, 2), (2, 3), (3, 0)]
    rows = [a for a, b in edges] + [b for a, b in edges]
    cols = [b for a, b in edges] + [a for a, b in edges]
    return sp.csr_matrix((np.array(weights * 2, dtype=np.int64), (rows, cols)), shape=(4, 4))


def test_metis_refines_graphs_above_the_size_bound_less(monkeypatch):
    """METIS's default 10 refinement passes up to LARGE_GRAPH_ENTRIES stored entries, 3 above (and the two
    settings give different partitions of this graph, so the test sees which one ran)."""
    import partition.metis as metis_module

    graph = sp.random(3000, 3000, density=2e-3, format="csr", random_state=0)
    graph = ((graph + graph.T) > 0).astype(np.int64).tocsr()
    graph = drop_diagonal(graph)
    default, ten, three = (metis_kway(graph, 8, seed=0, niter=n) for n in (None, 10, 3))
    assert graph.nnz <= metis_module.LARGE_GRAPH_ENTRIES and np.array_equal(default, ten)
    assert not np.array_equal(ten, three)
    monkeypatch.setattr(metis_module, "LARGE_GRAPH_ENTRIES", graph.nnz - 1)
    assert np.array_equal(metis_kway(graph, 8, seed=0), three)


def test_metis_partitions_large_graphs_k_way_at_every_k(monkeypatch):
    """Above KWAY_ENTRIES stored entries METIS runs k-way even for k <= 8, where pymetis would bisect
    recursively; at most KWAY_ENTRIES it keeps pymetis's choice (the two give different parts here)."""
    import pymetis

    import partition.metis as metis_module

    graph = sp.random(3000, 3000, density=2e-3, format="csr", random_state=0)
    graph = drop_diagonal(((graph + graph.T) > 0).astype(np.int64).tocsr())

    def direct(recursive):
        _, parts = pymetis.part_graph(4, pymetis.CSRAdjacency(graph.indptr.astype(np.int64), graph.indices.astype(np.int64)),
                                      eweights=graph.data, options=pymetis.Options(seed=0, niter=10), recursive=recursive)
        return np.asarray(parts)

    kway, bisection = direct(False), direct(True)
    assert not np.array_equal(kway, bisection)
    assert np.array_equal(metis_kway(graph, 4, seed=0), bisection)
    monkeypatch.setattr(metis_module, "KWAY_ENTRIES", graph.nnz - 1)
    assert np.array_equal(metis_kway(graph, 4, seed=0), kway)


def test_metis_uses_edge_weights():
    """On a 4-cycle both 2-2 cuts cut two edges; only the weights decide which pair stays together."""
    parts = metis_kway(cycle_with_weights([100, 1, 100, 1]), 2, seed=0)
    assert parts[0] == parts[1] and parts[2] == parts[3] and parts[0] != parts[2]
    parts = metis_kway(cycle_with_weights([1, 100, 1, 100]), 2, seed=0)
    assert parts[1] == parts[2] and parts[3] == parts[0] and parts[0] != parts[1]


@pytest.mark.parametrize("dataset", ["cora", "citeseer"])
def test_reg_has_lowest_input_redundancy_at_k8(dataset, request):
    graph = request.getfixturevalue(dataset)
    batch = sample_batch(graph, graph.train_idx, [None, None])
    input_redundancy = {}
    for name in ("reg", "range", "random"):
        micro_batches = plan_micro_batches(batch, 8, name, seed=0)
        input_redundancy[name] = redundancy(batch.blocks, [mb.blocks for mb in micro_batches])[0]
    assert input_redundancy["reg"] < input_redundancy["range"]
    assert input_redundancy["reg"] < input_redundancy["random"]


def test_redundancy_is_one_for_a_single_micro_batch(cora):
    batch = sample_batch(cora, cora.train_idx, [None, None])
    assert redundancy(batch.blocks, [batch.blocks]) == [1.0, 1.0]


def test_partitions_are_deterministic_and_balanced(cora):
    batch = sample_batch(cora, cora.train_idx, [None, None])
    for name in PARTITIONERS:
        one = partition_outputs(batch.blocks[-1], 4, name, seed=7)
        two = partition_outputs(batch.blocks[-1], 4, name, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(one, two))
        sizes = [g.numel() for g in one]
        # the partitioners balance only up to a tolerance (METIS's imbalance factor): 10% over the mean, +1 for rounding
        assert max(sizes) <= 1.1 * 140 / 4 + 1, (name, sizes)


def test_bad_partition_requests(cora):
    batch = sample_batch(cora, cora.train_idx[:3], [None, None])
    with pytest.raises(ValueError, match="unknown partitioner"):
        partition_outputs(batch.blocks[-1], 2, "spectral")
    with pytest.raises(ValueError, match="cannot split 3 output nodes into 4"):
        partition_outputs(batch.blocks[-1], 4, "reg")


def random_block(num_dst, num_src, num_edges, hubs=(), hub_readers=0, seed=0):
    """A block with random in-edges (distinct per dst), plus ``hubs`` (src positions) each read by
    ``hub_readers`` random outputs."""
    rng = np.random.default_rng(seed)
    adjacency = np.zeros((num_dst, num_src), dtype=bool)
    adjacency[rng.integers(0, num_dst, num_edges), rng.integers(0, num_src, num_edges)] = True
    for hub in hubs:
        adjacency[rng.choice(num_dst, hub_readers, replace=False), hub] = True
    csr = sp.csr_matrix(adjacency)
    block = Block(torch.arange(num_src), num_dst, torch.from_numpy(csr.indptr.astype(np.int64)),
                  torch.from_numpy(csr.indices.astype(np.int64)))
    return block, adjacency.astype(np.int64)


def brute_force_reg(adjacency):
    """``C = AᵀA`` without diagonal from the dense ``(num_dst, num_src)`` adjacency ``Aᵀ``."""
    c = adjacency @ adjacency.T
    np.fill_diagonal(c, 0)
    return c


@pytest.mark.parametrize("seed", range(4))
def test_reg_equals_brute_force_product_without_diagonal(seed):
    block, adjacency = random_block(40, 70, 300, seed=seed)
    expected = brute_force_reg(adjacency)
    reg = build_reg(block)
    assert reg.dtype == np.int64 and reg.has_sorted_indices and (reg.data > 0).all()
    assert np.array_equal(reg.toarray(), expected)
    assert np.array_equal(build_reg(block, clip_hubs=False).toarray(), expected)
    assert np.array_equal(build_reg(block, weighted=False).toarray(), (expected > 0).astype(np.int64))
    readers = adjacency.sum(axis=0)
    weights = np.maximum(1, np.rint(64 / np.maximum(readers - 1, 1))).astype(np.int64)
    inverse = (adjacency * weights) @ adjacency.T
    np.fill_diagonal(inverse, 0)
    assert np.array_equal(build_reg(block, inverse_degree=True).toarray(), inverse), "C = Aᵀ diag(w) A, w ≈ 64/(d − 1)"


def test_drop_diagonal_equals_setdiag_and_keeps_missing_diagonal_missing():
    rng = np.random.default_rng(0)
    matrix = sp.random(50, 50, density=0.2, format="csr", random_state=1, dtype=np.float64)
    matrix.data[rng.random(matrix.nnz) < 0.1] = 0  # explicit zeros go too
    expected = matrix.copy()
    expected.setdiag(0)
    expected.eliminate_zeros()
    result = drop_diagonal(matrix)
    assert np.array_equal(result.toarray(), expected.toarray()) and result.nnz == expected.nnz
    assert (result.diagonal() == 0).all() and (result.data != 0).all()


def test_hub_clipping_keeps_every_non_hub_pair_exact():
    hubs = [0, 1, 2]
    block, adjacency = random_block(60, 90, 250, hubs=hubs, hub_readers=45, seed=3)
    readers = adjacency.sum(axis=0)
    threshold = int(np.sort(readers)[-4])  # the three most-read src nodes are hubs
    assert set(np.flatnonzero(readers > threshold)) == set(hubs)
    clipped = build_reg(block, max_hub_degree=threshold).toarray()
    full = brute_force_reg(adjacency)
    shares_a_hub = (adjacency[:, hubs] @ adjacency[:, hubs].T) > 0
    assert np.array_equal(clipped[~shares_a_hub], full[~shares_a_hub]), "pairs that share no hub keep their weight"
    kept = adjacency.copy()
    kept[:, hubs] = 0
    assert np.array_equal(clipped, brute_force_reg(kept)), "a clipped pair counts its shared non-hub neighbours"
    assert shares_a_hub.sum() > 0 and (clipped != full).any(), "the hubs did change some pairs"
    weights = np.maximum(1, np.rint(64 / np.maximum(readers - 1, 1))).astype(np.int64)
    weights[hubs] = 0
    inverse = (adjacency * weights) @ adjacency.T
    np.fill_diagonal(inverse, 0)
    assert np.array_equal(build_reg(block, max_hub_degree=threshold, inverse_degree=True).toarray(), inverse)


def test_hub_threshold_keeps_the_least_read_nodes_within_the_pair_bound():
    readers = np.array([1, 1, 2, 3, 3, 5, 9, 9, 40, 300])
    pairs = lambda t: int((readers[readers <= t] * (readers[readers <= t] - 1)).sum())
    assert hub_threshold(readers, 10**9, min_degree=1) == 300, "nothing clipped when every pair fits"
    assert hub_threshold(readers, 200, min_degree=1) == 9 and pairs(9) <= 200 < pairs(40)
    assert hub_threshold(readers, 150, min_degree=1) == 5 and pairs(5) + 72 <= 150 < pairs(9), \
        "one 9-reader node would fit, but the class is clipped whole"
    assert hub_threshold(readers, 0, min_degree=4) == 4, "nodes read by at most min_degree outputs stay"
    assert hub_threshold(readers, 30, min_degree=3) == 3, "their pairs (14) count against the bound: 14 + 20 > 30"


@pytest.mark.parametrize("search", ["linear", "gallop"])
def test_reg_is_built_once_per_batch_across_the_k_search(cora, monkeypatch, search):
    import partition.partitioners as partitioners_module

    builds = []

    def counting_build_reg(block, *args, **kwargs):
        builds.append(block)
        return build_reg(block, *args, **kwargs)

    monkeypatch.setattr(partitioners_module, "build_reg", counting_build_reg)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    estimate = lambda blocks, accumulate: 1000 + 10 * blocks[0].num_src
    full = estimate(batch.blocks, False)
    plan = make_split(batch.blocks, estimate, budget=1000 + (full - 1000) // 6, partitioner="reg", search=search)
    assert len(plan.tried) >= 3, plan.tried
    assert len(builds) == 1, "one REG for every K tried"


def smallest_k_by_brute_force(blocks, estimate, budget, partitioner):
    return next(k for k in range(1, blocks[-1].num_dst + 1)
                if max(make_split(blocks, estimate, k=k, partitioner=partitioner).estimates) <= budget)


def assert_logarithmic_search(plan):
    tried = [k for k, _ in plan.tried]
    assert len(tried) == len(set(tried)), "no K partitioned twice"
    span = plan.k - tried[0] + 1
    assert len(tried) <= 2 * span.bit_length() + 1, (tried, "logarithmic in the distance searched")


@pytest.mark.parametrize("per_micro_batch_bytes", [40_500, 41_000, 42_000, 47_000])
def test_galloping_and_bisection_find_the_brute_force_k_when_fitting_is_monotone(cora, per_micro_batch_bytes):
    """Range parts differ by at most one output, so the largest shrinks with K: "fits" is monotone in K.
    A fixed cost per micro-batch (40 kB) makes the lower bound K₀ loose, so the search gallops far."""
    batch = sample_batch(cora, cora.train_idx, [None, None])
    estimate = lambda blocks, accumulate: 10_000 + 40_000 + 100 * blocks[-1].num_dst
    budget = 10_000 + per_micro_batch_bytes
    plan = make_split(batch.blocks, estimate, budget=budget, partitioner="range", search="gallop")
    assert plan.k == smallest_k_by_brute_force(batch.blocks, estimate, budget, "range")
    assert plan.k == make_split(batch.blocks, estimate, budget=budget, partitioner="range").k, "linear search agrees"
    assert plan.k - plan.tried[0][0] >= 5 or per_micro_batch_bytes == 47_000
    assert_logarithmic_search(plan)


@pytest.mark.parametrize("divisor", [1.5, 3, 7])
def test_galloping_and_bisection_find_the_brute_force_k_with_reg(cora, divisor):
    """With METIS parts "fits" is monotone in K only up to METIS's balance tolerance; at these budgets
    (micro-batches of tens of outputs) the search finds brute force's K."""
    batch = sample_batch(cora, cora.train_idx, [10, 10], torch.Generator().manual_seed(0))
    estimate = lambda blocks, accumulate: 10_000 + 100 * blocks[0].num_src + 3 * blocks[-1].num_dst
    budget = int(10_000 + (estimate(batch.blocks, False) - 10_000) / divisor)
    plan = make_split(batch.blocks, estimate, budget=budget, partitioner="reg", search="gallop")
    assert plan.k == smallest_k_by_brute_force(batch.blocks, estimate, budget, "reg")
    assert max(plan.estimates) <= budget
    assert_logarithmic_search(plan)


def test_linear_search_finds_the_smallest_k_where_fitting_is_not_monotone(cora):
    """Micro-batches of a few outputs each: "fits" flips with K; only the linear search is exact."""
    batch = sample_batch(cora, cora.train_idx, [10, 10], torch.Generator().manual_seed(0))
    estimate = lambda blocks, accumulate: 10_000 + 100 * blocks[0].num_src + 3 * blocks[-1].num_dst
    budget = int(10_000 + (estimate(batch.blocks, False) - 10_000) / 15)
    plan = make_split(batch.blocks, estimate, budget=budget)
    assert plan.k == smallest_k_by_brute_force(batch.blocks, estimate, budget, "reg")
    assert all(largest > budget for _, largest in plan.tried[:-1])
    fits = [max(make_split(batch.blocks, estimate, k=k).estimates) <= budget for k in range(plan.k, plan.k + 8)]
    assert fits[0] and not all(fits), f"not monotone: some K above the smallest does not fit ({fits})"
    assert make_split(batch.blocks, estimate, budget=budget, search="gallop").k >= plan.k


def sliced_sizes(blocks, group) -> list[tuple]:
    """Per layer, the counts the estimator reads of ``group``'s slices: src, dst and edge counts, degree histogram."""
    return [(c.num_src, c.num_dst, c.num_edges, c.degree_histogram)
            for c in (LayerCounts.from_csc(layer.indptr, layer.num_src) for layer in slice_layers(blocks, group))]


@pytest.mark.parametrize("fanouts", [[None, None], [5, 10]])
def test_a_split_keeps_the_sizes_its_micro_batches_are_sliced_to(cora, fanouts):
    """A split keeps each micro-batch's outputs and its layers' sizes, not its slices: slicing a group again gives
    those sizes, the degree histogram the estimate reads included (counted, not sliced, for K > 1; made without an
    estimate, counted when first read, not while planning). At K = 1 the micro-batch is the batch itself, which is
    what slicing every output gives on sampled blocks (every src node beyond the dst nodes is touched by an edge)."""
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(0))
    for k in (1, 4):
        split = make_split(batch.blocks, k=k, partitioner="reg")
        assert split.counted is None and split.stage_seconds["counting"] == 0
        assert len(split.groups) == len(split.sizes) == k and split.counted is split.sizes
        for group, sizes in zip(split.groups, split.sizes):
            expected = sliced_sizes(batch.blocks, group)
            assert [(s.num_src, s.num_dst, s.num_edges) for s in sizes] == [e[:3] for e in expected]
            if k > 1:
                assert [s.degree_histogram for s in sizes] == [e[3] for e in expected]
    assert MicroBatches(batch, split.groups)[0] is not batch
    assert MicroBatches(batch, make_split(batch.blocks, k=1).groups)[0] is batch


@pytest.mark.parametrize("k", [1, 5, 64, 65, 150])
def test_counting_every_group_at_once_equals_slicing_each(k):
    """``count_layers`` gives, for every group at once, the counts and degree histogram of slicing that group (one
    and several uint64 words of group bits: K = 64, 65, 150), on overlapping receptive fields of a sampled
    3-layer batch whose groups are random and uneven."""
    graph = make_sbm(num_nodes=3000, train_per_class=100, num_val=100, num_test=100)
    batch = sample_batch(graph, graph.train_idx, [3, 5, 10], torch.Generator().manual_seed(1))
    n, generator = batch.output_nodes.numel(), torch.Generator().manual_seed(k)
    cuts = torch.sort(torch.randperm(n - 1, generator=generator)[: k - 1] + 1).values  # uneven group sizes
    groups = [part.sort().values for part in torch.randperm(n, generator=generator).tensor_split(cuts)]
    counted = count_layers(batch.blocks, groups)
    assert [[(s.num_src, s.num_dst, s.num_edges, s.degree_histogram) for s in sizes] for sizes in counted] == \
        [sliced_sizes(batch.blocks, group) for group in groups]
    with pytest.raises(ValueError, match="out of range"):
        count_layers(batch.blocks, [torch.tensor([batch.output_nodes.numel()])])


def assert_same_slices(left, right):
    assert len(left) == len(right)
    for one, two in zip(left, right):
        assert one.num_dst == two.num_dst
        for name in ("src_index", "indptr", "indices", "edge_ids"):
            a, b = getattr(one, name), getattr(two, name)
            dtype = torch.int32 if name == "indices" else torch.int64  # local positions are int32
            assert a.dtype == b.dtype == dtype and torch.equal(a, b), name


def slice_with(slice_block, blocks, outputs):
    """:func:`slice_layers` with a given per-block kernel (output layer to input layer)."""
    layers, dst = [], outputs
    for block in reversed(blocks):
        layers.append(slice_block(block, dst))
        dst = layers[-1].src_index
    return layers[::-1]


@pytest.mark.parametrize("fanouts", [[None, None], [3, 5], [2, 4, 6]])
def test_compiled_slicing_equals_tensor_slicing(cora, fanouts):
    """The CPU kernel and the tensor ops (the GPU path) give the same slices, tensor for tensor, and
    ``slice_layers`` on CPU tensors is the kernel's (the first test checks its edges by set traversal)."""
    from partition.slicing import slice_block_compiled, slice_block_tensors

    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(0))
    groups = partition_outputs(batch.blocks[-1], 5, "random", seed=1)
    # one or two outputs: few touched src nodes, which the kernel sorts; every output: it scans the block's
    groups += [torch.tensor([0]), torch.tensor([3, 17]), torch.arange(batch.blocks[-1].num_dst),
               torch.zeros(0, dtype=torch.int64)]
    for group in groups:
        compiled = slice_with(slice_block_compiled, batch.blocks, group)
        assert_same_slices(compiled, slice_with(slice_block_tensors, batch.blocks, group))
        assert_same_slices(compiled, slice_layers(batch.blocks, group))


def copies_of_a_ring(copies: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSC of ``copies`` disjoint directed rings of ``size`` nodes (copy ``c``: nodes ``c·size …``), each node's one
    in-edge from the node before it."""
    nodes = torch.arange(copies * size)
    sources = nodes - nodes % size + (nodes % size - 1) % size
    return torch.arange(copies * size + 1), sources


def test_a_part_s_halves_nest_in_it_and_cut_its_own_edges(monkeypatch):
    """GraphPartition.halves bisects one part's nodes on the edges among them: two disjoint rings in one part are
    cut apart exactly (no edge between them), a part of four rings into two pairs of whole rings; nodes of parts not
    asked for stay -1; each part is bisected once; GraphSplitter.halves cuts a group of one part's outputs by it
    (sorted positions that partition it) and refuses a group spanning two parts."""
    bisected = []
    bisect = GraphPartition._bisect
    monkeypatch.setattr(GraphPartition, "_bisect", lambda self, nodes, seed: bisected.append(nodes.size) or
                        bisect(self, nodes, seed))
    indptr, indices = copies_of_a_ring(2, 50)
    one_part = GraphPartition(indptr, indices)
    halves = one_part.halves(1, 0, 0)  # the whole graph
    assert sorted(halves[:50].tolist()) == [halves[0]] * 50 and sorted(halves[50:].tolist()) == [halves[50]] * 50
    assert halves[0] != halves[50]

    indptr, indices = copies_of_a_ring(8, 40)
    graph = GraphPartition(indptr, indices)
    parts = graph.parts(2)
    rings = parts.reshape(8, 40)
    assert (rings == rings[:, :1]).all() and np.bincount(rings[:, 0]).tolist() == [4, 4]  # whole rings per part
    halves = graph.halves(2, 0, 1)
    assert halves is graph.halves(2, 0, 1) and bisected == [100, 160]  # each part once
    assert (halves[parts == 0] == -1).all()
    ring_halves = halves.reshape(8, 40)[rings[:, 0] == 1]
    assert (ring_halves == ring_halves[:, :1]).all() and sorted(np.bincount(ring_halves[:, 0]).tolist()) == [2, 2]
    with pytest.raises(ValueError, match="not one of the 2 parts"):
        graph.halves(2, 0, 2)

    outputs = torch.tensor([5, 45, 85, 125, 165, 205, 245, 285])  # one node of each ring
    splitter = graph.splitter(outputs)
    group = next(g for g in splitter.split(2) if parts[outputs[g[0]]] == 1)
    pieces = splitter.halves(2, 0, group)
    assert len(pieces) == 2 and torch.equal(torch.sort(torch.cat(pieces)).values, group)
    assert all(torch.equal(piece, torch.sort(piece).values) for piece in pieces)
    assert [set(halves[outputs[piece].numpy()].tolist()) for piece in pieces] in ([{0}, {1}], [{1}, {0}])
    with pytest.raises(ValueError, match="one part"):
        splitter.halves(2, 0, torch.arange(8))


def test_a_graph_partition_is_made_once_per_k_and_splits_any_batch_by_its_nodes_parts(cora):
    """The run's graph partition: METIS once per (K, seed), each part table kept; a batch's outputs are grouped by
    their nodes' parts (a partition of the outputs), the training nodes balanced across parts; the K search takes
    it as its splitter, and refuses it for another batch's outputs."""
    balanced = torch.zeros(cora.num_nodes, dtype=torch.bool)
    balanced[cora.train_idx] = True
    graph = GraphPartition(cora.indptr, cora.indices, balanced)
    assert (graph.graph != graph.graph.T).nnz == 0 and graph.graph.diagonal().sum() == 0
    parts = graph.parts(4, seed=1)
    assert parts is graph.parts(4, seed=1) and parts.shape == (cora.num_nodes,)
    per_part = np.bincount(parts[cora.train_idx.numpy()], minlength=4)
    assert per_part.max() <= 1.1 * cora.train_idx.numel() / 4, per_part  # METIS's imbalance tolerance, ~3%
    batch = sample_batch(cora, cora.train_idx, [5, 10], torch.Generator().manual_seed(0))
    groups = graph.splitter(batch.output_nodes).split(4, seed=1)
    assert torch.equal(torch.sort(torch.cat(groups)).values, torch.arange(batch.output_nodes.numel()))
    for group in groups:
        assert len(set(parts[batch.output_nodes[group].numpy()].tolist())) == 1
    split = make_split(batch.blocks, k=4, partitioner="graph", seed=1, splitter=graph.splitter(batch.output_nodes))
    assert [g.tolist() for g in split.groups] == [g.tolist() for g in groups]
    with pytest.raises(ValueError, match="another output block"):
        make_split(batch.blocks, k=4, partitioner="graph", splitter=graph.splitter(batch.output_nodes[:-1]))
    with pytest.raises(ValueError, match="cannot split"):
        graph.splitter(batch.output_nodes).split(batch.output_nodes.numel() + 1)
