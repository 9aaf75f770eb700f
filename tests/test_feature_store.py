"""The feature store seam (DESIGN.md › Seams): gathers equal ``x[ids]``, transfer counters are exact, the
staging buffer is reused, and the training step gathers through a store, one micro-batch alive at a time."""

from __future__ import annotations

import json
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn

from betty_trainer import (
    FeatureStore,
    GraphSAGE,
    HostFeatureStore,
    MicroBatches,
    TransferStats,
    accumulate_gradients,
    build_model,
    load_config,
    make_sbm,
    plan_micro_batches,
    sample_batch,
)
from betty_trainer.data.feature_store import hands_out_rows, same_device, transfer_bytes
from betty_trainer.execution.micro_batches import micro_batch_backward
from betty_trainer.models import set_dropout_key
from betty_trainer.models.registry import as_built
from betty_trainer.training import trainer as trainer_module
from estimator.counts import leading_range
from partition import make_split

CPU = torch.device("cpu")
META = torch.device("meta")  # a device other than the storage's, on a machine without a GPU


@pytest.fixture
def x():
    return torch.randn(500, 7, generator=torch.Generator().manual_seed(0))


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    """Unordered ids with repeats, as a batch's input nodes never are but a store must allow."""
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_gather_on_the_storage_device_equals_indexing_and_moves_nothing(x):
    store = HostFeatureStore(x, pin=False)
    ids = ids_of(123)
    rows = store.gather(ids, CPU)
    assert torch.equal(rows, x[ids])
    rows.zero_()  # a new tensor, not a view of the store
    assert torch.equal(store.x, x) and store.x.abs().sum() > 0
    assert store.stats == TransferStats(hits=0, misses=123, host_to_device_bytes=0)
    assert store.staging_rows == 0, "a gather to the storage device is not staged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bytes_moved_are_rows_times_row_bytes_when_the_devices_differ(x, dtype):
    store = HostFeatureStore(x.to(dtype), pin=False)
    first = store.gather(ids_of(100), META)
    assert first.device == META and first.shape == (100, 7) and first.dtype == dtype
    assert store.stats == TransferStats(0, 100, 100 * 7 * dtype.itemsize)
    before = store.stats.snapshot()
    store.gather(ids_of(40, 1), META)
    store.gather(ids_of(60, 2), CPU)  # same device: rows read, nothing moved
    assert store.stats - before == TransferStats(0, 100, 40 * 7 * dtype.itemsize)
    assert store.stats == TransferStats(0, 200, 140 * 7 * dtype.itemsize)


def test_transfer_bytes_counts_only_moves_between_different_devices():
    assert transfer_bytes(10, 28, "cpu", "cpu:0") == 0
    assert transfer_bytes(10, 28, "cpu", "meta") == 280
    assert transfer_bytes(0, 28, "cpu", "meta") == 0
    assert same_device("cpu", torch.device("cpu", 0)) and not same_device("cpu", "meta")


def test_staging_buffer_is_reused_by_smaller_gathers_and_grows_for_larger_ones(x):
    store = HostFeatureStore(x, pin=False)
    store.gather(ids_of(100), META)
    assert store.staging_rows == 100
    buffer = store._staging.data_ptr()
    for n in (40, 100, 1):
        ids = ids_of(n, n)
        assert torch.equal(store._stage(ids), x[ids])
        store.gather(ids, META)
        assert store.staging_rows == 100 and store._staging.data_ptr() == buffer, f"grew for {n} rows"
    ids = ids_of(120, 3)
    store.gather(ids, META)
    assert store.staging_rows == 150, "grows by STAGING_GROWTH (1.5×) when 1.5× covers the request"
    assert torch.equal(store._stage(ids), x[ids])
    store.gather(ids_of(400, 4), META)
    assert store.staging_rows == 400, "or to the request when it is larger"


