"""The closed-form estimator against measured peaks (Betty §4.4.3, Table 7), and memory-aware planning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from betty_trainer import Batch, plan_micro_batches, sample_batch
from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.execution.micro_batches import measure_training_step
from betty_trainer.memory.planner import make_planner
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import build_model, sage, set_dropout_key
from estimator.counts import counts_of
from estimator.estimate import COMPONENTS, estimate_micro_batch


def estimate_and_measure(graph, overrides, k, fanouts=None):
    """(estimate, measured) peak bytes per micro-batch of the full training batch, steady-state Adam; the
    micro-batches after the first accumulate into the earlier ones' gradients, as in training."""
    config = load_config(None, overrides)
    torch.manual_seed(0)
    model = build_model(config.model, graph)
    set_dropout_key(model, 0, 0)
    optimizer = torch.optim.Adam(model.parameters(), weight_decay=config.optim.weight_decay)  # as train() builds it
    batch = sample_batch(graph, graph.train_idx, fanouts or [None] * config.model.num_layers,
                         torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, k, "reg", 0)
    features = HostFeatureStore(graph.x, pin=False)
    measure_training_step(model, optimizer, micro_batches[0], features, graph.y, "cpu")  # Adam state exists
    spec = model_spec(config, graph)
    pairs = []
    for index, micro_batch in enumerate(micro_batches):
        estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0)
        measured = measure_training_step(model, optimizer, micro_batch, features, graph.y, "cpu",
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0)
        assert sum(estimate.at_peak.values()) == estimate.peak_bytes
        pairs.append((estimate.peak_bytes, measured.peak_bytes))
    return pairs


