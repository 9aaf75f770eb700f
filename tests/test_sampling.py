"""Neighbour sampling: full neighbourhoods are exact; uniform sampling has the right law."""

from __future__ import annotations

import math

import pytest
import torch

from betty_trainer import Graph, sample_batch
from betty_trainer.sampling import sample_block


def global_edges(block):
    """Set of (src, dst) global-id pairs of a block."""
    src = block.src_nodes[block.indices]
    dst = block.dst_nodes[block.edge_dst()]
    return set(zip(src.tolist(), dst.tolist()))


def graph_in_edges(graph, nodes):
    return {(int(s), int(v)) for v in nodes.tolist() for s in graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist()}


def test_full_neighbourhood_blocks_hold_every_in_edge(cora):
    batch = sample_batch(cora, cora.train_idx, [None, None])
    assert torch.equal(batch.output_nodes, cora.train_idx)
    for lower, upper in zip(batch.blocks[:-1], batch.blocks[1:]):
        assert torch.equal(lower.dst_nodes, upper.src_nodes)
    for block in batch.blocks:
        assert global_edges(block) == graph_in_edges(cora, block.dst_nodes)
        assert torch.unique(block.src_nodes).numel() == block.num_src
        touched = torch.unique(block.indices)
        extra = torch.arange(block.num_dst, block.num_src)
        assert torch.isin(extra, touched).all(), "every non-dst src node is an edge endpoint"


def test_fanout_caps_degree_without_replacement(cora):
    k = 3
    block = sample_block(cora, torch.arange(cora.num_nodes), k, torch.Generator().manual_seed(0))
    degree = cora.in_degrees()
    assert torch.equal(block.in_degrees(), torch.clamp(degree, max=k))
    edges = global_edges(block)
    assert len(edges) == block.num_edges, "no edge drawn twice"
    assert edges <= graph_in_edges(cora, torch.arange(cora.num_nodes))


def test_uniform_inclusion_probability(cora):
    """Each in-neighbour of a node with degree d is kept with probability k/d (GraphSAGE NS)."""
    k, trials = 2, 4000
    degree = cora.in_degrees()
    nodes = torch.nonzero(degree >= 6).flatten()[:40]
    graph_keys = torch.repeat_interleave(torch.arange(cora.num_nodes), degree) * cora.num_nodes + cora.indices
    counts = torch.zeros(cora.num_edges)
    generator = torch.Generator().manual_seed(123)
    for _ in range(trials):
        block = sample_block(cora, nodes, k, generator)
        keys = block.dst_nodes[block.edge_dst()] * cora.num_nodes + block.src_nodes[block.indices]
        counts[torch.searchsorted(graph_keys, keys)] += 1  # CSC is sorted by (dst, src)
    for v in nodes.tolist():
        d = int(degree[v])
        p = k / d
        observed = counts[cora.indptr[v]:cora.indptr[v + 1]] / trials
        sigma = math.sqrt(p * (1 - p) / trials)
        # 5 sigma per edge: with ~400 edges the chance of a false failure is < 1e-3
        assert (observed - p).abs().max() <= 5 * sigma, (v, observed, p)


def test_same_generator_state_same_batch(cora):
    one = sample_batch(cora, cora.train_idx, [5, 5], torch.Generator().manual_seed(9))
    two = sample_batch(cora, cora.train_idx, [5, 5], torch.Generator().manual_seed(9))
    three = sample_batch(cora, cora.train_idx, [5, 5], torch.Generator().manual_seed(10))
    for a, b in zip(one.blocks, two.blocks):
        assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indices, b.indices)
    assert not all(torch.equal(a.indices, c.indices) for a, c in zip(one.blocks, three.blocks))


def test_bad_fanout_is_rejected(cora):
    with pytest.raises(ValueError, match="fanout"):
        sample_batch(cora, cora.train_idx, [0, 5])


def test_from_edges_deduplicates_and_symmetrises():
    src, dst = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([1, 1, 2, 2, 0])
    graph = Graph.from_edges(src, dst, 3, x=torch.zeros(3, 1), y=torch.zeros(3, dtype=torch.long),
                             train_idx=torch.tensor([0]), val_idx=torch.tensor([1]), test_idx=torch.tensor([2]),
                             num_classes=1)
    assert graph.indptr.tolist() == [0, 2, 4, 6]
    assert graph.indices.tolist() == [1, 2, 0, 2, 0, 1]


def test_keyed_sample_of_each_seed_equals_its_sample_alone(cora):
    """Under one key, a seed's sampled in-edges (output layer) are those it gets when sampled alone,
    and a shuffled batch gives the same rows (keyed randomness, DESIGN.md › Seams)."""
    from betty_trainer.sampling import SampleKey

    key = SampleKey(11, epoch=3, step=4)
    seeds = cora.train_idx[:60]
    batch = sample_batch(cora, seeds, [3, 2], key=key)
    shuffled = sample_batch(cora, seeds.flip(0), [3, 2], key=key)
    assert global_edges(batch.blocks[-1]) == global_edges(shuffled.blocks[-1])
    for seed in seeds[:20].tolist():
        alone = sample_batch(cora, torch.tensor([seed]), [3, 2], key=key).blocks[-1]
        assert global_edges(alone) == {(s, v) for s, v in global_edges(batch.blocks[-1]) if v == seed}


def test_graph_indices_are_int32_and_blocks_int64(cora):
    assert cora.indices.dtype == torch.int32 and cora.indptr.dtype == torch.int64
    block = sample_batch(cora, cora.train_idx, [5], torch.Generator().manual_seed(0)).blocks[0]
    assert {block.src_nodes.dtype, block.indptr.dtype, block.indices.dtype} == {torch.int64}