def test_the_step_and_evaluation_refuse_a_raw_tensor_naming_the_wrapper(x):
    """The API took a raw (N, F) tensor before it took a store only: a tensor now gets a one-line fix."""
    from betty_trainer import Graph, evaluate

    n = x.shape[0]
    labels = torch.zeros(n, dtype=torch.long)
    ring = Graph.from_edges(torch.arange(n), (torch.arange(n) + 1) % n, n, x=x, y=labels, train_idx=torch.arange(n),
                            val_idx=torch.arange(0), test_idx=torch.arange(0), num_classes=2)
    batch = sample_batch(ring, torch.arange(4), [None])
    model = GraphSAGE(x.shape[1], 4, 2, 1, "mean", 0.0)
    for call in (lambda: accumulate_gradients(model, [batch], x, labels, CPU),
                 lambda: evaluate(model, [batch], x, labels, CPU)):
        with pytest.raises(TypeError, match=r"wrap an \(N, F\) tensor x as HostFeatureStore\(x\)"):
            call()


def test_a_host_store_wraps_a_tensor_without_copying(x):
    store = HostFeatureStore(x, pin=False)
    assert isinstance(store, FeatureStore)
    assert store.x is x and not store.pinned, "an unpinned store keeps the tensor as it is (no copy of the matrix)"
    with pytest.raises(ValueError, match=r"\(N, F\)"):
        HostFeatureStore(x[:, 0])
    assert HostFeatureStore(x).pinned == torch.cuda.is_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host→GPU path needs a CUDA GPU")
def test_pinned_staging_to_a_gpu_is_exact_and_not_overwritten_while_copying(x):
    store = HostFeatureStore(x)
    assert store.pinned and store.x.is_pinned()
    big, small = ids_of(400), ids_of(30, 1)
    first = store.gather(big, "cuda")
    second = store.gather(small, "cuda")  # rewrites the staging buffer the first copy read from
    assert store._staging.is_pinned()
    assert torch.equal(first.cpu(), x[big]) and torch.equal(second.cpu(), x[small])
    assert store.stats == TransferStats(0, 430, 430 * 7 * 4)


def test_the_host_store_hands_out_its_leading_rows_as_a_view_on_the_cpu_only(x):
    """``view`` gives ``x[:n]`` itself (no copy, counted as n misses and no bytes moved) for ids ``0 … n − 1`` in
    order on the CPU, and ``None`` for any other ids, another device or a store made with ``in_place=False``; a step
    asks only a plain host store (``hands_out_rows``), not a subclass of it."""
    store = HostFeatureStore(x, pin=False)
    view = store.view(torch.arange(10), "cpu")
    assert view.data_ptr() == x.data_ptr() and view.shape == (10, x.shape[1])
    assert store.stats.misses == 10 and store.stats.host_to_device_bytes == 0
    for ids in (torch.tensor([0, 2, 1]), torch.arange(1, 5), torch.tensor([], dtype=torch.int64)):
        assert store.view(ids, "cpu") is None
    assert store.view(torch.arange(10), "meta") is None and not store.views_rows("cuda")
    assert HostFeatureStore(x, pin=False, in_place=False).view(torch.arange(10), "cpu") is None
    assert store.stats.misses == 10
    assert hands_out_rows(store, "cpu") and not hands_out_rows(store, "meta")
    assert not hands_out_rows(HostFeatureStore(x, pin=False, in_place=False), "cpu")
    assert not hands_out_rows(PretendRemoteStore(x, pin=False), "cpu")  # a subclass may do more in its gather
    swapped = torch.arange(70_000)  # compared in chunks of 2^16 ids: a difference in the second chunk counts
    swapped[[66_000, 66_001]] = swapped[[66_001, 66_000]]
    assert leading_range(torch.arange(70_000)) and not leading_range(swapped)


