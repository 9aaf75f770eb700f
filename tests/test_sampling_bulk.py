"""Bulk matrix sampling (bulk-sampling paper §4.1): the batches NS gives, sampled k at a time as sparse products."""

from __future__ import annotations

import json

import pytest
import torch

from betty_trainer import Graph
from betty_trainer.config import load_config
from betty_trainer.sampling import SampleKey
from betty_trainer.sampling.bulk import BulkNeighborSampler
from betty_trainer.sampling.neighbor import NeighborSampler
from betty_trainer.sampling.schedule import batch_rounds, epoch_seeds, make_sampler
from betty_trainer.training.trainer import train
from tests.test_cli import QUICK, REPO

FANOUTS = {"full": [None, None], "full-minus-one": [-1, -1], "fanouts-5-10": [5, 10]}


@pytest.fixture(scope="module")
def random_graph():
    """A random multigraph edge list (duplicates and self-loops are dropped by Graph) with hubs above the fanouts."""
    generator = torch.Generator().manual_seed(5)
    n = 3000
    src = torch.randint(0, n, (40_000,), generator=generator)
    dst = torch.cat([torch.randint(0, 50, (10_000,), generator=generator),  # 50 hubs of in-degree ~200
                     torch.randint(0, n, (30_000,), generator=generator)])
    empty = torch.empty(0, dtype=torch.int64)
    return Graph.from_edges(src, dst, n, symmetric=False, x=torch.zeros(n, 1), y=torch.zeros(n, dtype=torch.long),
                            train_idx=torch.arange(n), val_idx=empty, test_idx=empty)


def assert_same_batch(expected, actual):
    assert len(expected.blocks) == len(actual.blocks)
    for ours, theirs in zip(expected.blocks, actual.blocks):
        assert ours.num_dst == theirs.num_dst
        for name in ("src_nodes", "indptr", "indices"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert theirs.edge_weight is None


@pytest.mark.parametrize("fanouts", list(FANOUTS))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("graph_name", ["cora", "random"])
def test_a_bulk_batch_is_the_ns_batch_alone_or_among_k(request, graph_name, k, fanouts):
    graph = request.getfixturevalue("cora" if graph_name == "cora" else "random_graph")
    fanouts = FANOUTS[fanouts]
    ns, bulk = NeighborSampler(graph, fanouts), BulkNeighborSampler(graph, fanouts, bulk=k)
    order = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(k))
    sizes = [97, 1, 256, 64, 130, 7, 300, 50][:k]  # uneven batches, one of a single seed
    seeds = list(order[:sum(sizes)].split(sizes))
    keys = [SampleKey(11, 2, 5 + i) for i in range(k)]
    together = bulk.sample_many(seeds, keys)
    assert len(together) == k
    for batch_seeds, key, batch in zip(seeds, keys, together):
        expected = ns.sample(batch_seeds, key)
        assert_same_batch(expected, batch)
        assert_same_batch(expected, bulk.sample(batch_seeds, key))  # alone


def test_the_draw_is_keyed_by_the_batch_not_its_neighbours_in_the_stack(cora):
    """The same seeds under two keys in one stack give NS's two different batches (keys are per row, not per
    stack), and a batch does not change when the stack around it does."""
    bulk = BulkNeighborSampler(cora, [3, 3], bulk=3)
    seeds = cora.train_idx
    first, second = bulk.sample_many([seeds, seeds], [SampleKey(1, 0, 0), SampleKey(1, 0, 1)])
    assert not torch.equal(first.blocks[0].src_nodes, second.blocks[0].src_nodes)
    other = bulk.sample_many([torch.arange(500, 900), seeds], [SampleKey(9), SampleKey(1, 0, 1)])[1]
    assert_same_batch(second, other)


def test_empty_batches_in_a_stack(cora):
    bulk = BulkNeighborSampler(cora, [4, 4])
    empty = torch.empty(0, dtype=torch.int64)
    batches = bulk.sample_many([empty, cora.train_idx[:10], empty], [SampleKey(0, 0, i) for i in range(3)])
    assert [b.blocks[0].num_src for b in (batches[0], batches[2])] == [0, 0]
    assert_same_batch(NeighborSampler(cora, [4, 4]).sample(cora.train_idx[:10], SampleKey(0, 0, 1)), batches[1])
    with pytest.raises(ValueError, match="bulk must be at least 1"):
        BulkNeighborSampler(cora, [4], bulk=0)