CASES = [
    ("cora", ["model.arch=sage", "model.aggregator=mean", "model.hidden=64"], 1, None),
    ("cora", ["model.arch=sage", "model.aggregator=mean", "model.hidden=256"], 8, None),
    ("cora", ["model.arch=sage", "model.aggregator=gcn", "model.hidden=64", "model.num_layers=3"], 4, [5, 10, 15]),
    ("citeseer", ["model.arch=sage", "model.aggregator=gcn", "model.hidden=256"], 4, None),
    ("citeseer", ["model.arch=gcn", "model.hidden=64"], 8, None),
    ("cora", ["model.arch=gcn", "model.hidden=256", "model.num_layers=3", "model.dropout=0"], 4, None),
    ("computers8", ["model.arch=gcn", "model.hidden=16", "model.dropout=0"], 1, None),
    ("cora", ["model.arch=sage", "model.aggregator=pool", "model.hidden=64", "model.num_layers=3"], 4, [5, 10, 15]),
    ("citeseer", ["model.arch=sage", "model.aggregator=pool", "model.hidden=256"], 8, None),
    ("cora", ["model.arch=gat", "model.hidden=64", "model.heads=2"], 8, None),
    ("citeseer", ["model.arch=gat", "model.hidden=16", "model.heads=4", "model.num_layers=3"], 4, [5, 10, 15]),
    # the LSTM is as wide as its input, so on Cora's 1433 features a step takes ~45 s here: cora64 keeps 64
    ("cora64", ["model.arch=sage", "model.aggregator=lstm", "model.hidden=64"], 4, None),
    # 20 s here; 3 sampled layers are covered by the gcn, pool and gat cases above and the LSTM by the case before
    # and test_estimate_matrix's lstm rows: slow
    pytest.param("cora64", ["model.arch=sage", "model.aggregator=lstm", "model.hidden=256", "model.num_layers=3"], 8,
                 [5, 10, 15], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dataset, overrides, k, fanouts", CASES)
def test_estimate_within_tolerance_of_measured_peak(request, dataset, overrides, k, fanouts):
    graph = request.getfixturevalue(dataset)
    tolerance = TOLERANCE.get(load_config(None, overrides).model.arch, DEFAULT_TOLERANCE)  # was ±5%
    for estimate, measured in estimate_and_measure(graph, overrides, k, fanouts):
        error = (estimate - measured) / measured
        assert -tolerance <= error <= tolerance, (estimate, measured, f"{error:+.2%}")


def test_estimate_is_itemised(cora):
    config = load_config(None, [])
    batch = sample_batch(cora, cora.train_idx, [None, None])
    estimate = estimate_micro_batch(counts_of(batch.blocks), model_spec(config, cora))
    assert set(estimate.at_peak) == set(COMPONENTS)
    assert estimate.totals["input_features"] == batch.input_nodes.numel() * cora.num_features * 4
    assert estimate.totals["labels"] == cora.train_idx.numel() * 8
    params = sum(p.numel() for p in build_model(config.model, cora).parameters()) * 4
    assert estimate.at_peak["parameters"] == params
    assert estimate.resident_bytes >= 3 * params  # parameters + two Adam moments
    assert estimate.peak_bytes >= max(estimate.forward_peak_bytes, estimate.backward_peak_bytes)


def weighted(batch, seed=0):
    """The batch with positive random edge weights on every block (what LABOR/GNS samplers produce)."""
    generator = torch.Generator().manual_seed(seed)
    return Batch([dataclasses.replace(block, edge_weight=torch.rand(block.num_edges, generator=generator) + 0.5)
                  for block in batch.blocks])


# Worst error now achieved (CPU, profiler ground truth): every built-in model to the byte on the compiled CPU path
# with single-tensor Adam (the terms count the loss scalar, autograd's seed gradient and the scalars inside Adam's
# division; GAT's was 2.4% over until its terms dropped forward's reference to z).
TOLERANCE: dict[str, float] = {}
DEFAULT_TOLERANCE = 0.0
SCALAR_BYTES = 16
"""Bytes of 0-d scalars that the tensor-op kernels' path and foreach Adam make inside single operators (a Python
number wrapped as a double tensor and its copy in the parameters' dtype, 4–8 bytes each) and the terms do not
follow there: measured 8 and 12 bytes."""

MATRIX_MODELS = [
    ["model.arch=sage", "model.aggregator=mean"],
    ["model.arch=sage", "model.aggregator=gcn"],
    ["model.arch=sage", "model.aggregator=pool"],
    ["model.arch=sage", "model.aggregator=lstm"],
    ["model.arch=gcn"],
    ["model.arch=gat", "model.heads=2"],
]


@pytest.mark.parametrize("dropout", [0.5, 0.0])
@pytest.mark.parametrize("model", [MATRIX_MODELS[0], MATRIX_MODELS[2], MATRIX_MODELS[4], MATRIX_MODELS[5]],
                         ids=["mean", "pool", "gcn", "gat"])
def test_estimate_on_a_full_graph_where_every_src_node_is_a_dst_node(cora64, model, dropout):
    """Every node an output, full neighbourhood: each block's dst nodes are all its src nodes, so the layers
    take no slice of their input (``Block.dst_rows``) and autograd makes no zero-filled slice gradient. The input
    nodes are ``0 … N − 1``, so the step reads the store's rows in place (no ``(N, F)`` gather; input dropout into
    a new tensor): the planner's estimate (:meth:`PeakEstimator.itemised`) equals that step's peak to the byte, and
    the estimate with a gather equals the peak of a store that gathers (``in_place=False``), each planner's estimate
    following its store; without dropout the two differ by exactly the gathered ``N × F`` floats."""
    overrides = model + ["model.hidden=32", "model.num_layers=3", f"model.dropout={dropout}"]
    config = load_config(None, overrides)
    batch = sample_batch(cora64, torch.arange(cora64.num_nodes), [None] * 3)
    assert all(block.num_dst == block.num_src for block in batch.blocks)
    stores = {in_place: HostFeatureStore(cora64.x, pin=False, in_place=in_place) for in_place in (True, False)}
    planners = {in_place: make_planner(config, cora64, None, torch.device("cpu"), store)
                for in_place, store in stores.items()}
    assert {in_place: planner.estimator.spec.features_in_place for in_place, planner in planners.items()} \
        == {True: True, False: False}  # the planner's estimate follows the store
    estimates = {in_place: planner.estimator.itemised(batch.blocks).peak_bytes for in_place, planner in planners.items()}
    spec = model_spec(config, cora64)
    assert estimates[False] == estimate_micro_batch(counts_of(batch.blocks), spec).peak_bytes
    for in_place, estimate in estimates.items():
        torch.manual_seed(0)
        net = build_model(config.model, cora64)
        set_dropout_key(net, 0, 0)
        optimizer = torch.optim.Adam(net.parameters(), weight_decay=config.optim.weight_decay)
        store = stores[in_place]
        measure_training_step(net, optimizer, batch, store, cora64.y, "cpu")  # Adam state exists
        measured = measure_training_step(net, optimizer, batch, store, cora64.y, "cpu").peak_bytes
        assert estimate == measured, (in_place, estimate, measured)
    if dropout == 0:
        assert estimates[False] - estimates[True] == cora64.x.numel() * cora64.x.element_size()


@pytest.mark.parametrize("model", MATRIX_MODELS, ids=lambda m: m[-1].split("=")[1] if "sage" in m[0] else m[0][11:])
@pytest.mark.parametrize("edge_weights", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_estimate_matrix(cora64, model, edge_weights, dropout):
    """model × aggregator × edge weights × dropout; K = 3, so micro-batches 2 and 3 accumulate."""
    overrides = model + ["model.hidden=32", f"model.dropout={dropout}"]
    config = load_config(None, overrides)
    torch.manual_seed(0)
    net = build_model(config.model, cora64)
    set_dropout_key(net, 0, 0)
    optimizer = torch.optim.Adam(net.parameters(), weight_decay=config.optim.weight_decay)  # as train() builds it
    batch = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))
    if edge_weights:
        batch = weighted(batch)
    micro_batches = plan_micro_batches(batch, 3, "reg", 0)
    assert (micro_batches[0].blocks[0].edge_weight is not None) == edge_weights
    # Adam state exists
    measure_training_step(net, optimizer, micro_batches[0], HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu")
    spec = model_spec(config, cora64)
    tolerance = TOLERANCE.get(config.model.arch, DEFAULT_TOLERANCE)
    for index, micro_batch in enumerate(micro_batches):
        estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0).peak_bytes
        measured = measure_training_step(net, optimizer, micro_batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu",
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
        assert abs(estimate - measured) <= tolerance * measured, (index, estimate, measured)


def test_a_layer_whose_code_changes_is_estimated_from_its_new_code(cora64, monkeypatch):
    """The terms are recorded from the layer's code, so a change to it changes the estimate with it: SAGE-mean
    aggregating by gather-scatter (an (E, F) message tensor kept for backward, as the layer did before its sparse
    matmul) is estimated to the measured byte, well above the sparse matmul's estimate."""
    from betty_trainer.models.recorded_terms import RecordedStack

    def gather_scatter_mean(block, h_src):
        messages = h_src.index_select(0, block.indices)
        total = torch.zeros(block.num_dst, h_src.shape[1]).index_add_(0, block.edge_dst(), messages)
        return total / block.in_degrees().clamp(min=1).unsqueeze(1)

    config = load_config(None, ["model.arch=sage", "model.aggregator=mean", "model.hidden=32", "model.dropout=0"])
    batch = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))

    def estimate_and_measured() -> tuple[int, int]:
        torch.manual_seed(0)
        net = build_model(config.model, cora64)
        terms = RecordedStack(net)  # recorded now, from the code as it is
        spec = dataclasses.replace(model_spec(config, cora64), forward_terms=terms.memory_terms,
                                   layer_terms=terms.layer_memory_terms)
        optimizer = torch.optim.Adam(net.parameters())
        measure_training_step(net, optimizer, batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu")
        measured = measure_training_step(net, optimizer, batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu")
        return estimate_micro_batch(counts_of(batch.blocks), spec).peak_bytes, measured.peak_bytes

    sparse, measured = estimate_and_measured()
    assert sparse == measured
    monkeypatch.setattr(sage, "mean_neighbours", gather_scatter_mean)
    messages, measured = estimate_and_measured()
    assert messages == measured
    assert messages - sparse >= batch.blocks[0].num_edges * 32 * 4  # layer 0's (E, 32) messages, kept


@pytest.mark.parametrize("model", [MATRIX_MODELS[0], MATRIX_MODELS[2], MATRIX_MODELS[4]], ids=["mean", "pool", "gcn"])
def test_estimate_of_the_tensor_op_kernels(cora64, monkeypatch, model):
    """The tensor-op paths (what runs on GPUs: chunked dropout hashing, argsort transpose, chunked segment
    max), run here on the CPU with the compiled kernels switched off, against the estimate that models them."""
    from betty_trainer.models import aggregate, dropout

    for module in (aggregate, dropout):
        monkeypatch.setattr(module, "compiled_kernels", lambda device, dtype: False)
    config = load_config(None, model + ["model.hidden=32", "model.dropout=0.5"])
    torch.manual_seed(0)
    net = build_model(config.model, cora64)
    set_dropout_key(net, 0, 0)
    optimizer = torch.optim.Adam(net.parameters(), weight_decay=config.optim.weight_decay)
    batch = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, 2, "reg", 0)
    measure_training_step(net, optimizer, micro_batches[0], HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu")
    spec = dataclasses.replace(model_spec(config, cora64), compiled_kernels=False)
    for index, micro_batch in enumerate(micro_batches):
        estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0).peak_bytes
        measured = measure_training_step(net, optimizer, micro_batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu",
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
        assert 0 <= measured - estimate <= SCALAR_BYTES, (index, estimate, measured)


@pytest.mark.parametrize("model", [MATRIX_MODELS[0], MATRIX_MODELS[5]], ids=["mean", "gat"])
def test_estimate_of_adams_foreach_path(cora64, model):
    """Adam's multi-tensor (foreach) step, CUDA's default, run here on the CPU where it is opt-in, with a
    hidden width where the optimizer step sets SAGE's peak (its square roots of every moment at once). GAT's peak
    stays in its backward (its attention's per-edge tensors), where the two paths are the same bytes."""
    config = load_config(None, model + ["model.hidden=256", "model.dropout=0.5"])
    torch.manual_seed(0)
    net = build_model(config.model, cora64)
    set_dropout_key(net, 0, 0)
    optimizer = torch.optim.Adam(net.parameters(), weight_decay=config.optim.weight_decay, foreach=True)
    batch = sample_batch(cora64, cora64.train_idx[:8], [2, 2], torch.Generator().manual_seed(0))
    measure_training_step(net, optimizer, batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu")
    measured = measure_training_step(net, optimizer, batch, HostFeatureStore(cora64.x, pin=False), cora64.y, "cpu").peak_bytes
    foreach = dataclasses.replace(model_spec(config, cora64), foreach=True)
    single = dataclasses.replace(foreach, foreach=False)
    tolerance = TOLERANCE.get(config.model.arch, DEFAULT_TOLERANCE)
    assert abs(estimate_micro_batch(counts_of(batch.blocks), foreach).peak_bytes - measured) <= \
        tolerance * measured + SCALAR_BYTES
    if config.model.arch != "gat":  # the two paths are told apart where the optimizer step sets the peak
        assert estimate_micro_batch(counts_of(batch.blocks), single).peak_bytes != \
            estimate_micro_batch(counts_of(batch.blocks), foreach).peak_bytes


def with_self_edges(batch):
    """The batch with one more in-edge per dst node of every block: the node itself (local src position ``d``), last
    in its row (a user's blocks may carry self loops; ours never do: graphs drop them when built)."""
    blocks = []
    for block in batch.blocks:
        degrees = block.indptr.diff()
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), (degrees + 1).cumsum(0)])
        indices = torch.empty(block.num_edges + block.num_dst, dtype=block.indices.dtype)
        own = indptr[1:] - 1  # each row's last slot
        mask = torch.ones(indices.numel(), dtype=torch.bool)
        mask[own] = False
        indices[mask], indices[own] = block.indices, torch.arange(block.num_dst, dtype=block.indices.dtype)
        blocks.append(dataclasses.replace(block, indptr=indptr, indices=indices))
    return Batch(blocks)