@pytest.mark.parametrize("arch", ["model.arch=sage", "model.arch=gat"])
def test_a_step_reading_the_store_in_place_equals_the_gathering_step_and_leaves_the_features_alone(arch):
    """A full-graph batch with every node an output in order: the step reads ``x`` in place (dropout 0.5 writes a
    new tensor, never ``x``), its loss and every gradient have the bits of the same step on a gathered copy, and
    ``x`` is unchanged."""
    graph = make_sbm(num_nodes=300, num_features=12, avg_degree=6, train_per_class=20, num_val=20, num_test=20)
    x = graph.x.clone()
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    assert batch.input_nodes.equal(torch.arange(graph.num_nodes))
    results = []
    for in_place in (True, False):
        config = load_config(None, [arch, "model.hidden=16", "model.dropout=0.5"])
        torch.manual_seed(0)
        model = build_model(config.model, graph)
        set_dropout_key(model, 0, 3)
        store = HostFeatureStore(graph.x, pin=False, in_place=in_place)
        gathers = []
        store.gather = lambda *args, calls=gathers, gather=store.gather: calls.append(args) or gather(*args)
        loss, _ = micro_batch_backward(model, batch, store, graph.y, torch.device("cpu"), graph.num_nodes)
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
        assert store.stats.misses == graph.num_nodes and len(gathers) == (0 if in_place else 1)
    (loss_view, grads_view), (loss_gather, grads_gather) = results
    assert loss_view == loss_gather and all(torch.equal(a, b) for a, b in zip(grads_view, grads_gather))
    assert torch.equal(graph.x, x)


@pytest.mark.parametrize("overrides", [["model.arch=sage", "model.aggregator=mean"], ["model.arch=sage", "model.aggregator=lstm"],
                                       ["model.arch=sage", "model.aggregator=pool"], ["model.arch=gcn"], ["model.arch=gat"],
                                       ["model.arch=gin"]], ids=["sage", "sage-lstm", "sage-pool", "gcn", "gat", "gin"])
def test_every_built_in_model_as_built_reads_the_store_in_place(overrides):
    """``as_built`` holds for every registered architecture as ``build_model`` makes it, so each reads a full-graph
    batch's features in place (no gather), and the features stay as they were after a step with dropout 0."""
    graph = make_sbm(num_nodes=200, num_features=10, avg_degree=5, train_per_class=15, num_val=10, num_test=10)
    x = graph.x.clone()
    torch.manual_seed(0)
    model = build_model(load_config(None, [*overrides, "model.hidden=8", "model.dropout=0"]).model, graph)
    assert as_built(model)
    store = HostFeatureStore(graph.x, pin=False)
    store.gather = lambda *args: pytest.fail("a built-in model as built gathered a full-graph batch's rows")
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    micro_batch_backward(model, batch, store, graph.y, CPU, graph.num_nodes)
    assert torch.equal(graph.x, x) and store.stats.misses == graph.num_nodes


class Centring(nn.Module):
    """Centres the input features in place (a user's layer may write the rows it is given), then runs ``inner``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, block, h):
        return self.inner(block, h if h.requires_grad else h.sub_(h.mean(0)))  # the input features only


class CentringSAGE(GraphSAGE):
    """A user's GraphSAGE subclass whose layers centre their input features in place."""

    def apply_layer(self, layer, block, h):
        return layer(block, h if h.requires_grad else h.sub_(h.mean(0)))


def _swapped_layer(model: GraphSAGE) -> GraphSAGE:
    model.layers[0] = Centring(model.layers[0])
    return model


def _patched_method(model: GraphSAGE) -> GraphSAGE:
    model.apply_layer = lambda layer, block, h: CentringSAGE.apply_layer(model, layer, block, h)
    return model


@pytest.mark.parametrize("make", [lambda *a: CentringSAGE(*a, num_layers=2, dropout=0.0),
                                  lambda *a: _swapped_layer(GraphSAGE(*a, num_layers=2, dropout=0.0)),
                                  lambda *a: _patched_method(GraphSAGE(*a, num_layers=2, dropout=0.0))],
                         ids=["subclass", "swapped-layer", "patched-method"])