@pytest.mark.parametrize("macro_batch", [0, 2])
def test_batch_rounds_give_the_ns_batches_k_at_a_time(cora, macro_batch):
    """``sampling.bulk = 3`` over 9 batches (not a multiple of the macro-batch of 2): the rounds, their keys and
    batches are NS's."""
    overrides = ["model.num_layers=2", "sampling.fanouts=[5,10]", "sampling.batch_size=16",
                 f"features.macro_batch={macro_batch}", "sampling.bulk=3"]
    config, bulk_config = (load_config(None, [f"sampling.sampler={name}", *overrides]) for name in ("ns", "bulk-ns"))
    graph = cora
    seeds = epoch_seeds(config, graph, 1)[:9]
    sampler, bulk = make_sampler(config, graph), make_sampler(bulk_config, graph)
    assert isinstance(bulk, BulkNeighborSampler) and bulk.bulk == 3
    expected = list(batch_rounds(config, sampler, seeds, 1, row_bytes=4))
    actual = list(batch_rounds(bulk_config, bulk, seeds, 1, row_bytes=4))
    assert [len(r.batches) for r in actual] == [len(r.batches) for r in expected]
    for ours, theirs in zip(expected, actual):
        assert (ours.staged_nodes is None) == (theirs.staged_nodes is None)
        if ours.staged_nodes is not None:
            assert torch.equal(ours.staged_nodes, theirs.staged_nodes)
        for (key, batch_seeds, batch), (bulk_key, bulk_seeds, bulk_batch) in zip(ours.batches, theirs.batches):
            assert key == bulk_key and torch.equal(batch_seeds, bulk_seeds)
            assert_same_batch(batch, bulk_batch)


def test_training_with_bulk_ns_is_training_with_ns(tmp_path):
    """The quickstart config with mini-batches, fanouts and macro-batches: the same metrics, epoch by epoch."""
    common = [*QUICK, "sampling.fanouts=[5,10]", "sampling.batch_size=64", "features.macro_batch=2",
              "train.device=cpu", "sampling.bulk=3"]
    metrics = {}
    for name in ("ns", "bulk-ns"):
        config = load_config(REPO / "configs/quickstart.yaml", [*common, f"sampling.sampler={name}",
                                                                f"train.run_dir={tmp_path / name}"])
        result = train(config)
        lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        metrics[name] = [{k: v for k, v in line.items() if k != "seconds"} for line in lines]
    assert len(metrics["ns"]) == 2 and metrics["ns"] == metrics["bulk-ns"]


@pytest.mark.parametrize("fanouts", [[None, None], [5, 10]])
def test_extraction_by_sort_numbers_blocks_as_the_dense_flags_do(cora, monkeypatch, fanouts):
    """Extraction flags each (batch, node) pair when they are few, else sorts the touched pairs: both are NS's."""
    import betty_trainer.sampling.bulk as bulk_module

    monkeypatch.setattr(bulk_module, "_DENSE_RELABEL", 0)  # always the sort
    seeds = list(torch.randperm(cora.num_nodes, generator=torch.Generator().manual_seed(3))[:300].split(100))
    keys = [SampleKey(4, 1, i) for i in range(3)]
    ns = NeighborSampler(cora, fanouts)
    for batch_seeds, key, batch in zip(seeds, keys, BulkNeighborSampler(cora, fanouts).sample_many(seeds, keys)):
        assert_same_batch(ns.sample(batch_seeds, key), batch)


def test_an_independent_rank_samples_its_parts_in_bulk(cora):
    """Independent minibatching hands the wrapped sampler its parts of k global batches at once (and its bulk)."""
    from betty_trainer.sampling.independent import IndependentSampler

    seeds = list(cora.train_idx[:120].split(40))
    keys = [SampleKey(2, 0, i) for i in range(3)]
    bulk = IndependentSampler(BulkNeighborSampler(cora, [4, 4], bulk=3), rank=1, world_size=2)
    ns = IndependentSampler(NeighborSampler(cora, [4, 4]), rank=1, world_size=2)
    assert bulk.bulk == 3 and ns.bulk == 1
    for batch_seeds, key, batch in zip(seeds, keys, bulk.sample_many(seeds, keys)):
        assert_same_batch(ns.sample(batch_seeds, key), batch)
