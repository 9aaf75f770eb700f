"""The device node cache and macro-batch gathering (issue 8, Build 6–7): rows equal ``x[ids]`` for every
cache kind, the counters equal a hand-computed gather, LRU equals its definition, and training with any
cache (or macro-batching) gives the same losses as training without one."""

from __future__ import annotations

import json

import pytest
import torch

from betty_trainer import HostFeatureStore, TransferStats, load_config
from betty_trainer.data import cache as cache_module
from betty_trainer.data.cache import CachedFeatureStore, cache_capacity
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError
from betty_trainer.sampling.schedule import make_sampler, staging_rounds
from betty_trainer.training import trainer as trainer_module
from betty_trainer.training.trainer import feature_store

CPU = torch.device("cpu")
F = 3
ROW = F * 4  # float32 row bytes


@pytest.fixture
def x():
    return torch.randn(20, F, generator=torch.Generator().manual_seed(0))


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture
def crossing(monkeypatch):
    """Count bytes as if the cache lay on another device than the host (the data stay on the CPU)."""
    monkeypatch.setattr(cache_module, "transfer_bytes", lambda rows, row_bytes, source, target: rows * row_bytes)


# --- counters against hand-computed gathers ------------------------------------------------------------------

def test_lru_counters_and_contents_follow_a_hand_computed_sequence(x, crossing):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "lru", capacity=4)
    # (request, hits, misses, cache after): recency by gather, ties by node id (larger kept)
    steps = [((0, 1, 2), 0, 3, [0, 1, 2]),
             ((1, 2, 3, 4), 2, 2, [1, 2, 3, 4]),
             ((0, 5), 0, 2, [0, 3, 4, 5]),  # 1 and 2 (read at step 2, smaller ids than 3, 4) are evicted
             ((5, 6, 7, 8, 9), 1, 4, [6, 7, 8, 9])]  # five nodes read at step 4: the four largest stay
    hits = misses = 0
    for request, step_hits, step_misses, after in steps:
        before = store.stats.snapshot()
        rows = store.gather(ids(*request), CPU)
        assert torch.equal(rows, x[ids(*request)])
        assert store.stats - before == TransferStats(step_hits, step_misses, step_misses * ROW, 0)
        assert store.cached_nodes.tolist() == after
        hits, misses = hits + step_hits, misses + step_misses
    assert store.stats == TransferStats(hits=3, misses=11, host_to_device_bytes=11 * ROW, cache_fill_bytes=0)
    assert store.stats.hit_rate == 3 / 14


def test_static_cache_holds_the_top_degree_nodes_and_counts_its_fill_once(x, crossing):
    degrees = torch.arange(20) % 7  # degree 6: nodes 6, 13; degree 5: nodes 5, 12, 19
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "static", capacity=3, degrees=degrees)
    assert torch.equal(store.gather(ids(6, 13, 0), CPU), x[ids(6, 13, 0)])
    assert store.cached_nodes.tolist() == [5, 6, 13]  # ties at degree 5 go to the lowest id
    assert store.stats == TransferStats(hits=2, misses=1, host_to_device_bytes=4 * ROW, cache_fill_bytes=3 * ROW)
    assert torch.equal(store.gather(ids(5, 12, 5), CPU), x[ids(5, 12, 5)])  # repeats are rows like any other
    assert store.stats == TransferStats(hits=4, misses=2, host_to_device_bytes=5 * ROW, cache_fill_bytes=3 * ROW)
    assert store.cached_nodes.tolist() == [5, 6, 13], "a static cache never changes"


def test_without_crossing_devices_nothing_counts_as_moved_but_misses_and_fills_do(x):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "static", capacity=3,
                               degrees=torch.arange(20) % 7)
    store.gather(ids(6, 13, 0), CPU)
    assert store.stats == TransferStats(hits=2, misses=1, host_to_device_bytes=0, cache_fill_bytes=3 * ROW)