def test_a_model_that_may_write_its_input_gets_a_gather(make):
    """Only a built-in model as built reads the store's rows in place (``as_built``): a subclass, a built-in model
    with a layer of the user's or a method set on the instance, each writing its input in place (dropout 0, so
    nothing copies it first), gets a gathered copy, and the features stay as they were."""
    graph = make_sbm(num_nodes=300, num_features=12, avg_degree=6, train_per_class=20, num_val=20, num_test=20)
    x = graph.x.clone()
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    model = make(graph.num_features, 16, graph.num_classes)
    assert not as_built(model) and as_built(GraphSAGE(graph.num_features, 16, graph.num_classes))
    store = HostFeatureStore(graph.x, pin=False)
    micro_batch_backward(model, batch, store, graph.y, CPU, graph.num_nodes)
    assert torch.equal(graph.x, x) and store.stats.misses == graph.num_nodes


def test_micro_batches_are_built_when_read_and_equal_the_planned_ones():
    graph = make_sbm(num_nodes=400, num_features=16, avg_degree=6, train_per_class=30, num_val=20, num_test=20)
    batch = sample_batch(graph, graph.train_idx, [5, 5], torch.Generator().manual_seed(0))
    eager = plan_micro_batches(batch, 3, "range", seed=0)
    lazy = MicroBatches(batch, make_split(batch.blocks, k=3, partitioner="range", seed=0).groups)
    assert len(lazy) == 3 and lazy.num_outputs == batch.output_nodes.numel()
    for built in (list(lazy), lazy[0:3], [lazy[i] for i in range(3)]):
        for one, other in zip(eager, built):
            for a, b in zip(one.blocks, other.blocks):
                assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indices, b.indices)
                assert torch.equal(a.indptr, b.indptr) and a.num_dst == b.num_dst


class WatchedMicroBatches(MicroBatches):
    """Checks, as each micro-batch is built, that the one before it is no longer referenced."""

    def __iter__(self):
        previous = None
        for micro_batch in super().__iter__():
            assert previous is None or previous() is None, "the previous micro-batch is still alive"
            previous = weakref.ref(micro_batch)
            yield micro_batch
            del micro_batch


