"""Bulk matrix sampling (bulk-sampling paper §4): bulk-ns gives NS's batches, sampled k at a time as sparse products;
bulk-ladies draws LADIES' layer-wise samples (§4.2) as a brute-force dense reference says it should."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
import torch
from scipy.stats import binom

from betty_trainer import Graph
from betty_trainer.config import load_config
from betty_trainer.sampling import SampleKey
from betty_trainer.sampling.bulk import BulkLadiesSampler, BulkNeighborSampler
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


@pytest.mark.parametrize("kernel", ["auto", "tensor"])
@pytest.mark.parametrize("fanouts", list(FANOUTS))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("graph_name", ["cora", "random"])
def test_a_bulk_batch_is_the_ns_batch_alone_or_among_k(request, graph_name, k, fanouts, kernel):
    """Every bulk batch equals NS's bit for bit, sampled alone or among k, by the CPU kernels or the tensor ops
    (the code a GPU runs)."""
    graph = request.getfixturevalue("cora" if graph_name == "cora" else "random_graph")
    fanouts = FANOUTS[fanouts]
    ns, bulk = NeighborSampler(graph, fanouts), BulkNeighborSampler(graph, fanouts, bulk=k, kernel=kernel)
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
    with pytest.raises(ValueError, match="kernel must be"):
        BulkLadiesSampler(cora, [4], kernel="fast")


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


@pytest.mark.parametrize("kernel", ["auto", "tensor"])
@pytest.mark.parametrize("fanouts", [[None, None], [5, 10]])
def test_extraction_without_dense_arrays_numbers_blocks_as_with_them(cora, monkeypatch, fanouts, kernel):
    """Extraction uses a dense array over node ids when it is small beside the work, else sorts the touched pairs
    (tensor ops) or hashes each batch's ids (the CPU kernel): every way gives NS's blocks."""
    import betty_trainer.sampling.bulk as bulk_module

    monkeypatch.setattr(bulk_module, "_DENSE_RELABEL", 0)  # never the dense array
    seeds = list(torch.randperm(cora.num_nodes, generator=torch.Generator().manual_seed(3))[:300].split(100))
    keys = [SampleKey(4, 1, i) for i in range(3)]
    ns = NeighborSampler(cora, fanouts)
    bulk = BulkNeighborSampler(cora, fanouts, kernel=kernel)
    for batch_seeds, key, batch in zip(seeds, keys, bulk.sample_many(seeds, keys)):
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


# ---------------------------------------------------------------- bulk-ladies (§4.2) against a dense reference


@pytest.fixture(scope="module")
def small_graph():
    """A directed graph of 14 nodes, about 4 in-edges each."""
    generator = torch.Generator().manual_seed(8)
    src, dst = torch.randint(0, 14, (2, 60), generator=generator)
    empty = torch.empty(0, dtype=torch.int64)
    return Graph.from_edges(src, dst, 14, symmetric=False, x=torch.zeros(14, 1), y=torch.zeros(14, dtype=torch.long),
                            train_idx=torch.arange(14), val_idx=empty, test_idx=empty)


def dense_ladies_probabilities(graph, dst):
    """§4.2.1 by brute force: ``Q`` the ``1 × N`` row with a 1 per dst node, ``P = Q·A`` dense (``A[u, v] = 1`` for
    each edge ``v → u``), row-normalised, then each column's squared norm over their sum, as exact fractions."""
    n = graph.num_nodes
    a = torch.zeros(n, n, dtype=torch.float64)
    a[torch.repeat_interleave(torch.arange(n), graph.in_degrees()), graph.indices.long()] = 1
    q = torch.zeros(1, n, dtype=torch.float64)
    q[0, dst] = 1
    p = [Fraction(int(x)) for x in (q @ a)[0]]  # exact: small integers
    p = [x / sum(p) for x in p]  # NORM
    squared = [x * x for x in p]  # the squared norm of each column of the one-row P
    return {v: x / sum(squared) for v, x in enumerate(squared) if x}


def successive_inclusion(probabilities, s):
    """P(v among the s distinct draws) when each draw takes v with probability p_v renormalised over the vertices
    not yet drawn (ITS repeated without replacement, §4.1.2), by enumerating every ordered s-tuple, exactly."""
    inclusion = dict.fromkeys(probabilities, Fraction(0))
    for order in itertools.permutations(probabilities, s):
        chance, left = Fraction(1), Fraction(1)
        for v in order:
            chance *= probabilities[v] / left
            left -= probabilities[v]
        for v in order:
            inclusion[v] += chance
    return inclusion


DST_SETS = [[0, 3, 7], [5], [1, 2, 9, 11], [13, 4]]


def test_ladies_probabilities_equal_the_dense_reference_exactly(small_graph):
    sampler = BulkLadiesSampler(small_graph, [3], bulk=4)
    for (nodes, p), dst in zip(sampler.column_probabilities([torch.tensor(d) for d in DST_SETS]), DST_SETS):
        expected = dense_ladies_probabilities(small_graph, dst)
        assert nodes.tolist() == sorted(expected)
        assert p.dtype == torch.float64 and p.tolist() == [float(expected[v]) for v in sorted(expected)]


