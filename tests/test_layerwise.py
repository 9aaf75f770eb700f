"""Layer-wise chunked execution with recomputation equals the full-batch gradient (issue 10), for every
built-in model, dropout on, full neighbourhood and sampled, on Cora and Amazon Computers."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from betty_trainer import GCN, GraphSAGE, accumulate_gradients, load_config, make_sbm, sample_batch
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.execution.layerwise import LayerwisePlan, layerwise_backward, measure_layerwise_step
from betty_trainer.memory.planner import Planner
from betty_trainer.memory.spec import spec_of
from betty_trainer.models import set_dropout_key
from betty_trainer.models.capabilities import affine_layers, whole_block_layers
from betty_trainer.models.gat import GAT
from betty_trainer.models.sage import SAGEConv
from betty_trainer.models.stack import runs_layer_by_layer
from betty_trainer.rng import compiled_kernels
from estimator.counts import counts_of
from estimator.layerwise import estimate_layerwise
from estimator.peaks import PeakEstimator
from partition.chunks import chunk_floor, chunk_layers
from tests.test_estimator import DEFAULT_TOLERANCE  # the micro-batch estimator's bound (0: to the byte)

CPU = torch.device("cpu")
# the micro-batch exactness bound of tests/test_exactness.py (1e-5 of the largest entry), taken over the whole
# gradient: per tensor, a bias of 7 entries that cancel to 1e-5 of their summands turns float32 round-off
# (2⁻²⁴ per addition) into a relative error of 1e-5 on its own
BOUND = 1e-5
# DEFAULT_TOLERANCE, the micro-batch estimator's bound, holds layer-wise too: measured on the CPU, the layer-wise
# estimate equals the peak to the byte for every built-in model (SAGE-pool at 4 and 16 chunks was 12 bytes under
# until the terms counted the scalars inside Adam's division)


def layerwise_peak(planner: Planner, batch, chunks, host_outputs: bool | None = None) -> int:
    """The planner's estimate of ``batch`` run layer by layer in ``chunks`` (``h_l`` where ``chunks`` says, unless
    ``host_outputs`` is given)."""
    host = chunks.host_outputs if host_outputs is None else host_outputs
    return planner.estimator.layerwise(batch.blocks).peak(chunks.layers, host)


def layerwise_floor(planner: Planner, batch) -> int:
    """The floor the planner's chunk search refuses a budget below."""
    return chunk_floor(batch.blocks, planner.estimator.layerwise(batch.blocks), planner.device.type != "cpu")


@pytest.fixture(scope="module")
def computers64(computers):
    return dataclasses.replace(computers, x=computers.x[:, :64].contiguous())  # 767 features: 64 keep the LSTM fast