@pytest.mark.parametrize("edge_weights", [False, True], ids=["unweighted", "weighted"])
def test_gat_on_blocks_with_self_edges_is_estimated_to_the_byte_and_attends_as_without_them(cora64, edge_weights):
    """GAT gives a block's own self edges no attention (a score of −∞) instead of dropping them, so its tensors'
    sizes are the counts' (E + D edges attended, E counting the self edges): the estimate equals the measured peak
    on such blocks, and the logits equal those of the same blocks without the self edges."""
    config = load_config(None, ["model.arch=gat", "model.hidden=16", "model.heads=2", "model.dropout=0.5"])
    torch.manual_seed(0)
    net = build_model(config.model, cora64)
    set_dropout_key(net, 0, 0)
    optimizer = torch.optim.Adam(net.parameters(), weight_decay=config.optim.weight_decay)
    plain = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))
    plain = weighted(plain) if edge_weights else plain
    looped = with_self_edges(plain)
    if edge_weights:  # the self edges' own weights, which their −∞ score makes irrelevant
        looped = Batch([dataclasses.replace(b, edge_weight=torch.full((b.num_edges,), 3.0)) for b in looped.blocks])
        for p, b in zip(plain.blocks, looped.blocks):  # the other edges keep their weights
            keep = torch.ones(b.num_edges, dtype=torch.bool)
            keep[b.indptr[1:] - 1] = False
            b.edge_weight[keep] = p.edge_weight
    features = HostFeatureStore(cora64.x, pin=False)
    measure_training_step(net, optimizer, looped, features, cora64.y, "cpu")  # Adam state exists
    spec = model_spec(config, cora64)
    estimate = estimate_micro_batch(counts_of(looped.blocks), spec).peak_bytes
    assert estimate == measure_training_step(net, optimizer, looped, features, cora64.y, "cpu").peak_bytes
    net.eval()
    with torch.no_grad():
        x = features.gather(plain.input_nodes, torch.device("cpu"))
        assert torch.equal(net(looped.blocks, x), net(plain.blocks, x))  # α = 0 adds exact zeros


