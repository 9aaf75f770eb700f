"""Sampling at scale: O(sampled edges) kernels, keyed randomness, O(batch) relabelling (issue 7 › Build 2).

Both kernels (numba on CPU, tensor ops for any device) are checked for the sampling
law and must return the identical sample; relabelling is checked against a
reference and shown not to allocate anything sized by the id space.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from betty_trainer import Graph, sample_batch
from betty_trainer.errors import DatasetError
from betty_trainer.sampling.neighbor import (
    NeighborSampler,
    SampleKey,
    _relabel,
    floyd_offsets,
    sample_block,
)
from partition.slicing import relabel_dst_first

KERNELS = ["numba", "tensor"]


def csc_graph(degrees, num_nodes=None, seed=0) -> Graph:
    """Node ``v`` has in-degree ``degrees[v]``; sources distinct, sorted, uniform over the nodes."""
    rng = np.random.default_rng(seed)
    degrees = np.asarray(degrees, dtype=np.int64)
    n = num_nodes or len(degrees)
    rows = [np.sort(rng.choice(n, size=d, replace=False)) for d in degrees]
    indptr = np.zeros(n + 1, dtype=np.int64)
    indptr[1 : len(degrees) + 1] = np.cumsum(degrees)
    indptr[len(degrees) + 1 :] = indptr[len(degrees)]
    indices = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return Graph(torch.from_numpy(indptr), torch.from_numpy(indices), torch.zeros(n, 1), torch.zeros(n, dtype=torch.long),
                 torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), 1)


def rows_of(block):
    """Global source ids kept for each dst node, in block (CSC) order."""
    src = block.src_nodes[block.indices]
    return [src[block.indptr[d]:block.indptr[d + 1]].tolist() for d in range(block.num_dst)]


def assert_same_block(one, two):
    assert torch.equal(one.src_nodes, two.src_nodes)
    assert torch.equal(one.indptr, two.indptr)
    assert torch.equal(one.indices, two.indices)
    for tensor in (one.src_nodes, one.indptr):
        assert tensor.dtype == torch.int64
    assert one.indices.dtype == two.indices.dtype == torch.int32  # local positions


@pytest.fixture(scope="module")
def mixed():
    """Degrees from 0 to 300 (several rows of each kind: below, at and above the fanouts)."""
    degrees = [0, 1, 2, 3, 5, 9, 10, 11, 12, 25, 60, 150, 300] * 8
    return csc_graph(degrees, num_nodes=400)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fanout", [1, 3, 10])
def test_sample_is_distinct_true_neighbours_in_csc_order(mixed, kernel, fanout):
    dst = torch.arange(len([0, 1, 2, 3, 5, 9, 10, 11, 12, 25, 60, 150, 300] * 8))
    block = sample_block(mixed, dst, fanout, key=12345, kernel=kernel)
    degree = mixed.in_degrees()[dst]
    assert torch.equal(block.src_nodes[: dst.numel()], dst)
    assert torch.equal(block.in_degrees(), torch.clamp(degree, max=fanout)), "exactly k per row of degree > k"
    for v, kept in zip(dst.tolist(), rows_of(block)):
        true = mixed.indices[mixed.indptr[v]:mixed.indptr[v + 1]].tolist()
        assert kept == sorted(set(kept)), "distinct and in CSC (ascending source) order"
        assert set(kept) <= set(true)
        if len(true) <= fanout:
            assert kept == true, "rows of degree ≤ k keep every in-edge"
    extra = block.src_nodes[dst.numel():]
    assert torch.equal(extra, torch.sort(extra).values) and torch.isin(extra, dst).logical_not().all()


@pytest.mark.parametrize("fanouts", [[3, 10], [None, 4], [None, None], [1, 1, 2]])
def test_numba_and_tensor_kernels_give_the_same_sample(mixed, fanouts):
    seeds = torch.tensor([5, 200, 11, 90, 13, 77, 3])
    for seed in range(3):
        key = SampleKey(seed, epoch=1, step=seed)
        one = NeighborSampler(mixed, fanouts, kernel="numba").sample(seeds, key)
        two = NeighborSampler(mixed, fanouts, kernel="tensor").sample(seeds, key)
        for a, b in zip(one.blocks, two.blocks):
            assert_same_block(a, b)


def test_floyd_gives_every_subset_with_equal_probability():
    """d = 6, k = 3: the 20 subsets of offsets, one draw per row over 40,000 rows (node ids as counters)."""
    rows, d, k = 40_000, 6, 3
    offsets = floyd_offsets(torch.arange(rows), torch.full((rows,), d), [0x1234, 0xBEEF, 0x5EED])
    assert (offsets[:, 1:] > offsets[:, :-1]).all() and offsets.min() >= 0 and offsets.max() < d
    counts = Counter(map(tuple, offsets.tolist()))
    assert set(counts) == set(combinations(range(d), k))
    p = 1 / math.comb(d, k)
    sigma = math.sqrt(rows * p * (1 - p))
    # 5 sigma per subset: with 20 subsets a false failure has probability < 1e-4
    assert max(abs(c - rows * p) for c in counts.values()) <= 5 * sigma, counts


@pytest.mark.parametrize("kernel", KERNELS)
def test_per_edge_inclusion_probability_is_k_over_degree(kernel):
    """Each in-edge of a dst of degree d is kept with probability k/d (GraphSAGE NS).

    2,000 rows of each degree, all reading sources 0 … d − 1 (so a kept source is
    its offset), sampled under 5 keys: 10,000 trials per edge."""
    degrees, rows, k, keys = [11, 17, 40, 101], 2_000, 10, 5
    per_row = np.repeat(degrees, rows)
    indptr = np.zeros(per_row.size + 1, dtype=np.int64)
    np.cumsum(per_row, out=indptr[1:])
    indices = np.concatenate([np.arange(d) for d in per_row])
    n = per_row.size
    graph = Graph(torch.from_numpy(indptr), torch.from_numpy(indices), torch.zeros(n, 1), torch.zeros(n, dtype=torch.long),
                  torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), 1)
    group = torch.repeat_interleave(torch.arange(len(degrees)), rows)
    counts = torch.zeros(len(degrees), max(degrees))
    for trial in range(keys):
        block = sample_block(graph, torch.arange(n), k, key=SampleKey(trial).layer_key(0), kernel=kernel)
        offset = block.src_nodes[block.indices]
        flat = group[block.edge_dst()] * max(degrees) + offset
        counts += torch.bincount(flat, minlength=counts.numel()).view_as(counts)
    trials = rows * keys
    for g, d in enumerate(degrees):
        p = k / d
        observed = counts[g, :d] / trials
        sigma = math.sqrt(p * (1 - p) / trials)
        # 5 sigma per edge over 169 edges: a false failure has probability < 1e-4
        assert (observed - p).abs().max() <= 5 * sigma, (d, observed, p)
        assert counts[g, d:].sum() == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_sample_of_a_node_does_not_depend_on_the_rest_of_the_batch(mixed, kernel):
    key = SampleKey(7, epoch=2, step=5)
    sampler = NeighborSampler(mixed, [3, 4], kernel=kernel)
    one = sampler.sample(torch.tensor([11, 12, 24, 50]), key)
    two = sampler.sample(torch.tensor([90, 50, 77, 11, 3, 63]), key)
    for block_one, block_two in zip(one.blocks, two.blocks):
        rows_one = dict(zip(block_one.dst_nodes.tolist(), rows_of(block_one)))
        rows_two = dict(zip(block_two.dst_nodes.tolist(), rows_of(block_two)))
        shared = set(rows_one) & set(rows_two)
        assert len(shared) >= 2
        for v in shared:
            assert rows_one[v] == rows_two[v], v
    other_step = sampler.sample(torch.tensor([11, 12, 24, 50]), SampleKey(7, epoch=2, step=6))
    assert any(rows_of(a) != rows_of(b) for a, b in zip(one.blocks, other_step.blocks)), "the key matters"


def test_generator_api_is_a_keyed_sample(cora):
    """sample_batch(..., generator) draws one key from the generator: same state, same batch."""
    state = torch.Generator().manual_seed(3)
    key = SampleKey.draw(torch.Generator().manual_seed(3))
    one = sample_batch(cora, cora.train_idx, [4, 4], state)
    two = sample_batch(cora, cora.train_idx, [4, 4], key=key)
    three = NeighborSampler(cora, [4, 4]).sample(cora.train_idx, key)
    for a, b, c in zip(one.blocks, two.blocks, three.blocks):
        assert_same_block(a, b)
        assert_same_block(a, c)
    full = NeighborSampler(cora, [None, -1]).sample(cora.train_idx, key)
    for a, b in zip(full.blocks, sample_batch(cora, cora.train_idx, [None, None]).blocks):
        assert_same_block(a, b)


@pytest.fixture(scope="module")
def hubs():
    """2,000 nodes of in-degree 20, then 100 hubs of in-degree 10⁵ (all sources 0 … 10⁵ − 1)."""
    plain, count, hub_degree = 2_000, 100, 100_000
    num_nodes = hub_degree + 1
    rng = np.random.default_rng(0)
    plain_rows = np.sort(rng.integers(0, num_nodes - 20, size=(plain, 20)), axis=1) + np.arange(20)
    indices = np.concatenate([plain_rows.ravel(), np.tile(np.arange(hub_degree), count)]).astype(np.int32)
    degrees = np.zeros(num_nodes, dtype=np.int64)
    degrees[:plain] = 20
    degrees[plain:plain + count] = hub_degree
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    graph = Graph(torch.from_numpy(indptr), torch.from_numpy(indices), torch.zeros(num_nodes, 1),
                  torch.zeros(num_nodes, dtype=torch.long), torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), 1)
    return graph, torch.arange(plain, plain + count)


def test_hubs_give_exactly_k_each_and_both_kernels_agree(hubs):
    graph, hub_ids = hubs
    dst = torch.cat([hub_ids, torch.arange(924)])  # 1024 seeds, 100 of them hubs
    one = sample_block(graph, dst, 10, key=99, kernel="numba")
    two = sample_block(graph, dst, 10, key=99, kernel="tensor")
    assert_same_block(one, two)
    assert torch.equal(one.in_degrees(), torch.full((1024,), 10))
    kept = rows_of(one)
    for row in kept[:100]:
        assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < 100_000
    assert len({tuple(row) for row in kept[:100]}) == 100, "each hub draws its own sample"


def test_tensor_sampling_allocates_nothing_sized_by_the_graph():
    """1M nodes, 100 dst: every allocation made while sampling is far below 8·N bytes."""
    n = 1_000_000
    indptr = torch.arange(n + 1, dtype=torch.int64) * 3
    indices = (torch.arange(3 * n, dtype=torch.int64) * 7919) % n
    indices = indices.view(n, 3).sort(1).values.flatten()
    graph = Graph(indptr, indices, torch.zeros(n, 1), torch.zeros(n, dtype=torch.long),
                  torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), 1)
    dst = torch.arange(0, n, n // 100)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        block = sample_block(graph, dst, 2, key=5, kernel="tensor")
    allocated = sum(max(event.cpu_memory_usage, 0) for event in prof.events())
    assert block.num_edges == 200
    assert allocated < 8 * n // 16, allocated  # (nested events count twice) vs 8·N = 8 MB for one N-sized int64


def reference_relabel(dst, touched):
    extra = sorted(set(touched.tolist()) - set(dst.tolist()))
    ids = dst.tolist() + extra
    position = {v: i for i, v in enumerate(ids)}
    return ids, [position[v] for v in touched.tolist()]


@pytest.mark.parametrize("method", ["unique", "numba", "dense"])
def test_relabel_puts_dst_first_then_ascending(method):
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        space = 50 if trial % 2 else 5_000
        dst = torch.randperm(space, generator=generator)[: 1 + trial]
        touched = torch.randint(0, space, (3 * trial + 1,), generator=generator)
        if method == "unique":
            ids, local = relabel_dst_first(dst, touched)
        elif method == "dense":
            ids, local = relabel_dst_first(dst, touched, space)
        else:
            ids, local = (torch.from_numpy(a) for a in _relabel(dst.numpy(), touched.numpy()))
        expected_ids, expected_local = reference_relabel(dst, touched)
        assert ids.tolist() == expected_ids and local.tolist() == expected_local


def test_relabel_of_huge_ids_allocates_nothing_sized_by_the_id_space():
    """Ids near 2⁴⁰ (a dense scratch would need 8 TB) and N = 5·10⁷ under the profiler."""
    dst = torch.tensor([2**40 + 5, 3, 2**39])
    touched = torch.tensor([2**40 + 9, 3, 2**40 + 5, 17, 2**40 + 9, 2**39 + 1])
    expected = reference_relabel(dst, touched)
    for ids, local in (relabel_dst_first(dst, touched), _relabel(dst.numpy(), touched.numpy())):
        assert (list(map(int, ids)), list(map(int, local))) == expected
    dst, touched = torch.tensor([49_999_999, 3, 7_000_000]), torch.tensor([5, 3, 49_999_999, 12_345_678, 5])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ids, local = relabel_dst_first(dst, touched)
    assert sum(max(event.cpu_memory_usage, 0) for event in prof.events()) < 16 * 1024
    assert (ids.tolist(), local.tolist()) == reference_relabel(dst, touched)


def test_tensor_kernel_creates_no_tensor_on_the_default_device(mixed):
    """Under a ``meta`` default device any factory call without ``device=`` would make a meta tensor
    that breaks the arithmetic or the result; the sample must come out on the inputs' device, unchanged."""
    dst = torch.tensor([12, 11, 25, 0, 50])
    expected = sample_block(mixed, dst, 3, key=4, kernel="tensor")
    with torch.device("meta"):
        block = sample_block(mixed, dst, 3, key=4, kernel="tensor")
        full = sample_block(mixed, dst, None, kernel="tensor")
    assert block.src_nodes.device.type == "cpu" and full.indices.device.type == "cpu"
    assert_same_block(block, expected)
    assert_same_block(full, sample_block(mixed, dst, None, kernel="numba"))