def make(arch: str, graph, seed: int = 0, hidden: int = 16):
    torch.manual_seed(seed)
    f, c = graph.num_features, graph.num_classes
    if arch == "gcn":
        return GCN(f, hidden, c, graph.in_degrees(), 2, 0.5)
    if arch == "gat":
        return GAT(f, hidden // 2, c, 2, heads=2, dropout=0.5)
    return GraphSAGE(f, hidden, c, 2, arch.removeprefix("sage-"), 0.5)


def full_batch_gradients(model, batch, graph):
    model.zero_grad(set_to_none=True)
    loss, correct = accumulate_gradients(model, [batch], HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    return [p.grad.clone() for p in model.parameters()], loss, correct


def layerwise_gradients(model, batch, graph, k):
    model.zero_grad(set_to_none=True)
    loss, correct = layerwise_backward(model, batch, chunk_layers(batch.blocks, k, "metis", seed=1),
                                       HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    return [p.grad.clone() for p in model.parameters()], loss, correct


def assert_same(reference, candidate):
    (ref_grads, ref_loss, ref_correct), (grads, loss, correct) = reference, candidate
    assert correct == ref_correct
    assert loss == pytest.approx(ref_loss, rel=1e-6)  # Σ CE regrouped by chunk: float32, ~1e-7 relative per add
    scale = max(ref.abs().max() for ref in ref_grads)
    assert scale > 0
    for ref, got in zip(ref_grads, grads):
        assert ref.abs().max() > 0
        assert (ref - got).abs().max() <= BOUND * scale


ARCHS = ["sage-mean", "sage-gcn", "sage-pool", "sage-lstm", "gcn", "gat"]


@pytest.mark.parametrize("fanouts", [[None, None], [10, 25]], ids=["full-neighbourhood", "sampled-10-25"])
@pytest.mark.parametrize("arch", ARCHS)
def test_layerwise_equals_full_batch_on_cora(cora64, arch, fanouts):
    seeds = cora64.train_idx
    if arch == "sage-lstm":  # one LSTM step per in-degree: Cora's hubs (168) make the full neighbourhood slow
        fanouts, seeds = [10, 10] if fanouts[0] is None else fanouts, seeds[:20]
    model = make(arch, cora64)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora64, seeds, fanouts, torch.Generator().manual_seed(5))
    reference = full_batch_gradients(model, batch, cora64)
    for k in (2, 8, 32):
        assert_same(reference, layerwise_gradients(model, batch, cora64, k))


def _amazon_cases():
    """Every architecture and fanout, as on Cora; only GCN on the full neighbourhood runs by default, the rest are
    ``slow`` (minutes together on 2 cores): the Cora test above checks the same equality for each of them."""
    for arch in ARCHS:
        for fanouts, name in (([None, None], "full-neighbourhood"), ([10, 25], "sampled-10-25")):
            kept = (arch, name) == ("gcn", "full-neighbourhood")
            yield pytest.param(arch, fanouts, id=f"{arch}-{name}", marks=() if kept else pytest.mark.slow)


@pytest.mark.parametrize("arch, fanouts", list(_amazon_cases()))
def test_layerwise_equals_full_batch_on_amazon_computers(computers64, arch, fanouts):
    computers = computers64
    model = make(arch, computers)
    set_dropout_key(model, seed=1, step=4)
    seeds = torch.randperm(computers.num_nodes, generator=torch.Generator().manual_seed(0))[:150]
    if arch == "sage-lstm":  # one LSTM step per in-degree: Amazon's hubs make wide fanouts slow
        fanouts, seeds = [5, 5], seeds[:20]
    batch = sample_batch(computers, seeds, fanouts, torch.Generator().manual_seed(2))
    reference = full_batch_gradients(model, batch, computers)
    for k in (2, 8, 32):
        assert_same(reference, layerwise_gradients(model, batch, computers, k))


@pytest.mark.parametrize("arch", ["sage-mean", "sage-gcn", "gat"])
def test_a_projecting_layer_projects_its_block_s_src_rows_once_per_pass(cora, arch, monkeypatch):
    """Layers that project before aggregating (GAT; SAGE mean/gcn with F_in > F_out, 1433 → 16 → 7 here)
    project each src row of their block once in the forward and once in the recompute, not once per chunk
    that reads it (the chunks' src rows add up to more: the layer-wise redundancy); an affine layer run off the
    whole block (SAGE mean/gcn, with the compiled CPU kernels) only once: its backward recomputes nothing."""
    model = make(arch, cora)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    chunks = chunk_layers(batch.blocks, 8, "metis", seed=0)
    projected_rows = [0] * len(model.layers)
    for index, layer in enumerate(model.layers):
        def counting(h, index=index, project=layer.project):
            projected_rows[index] += h.shape[0]
            return project(h)
        monkeypatch.setattr(layer, "project", counting)
    layerwise_backward(model, batch, chunks, HostFeatureStore(cora.x, pin=False), cora.y, CPU)
    whole_block = [rows and compiled_kernels(CPU, torch.float32) for rows in whole_block_layers(model)]
    assert whole_block == [arch != "gat"] * 2
    assert projected_rows == [(1 if whole else 2) * block.num_src for whole, block in zip(whole_block, batch.blocks)]
    assert all(sum(piece.num_src for piece in pieces) > block.num_src for block, pieces in zip(batch.blocks, chunks.layers))


def test_layerwise_dropout_really_applies(cora):
    """Guards the tests above: with dropout the recomputed masks matter (the gradient differs from p=0)."""
    model = make("sage-mean", cora)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    with_dropout = layerwise_gradients(model, batch, cora, 4)[0]
    model.dropout.p = 0.0
    without = layerwise_gradients(model, batch, cora, 4)[0]
    assert (with_dropout[0] - without[0]).abs().max() > 1e-3 * without[0].abs().max()


def test_a_model_that_cannot_run_layer_by_layer_is_refused(cora):
    class Custom(GraphSAGE):
        def forward(self, blocks, x, consume_input=False):
            return super().forward(blocks, x) * 2

    model = Custom(cora.num_features, 8, cora.num_classes)
    assert not runs_layer_by_layer(model) and runs_layer_by_layer(make("gcn", cora))
    batch = sample_batch(cora, cora.train_idx[:10], [None, None])
    with pytest.raises(ValueError, match="cannot run layer by layer.*micro_batch.mode=micro_batches"):
        layerwise_backward(model, batch, chunk_layers(batch.blocks, 2), HostFeatureStore(cora.x, pin=False), cora.y, CPU)


def test_every_hidden_node_is_computed_once_per_pass(cora):
    """The chunks of a layer partition its dst nodes: no node is computed twice, none is left out; the slice a
    chunk makes when it runs has the shape the chunk was planned with."""
    batch = sample_batch(cora, cora.train_idx, [None, None])
    chunks = chunk_layers(batch.blocks, 8, "metis", seed=0)
    for block, pieces in zip(batch.blocks, chunks.layers):
        dst = torch.cat([piece.dst for piece in pieces])
        assert torch.equal(dst.sort().values, torch.arange(block.num_dst))
        for piece in pieces:
            sliced = piece.slice(block)
            assert torch.equal(sliced.src_index[: piece.num_dst], piece.dst) and sliced.num_src == piece.num_src
            assert torch.equal(sliced.indptr, piece.indptr)


@pytest.mark.parametrize("arch", ARCHS)
def test_layerwise_estimate_is_within_the_estimator_bound_of_the_measured_peak(cora, cora64, arch):
    """The layer-wise estimate (estimator.layerwise, from the layers' own memory terms) against the measured
    peak of a layer-wise step (resident: model state, gradients, the batch's blocks and the chunks' dst nodes
    and pointers). Hidden 16: every layer that can project first does (1433 → 16 → 7)."""
    graph = cora64 if arch == "sage-lstm" else cora  # the LSTM: 64 features, fanouts 5 (its profiled steps are slow)
    assert_layerwise_estimate(make(arch, graph), arch, graph, [5, 5] if arch == "sage-lstm" else [None, None])


@pytest.mark.parametrize("arch", ["sage-mean", "sage-gcn", "sage-pool", "gcn", "gat"])
def test_layerwise_estimate_of_layers_that_do_not_project_first(cora64, arch):
    """As above on 64 features and hidden 256: layer 1 aggregates its input rows before its linear map (64 <
    256), and layer 2 reads its rows of h_1, which the executor holds until the chunk ends."""
    assert_layerwise_estimate(make(arch, cora64, hidden=256), arch, cora64, [None, None])


def test_layerwise_gat_estimate_where_the_peak_is_the_sum_of_z_gradients():
    """Many src rows of a wide z (4 heads × 64) over narrow features: the step peaks where autograd sums ∂z out of
    place (attention_aggregate's ∂z arrives first, through z.view(-1, H, F)), which the estimate replays
    (now the recorder's out-of-place sum into a view's gradient); modelled in place it was 8–12% under here."""
    graph = make_sbm(num_nodes=20_000, num_features=64, avg_degree=10, train_per_class=40, num_val=50, num_test=50)
    torch.manual_seed(0)
    assert_layerwise_estimate(GAT(graph.num_features, 64, graph.num_classes, 2, heads=4, dropout=0.5), "gat", graph,
                              [None, None])


def assert_layerwise_estimate(model, arch: str, graph, fanouts) -> None:
    config = load_config(None, [f"model.arch={arch.split('-')[0]}", "optim.weight_decay=5e-4"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    batch = sample_batch(graph, graph.train_idx, fanouts, torch.Generator().manual_seed(0))
    spec = spec_of(model, config, CPU)
    for index, k in enumerate((1, 4, 16)):
        work = LayerwisePlan(batch, chunk_layers(batch.blocks, k, "metis", 0), work=0.0,
                             partitioners=["metis"] * len(batch.blocks))
        set_dropout_key(model, 0, 0)
        features = HostFeatureStore(graph.x, pin=False)
        if index == 0:
            measure_layerwise_step(model, optimizer, work, features, graph.y, CPU)  # Adam's state exists from here on
        measured = measure_layerwise_step(model, optimizer, work, features, graph.y, CPU)
        estimate = estimate_layerwise(counts_of(batch.blocks), [counts_of(layer, [False] * len(layer))
                                                                for layer in work.chunks.layers], spec,
                                      spec.projections)
        assert estimate.resident_bytes == measured.resident_bytes
        error = (estimate.peak_bytes - measured.peak_bytes) / measured.peak_bytes
        assert abs(error) <= DEFAULT_TOLERANCE, (arch, k, estimate.peak_bytes, measured.peak_bytes)


@pytest.mark.parametrize("fraction", [1.0, 0.7, 0.45])  # below ~0.37 nothing fits: the model state is the floor
def test_planned_layerwise_chunks_fit_the_budget_measured(cora, fraction):
    """micro_batch.mode=layerwise under a budget: the chunks chosen, run for real, fit it (measured peak)."""
    config = load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise"])
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    full = Planner(config.micro_batch, PeakEstimator(spec_of(model, config, CPU)), CPU)
    whole = layerwise_peak(full, batch, chunk_layers(batch.blocks, 1))
    budget = int(whole * fraction)
    planner = Planner(load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise",
                                                   f"micro_batch.budget={budget}"]).micro_batch,
                                PeakEstimator(spec_of(model, config, CPU)), CPU)
    plan = planner.plan(batch)
    assert plan.method == "layerwise" and plan.estimate <= budget
    # never a chunking above the whole batch in one micro-batch (one chunk per layer is, here): at 1.0 the budget
    # holds one chunk per layer, but the plan is the chunking under the one-micro-batch estimate
    assert plan.estimate <= PeakEstimator(spec_of(model, config, CPU)).peak(batch.blocks, weighted=[False, False])
    assert plan.pieces > 1

    set_dropout_key(model, 0, 0)
    features = HostFeatureStore(cora.x, pin=False)
    measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU)  # Adam's state exists from here on
    measured = measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU)
    assert measured.peak_bytes <= budget  # never an overrun