def test_training_gathers_through_the_store_with_one_micro_batch_alive():
    graph = make_sbm(num_nodes=400, num_features=16, avg_degree=6, train_per_class=30, num_val=20, num_test=20)
    batch = sample_batch(graph, graph.train_idx, [5, 5], torch.Generator().manual_seed(0))
    plan = make_split(batch.blocks, k=4, partitioner="range", seed=0)
    torch.manual_seed(0)
    model = GraphSAGE(16, 8, graph.num_classes, 2, "mean", 0.0)
    accumulate_gradients(model, plan_micro_batches(batch, 4, "range", 0), HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    store = HostFeatureStore(graph.x, pin=False)
    accumulate_gradients(model, WatchedMicroBatches(batch, plan.groups), store, graph.y, CPU)
    for expected, got in zip(reference, (p.grad for p in model.parameters())):
        assert torch.equal(expected, got)
    assert store.stats == TransferStats(0, sum(sizes[0].num_src for sizes in plan.sizes), 0)


class PretendRemoteStore(HostFeatureStore):
    """Counts every gather as if it crossed to another device; logs each gather's bytes."""

    log: ClassVar[list[int]] = []

    def gather(self, node_ids, device):
        self.stats.host_to_device_bytes += node_ids.numel() * self.row_bytes
        PretendRemoteStore.log.append(node_ids.numel() * self.row_bytes)
        return super().gather(node_ids, device)


def test_metrics_record_the_bytes_training_moved_in_each_epoch(tmp_path, monkeypatch):
    windows, splits_accuracy = [], trainer_module.splits_accuracy

    def marked(*args, **kwargs):  # evaluation's gathers fall in [start, end) of the log
        start = len(PretendRemoteStore.log)
        result = splits_accuracy(*args, **kwargs)
        windows.append((start, len(PretendRemoteStore.log)))
        return result

    monkeypatch.setattr(PretendRemoteStore, "log", [])
    monkeypatch.setattr(trainer_module, "HostFeatureStore", PretendRemoteStore)
    monkeypatch.setattr(trainer_module, "splits_accuracy", marked)
    config = load_config(None, ["optim.epochs=2", "train.progress=false", "dataset.synthetic.num_nodes=600",
                                "dataset.synthetic.num_val=100", "dataset.synthetic.num_test=100",
                                "micro_batch.num_micro_batches=3", "sampling.fanouts=5,5", "sampling.batch_size=40"])
    trainer_module.train(config, run_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    log = PretendRemoteStore.log
    (start0, end0), (start1, _) = windows
    assert start1 > end0 > start0, "both epochs gathered for training and for evaluation"
    per_epoch = [sum(log[:start0]), sum(log[end0:start1])]
    assert all(value > 0 for value in per_epoch)
    assert [line["host_to_device_bytes"] for line in lines] == per_epoch, "training's gathers only, per epoch"


# --- memory-mapped features (issue 9): read on demand, never copied whole ---------------------------------


def _rss_anon_bytes() -> int:
    """Anonymous resident memory of this process (what a copy of the features would add; pages of a
    mapped file are counted apart, as RssFile)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def mapped_graph(tmp_path_factory):
    """A power-law graph generated into the on-disk cache and mapped from it: x is (16000, 1024) float32, 65.5 MB."""
    from betty_trainer.datasets import make_powerlaw

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BETTY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return make_powerlaw(num_nodes=16_000, num_edges=160_000, num_classes=4, num_features=1024, exponent=2.5,
                             homophily=0.8, feature_signal=0.3, train_fraction=0.05, val_fraction=0.01,
                             test_fraction=0.01, seed=0)


def test_a_cached_graph_s_features_are_a_file_mapping_and_in_memory_ones_are_not(mapped_graph):
    from betty_trainer.data.feature_store import is_file_backed

    assert is_file_backed(mapped_graph.x) and is_file_backed(mapped_graph.x[100:])
    assert not is_file_backed(mapped_graph.x.clone()) and not is_file_backed(torch.ones(10**6))


def test_pinning_a_memory_mapped_matrix_keeps_the_mapping_instead_of_copying_it(mapped_graph):
    store = HostFeatureStore(mapped_graph.x, pin=True)  # an in-RAM matrix would be copied into pinned memory
    assert store.memory_mapped and store.pinned and store.x is mapped_graph.x
    ids = torch.tensor([5, 15_999, 5, 77])
    assert torch.equal(store.gather(ids, CPU), mapped_graph.x[ids])


def test_training_on_memory_mapped_features_reads_only_the_batch_rows(mapped_graph):
    graph = mapped_graph
    batch = sample_batch(graph, graph.train_idx[:64], [5, 5], torch.Generator().manual_seed(0))

    def gradients(features):
        torch.manual_seed(0)
        model = GraphSAGE(graph.num_features, 16, graph.num_classes, 2, "mean", 0.0)
        accumulate_gradients(model, plan_micro_batches(batch, 2, "range", 0), features, graph.y, CPU)
        return [p.grad for p in model.parameters()]

    before = _rss_anon_bytes()
    store = HostFeatureStore(graph.x, pin=False)
    mapped = gradients(store)
    grown = _rss_anon_bytes() - before
    assert store.memory_mapped and store.stats.misses >= batch.blocks[0].num_src
    assert grown < graph.x.nbytes // 4, f"anonymous memory grew by {grown} bytes: a copy of the features?"
    in_memory = gradients(HostFeatureStore(graph.x.clone(), pin=False))
    assert all(torch.equal(a, b) for a, b in zip(mapped, in_memory)), "same gradients as from an in-RAM matrix"