def test_graph_stores_int32_indices_and_checks_dtypes():
    src, dst = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0])
    fields = {"x": torch.zeros(3, 1), "y": torch.zeros(3, dtype=torch.long), "train_idx": torch.tensor([0]),
                  "val_idx": torch.tensor([1]), "test_idx": torch.tensor([2]), "num_classes": 1}
    graph = Graph.from_edges(src, dst, 3, **fields)
    assert graph.indices.dtype == torch.int32 and graph.indptr.dtype == torch.int64
    block = sample_block(graph, torch.tensor([0, 2]), None)
    assert block.src_nodes.dtype == torch.int64 and block.indices.dtype == torch.int32
    with pytest.raises(DatasetError, match="indices int32 or int64"):
        Graph(graph.indptr, graph.indices.float(), **fields)


def test_numba_kernel_split_over_threads_gives_the_same_sample():
    """Enough rows that the CPU kernel splits them over threads: still the tensor path's sample."""
    n, degree = 30_000, 15
    indptr = torch.arange(n + 1, dtype=torch.int64) * degree
    indices = ((torch.arange(n)[:, None] * 31 + torch.arange(degree)) % n).sort(1).values.flatten()
    graph = Graph(indptr, indices, torch.zeros(n, 1), torch.zeros(n, dtype=torch.long),
                  torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), 1)
    dst = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        split = sample_block(graph, dst, 10, key=21, kernel="numba")
    finally:
        torch.set_num_threads(threads)
    assert_same_block(split, sample_block(graph, dst, 10, key=21, kernel="tensor"))


def test_unknown_kernel_is_refused(mixed):
    with pytest.raises(ValueError, match="kernel must be"):
        NeighborSampler(mixed, [3], kernel="cuda")
    with pytest.raises(ValueError, match="kernel must be"):
        sample_block(mixed, torch.tensor([1]), 3, key=1, kernel="fast")