def test_each_layer_runs_in_as_few_chunks_as_the_budget_lets_it(cora):
    """Under a budget the input layer (1,433 features in) needs more chunks than the 64-wide layer after it: the
    planner lowers each layer's count on its own, so the narrow layer runs in fewer chunks, and the step, run for
    real, still fits (measured peak)."""
    config = load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise"])
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    estimator = PeakEstimator(spec_of(model, config, CPU))
    budget = int(layerwise_peak(Planner(config.micro_batch, estimator, CPU), batch, chunk_layers(batch.blocks, 1)) * 0.5)
    section = config.micro_batch.model_copy(update={"budget": budget})
    plan = Planner(section, estimator, CPU).plan(batch)
    counts = [len(layer) for layer in plan.chunks.layers]
    uniform = plan.tried[-1][0] if plan.tried[-1][1] <= budget else min(k for k, peak in plan.tried if peak <= budget)
    assert counts[0] == uniform and counts[1] < counts[0], (counts, plan.tried)
    assert plan.estimate <= budget and plan.report()["chunks_per_layer"] == counts
    assert plan.summary == f"layer by layer in {counts[0]}, {counts[1]} chunks per layer"
    set_dropout_key(model, 0, 0)
    features = HostFeatureStore(cora.x, pin=False)
    measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU)  # Adam's state exists from here on
    measured = measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU)
    assert measured.peak_bytes == plan.estimate  # the estimate replays the step byte for byte on the CPU