def test_gns_cache_is_the_sampler_node_set_and_a_refresh_reads_only_new_nodes(x, crossing):
    sets = {0: ids(1, 2, 3), 1: ids(1, 2, 3), 2: ids(2, 3, 7, 9)}
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "gns", node_source=lambda key: sets[key])
    store.begin_batch(0)
    assert store.stats == TransferStats(0, 0, 3 * ROW, cache_fill_bytes=3 * ROW)
    assert torch.equal(store.gather(ids(3, 4, 1), CPU), x[ids(3, 4, 1)])
    assert store.stats == TransferStats(2, 1, 4 * ROW, 3 * ROW)
    store.begin_batch(1)  # the same set: nothing read
    assert store.stats == TransferStats(2, 1, 4 * ROW, 3 * ROW)
    store.begin_batch(2)  # 2 and 3 stay on the device; 7 and 9 are read
    assert store.cached_nodes.tolist() == [2, 3, 7, 9] and store.capacity == 4
    assert store.stats == TransferStats(2, 1, 6 * ROW, 5 * ROW)
    assert torch.equal(store.gather(ids(1, 9, 2), CPU), x[ids(1, 9, 2)])
    assert store.stats == TransferStats(4, 2, 7 * ROW, 5 * ROW)


def test_a_staged_macro_batch_reads_each_node_once_and_counts_a_miss_at_its_first_request(x, crossing):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "static", capacity=3, degrees=torch.arange(20) % 7)
    store.prefetch(torch.cat([ids(1, 2, 6), ids(2, 3, 1), ids(9)]))  # union 1, 2, 3, 6, 9; 6 is cached
    assert store.staged_rows == 5
    assert store.stats == TransferStats(0, 0, (3 + 4) * ROW, 3 * ROW)  # fill 3 rows, stage reads 1, 2, 3, 9
    assert torch.equal(store.gather(ids(1, 2, 6), CPU), x[ids(1, 2, 6)])
    assert store.stats - TransferStats(0, 0, 7 * ROW, 3 * ROW) == TransferStats(1, 2, 0, 0)
    assert torch.equal(store.gather(ids(2, 3, 1, 13), CPU), x[ids(2, 3, 1, 13)])  # 13: not staged, cached
    assert store.stats == TransferStats(hits=4, misses=3, host_to_device_bytes=7 * ROW, cache_fill_bytes=3 * ROW)
    assert torch.equal(store.gather(ids(0), CPU), x[ids(0)])  # neither staged nor cached: read now
    assert store.stats == TransferStats(4, 4, 8 * ROW, 3 * ROW)
    assert store.device_bytes == 3 * ROW + 20 * 4 + 3 * 8 + (20 * 4 + 5 * ROW + 5 * 8 + 5 * 1)
    store.release()  # 9 was read for the stage and never requested
    assert store.stats == TransferStats(4, 4, 8 * ROW, 4 * ROW)
    assert store.staged_rows == 0
    assert store.device_bytes == 3 * ROW + 20 * 4 + 3 * 8 + 20 * 4  # the stage's table stays allocated


def test_macro_batch_gathering_moves_exactly_the_lower_bound(x, crossing):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "none")
    batches = [torch.randperm(20, generator=torch.Generator().manual_seed(s))[:8] for s in range(4)]
    store.prefetch(torch.cat(batches))
    for batch in batches:
        assert torch.equal(store.gather(batch, CPU), x[batch])
    store.release()
    distinct = torch.unique(torch.cat(batches)).numel()
    assert store.stats == TransferStats(hits=32 - distinct, misses=distinct, host_to_device_bytes=distinct * ROW,
                                        cache_fill_bytes=0)


def test_a_gather_to_another_device_goes_to_the_host_store(x):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "lru", capacity=4)
    rows = store.gather(ids(1, 2), torch.device("meta"))
    assert rows.device.type == "meta" and rows.shape == (2, F)
    assert store.stats == TransferStats(0, 2, 2 * ROW, 0) and store.cached_nodes.numel() == 0


# --- behaviour on random gathers ---------------------------------------------------------------------------