@pytest.mark.parametrize("kernel", ["auto", "tensor"])
def test_ladies_blocks_hold_every_edge_from_the_sampled_vertices_row_normalised(small_graph, kernel):
    """Per batch and layer: min(s, support) sampled vertices, each in the batch's aggregated neighbourhood; the
    block's edges are all of A's edges from them to the dst nodes, each weighing 1/(its dst node's count); its src
    nodes are the dst nodes then the other sampled vertices, ascending; the next layer samples from all of them."""
    s = 3
    sampler = BulkLadiesSampler(small_graph, [s, s], bulk=4, kernel=kernel)
    edges = set(zip(small_graph.indices.long().tolist(),
                    torch.repeat_interleave(torch.arange(14), small_graph.in_degrees()).tolist()))
    keys = [SampleKey(3, 0, i) for i in range(len(DST_SETS))]
    for dst, batch in zip(DST_SETS, sampler.sample_many([torch.tensor(d) for d in DST_SETS], keys)):
        for block in reversed(batch.blocks):
            rows = block.dst_nodes.tolist()
            assert rows == dst
            support = dense_ladies_probabilities(small_graph, rows)
            source = block.src_nodes[block.indices.long()]
            sampled = set(source.tolist())
            assert len(sampled) == min(s, len(support)) and sampled <= set(support)
            kept = {(int(v), int(u)) for v, u in zip(source, block.dst_nodes[block.edge_dst()])}
            assert kept == {(v, u) for v, u in edges if v in sampled and u in rows}
            assert torch.equal(block.edge_weight, 1 / block.in_degrees().float()[block.edge_dst()])
            assert block.src_nodes.tolist() == rows + sorted(sampled - set(rows))
            dst = block.src_nodes.tolist()


def test_ladies_draws_match_successive_sampling_within_a_binomial_bound(small_graph):
    """Over 4,000 keys, how often each vertex is drawn for one batch against its exact inclusion probability
    under successive ITS draws without replacement: each count is Binomial(4000, π_v) when the hashed variates are
    independent uniforms, so it lies in the central 1 − 10⁻⁶/m interval of that law (m vertices; Bonferroni) but for
    a 10⁻⁶ chance over the choice of keys. All 4,000 batches are one bulk stack."""
    dst, s, draws = [0, 3, 7], 3, 4000
    probabilities = dense_ladies_probabilities(small_graph, dst)
    inclusion = successive_inclusion(probabilities, s)
    batches = BulkLadiesSampler(small_graph, [s], bulk=draws).sample_many(
        [torch.tensor(dst)] * draws, [SampleKey(21, 0, step) for step in range(draws)])
    counts = dict.fromkeys(probabilities, 0)
    for batch in batches:
        block = batch.blocks[0]
        for v in set(block.src_nodes[block.indices.long()].tolist()):
            counts[v] += 1
    alpha = 1e-6 / len(probabilities)
    for v, pi in inclusion.items():
        low, high = binom.interval(1 - alpha, draws, float(pi))
        assert low <= counts[v] <= high, (v, counts[v], float(pi) * draws)
    assert sum(counts.values()) == s * draws


def test_a_ladies_batch_is_the_same_alone_or_among_k(cora):
    sampler = BulkLadiesSampler(cora, [64, 32], bulk=3)
    seeds = list(cora.train_idx[:90].split(30))
    keys = [SampleKey(5, 1, i) for i in range(3)]
    for batch_seeds, key, batch in zip(seeds, keys, sampler.sample_many(seeds, keys)):
        alone = sampler.sample(batch_seeds, key)
        for ours, theirs in zip(batch.blocks, alone.blocks):
            for name in ("src_nodes", "indptr", "indices", "edge_weight"):
                assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    tensor = BulkLadiesSampler(cora, [64, 32], kernel="tensor").sample(seeds[0], keys[0])
    assert all(torch.equal(a.indices, b.indices) for a, b in zip(tensor.blocks, sampler.sample(seeds[0], keys[0]).blocks))


def test_config_names_the_bulk_samplers_and_refuses_bad_values(cora, monkeypatch):
    from betty_trainer.errors import ConfigError

    config = load_config(None, ["sampling.sampler=bulk-ladies", "sampling.fanouts=[8,8]", "sampling.bulk=5"])
    sampler = make_sampler(config, cora)
    assert isinstance(sampler, BulkLadiesSampler) and sampler.bulk == 5 and sampler.device.type == "cpu"
    for bad, match in ((["sampling.device=gpu"], "device"), (["sampling.bulk=0"], "bulk"),
                       (["sampling.sampler=bulk-gns"], "sampler"),
                       (["sampling.device=cuda", "sampling.sampler=ns"], "bulk-ns or bulk-ladies")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        make_sampler(load_config(None, ["sampling.sampler=bulk-ns", "sampling.device=cuda"]), cora)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        BulkNeighborSampler(cora, [4], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bulk_samplers_on_a_gpu_give_the_cpu_batches(cora):
    """sampling.device=cuda: the same tensor code on the GPU; NS's batches exactly (integer hashes), LADIES' sampled
    vertex counts (its races compare float64 logs, which a GPU may round differently in the last place)."""
    seeds = list(cora.train_idx[:120].split(40))
    keys = [SampleKey(6, 0, i) for i in range(3)]
    ns = NeighborSampler(cora, [5, 10])
    for batch_seeds, key, batch in zip(seeds, keys, BulkNeighborSampler(cora, [5, 10], device="cuda").sample_many(
            seeds, keys)):
        assert_same_batch(ns.sample(batch_seeds, key), batch)
    cpu, gpu = (BulkLadiesSampler(cora, [64, 32], device=device).sample_many(seeds, keys) for device in ("cpu", "cuda"))
    assert [[b.num_src for b in x.blocks] for x in cpu] == [[b.num_src for b in x.blocks] for x in gpu]