def test_chunks_asked_above_the_whole_batch_s_estimate_are_said_once(cora, caplog):
    """Without a budget the chunks asked for run as asked; one chunk per layer holds every layer's output, so on
    Cora's full batch it is estimated above the whole batch in one micro-batch, and the planner says so once."""
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    config = load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise", "micro_batch.num_micro_batches=1"])
    estimator = PeakEstimator(spec_of(model, config, CPU))
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    planner = Planner(config.micro_batch, estimator, CPU)
    with caplog.at_level(logging.WARNING, logger="betty_trainer"):
        plan = planner.plan(batch)
        planner.plan(sample_batch(cora, cora.train_idx, [None, None]))
    whole = estimator.peak(batch.blocks, weighted=[False, False])
    assert plan.pieces == 1 and plan.estimate > whole
    (said,) = [r.getMessage() for r in caplog.records if "above the whole batch" in r.getMessage()]
    assert said.startswith(f"layer by layer in 1 chunks per layer (micro_batch.num_micro_batches) is estimated at "
                           f"{plan.estimate / 2**20:.1f} MiB, above the whole batch in one micro-batch ({whole / 2**20:.1f}")


def test_auto_picks_the_plan_with_less_work_among_those_that_fit(cora):
    """On a dense full neighbourhood Betty's micro-batches recompute shared hidden nodes; auto must weigh
    that: it returns the candidate of least estimated work, and both candidates are reported."""
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    base = load_config(None, ["model.hidden=64"])
    spec = spec_of(model, base, CPU)
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    plans = {}
    for mode in ("micro_batches", "layerwise", "auto"):
        section = load_config(None, ["model.hidden=64", f"micro_batch.mode={mode}",
                                     "micro_batch.num_micro_batches=8"]).micro_batch
        plans[mode] = Planner(section, PeakEstimator(spec), CPU).plan(batch)
    assert plans["auto"].method == min(("micro_batches", "layerwise"), key=lambda m: plans[m].work)
    assert plans["layerwise"].work < plans["micro_batches"].work  # every node an output: Betty's redundancy dominates