def reference_lru(requests: list[torch.Tensor], capacity: int) -> list[int]:
    """Misses per gather of the cache holding the ``capacity`` largest (last gather read, node id)."""
    last: dict[int, int] = {}
    misses = []
    for step, request in enumerate(requests):
        ranked = sorted(last, key=lambda node: (last[node], node), reverse=True)[:capacity]
        cached = set(ranked)
        misses.append(sum(1 for node in request.tolist() if node not in cached))
        for node in request.tolist():
            last[node] = step
    return misses


@pytest.mark.parametrize("capacity", [1, 7, 40])
def test_lru_misses_equal_the_definition_on_random_gathers(capacity):
    x = torch.randn(60, 2)
    generator = torch.Generator().manual_seed(capacity)
    requests = [torch.randint(0, 60, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
                for _ in range(40)]
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "lru", capacity=capacity)
    got = []
    for request in requests:
        before = store.stats.misses
        assert torch.equal(store.gather(request, CPU), x[request])
        got.append(store.stats.misses - before)
    assert got == reference_lru(requests, capacity)
    assert store.cached_nodes.numel() == min(capacity, torch.unique(torch.cat(requests)).numel())


@pytest.mark.parametrize("kind", ["none", "static", "lru", "gns"])
def test_every_kind_returns_the_rows_of_the_host(kind):
    x = torch.randn(100, 5, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, kind, capacity=17,
                               degrees=torch.randint(0, 9, (100,), generator=generator),
                               node_source=lambda key: torch.arange(key % 3, 100, 7))
    for step in range(12):
        store.begin_batch(step)
        if step % 4 == 0:
            store.prefetch(torch.randint(0, 100, (50,), generator=generator))
        request = torch.randint(0, 100, (30,), generator=generator)
        rows = store.gather(request, CPU)
        assert torch.equal(rows, x[request])
        rows.zero_()  # a new tensor: the cache and the stage are untouched
        if step % 4 == 3:
            store.release()
    assert store.stats.hits + store.stats.misses == 12 * 30


def test_cache_capacity_reads_fractions_counts_and_bytes():
    assert cache_capacity(0.1, 1000, 400) == 100
    assert cache_capacity(0.0015, 1000, 400) == 2  # rounded up
    assert cache_capacity(1.0, 1000, 400) == 1000
    assert cache_capacity(250, 1000, 400) == 250
    assert cache_capacity(5000, 1000, 400) == 1000
    assert cache_capacity("40KB", 1000, 400) == 100
    for bad in (0, 1.5, -3, "lots", True):
        with pytest.raises(ValueError):
            cache_capacity(bad, 1000, 400)


def test_cache_capacity_of_a_fraction_is_the_exact_ceiling_of_the_decimal():
    """⌈fraction · N⌉ on the decimal the fraction is written as: in floats 0.07 · 100 = 7.000000000000001, whose
    ceiling (8) once gave a row more than asked."""
    for fraction, rows in ((0.07, 7), (0.14, 14), (0.28, 28), (0.55, 55), (0.56, 56), (0.015, 2), (0.0015, 1)):
        assert cache_capacity(fraction, 100, 400) == rows, fraction
    assert cache_capacity(0.29, 100, 400) == 29  # 28.999999999999996 in floats: the ceiling was right already


@pytest.mark.parametrize("size, row_bytes", [("0B", 400), ("0.1", 400), ("100B", 400), ("399B", 400), ("0B", 1)])
def test_cache_capacity_refuses_a_size_in_bytes_below_one_row(size, row_bytes):
    """A size in bytes that holds no row (a quoted fraction '0.1' reads as 0 bytes) is refused naming the key and
    the fix, as a ConfigError (the CLI prints it) that is also a ValueError; it once gave a capacity of 0."""
    with pytest.raises(ConfigError, match=r"features\.cache\.size") as error:
        cache_capacity(size, 1000, row_bytes)
    assert isinstance(error.value, ValueError)
    assert cache_capacity("400B", 1000, 400) == 1 and cache_capacity("799B", 1000, 400) == 1


@pytest.mark.parametrize("size", ["'0.1'", "0B", "0KiB"])
def test_a_size_of_zero_bytes_is_refused_by_the_config(size):
    """Sizes that read as 0 bytes are refused when the config is read, before any graph is loaded."""
    with pytest.raises(ConfigError, match=r"features\.cache\.size.*0 bytes"):
        load_config(None, ["features.cache.kind=lru", f"features.cache.size={size}"])


