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


@pytest.mark.parametrize("bulk", [False, True], ids=["ns", "bulk-ns"])
def test_a_fanout_above_every_in_degree_is_the_largest_in_degree_and_samples_what_it_samples(cora, bulk):
    """A fanout of 2⁴⁰ made 2⁴⁰ round keys, one per round, before sampling (a hang, found by the failure audit); any
    fanout at or above the largest in-degree keeps every in-edge, so NS takes the largest in-degree instead."""
    from betty_trainer.sampling import BulkNeighborSampler, NeighborSampler, SampleKey

    largest = int(cora.indptr.diff().max())
    make = BulkNeighborSampler if bulk else NeighborSampler
    huge, exact = make(cora, [2**40, 5]), make(cora, [largest, 5])
    assert huge.fanouts == [largest, 5]
    seeds, key = cora.train_idx[:64], SampleKey(0, 0, 0)
    ours, theirs = huge.sample(seeds, key), exact.sample(seeds, key)
    full = sample_batch(cora, seeds, [None, 5], key=key)
    for mine, other in zip(ours.blocks, theirs.blocks):
        assert torch.equal(mine.indptr, other.indptr) and torch.equal(mine.indices, other.indices)
    assert torch.equal(ours.blocks[0].indices, full.blocks[0].indices), "every in-edge, as the full neighbourhood"


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


@pytest.mark.parametrize("kernel", ["numba", "tensor"])
def test_graph_and_block_indices_are_int32(cora, kernel):
    """Local src positions are int32 (half of int64's bytes per edge) from every sampler and kernel, and in
    micro-batch slices made by either slicer; node ids and pointers stay int64."""
    from betty_trainer.sampling import GNSSampler, LaborSampler, NeighborSampler, SampleKey
    from partition.slicing import slice_block_compiled, slice_block_tensors

    assert cora.indices.dtype == torch.int32 and cora.indptr.dtype == torch.int64
    samplers = [NeighborSampler(cora, [None, 5], kernel=kernel), LaborSampler(cora, [5, 5], kernel=kernel),
                LaborSampler(cora, [5, 5], importance_iterations=2, kernel=kernel),
                GNSSampler(cora, [5, 5], cache_fraction=0.1, kernel=kernel)]
    for sampler in samplers:
        for block in sampler.sample(cora.train_idx, SampleKey(0, 0, 0)).blocks:
            assert block.indices.dtype == torch.int32, type(sampler).__name__
            assert block.src_nodes.dtype == block.indptr.dtype == torch.int64
            for slicer in (slice_block_compiled, slice_block_tensors):
                piece = slicer(block, torch.arange(0, block.num_dst, 2))
                assert piece.indices.dtype == torch.int32 and piece.indptr.dtype == torch.int64
                assert block.restrict(piece).indices.dtype == torch.int32


def test_block_converts_int64_indices_and_refuses_too_many_src_nodes():
    from betty_trainer.data.block import Block

    block = Block(torch.arange(3), 2, torch.tensor([0, 1, 2]), torch.tensor([2, 0]))
    assert block.indices.dtype == torch.int32 and block.indices.tolist() == [2, 0]
    with pytest.raises(ValueError, match="2³¹"):
        Block(torch.zeros(1, dtype=torch.int64).expand(2**31), 0, torch.zeros(1, dtype=torch.int64),
              torch.zeros(0, dtype=torch.int64))  # a view: 2³¹ src ids without their memory


SAMPLER_CONFIGS = {
    "full": ["sampling.sampler=full"],
    "ns": ["sampling.sampler=ns", "sampling.fanouts=[5,10]"],
    "bulk-ns": ["sampling.sampler=bulk-ns", "sampling.fanouts=[5,10]"],
    "bulk-ladies": ["sampling.sampler=bulk-ladies", "sampling.fanouts=[64,32]"],
    "labor-0": ["sampling.sampler=labor", "sampling.fanouts=[5,10]"],
    "labor-star-kappa4": ["sampling.sampler=labor", "sampling.fanouts=[5,10]", "sampling.labor.importance_iterations=-1",
                          "sampling.labor.batch_dependency=4", "sampling.labor.layer_dependency=true"],
    "gns": ["sampling.sampler=gns", "sampling.fanouts=[5,10]", "sampling.gns.cache_fraction=0.05"],
    "gns-cache-only-input": ["sampling.sampler=gns", "sampling.fanouts=[5,10]", "sampling.gns.cache_fraction=0.05",
                             "sampling.gns.cache_only_input_layer=true"],
}