@pytest.mark.parametrize("budget_share", [None, 0.6])
def test_auto_estimates_the_whole_batch_once_per_plan(cora, monkeypatch, budget_share):
    """Both searches of ``micro_batch.mode=auto`` read the whole batch's estimate in one micro-batch (the K search's
    start, the chunk search's ceiling): it is made once per plan, under a budget and at K = 1 without one."""
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    config = load_config(None, ["model.hidden=64", "micro_batch.mode=auto", "micro_batch.num_micro_batches=1"])
    estimator = PeakEstimator(spec_of(model, config, CPU))
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    budget = None if budget_share is None else int(budget_share * estimator.peak(batch.blocks))
    whole, peak = [], estimator.peak
    monkeypatch.setattr(estimator, "peak", lambda structures, *args, **kwargs: (
        whole.append(structures) if structures is batch.blocks else None) or peak(structures, *args, **kwargs))
    planner = Planner(config.micro_batch.model_copy(update={"budget": budget}), estimator, CPU)
    planner.plan(batch)
    assert len(whole) == 1
    planner.plan(batch, min_pieces=2)  # a re-plan is another plan: once more
    assert len(whole) == 2


def test_training_layer_by_layer_ends_with_the_parameters_of_the_full_batch(tmp_path):
    """train() with micro_batch.mode=layerwise (4 chunks per layer) against K = 1: after 3 epochs of dropout
    and Adam the parameters agree to float32 round-off, and the run reports its plan as layer-wise."""
    from betty_trainer.training.checkpoint import load_checkpoint
    from betty_trainer.training.trainer import train

    common = ["optim.epochs=3", "train.progress=false"]
    results = {}
    for name, extra in {"layerwise": ["micro_batch.mode=layerwise", "micro_batch.num_micro_batches=4"],
                        "full": ["micro_batch.num_micro_batches=1"]}.items():
        config = load_config("configs/quickstart.yaml", common + extra + [f"train.run_dir={tmp_path / name}"])
        train(config)
        results[name] = load_checkpoint(tmp_path / name)["model"]
    report = (tmp_path / "layerwise" / "plan.json").read_text()
    assert '"mode": "layerwise"' in report and '"num_pieces": 4' in report
    for key, value in results["full"].items():
        # the per-step bound (BOUND) compounded through 3 epochs of Adam, whose update divides by √v: a parameter
        # with a tiny second moment amplifies round-off, as tests/test_planner.py's trained comparison allows
        assert torch.allclose(results["layerwise"][key], value, rtol=1e-4, atol=1e-6), key


@pytest.mark.parametrize("arch", ["sage-mean", "gat"])
def test_host_resident_layer_outputs_give_the_full_batch_gradient(cora, arch, monkeypatch):
    """chunks.host_outputs: the hidden layers' outputs are kept in host memory (a plain CPU tensor without
    CUDA) and each chunk's rows copied to the device; the gradient is the full batch's (GAT: its projected
    layers read their row blocks from host memory too)."""
    from betty_trainer.execution import layerwise

    placements = []

    def recording_storage(rows, like, host):
        placements.append(host)
        out = layerwise.output_storage.__wrapped__(rows, like, host)
        assert out.device.type == "cpu" and out.is_pinned() == (host and torch.cuda.is_available())
        return out

    recording_storage.__wrapped__ = layerwise.output_storage
    monkeypatch.setattr(layerwise, "output_storage", recording_storage)
    model = make(arch, cora)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    reference = full_batch_gradients(model, batch, cora)
    chunks = chunk_layers(batch.blocks, 4, "metis", seed=1)
    chunks.host_outputs = True
    model.zero_grad(set_to_none=True)
    loss, correct = layerwise_backward(model, batch, chunks, HostFeatureStore(cora.x, pin=False), cora.y, CPU)
    assert placements == [True, False]  # h_1 on the host, the logits on the device
    assert_same(reference, ([p.grad.clone() for p in model.parameters()], loss, correct))