def test_a_size_below_one_row_is_refused_when_the_store_is_built():
    """The row size is known only with the graph: the feature store refuses the size as a ConfigError then."""
    config = load_config(None, SMALL + ["features.cache.kind=static", "features.cache.size=8B"])
    from betty_trainer.datasets import load_dataset

    graph = load_dataset(config.dataset)
    assert graph.x.shape[1] * graph.x.element_size() > 8
    with pytest.raises(ConfigError, match=r"features\.cache\.size '8B' is 8 bytes, less than one"):
        feature_store(config, graph, CPU, make_sampler(config, graph))


def test_staging_rounds_keep_each_round_s_distinct_rows_within_the_budget():
    inputs = [ids(0, 1, 2), ids(1, 2, 3), ids(4, 5), ids(6, 7, 8, 9, 10), ids(10)]
    assert staging_rounds(inputs, ROW, None) == [range(0, 5)]
    # budget 4 rows: {0,1,2,3} | {4,5} (adding 6..10 would make 7) | {6..10} alone is over it; {10} adds nothing
    assert staging_rounds(inputs, ROW, 4 * ROW) == [range(0, 2), range(2, 3), range(3, 5)]
    assert staging_rounds(inputs, ROW, 1) == [range(0, 1), range(1, 2), range(2, 3), range(3, 5)]


# --- config and training ----------------------------------------------------------------------------------

SMALL = ["optim.epochs=2", "train.progress=false", "dataset.synthetic.num_nodes=600", "dataset.synthetic.num_val=100",
         "dataset.synthetic.num_test=100", "micro_batch.num_micro_batches=2", "sampling.fanouts=5,5",
         "sampling.batch_size=40"]


@pytest.mark.parametrize("override, key", [
    (["features.cache.kind=gns"], "features.cache.kind"),
    (["features.cache.kind=lfu"], "features.cache.kind"),
    (["features.cache.size=0"], "features.cache.size"),
    (["features.cache.size=1.5"], "features.cache.size"),
    (["features.cache.size=lots"], "features.cache.size"),
    (["features.macro_batch=-1"], "features.macro_batch"),
    (["features.macro_batch_budget=lots"], "features.macro_batch_budget"),
])
def test_bad_cache_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, override)


def test_the_feature_store_is_what_the_config_names():
    config = load_config(None, SMALL + ["features.cache.kind=lru", "features.cache.size=0.05"])
    from betty_trainer.datasets import load_dataset

    graph = load_dataset(config.dataset)
    store = feature_store(config, graph, CPU, make_sampler(config, graph))
    assert isinstance(store, CachedFeatureStore) and store.kind == "lru" and store.capacity == 30
    plain = feature_store(load_config(None, SMALL), graph, CPU, make_sampler(config, graph))
    assert isinstance(plain, HostFeatureStore)


def _losses(tmp_path, monkeypatch, name, overrides):
    """The (loss, val_acc) of each epoch of a small run, and the feature store it trained with."""
    stores, make = [], trainer_module.feature_store

    def recorded(*args, **kwargs):
        stores.append(make(*args, **kwargs))
        return stores[-1]

    monkeypatch.setattr(trainer_module, "feature_store", recorded)
    trainer_module.train(load_config(None, SMALL + overrides), run_dir=tmp_path / name)
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    metrics = [(line["loss"], line["val_acc"]) for line in lines]
    counted = [(line["feature_hits"], line["feature_misses"]) for line in lines]
    return metrics, stores[0], counted