@pytest.mark.parametrize("arch", ["sage-mean", "sage-pool", "gcn", "gin", "gat"])
def test_a_hidden_layer_whose_input_only_the_call_holds_is_estimated_to_the_byte(cora, arch):
    """A cooperative share's exchanged rows reach ``layer_forward`` as an argument that nothing else keeps: its
    frame holds them until the layer returns, beside the dropout's copy. The stack's terms once let them go at the
    dropout (1.2 MB under on a 1,400-row block at 256 columns); the forward's peak, measured, against the terms
    the estimate replays (recorded; SAGE pool's written by hand where the recorder refuses it)."""
    from estimator.measure import measure_peak
    from estimator.tape import Replay, StepTape
    from tests.test_recorded_terms import MODELS

    config = load_config(None, [*MODELS[arch], "model.num_layers=3", "model.hidden=256", "model.dropout=0.5"])
    torch.manual_seed(0)
    model = build_model(config.model, cora)
    set_dropout_key(model, 0, 0)
    block = sample_batch(cora, cora.train_idx[:60], [None, None, None]).blocks[1]
    rows, width = block.num_src, model.widths[1]
    measured = measure_peak(lambda: model.layer_forward(1, block, torch.ones(rows, width).requires_grad_()), "cpu",
                            list(model.parameters()))
    replay, spec = Replay(), model_spec(config, cora)
    spec.layer_terms(StepTape(replay, spec, accumulate=False), 1, counts_of([block])[0],
                     replay.alloc(rows * width * 4, "rows"), True)
    assert replay.peak == measured.peak_bytes - measured.resident_bytes