def test_the_plan_keeps_layer_outputs_on_the_host_only_when_the_device_budget_does_not_hold_them(cora64):
    """The placement decision: at the fewest chunks that fit, h_l stays on the device when the estimate with
    it there fits the budget, and goes to host memory when only the estimate without it fits. (Hidden 256 on
    64 features: at 2 chunks the peak is in layer 2's backward, where h_1 is live; at 1 chunk, as on Cora's 1433
    features, it is in layer 1's backward, where h_1 is already freed, and host memory does not lower it.) The planner is told
    the device is CUDA (its budget is given, so nothing queries a GPU); on the CPU h_l stays where it is."""
    graph = cora64
    config = load_config(None, ["model.hidden=256", "micro_batch.mode=layerwise"])
    model = GraphSAGE(graph.num_features, 256, graph.num_classes, 2, "mean", 0.5)
    spec = spec_of(model, config, CPU)
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    probe = Planner(config.micro_batch, PeakEstimator(spec), CPU)
    peaks = {}
    for k in (1, 2):
        chunks = chunk_layers(batch.blocks, k, config.micro_batch.partitioner, 0)
        peaks[k] = layerwise_peak(probe, batch, chunks, False), layerwise_peak(probe, batch, chunks, True)
        estimate = estimate_layerwise(counts_of(batch.blocks), [counts_of(layer, [False] * len(layer))
                                                                for layer in chunks.layers], spec,
                                      spec.projections, host_outputs=True)
        assert estimate.peak_bytes == peaks[k][1]
        assert peaks[k][1] < peaks[k][0] if k == 2 else peaks[k][1] == peaks[k][0]  # h_1: 2708 × 256 floats
    host_1, (device_2, host_2) = peaks[1][1], peaks[2]
    assert host_1 > device_2 and host_1 > host_2  # so that neither budget below fits at K = 1
    for budget, host in ((device_2, False), (host_2, True)):
        section = config.micro_batch.model_copy(update={"budget": budget, "safety_margin": 0})  # no allocator margin
        plan = Planner(section, PeakEstimator(spec), torch.device("cuda")).plan(batch)
        assert plan.pieces == 2 and plan.host_outputs == host and plan.chunks.host_outputs == host
        assert plan.estimate == (host_2 if host else device_2) <= budget
        # on the CPU host memory is the device's: h_l never moves there, and the plan fits without it
        plan = Planner(section, PeakEstimator(spec), CPU).plan(batch)
        assert not plan.host_outputs and plan.estimate == layerwise_peak(probe, batch, plan.chunks, False) <= budget


def test_an_impossible_layerwise_budget_is_refused_at_the_floor_without_chunking(cora, monkeypatch):
    """Below the floor (model state, structure, the whole layers a backward holds, the largest node's in-edges) no
    chunk count fits: the planner says so, naming the budget and the floor, before partitioning anything."""
    from betty_trainer.errors import PlanningError
    from partition import chunks as chunks_module

    config = load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise", "micro_batch.budget=4000000"])
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    planner = Planner(config.micro_batch, PeakEstimator(spec_of(model, config, CPU)), CPU)
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    floor = layerwise_floor(planner, batch)
    assert floor > 4000000

    def no_chunking(*args, **kwargs):
        raise AssertionError("the floor check comes before any chunking")

    monkeypatch.setattr(chunks_module, "chunk_layers", no_chunking)
    with pytest.raises(PlanningError, match=f"budget 4000000 bytes is impossible layer by layer: at any number of "
                                            f"chunks per layer a step needs at least {floor} bytes"):
        planner.plan(batch)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_layerwise_floor_is_below_the_estimate_of_every_chunking(cora, cora64, arch):
    """estimator.layerwise.layerwise_floor bounds every chunking's estimate from below (REG and METIS from 1 chunk
    per layer to as many as they make), hidden 16 (layers that project first) and 256 on 64 features (layers that
    aggregate first), and is met: one dst node per chunk (range at the largest dst count) is estimated at exactly
    the floor plus 8 bytes per chunk past each layer's first (its int64 pointer entries)."""
    graph = cora64 if arch == "sage-lstm" else cora
    fanouts = [10, 10] if arch == "sage-lstm" else [None, None]
    batch = sample_batch(graph, graph.train_idx, fanouts, torch.Generator().manual_seed(0))
    most = max(block.num_dst for block in batch.blocks)
    for model in (make(arch, graph), make(arch, cora64, hidden=256)):
        config = load_config(None, [f"model.arch={arch.split('-')[0]}"])
        planner = Planner(config.micro_batch, PeakEstimator(spec_of(model, config, CPU)), CPU)
        floor = layerwise_floor(planner, batch)
        peaks = [layerwise_peak(planner, batch, chunk_layers(batch.blocks, k, partitioner, 0))
                 for k in (1, 4, 32, most) for partitioner in ("reg", "metis")]
        assert floor <= min(peaks), f"{arch}: floor {floor} above {min(peaks)}"
        singletons = layerwise_peak(planner, batch, chunk_layers(batch.blocks, most, "range", 0))
        assert singletons - floor == sum(8 * (block.num_dst - 1) for block in batch.blocks)