@pytest.mark.parametrize("overrides", [
    ["features.cache.kind=static", "features.cache.size=0.2"],
    ["features.cache.kind=lru", "features.cache.size=50"],
    ["features.macro_batch=1"],
    ["features.cache.kind=lru", "features.macro_batch=4"],
    ["features.macro_batch=5", "features.macro_batch_budget=72KB"],  # one batch fits (a batch over it is not staged)
])
def test_training_with_a_cache_gives_the_losses_of_training_without_one(tmp_path, monkeypatch, overrides):
    cached, store, cached_counts = _losses(tmp_path, monkeypatch, "cached", overrides)
    plain, host, plain_counts = _losses(tmp_path, monkeypatch, "plain", [])
    assert cached == plain
    assert isinstance(store, CachedFeatureStore) and isinstance(host, HostFeatureStore)
    assert store.stats.hits > 0, "the cache served rows"
    assert all(hits > 0 for hits, _ in cached_counts) and all(hits == 0 for hits, _ in plain_counts)
    # the same rows are requested either way: each epoch's hits + misses are the same
    assert [sum(pair) for pair in cached_counts] == [sum(pair) for pair in plain_counts]


def test_training_with_the_gns_cache_gives_the_losses_of_gns_without_it(tmp_path, monkeypatch):
    gns = ["sampling.sampler=gns", "sampling.gns.cache_fraction=0.05", "sampling.gns.refresh_every=3"]
    cached, store, _ = _losses(tmp_path, monkeypatch, "cached", gns + ["features.cache.kind=gns"])
    plain, _, _ = _losses(tmp_path, monkeypatch, "plain", gns)
    assert cached == plain
    assert store.kind == "gns" and store.stats.hits > 0 and store.stats.cache_fill_bytes > 0


# --- what the memory plan leaves for the store -----------------------------------------------------------------

def test_the_device_bytes_bound_equals_what_a_full_store_holds(x):
    """A full cache (and a full staged macro-batch) holds what ``max_device_bytes``, the planner's reservation,
    says: equal, not just below, so the plan leaves no room unused."""
    host = HostFeatureStore(x, pin=False)
    nodes = x.shape[0]
    static = CachedFeatureStore(host, CPU, "static", capacity=5, degrees=torch.arange(nodes))
    static.gather(ids(0, 1), CPU)  # the first gather fills it
    assert static.device_bytes == static.max_device_bytes == cache_module.device_bytes_bound("static", 5, nodes, ROW)
    lru = CachedFeatureStore(host, CPU, "lru", capacity=4)
    lru.gather(ids(0, 1, 2, 3, 4, 5), CPU)
    assert lru.device_bytes == lru.max_device_bytes == cache_module.device_bytes_bound("lru", 4, nodes, ROW)
    gns = CachedFeatureStore(host, CPU, "gns", 3, node_source=lambda key: ids(2, 3, 7))
    gns.begin_batch(0)
    assert gns.device_bytes == gns.max_device_bytes == cache_module.device_bytes_bound("gns", 3, nodes, ROW)
    staging = CachedFeatureStore(host, CPU, "lru", capacity=4, stage_budget=6 * ROW)
    staging.prefetch(ids(1, 2, 3, 5, 8, 13, 2))  # 6 distinct rows
    assert staging.device_bytes == staging.max_device_bytes == \
        cache_module.device_bytes_bound("lru", 4, nodes, ROW, stage_rows=6)
    assert host.device_bytes == host.max_device_bytes == 0