@pytest.mark.parametrize("arch", ["sage-mean", "gcn"])
@pytest.mark.parametrize("sampler", list(SAMPLER_CONFIGS))
def test_every_sampler_micro_batches_equal_the_batch(cora, sampler, arch):
    """For every sampler (weighted blocks included), K micro-batches accumulate the gradients of K = 1 within
    the exactness bound of tests/test_exactness.py (Betty §4.2): micro-batches are slices of the sampled batch.
    GCN runs in float64: in float32 its 7-entry bias gradient differs by 1.3e-5 of its largest entry at K = 2
    with every sampler, "full" included (summation order), just above the float32 bound."""
    import dataclasses

    from betty_trainer import GCN, GraphSAGE, plan_micro_batches
    from betty_trainer.config import load_config
    from betty_trainer.models import set_dropout_key
    from betty_trainer.sampling import SampleKey
    from betty_trainer.sampling.schedule import make_sampler
    from tests.test_exactness import assert_same_gradients, gradients

    config = load_config(None, ["model.num_layers=2", *SAMPLER_CONFIGS[sampler]])
    batch = make_sampler(config, cora).sample(cora.train_idx, SampleKey(3, 1, 2))
    weighted = sampler not in ("full", "ns", "bulk-ns")
    assert all((block.edge_weight is not None) == weighted for block in batch.blocks)
    torch.manual_seed(0)
    graph = cora
    if arch == "gcn":
        model = GCN(cora.num_features, 32, cora.num_classes, cora.in_degrees(), 2, 0.5).double()
        graph = dataclasses.replace(cora, x=cora.x.double())
    else:
        model = GraphSAGE(cora.num_features, 32, cora.num_classes, 2, "mean", 0.5)
    set_dropout_key(model, seed=1, step=5)
    reference = gradients(model, [batch], graph)
    for k in (2, 4):
        assert_same_gradients(reference, gradients(model, plan_micro_batches(batch, k, "reg", seed=1), graph))


def test_make_sampler_builds_the_configured_sampler(cora):
    from betty_trainer.config import load_config
    from betty_trainer.sampling import GNSSampler, LaborSampler, NeighborSampler
    from betty_trainer.sampling.schedule import make_sampler

    def build(*overrides):
        return make_sampler(load_config(None, ["model.num_layers=2", *overrides]), cora)

    assert build().fanouts == [None, None]
    assert build("sampling.sampler=full").fanouts == [None, None]
    assert isinstance(build("sampling.sampler=ns", "sampling.fanouts=[3,4]"), NeighborSampler)
    labor = build("sampling.sampler=labor", "sampling.fanouts=[3,4]", "sampling.labor.batch_dependency=inf",
                  "sampling.labor.importance_iterations=2", "sampling.batch_size=50")
    assert isinstance(labor, LaborSampler) and labor.batch_dependency == math.inf
    assert labor.importance_iterations == 2 and labor.batches_per_epoch == math.ceil(cora.train_idx.numel() / 50)
    gns = build("sampling.sampler=gns", "sampling.fanouts=[3,4]", "sampling.gns.refresh_every=7")
    assert isinstance(gns, GNSSampler) and gns.refresh_every == 7 and gns.fanouts == [3, 4]


def test_a_full_neighbourhood_batch_is_sampled_once_for_equal_seeds(cora):
    """Full-batch training asks for the same seeds every epoch: the full-neighbourhood sampler hands its last batch
    back for equal seeds (another tensor, another key), a new one for other seeds, and a sampling one never keeps."""
    from betty_trainer import NeighborSampler, SampleKey
    from betty_trainer.memory.planner import same_structure

    seeds = cora.train_idx.clone()
    full = NeighborSampler(cora, [None, None])
    first = full.sample(seeds, SampleKey(0, 0, 0))
    seeds.add_(1)  # the sampler kept a copy of the seeds, not the caller's tensor
    assert full.sample(cora.train_idx.clone(), SampleKey(0, 1, 0)) is first
    assert same_structure(first, sample_batch(cora, cora.train_idx, [None, None]))
    other = full.sample(seeds, SampleKey(0, 1, 0))
    assert other is not first and torch.equal(other.output_nodes, seeds)
    sampling = NeighborSampler(cora, [5, 5])
    one, two = (sampling.sample(cora.train_idx, SampleKey(0, epoch, 0)) for epoch in (0, 1))
    assert one is not two and not same_structure(one, two)