@pytest.mark.parametrize("parts", [1, 3, 64])
def test_relu_backward_from_the_output_equals_autograd_s(parts):
    """An affine layer's backward takes the stack's ReLU from the stored h_l = ReLU(x), not from x: the same
    gradient, bit for bit (zeros where x ≤ 0, exact zeros included), row block by row block."""
    from betty_trainer.execution.layerwise import relu_backward_

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 8, generator=generator)
    x[::7, ::3] = 0.0  # ReLU's kink: its own backward writes 0 there
    x.requires_grad_()
    grad = torch.randn(50, 8, generator=generator)
    torch.relu(x).backward(grad)
    masked = grad.clone()
    relu_backward_(masked, torch.relu(x.detach()), parts)
    assert torch.equal(masked, x.grad) and (masked == 0).sum() > 0


def test_a_sage_subclass_that_changes_propagate_is_not_taken_as_affine(cora):
    """Affine in z is a promise about propagate: a subclass with a learnable gain on A·z (whose gradient reads z)
    does not inherit it, keeps z for its backward, and gets the full batch's gradient."""
    from torch import nn

    from betty_trainer.models.sage import SAGEConv

    class GainSAGE(SAGEConv):
        def __init__(self, a, b):
            super().__init__(a, b, "mean")
            self.gain = nn.Parameter(torch.linspace(0.5, 1.5, b))

        def forward(self, block, h):
            return self.propagate(block, self.project(h), block.dst_rows(h))

        def propagate(self, block, z, h_dst=None):
            return self.gain * self.aggregate(block, z) + self.fc_self(h_dst) + self.bias

    model = make("sage-mean", cora)
    model.layers[0] = GainSAGE(cora.num_features, 16)
    assert affine_layers(model) == [False, True]
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    assert_same(full_batch_gradients(model, batch, cora), layerwise_gradients(model, batch, cora, 4))


def test_a_budget_one_node_chunks_meet_is_never_refused(cora64):
    """A partitioner may stop short of one dst node per chunk (REG leaves parts empty) or never reach their peak:
    once the doubling ends unfitted, the planner tries one node per chunk, so a budget at their estimate (the floor
    plus 8 bytes per chunk past each layer's first) gets a plan that fits, from range chunks. SAGE pool, hidden 256
    on 64 features: every REG chunking of Cora's full batch is estimated above that budget."""
    config = load_config(None, ["model.hidden=256", "model.aggregator=pool", "micro_batch.mode=layerwise"])
    model = GraphSAGE(cora64.num_features, 256, cora64.num_classes, 2, "pool", 0.5)
    spec = spec_of(model, config, CPU)
    batch = sample_batch(cora64, torch.arange(cora64.num_nodes), [None, None])
    floor = layerwise_floor(Planner(config.micro_batch, PeakEstimator(spec), CPU), batch)
    budget = floor + sum(8 * (block.num_dst - 1) for block in batch.blocks)
    section = config.micro_batch.model_copy(update={"budget": budget})
    plan = Planner(section, PeakEstimator(spec), CPU).plan(batch)
    assert plan.estimate <= budget
    assert min(peak for _, peak in plan.tried[:-1]) > budget  # no REG chunking fitted
    assert plan.partitioner == "range" and plan.tried[-1][0] == cora64.num_nodes  # one node per chunk fitted
    assert plan.pieces <= cora64.num_nodes  # then each layer as few range chunks as still fit


@pytest.mark.parametrize("aggregator", ["mean", "gcn"])
def test_an_affine_layer_runs_off_the_whole_block_in_row_blocks_split_by_range(cora, aggregator, monkeypatch):
    """SAGE mean/gcn projecting first (affine in z) run each layer in contiguous dst row blocks off the whole block
    where the compiled kernels run: the plan under a budget splits them by ``range`` (no partitioner's work; only
    the count matters), the step makes no chunk slice, its estimate is its measured peak, and its gradient is the
    full batch's. GAT (not affine) still slices its chunks."""
    from partition.chunks import Chunk

    pytest.importorskip("numba")
    config = load_config(None, ["model.hidden=64", "micro_batch.mode=layerwise", f"model.aggregator={aggregator}"])
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, aggregator, 0.5)
    assert affine_layers(model) == [True, True]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    estimator = PeakEstimator(spec_of(model, config, CPU))
    assert estimator.layerwise(batch.blocks).ranged == [True, True]
    budget = int(layerwise_peak(Planner(config.micro_batch, estimator, CPU), batch, chunk_layers(batch.blocks, 1)) * 0.4)
    plan = Planner(config.micro_batch.model_copy(update={"budget": budget}), estimator, CPU).plan(batch)
    assert plan.pieces > 1
    for layer in plan.chunks.layers:  # contiguous ranges covering the layer's dst rows in order
        assert torch.equal(torch.cat([chunk.dst for chunk in layer]), torch.arange(sum(c.num_dst for c in layer)))

    def no_slice(self, block):
        raise AssertionError("an affine layer's chunk was sliced")

    monkeypatch.setattr(Chunk, "slice", no_slice)
    features = HostFeatureStore(cora.x, pin=False)
    set_dropout_key(model, 0, 0)
    measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU)  # Adam's state exists from here on
    assert measure_layerwise_step(model, optimizer, plan, features, cora.y, CPU).peak_bytes == plan.estimate <= budget
    set_dropout_key(model, seed=3, step=11)
    assert_same(full_batch_gradients(model, batch, cora), layerwise_gradients(model, batch, cora, 5))
    gat = make("gat", cora)
    with pytest.raises(AssertionError, match="was sliced"):
        layerwise_gradients(gat, batch, cora, 2)