def test_the_planner_budget_is_what_the_feature_store_leaves():
    from betty_trainer.datasets import load_dataset
    from betty_trainer.memory.planner import make_planner

    overrides = SMALL + ["micro_batch.budget=64MB", "features.cache.kind=lru", "features.cache.size=50",
                         "features.macro_batch=2", "features.macro_batch_budget=20KB"]
    config = load_config(None, overrides)
    graph = load_dataset(config.dataset)
    row = graph.x.shape[1] * 4
    store = feature_store(config, graph, CPU, make_sampler(config, graph))
    reserved = store.max_device_bytes
    assert reserved == cache_module.device_bytes_bound("lru", 50, graph.num_nodes, row, 20_000 // row)
    planner = make_planner(config, graph, None, CPU, store)
    assert planner.feature_store_bytes == reserved and planner.budget == 64_000_000 - reserved
    small = load_config(None, overrides[:-2] + ["micro_batch.budget=8KB"])
    with pytest.raises(ConfigError, match="leaving nothing for a training step"):
        make_planner(small, graph, None, CPU, feature_store(small, graph, CPU, make_sampler(small, graph)))
    unbounded = load_config(None, overrides[:-1])
    with pytest.raises(ConfigError, match="needs features.macro_batch_budget"):
        feature_store(unbounded, graph, CPU, make_sampler(unbounded, graph))
    changed = load_config(None, [o for o in overrides[:-1] if not o.startswith("micro_batch.budget")])
    changed.micro_batch.budget = 64_000_000  # a budget set from Python after the config was validated
    with pytest.raises(ConfigError, match="needs features.macro_batch_budget"):
        feature_store(changed, graph, CPU, make_sampler(changed, graph))
    plain = load_config(None, SMALL)
    assert feature_store(plain, graph, CPU, make_sampler(plain, graph)).max_device_bytes == 0


def test_a_batch_over_the_macro_batch_budget_on_its_own_is_not_staged():
    from betty_trainer.datasets import load_dataset
    from betty_trainer.sampling.schedule import batch_rounds, epoch_seeds

    config = load_config(None, SMALL + ["features.macro_batch=2", "features.macro_batch_budget=1KB"])
    graph = load_dataset(config.dataset)
    sampler = make_sampler(config, graph)
    store = feature_store(config, graph, CPU, sampler)
    rounds = list(batch_rounds(config, sampler, epoch_seeds(config, graph, 0), 0, store.row_bytes))
    batches = [batch for round_ in rounds for _, _, batch in round_.batches]
    assert batches and all(b.input_nodes.numel() * store.row_bytes > 1000 for b in batches)
    assert all(round_.staged_nodes is None for round_ in rounds)  # each batch alone is over 1 KB: not staged


def test_evaluation_reads_through_the_host_store_not_the_training_cache(tmp_path, monkeypatch):
    """Layer-wise evaluation reads every node's rows; through an LRU cache it would evict the training
    working set each epoch, so it goes to the host store beneath the cache."""
    seen, evaluate = [], trainer_module.splits_accuracy

    def recorded(model, graph, features, *args, **kwargs):
        seen.append(features)
        return evaluate(model, graph, features, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "splits_accuracy", recorded)
    trainer_module.train(load_config(None, SMALL + ["features.cache.kind=lru", "features.cache.size=50"]),
                         run_dir=tmp_path / "run")
    assert seen and all(isinstance(features, HostFeatureStore) for features in seen)


def test_a_gns_refresh_takes_rows_a_staged_macro_batch_already_holds(x, crossing):
    store = CachedFeatureStore(HostFeatureStore(x, pin=False), CPU, "gns", node_source=lambda key: ids(2, 3, 4, 9))
    store.prefetch(ids(1, 2, 3, 4, 5))
    read = store.stats.snapshot()
    store.begin_batch(0)  # 2, 3, 4 come from the stage on the device; only 9 is read from the host
    assert store.stats - read == TransferStats(0, 0, ROW, cache_fill_bytes=ROW)
    assert torch.equal(store.gather(ids(9, 2, 4), CPU), x[ids(9, 2, 4)])


def test_a_static_cache_holds_the_nodes_most_neighbour_lists_hold_on_a_directed_graph():
    """Node 0 points at 1..5 (out-degree 5: five neighbour lists hold it, so it is read most); node 6 is pointed
    at by 1..5 (in-degree 5, read by no one). A static cache of one node holds 0, not 6."""
    src = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5])
    dst = torch.tensor([1, 2, 3, 4, 5, 6, 6, 6, 6, 6])
    graph = Graph.from_edges(src, dst, 7, symmetric=False, x=torch.randn(7, 4), y=torch.zeros(7, dtype=torch.long),
                             train_idx=torch.arange(7), val_idx=torch.arange(0), test_idx=torch.arange(0), num_classes=2)
    assert graph.out_degrees().tolist() == [5, 1, 1, 1, 1, 1, 0] and int(graph.in_degrees()[6]) == 5
    config = load_config(None, ["features.cache.kind=static", "features.cache.size=1"])
    store = feature_store(config, graph, CPU, make_sampler(config, graph))
    store.gather(torch.tensor([1]), CPU)  # the first gather fills it
    assert store.cached_nodes.tolist() == [0]