@pytest.mark.parametrize("budget_share", [None, 0.6])
def test_the_plan_names_what_split_each_layer(cora64, budget_share):
    """A layer run off the whole block is split by ``range`` whatever ``micro_batch.partitioner`` says (only the
    count of its chunks matters); ``plan.json`` names each layer's partitioner (``partitioner_per_layer``, and
    ``partitioner`` in words), not the configured one for every layer. SAGE mean, 64 features, hidden 128: layer 0
    aggregates first (64 < 128), layer 1 projects first and is affine."""
    pytest.importorskip("numba")
    config = load_config(None, ["model.hidden=128", "micro_batch.mode=layerwise", "micro_batch.partitioner=metis"])
    model = GraphSAGE(cora64.num_features, 128, cora64.num_classes, 2, "mean", 0.5)
    estimator = PeakEstimator(spec_of(model, config, CPU))
    batch = sample_batch(cora64, torch.arange(cora64.num_nodes), [None, None])
    assert estimator.layerwise(batch.blocks).ranged == [False, True]
    whole = layerwise_peak(Planner(config.micro_batch, estimator, CPU), batch, chunk_layers(batch.blocks, 1))
    budget = None if budget_share is None else int(budget_share * whole)
    plan = Planner(config.micro_batch.model_copy(update={"budget": budget}), estimator, CPU).plan(batch)
    assert plan.estimate <= (budget or plan.estimate) and len(plan.chunks.layers[1]) > 1
    ranges = plan.chunks.layers[1]  # contiguous ranges covering the layer's dst rows in order
    assert torch.equal(torch.cat([chunk.dst for chunk in ranges]), torch.arange(batch.blocks[1].num_dst))
    report = json.loads(json.dumps(plan.report()))
    assert plan.partitioners == report["partitioner_per_layer"] == ["metis", "range"]
    assert report["partitioner"] == "metis, range"


class _ScaledProjection(SAGEConv):
    """A SAGE layer whose projection is its own (``2·W_neigh·h``): not SAGE's affine form, whose backward writes
    ``W_neigh``'s gradient as SAGE's projection makes it."""

    def project(self, h):
        return 2.0 * self.fc_neigh(h)

    def forward(self, block, h_src):
        return self.propagate(block, self.project(h_src), block.dst_rows(h_src))


def test_a_sage_layer_that_changes_what_the_affine_backward_assumes_is_not_run_off_the_whole_block(cora):
    """A subclass overriding ``project``, a parametrized weight, and a frozen one: the first two lose the affine
    flag (layer-wise recomputes them from the kept ``z``, the gradients stay the full batch's), and the backward
    that writes gradients itself leaves a frozen parameter's ``.grad`` alone."""
    model = make("sage-mean", cora)
    for index, layer in enumerate(model.layers):
        scaled = _ScaledProjection(layer.in_feats, layer.out_feats, "mean")
        scaled.load_state_dict(layer.state_dict())
        model.layers[index] = scaled
    assert affine_layers(model) == [False, False]
    set_dropout_key(model, seed=3, step=1)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    assert_same(full_batch_gradients(model, batch, cora), layerwise_gradients(model, batch, cora, 4))

    plain = make("sage-mean", cora)
    torch.nn.utils.parametrize.register_parametrization(plain.layers[1].fc_neigh, "weight", torch.nn.Identity())
    assert affine_layers(plain) == [True, False]

    frozen = make("sage-mean", cora)
    frozen.layers[0].fc_self.weight.requires_grad_(False)
    set_dropout_key(frozen, seed=3, step=1)
    frozen.zero_grad(set_to_none=True)
    layerwise_backward(frozen, batch, chunk_layers(batch.blocks, 4, "metis", seed=1),
                       HostFeatureStore(cora.x, pin=False), cora.y, CPU)
    assert frozen.layers[0].fc_self.weight.grad is None
    assert frozen.layers[0].fc_neigh.weight.grad is not None
