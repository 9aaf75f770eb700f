"""Memory-aware planning (Betty §4.4.3): the smallest K under a budget, measured to fit; OOM re-planning."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty_trainer import Batch, HostFeatureStore, make_sbm, sample_batch
from betty_trainer.cli import main
from betty_trainer.config import load_config
from betty_trainer.errors import CalibrationError, ConfigError, PlanningError
from betty_trainer.execution import micro_batches as micro_batches_module
from betty_trainer.execution.micro_batches import measure_training_step
from betty_trainer.memory.planner import GRAPH_K_SHRINK_AFTER, Planner, graph_partition, make_planner
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import aggregate, build_model, set_dropout_key
from betty_trainer.training.checkpoint import load_checkpoint
from betty_trainer.training.trainer import train
from estimator.peaks import PeakEstimator
from partition import GraphPartition, make_split, redundancy
from partition import search as search_module
from partition.partitioners import GraphSplitter
from partition.slicing import count_layers
from tests.conftest import REPO

GRAPH = {"num_nodes": 2000, "num_features": 200, "avg_degree": 8, "train_per_class": 40, "num_val": 100, "num_test": 100}
OVERRIDES = ["model.hidden=16", "train.progress=false"] + [f"dataset.synthetic.{k}={v}" for k, v in GRAPH.items()]


@pytest.fixture(scope="module")
def setting():
    graph = make_sbm(**GRAPH)
    config = load_config(None, OVERRIDES)
    batch = sample_batch(graph, graph.train_idx, [None, None])
    torch.manual_seed(0)
    model = build_model(config.model, graph)
    set_dropout_key(model, 0, 0)
    optimizer = torch.optim.Adam(model.parameters())
    measure_training_step(model, optimizer, batch, HostFeatureStore(graph.x, pin=False), graph.y, "cpu")  # Adam state exists
    full_peak = measure_training_step(model, optimizer, batch, HostFeatureStore(graph.x, pin=False), graph.y, "cpu").peak_bytes
    return graph, config, batch, model, optimizer, full_peak


@pytest.mark.parametrize("fraction", [2.0, 1.0, 0.5, 0.25])
def test_planned_micro_batches_fit_the_budget_with_the_smallest_k(setting, fraction):
    graph, config, batch, model, optimizer, full_peak = setting
    budget = int(full_peak * fraction)
    overrides = OVERRIDES + [f"micro_batch.budget={budget}"]
    planner = Planner(load_config(None, overrides).micro_batch, PeakEstimator(model_spec(config, graph)), torch.device("cpu"))
    plan = planner.plan(batch)
    for index, micro_batch in enumerate(plan.micro_batches):  # as training runs them: later ones hold the gradients
        measured = measure_training_step(model, optimizer, micro_batch, HostFeatureStore(graph.x, pin=False), graph.y,
                                         "cpu", accumulate=index > 0)
        assert measured.peak_bytes <= budget, (plan.pieces, measured.peak_bytes, budget)
    estimate = lambda structures, accumulate: planner.estimator.peak(structures, accumulate)
    brute_force = next(k for k in range(1, plan.pieces + 1)
                       if max(make_split(batch.blocks, estimate, k=k, seed=0).estimates) <= budget)
    assert plan.pieces == brute_force
    if fraction >= 1.0:
        assert plan.pieces == 1
    else:
        assert plan.split.tried[0][0] > 1, "the search starts from the ratio of estimates, not from K = 1"


def test_balanced_weights_keep_the_largest_micro_batch_near_the_mean(setting):
    graph, config, batch, *_ = setting
    estimator = PeakEstimator(model_spec(config, graph))
    plan = Planner(config.micro_batch, estimator, torch.device("cpu")).plan(batch)
    dynamic = [estimator.peak(layers, index > 0) - estimator.resident_bytes for index, layers in enumerate(plan.split.sizes)]
    # METIS balances the output-cost weights only up to its imbalance factor, and the weights are the
    # estimator's per-output costs, not its exact per-micro-batch bytes (shared inputs): 25% over the mean
    assert max(dynamic) <= 1.25 * sum(dynamic) / len(dynamic)


def test_impossible_and_malformed_budgets_name_the_cause(setting, capsys, tmp_path):
    graph, config, batch, *_ = setting
    spec = model_spec(config, graph)
    tiny = load_config(None, OVERRIDES + ["micro_batch.budget=1000"]).micro_batch
    with pytest.raises(PlanningError, match="below what training holds"):
        Planner(tiny, PeakEstimator(spec), torch.device("cpu")).plan(batch)
    resident = Planner(tiny, PeakEstimator(spec), torch.device("cpu")).resident  # above it, but below one output's need
    small = load_config(None, OVERRIDES + [f"micro_batch.budget={resident + 1000}"]).micro_batch
    with pytest.raises(PlanningError, match=r"impossible: output node \d+ of the batch alone needs"):
        Planner(small, PeakEstimator(spec), torch.device("cpu")).plan(batch)
    for bad, message in (("-5", "must be positive"), ("lots", "expected a size in bytes")):
        assert main(["plan", "--config", str(REPO / "configs/quickstart.yaml"), f"micro_batch.budget={bad}"]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Planner(load_config(None, ["micro_batch.budget=auto"]).micro_batch, PeakEstimator(spec), torch.device("cpu"))
    with_budget = load_config(None, OVERRIDES + ["micro_batch.budget=1GB"])
    with pytest.raises(ConfigError, match="custom model: calibrate it"):
        Planner(with_budget.micro_batch, None, torch.device("cpu"))
    with pytest.raises(CalibrationError, match=r"cannot calibrate Linear: its forward failed .*\(TypeError: "):
        train(with_budget, model=torch.nn.Linear(1, 1), graph=graph, run_dir=tmp_path)


def test_out_of_memory_replans_and_equals_planning_the_larger_k(tmp_path, monkeypatch):
    original = micro_batches_module.accumulate_gradients
    failures = []

    def flaky(model, micro_batches, features, labels, device):
        if len(micro_batches) < 4:  # as if the GPU ran out of memory in the second micro-batch with K = 2
            failures.append(len(micro_batches))
            micro_batches_module.micro_batch_backward(model, micro_batches[0], features, labels, device,
                                                      micro_batches.num_outputs)  # the first one's gradients made
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        return original(model, micro_batches, features, labels, device)

    overrides = OVERRIDES + ["optim.epochs=2"]
    train(load_config(None, overrides + ["micro_batch.num_micro_batches=4"]), run_dir=tmp_path / "planned")
    monkeypatch.setattr(micro_batches_module, "accumulate_gradients", flaky)
    train(load_config(None, overrides + ["micro_batch.num_micro_batches=2"]), run_dir=tmp_path / "replanned")
    assert failures == [2, 2], "each batch failed once with K = 2, then ran with K = 4 (doubled)"
    planned, replanned = load_checkpoint(tmp_path / "planned"), load_checkpoint(tmp_path / "replanned")
    for name, tensor in planned["model"].items():
        assert torch.equal(tensor, replanned["model"][name]), name
    assert planned["optimizer"]["state"][0]["step"] == replanned["optimizer"]["state"][0]["step"] == 2


def test_plan_command_table_matches_plan_json(tmp_path, capsys):
    output = tmp_path / "plan.json"
    status = main(["plan", "--config", str(REPO / "configs/quickstart.yaml"), *OVERRIDES, "micro_batch.budget=4MiB",
                   "--measure", "--output", str(output)])
    printed = capsys.readouterr().out
    assert status == 0
    report = json.loads(output.read_text())
    assert report["budget_bytes"] == 4 * 2**20 and report["num_pieces"] == len(report["pieces"])
    terms = report["memory_terms"]  # on the CPU: no workspace, no allocator margin, the budget as given
    assert (terms["device_workspace"], terms["allocator_margin"], terms["step_bytes"]) == (0, 0, 4 * 2**20)
    assert "device_workspace 0.00 MiB" in printed and "allocator margin 0.00 MiB (cpu)" in printed
    for row in report["pieces"]:
        assert row["measured_peak_bytes"] <= report["budget_bytes"]
        assert abs(row["error"]) <= 0.001  # SAGE-mean: the micro-batch estimator's bound (tests/test_estimator.py)
        line = next(line for line in printed.splitlines()
                    if line.startswith("│") and line.split("│")[1].strip() == str(row["piece"]))
        assert f"{row['estimate']['peak_bytes'] / 2**20:.2f}" in line and f"{row['measured_peak_bytes'] / 2**20:.2f}" in line
    assert f"K = {report['num_pieces']}" in printed


def test_plan_reuse_returns_the_same_micro_batches_until_the_batch_changes(setting, monkeypatch):
    import partition.partitioners as partitioners_module

    graph, config, batch, *_ = setting
    builds = []
    original = partitioners_module.build_reg
    monkeypatch.setattr(partitioners_module, "build_reg", lambda block, *a, **k: builds.append(1) or original(block, *a, **k))
    fixed = load_config(None, OVERRIDES + ["micro_batch.num_micro_batches=4"]).micro_batch
    planner = Planner(fixed, PeakEstimator(model_spec(config, graph)), torch.device("cpu"))
    plan = planner.plan(batch)
    resampled = sample_batch(graph, graph.train_idx, [None, None])  # new tensors, same structure
    assert resampled.blocks[0].indices is not batch.blocks[0].indices
    assert planner.plan(resampled) is plan, "an identical batch gets the last plan back"
    assert (planner.plans_made, planner.plans_reused, len(builds)) == (1, 1, 1)
    fresh = Planner(fixed, PeakEstimator(model_spec(config, graph)), torch.device("cpu")).plan(resampled)
    for one, two in zip(plan.micro_batches, fresh.micro_batches):  # what planning that batch from scratch gives
        for a, b in zip(one.blocks, two.blocks):
            assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indptr, b.indptr)
            assert torch.equal(a.indices, b.indices)

    assert len(builds) == 2, "the fresh planner built its own REG"
    more = planner.plan(batch, 6)  # re-planning after an out-of-memory error
    assert more.pieces == 6 and planner.plans_made == 2 and len(builds) == 2, "a new plan; the batch's REG is reused"
    assert planner.plan(batch, 6) is more and planner.plans_made == 2

    changed = sample_batch(graph, graph.train_idx, [None, None])
    changed.blocks[0].indices = changed.blocks[0].indices.clone()
    changed.blocks[0].indices[0] = (changed.blocks[0].indices[0] + 1) % changed.blocks[0].num_src  # one edge moved
    replanned = planner.plan(changed, 6)
    assert planner.plans_made == 3 and replanned is not more
    weighted = sample_batch(graph, graph.train_idx, [None, None])
    weighted.blocks[-1].edge_weight = torch.ones(weighted.blocks[-1].num_edges)
    planner.plan(weighted, 6)
    assert planner.plans_made == 4, "edge weights are part of the structure"


def test_a_weighted_batch_is_planned_with_weighted_estimates(setting):
    """The planner estimates layer slices, which carry no edge weights: it must take them from the batch,
    so each planned micro-batch's estimate is that of the weighted micro-batch training runs."""
    graph, config, batch, *_ = setting
    generator = torch.Generator().manual_seed(0)
    weighted = Batch([dataclasses.replace(b, edge_weight=torch.rand(b.num_edges, generator=generator))
                      for b in batch.blocks])
    overrides = OVERRIDES + ["micro_batch.budget=1GB"]
    planner = Planner(load_config(None, overrides).micro_batch, PeakEstimator(model_spec(config, graph)), torch.device("cpu"))
    plan = planner.plan(weighted)
    for index, micro_batch in enumerate(plan.micro_batches):
        assert micro_batch.blocks[0].edge_weight is not None
        assert plan.split.estimates[index] == planner.estimator.peak(micro_batch.blocks, accumulate=index > 0)
    unweighted_estimate = Planner(load_config(None, overrides).micro_batch, PeakEstimator(model_spec(config, graph)),
                                            torch.device("cpu")).plan(batch).split.estimates[0]
    assert plan.split.estimates[0] > unweighted_estimate  # the weights are bytes of their own


def test_a_batch_trained_on_every_step_keeps_its_transposes_in_one_micro_batch_only(setting, monkeypatch):
    """A recurring batch planned in one micro-batch keeps the transpose of each block whose aggregation's backward
    runs (the estimator's ``transposed_layers``), and the estimate, larger by exactly those bytes, is the measured
    peak; a re-plan in more micro-batches, a layer-wise plan, or a budget the transposes would miss keeps none, nor
    does ``keep_transposes: auto`` without a budget or ``false``."""
    graph, config, _, model, optimizer, _ = setting
    batch = sample_batch(graph, graph.train_idx, [None, None])  # its own: the plan changes what its blocks hold
    estimator, cpu = PeakEstimator(model_spec(config, graph)), torch.device("cpu")
    auto = config.micro_batch.model_copy(update={"num_micro_batches": 1})
    assert auto.keep_transposes == "auto"
    without = Planner(auto, estimator, cpu, recurring=True).plan(batch).estimate
    assert all(block.transpose is None for block in batch.blocks)
    one = auto.model_copy(update={"keep_transposes": True})
    Planner(one, estimator, cpu).plan(batch)  # a batch the run does not train on every step
    assert all(block.transpose is None for block in batch.blocks)

    planner = Planner(one, estimator, cpu, recurring=True)
    plan = planner.plan(batch)
    keep = estimator.transposed_layers(batch.blocks)
    assert keep == [True, True]  # SAGE-mean projects 200 → 16 columns first: both layers' aggregations backpropagate
    assert [block.transpose is not None for block in batch.blocks] == keep
    kept = sum(4 * (block.num_src + 1) + 2 * block.num_edges for block in batch.blocks)  # int16 positions
    assert plan.estimate == without + kept and plan.kept_transpose_bytes == kept
    report = plan.report()
    assert report["kept_transpose_bytes"] == kept and report["full_batch"]["estimate_peak_bytes"] == plan.estimate
    set_dropout_key(model, 0, 0)
    with monkeypatch.context() as patch:  # the step gathers on the kept transposes: no scatter, none built per call
        patch.setattr(aggregate, "_csr_scatter", None)
        patch.setattr(aggregate, "_transpose", None)
        assert plan.measure(model, optimizer, HostFeatureStore(graph.x, pin=False), graph.y, cpu) == [plan.estimate]
    assert planner.plan(batch) is plan and all(block.transpose is not None for block in batch.blocks)

    assert planner.plan(batch, min_pieces=2).pieces == 2  # as after an out-of-memory error
    assert all(block.transpose is None for block in batch.blocks)
    layerwise = config.micro_batch.model_copy(update={"num_micro_batches": 1, "mode": "layerwise"})
    Planner(layerwise, estimator, cpu, recurring=True).plan(batch)
    assert all(block.transpose is None for block in batch.blocks)
    for wanted in ("auto", True):
        tight = Planner(one.model_copy(update={"budget": without + kept - 1, "keep_transposes": wanted}), estimator, cpu,
                        recurring=True).plan(batch)
        assert tight.pieces == 1 and tight.estimate == without and all(block.transpose is None for block in batch.blocks)
    roomy = Planner(auto.model_copy(update={"budget": without + kept}), estimator, cpu, recurring=True).plan(batch)
    assert roomy.pieces == 1 and roomy.estimate == without + kept
    assert all(block.transpose is not None for block in batch.blocks)
    never = auto.model_copy(update={"budget": without + kept, "keep_transposes": False})
    assert Planner(never, estimator, cpu, recurring=True).plan(batch).estimate == without
    assert all(block.transpose is None for block in batch.blocks)


def test_a_run_keeping_its_transposes_trains_as_one_that_scatters(tmp_path, monkeypatch):
    """``train()`` on one full batch in one micro-batch with ``keep_transposes: true`` makes each block's transpose
    once for the run and gathers every aggregation's backward on it (the scatter would fail here), and ends with the
    parameters of the run that scatters, to float32 reassociation of the sums."""
    overrides = OVERRIDES + ["optim.epochs=3", "micro_batch.num_micro_batches=1"]
    train(load_config(None, overrides + ["micro_batch.keep_transposes=false"]), run_dir=tmp_path / "scatters")
    transposes, transpose = [], aggregate._transpose
    monkeypatch.setattr(aggregate, "_csr_scatter", None)
    monkeypatch.setattr(aggregate, "_transpose", lambda *args: transposes.append(args[0]) or transpose(*args))
    train(load_config(None, overrides + ["micro_batch.keep_transposes=true"]), run_dir=tmp_path / "kept")
    assert len(transposes) == 2, "one per block of the batch, when it was planned"
    scatters, kept = load_checkpoint(tmp_path / "scatters"), load_checkpoint(tmp_path / "kept")
    for name, tensor in scatters["model"].items():
        torch.testing.assert_close(kept["model"][name], tensor, msg=name)


@pytest.mark.parametrize("sampling, recurring", [([], True), (["sampling.fanouts=[5,5]"], False),
                                                 (["sampling.batch_size=10"], False)])
def test_only_a_run_on_one_full_batch_of_full_neighbourhoods_recurs(setting, sampling, recurring):
    graph = setting[0]
    config = load_config(None, OVERRIDES + sampling)
    assert make_planner(config, graph, None, torch.device("cpu"), HostFeatureStore(graph.x, pin=False)).recurring is recurring


def test_only_a_layer_whose_aggregation_backpropagates_keeps_its_transpose(setting):
    """SAGE-mean aggregating its input rows before projecting them (200 → 256 columns) takes no gradient through
    layer 0's aggregation, so layer 0's block keeps no transpose."""
    graph, _, _, _, _, _ = setting
    config = load_config(None, [o for o in OVERRIDES if not o.startswith("model.hidden")] + ["model.hidden=256"])
    batch = sample_batch(graph, graph.train_idx, [None, None])
    assert PeakEstimator(model_spec(config, graph)).transposed_layers(batch.blocks) == [False, True]


@pytest.fixture(scope="module")
def cora_full_batch(cora):
    """Cora with every node an output, full neighbourhood, 2-layer SAGE-mean hidden 64 (the planner's
    done-when setting of issue 10 on a smaller graph), its Adam state resident, and the K = 1 measured peak."""
    config = load_config(None, ["model.hidden=64", "model.aggregator=mean", "optim.weight_decay=5e-4"])
    torch.manual_seed(0)
    model = build_model(config.model, cora)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    batch = sample_batch(cora, torch.arange(cora.num_nodes), [None, None])
    set_dropout_key(model, 0, 0)
    measure_training_step(model, optimizer, batch, HostFeatureStore(cora.x, pin=False), cora.y, "cpu")  # Adam state exists
    full_peak = measure_training_step(model, optimizer, batch, HostFeatureStore(cora.x, pin=False), cora.y, "cpu").peak_bytes
    return config, model, optimizer, batch, full_peak


@pytest.mark.parametrize("fraction", [1.0, 0.75, 0.5, 0.375])
def test_auto_chooses_a_plan_that_fits_the_budget_measured(cora, cora_full_batch, fraction):
    """micro_batch.mode=auto under a budget: whichever mode it picks, the step run for real fits (measured
    peak ≤ budget: Betty's micro-batches one by one as training runs them, or the layer-wise step)."""
    config, model, optimizer, batch, full_peak = cora_full_batch
    budget = int(full_peak * fraction)
    section = config.micro_batch.model_copy(update={"mode": "auto", "budget": budget})
    plan = Planner(section, PeakEstimator(model_spec(config, cora)), torch.device("cpu")).plan(batch)
    set_dropout_key(model, 0, 0)
    assert plan.method in ("micro_batches", "layerwise") and plan.estimate <= budget
    measured = max(plan.measure(model, optimizer, HostFeatureStore(cora.x, pin=False), cora.y, torch.device("cpu")))
    assert measured <= budget, (plan.method, plan.pieces, measured, budget)


@pytest.mark.parametrize("aggregator, linear, aggregate", [
    ("mean", (10 + 4) * 8 * 4, 20 * 4),  # projected first (8 > 4) on the src rows, fc_self on the dst rows
    ("gcn", 10 * 8 * 4, 20 * 4),  # no fc_self
    ("pool", (4 + 4) * 8 * 4 + 10 * 8 * 8, 20 * 8),  # fc_pool on the src rows; max over 8-wide rows
    ("lstm", (4 + 4) * 8 * 4, 20 * 8 * 8 * 8),  # an LSTM step (8·a²) per edge
])
def test_step_work_counts_each_sage_aggregator_s_own_maps(aggregator, linear, aggregate):
    """``auto``'s work model by hand: one layer 8 → 4, 10 src rows, 4 dst rows, 20 edges; a micro-batch runs
    it forward and backward (the input layer's input takes no gradient), a layer-wise step once more."""
    from types import SimpleNamespace

    from betty_trainer.models.sage import sage_work
    from estimator.work import MASK_COST, step_work

    spec = SimpleNamespace(arch="sage", aggregator=aggregator, widths=[8, 4], heads=1, layer_work=sage_work)
    piece = SimpleNamespace(num_src=10, num_dst=4, num_edges=20)
    gather = 10 * 8 * MASK_COST
    assert step_work(spec, [[piece]], layerwise=False) == 2 * (linear + aggregate) + gather
    assert step_work(spec, [[piece]], layerwise=True) == 3 * (linear + aggregate) + 2 * gather


@pytest.mark.parametrize("aggregator, self_rows", [("mean", 4), ("gcn", 0)])
def test_step_work_of_a_projected_sage_layer_projects_its_block_s_src_rows_once(aggregator, self_rows):
    """Layer-wise, a SAGE layer that projects first projects its block's 7 src rows once per pass instead of
    each chunk's (two chunks of 10 src rows and 2 dst rows each); ``mean``'s self term still runs on each
    chunk's dst rows. Gathered: the block's src rows (8 wide), each chunk's rows of z (4 wide) and ``mean``'s
    dst input rows (8 wide)."""
    from types import SimpleNamespace

    from betty_trainer.models.sage import sage_work
    from estimator.work import MASK_COST, step_work

    spec = SimpleNamespace(arch="sage", aggregator=aggregator, widths=[8, 4], heads=1, layer_work=sage_work)
    pieces = [SimpleNamespace(num_src=10, num_dst=2, num_edges=10)] * 2
    linear, aggregate = (7 + self_rows) * 8 * 4, 20 * 4
    gather = (7 * 8 + 20 * 4 + self_rows * 8) * MASK_COST
    assert step_work(spec, [pieces], layerwise=True, projected_rows=[7]) == 3 * (linear + aggregate) + 2 * gather


def test_fewer_micro_batches_than_asked_are_reported_once(cora, caplog):
    """REG's METIS may leave parts empty: the planner says so (once) and names the partitioners that give exactly K."""
    config = load_config(None, ["dataset.name=cora", "micro_batch.num_micro_batches=64"])
    batch = sample_batch(cora, cora.train_idx, [None, None])
    for partitioner in ("reg", "range"):
        section = config.micro_batch.model_copy(update={"partitioner": partitioner})
        planner = Planner(section, PeakEstimator(model_spec(config, cora)), torch.device("cpu"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="betty_trainer"):
            plan = planner.plan(batch)
            planner.plan(batch, 2)  # planned again: the warning is not repeated
        said = [r.getMessage() for r in caplog.records if "asks for 64 micro-batches" in r.getMessage()]
        if partitioner == "reg":
            assert plan.pieces < 64 and len(said) == 1 and f"made {plan.pieces}" in said[0]
        else:
            assert plan.pieces == 64 and not said


@pytest.mark.parametrize("mode", ["micro_batches", "layerwise"])
def test_every_plan_is_a_step_plan_that_runs_the_full_batch_s_gradient(setting, mode):
    """Whatever the planner returns is used through the StepPlan interface alone: ``run`` gives the full batch's
    loss and gradient (dropout off: the same sums in another order), ``redundancy`` has one entry per layer,
    ``report`` is JSON and names the method and the host bytes the plan holds (its tensors, walked), ``measure``
    gives a peak per measured unit."""

    from betty_trainer import StepPlan

    graph, config, batch, *_ = setting
    section = load_config(None, OVERRIDES + [f"micro_batch.mode={mode}", "micro_batch.num_micro_batches=3"]).micro_batch
    plan = Planner(section, PeakEstimator(model_spec(config, graph)), torch.device("cpu")).plan(batch)
    assert isinstance(plan, StepPlan) and plan.method == mode and plan.pieces == 3
    gradients = {}
    for name, run in {"plan": plan.run, "full batch": micro_batches_module.MicroBatchPlan(
            batch, make_split(batch.blocks, k=1), None, "range").run}.items():
        torch.manual_seed(0)
        model = build_model(config.model.model_copy(update={"dropout": 0.0}), graph)
        result = run(model, HostFeatureStore(graph.x, pin=False), graph.y, torch.device("cpu"))
        gradients[name] = (result.loss, [p.grad for p in model.parameters()])
    (loss, grads), (full_loss, full_grads) = gradients["plan"], gradients["full batch"]
    assert loss == pytest.approx(full_loss, rel=1e-5)  # float32 sums regrouped: ~1e-7 relative per term
    for grad, full in zip(grads, full_grads):
        torch.testing.assert_close(grad, full, rtol=1e-4, atol=1e-6)  # as tests/test_exactness.py
    assert len(plan.redundancy()) == len(batch.blocks) and min(plan.redundancy()) >= 1.0
    report = json.loads(json.dumps(plan.report()))
    assert report["mode"] == mode and report["redundancy_per_layer"] == plan.redundancy()
    tensors = storage_bytes(held_tensors(plan, plan.batch), [t for block in batch.blocks for t in block.tensors()])
    assert report["plan_host_bytes"] == plan.host_bytes == tensors > 0  # the groups, or the chunks' dst and pointers
    model = build_model(config.model, graph)
    measured = plan.measure(model, torch.optim.Adam(model.parameters()), HostFeatureStore(graph.x, pin=False),
                            graph.y, torch.device("cpu"))
    assert len(measured) == (3 if mode == "micro_batches" else 1) and min(measured) > 0


def test_the_old_mode_name_betty_still_works_and_says_it_was_renamed(caplog):
    with caplog.at_level("WARNING", logger="betty_trainer"):
        config = load_config(None, ["micro_batch.mode=betty"])
    assert config.micro_batch.mode == "micro_batches"
    assert "micro_batch.mode=betty is now called micro_batch.mode=micro_batches" in caplog.text


def held_tensors(value, beside, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from ``value`` through attributes, lists, tuples and dicts, except through ``beside``
    (the plan's batch) and callables (an estimate the plan was handed is the estimator's, not the plan's)."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is beside or callable(value) or isinstance(value, (str, int, float, bool)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        children = list(getattr(value, "__dict__", {}).values())
    return [t for child in children for t in held_tensors(child, beside, seen)]


def storage_bytes(tensors, beside=()) -> int:
    """Bytes of the distinct storages of ``tensors`` that ``beside``'s tensors do not hold."""
    excluded = {t.untyped_storage().data_ptr() for t in beside}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in excluded)


@pytest.mark.parametrize("dataset", ["computers", "cornell5"])
def test_a_betty_plan_at_k_16_holds_under_a_tenth_of_the_k_1_step(dataset, request):
    """Issue 23's slices on demand: a micro-batch plan keeps its micro-batches' output positions, not their slices
    (which held ``8·S + 12·E`` bytes per micro-batch and layer: +50 MiB at K = 16 on Amazon Computers), so the host
    bytes it holds beside the batch are the same at every K and at K = 16 at most 10% of the K = 1 step's measured
    peak; ``plan.json``'s ``plan_host_bytes`` is what the plan holds, counted here by walking it. The outputs are
    every labelled node, the full neighbourhood of a 2-layer GraphSAGE (hidden 64)."""
    graph = request.getfixturevalue(dataset)
    batch = sample_batch(graph, torch.nonzero(graph.y >= 0).flatten(), [None, None])
    held, plans = {}, {}
    for k in (1, 16):
        config = load_config(None, ["model.hidden=64", "model.num_layers=2", f"micro_batch.num_micro_batches={k}"])
        plans[k] = plan = Planner(config.micro_batch, PeakEstimator(model_spec(config, graph)), torch.device("cpu")).plan(batch)
        assert plan.pieces == k
        held[k] = storage_bytes(held_tensors(plan, plan.batch), [t for block in batch.blocks for t in block.tensors()])
        assert plan.report()["plan_host_bytes"] == plan.host_bytes == held[k]
    assert held[16] == held[1] == 8 * batch.output_nodes.numel()
    torch.manual_seed(0)
    model = build_model(config.model, graph)
    peak = max(plans[1].measure(model, torch.optim.Adam(model.parameters()), HostFeatureStore(graph.x, pin=False),
                                graph.y, torch.device("cpu")))
    assert held[16] <= 0.10 * peak, (held[16], peak)


def two_copies(graph) -> GraphPartition:
    """A graph partition of two disjoint copies of ``graph`` (nodes ``v`` and ``N + v``), the training nodes of
    both balanced: at K = 2 METIS cuts no edge, one copy per part, so all of a batch of the first copy's nodes
    lands in one part."""
    adjacency = sp.csc_matrix((np.ones(graph.num_edges), graph.indices.numpy(), graph.indptr.numpy()),
                              shape=(graph.num_nodes, graph.num_nodes))
    doubled = sp.block_diag([adjacency, adjacency], format="csc")
    balanced = torch.zeros(2 * graph.num_nodes, dtype=torch.bool)
    balanced[torch.cat([graph.train_idx, graph.train_idx + graph.num_nodes])] = True
    return GraphPartition(torch.from_numpy(doubled.indptr.astype(np.int64)), torch.from_numpy(doubled.indices), balanced)


def test_sampled_batches_are_split_by_the_graph_partition_with_exact_estimates(setting):
    """micro_batch.assignment=graph without a budget: every sampled batch is split by its outputs' parts in the
    graph's K-way partition (one METIS for the run); the plan's estimate, made when asked, is the largest of the
    micro-batches as they run."""
    graph, config, *_ = setting
    by_graph = load_config(None, OVERRIDES + ["micro_batch.assignment=graph", "micro_batch.num_micro_batches=4"])
    partition = graph_partition(by_graph, graph)
    estimator = PeakEstimator(model_spec(config, graph))
    planner = Planner(by_graph.micro_batch, estimator, torch.device("cpu"), graph_partition=partition)
    for step in range(2):
        batch = sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(step))
        plan = planner.plan(batch)
        assert plan.partitioner == "graph" and plan.pieces == 4
        parts = partition.parts(4, planner.seed)[batch.output_nodes.numpy()]
        assert sorted(sorted(group.tolist()) for group in plan.split.groups) == \
            sorted(np.flatnonzero(parts == p).tolist() for p in range(4))
        assert not plan.split.estimates  # nothing estimated per batch without a budget, until asked
        assert plan.estimate == max(estimator.peak(micro_batch.blocks, index > 0)
                                    for index, micro_batch in enumerate(plan.micro_batches))
    assert planner.plans_made == 2 and planner.fallbacks == 0


@pytest.fixture
def counts(monkeypatch) -> list[tuple]:
    """The arguments of every :func:`partition.slicing.count_layers` call a split makes, in order."""
    calls = []
    count = search_module.count_layers
    monkeypatch.setattr(search_module, "count_layers", lambda *args: calls.append(args) or count(*args))
    return calls


@pytest.mark.parametrize("assignment", ["graph", "batch"])
def test_a_sampled_batch_split_at_a_fixed_k_counts_no_micro_batch_per_step(setting, counts, assignment):
    """A fixed K (issue 23: counting was most of such a plan), its outputs assigned by the run's graph partition or
    by the partitioner per batch: planning, the step and the redundancy the training loop reads after it count no
    micro-batch's sizes; that redundancy, from the micro-batches the step built, is exactly the counted one, and the
    work and the estimate, counted once when first read, are the counted sizes' (the estimate: each micro-batch's
    closed-form peak, as a search under a budget has it)."""
    graph, config, *_ = setting
    fixed = load_config(None, OVERRIDES + [f"micro_batch.assignment={assignment}", "micro_batch.num_micro_batches=4"])
    estimator = PeakEstimator(model_spec(config, graph))
    planner = Planner(fixed.micro_batch, estimator, torch.device("cpu"),
                      graph_partition=graph_partition(fixed, graph) if assignment == "graph" else None)
    batch = sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(0))
    plan = planner.plan(batch)
    plan.run(build_model(config.model, graph), HostFeatureStore(graph.x, pin=False), graph.y, torch.device("cpu"))
    ran = plan.redundancy()
    assert not counts and plan.split.counted is None and plan.pieces == 4 and not plan.split.estimates
    assert plan.partitioner == ("graph" if assignment == "graph" else fixed.micro_batch.partitioner)
    counted = count_layers(batch.blocks, plan.split.groups)
    assert ran == redundancy(batch.blocks, counted) and ran[0] > 1
    assert plan.work == estimator.micro_batch_work(counted) and len(counts) == 1  # counted now, once
    assert plan.estimate == max(estimator.peak(layers, index > 0) for index, layers in enumerate(counted))
    assert plan.redundancy() == ran and len(counts) == 1


@pytest.mark.parametrize("assignment", ["graph", "batch"])
def test_a_run_of_sampled_batches_at_a_fixed_k_counts_only_the_first_batch_it_shows(tmp_path, counts, assignment):
    """``train()`` on sampled mini-batches split at a fixed K (by the graph, or by REG per batch) counts micro-batches
    once: the first batch's plan it shows and writes (``plan.json``: estimate and sizes); every later batch and
    epoch, and the redundancy logged after each step, count nothing."""
    train(load_config(None, OVERRIDES + ["sampling.fanouts=5,10", "sampling.batch_size=50", "optim.epochs=2",
                                         f"micro_batch.assignment={assignment}", "micro_batch.num_micro_batches=4"]),
          run_dir=tmp_path)
    epochs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(counts) == 1 and len(epochs) == 2 and all(epoch["input_redundancy"] > 1 for epoch in epochs)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["partitioner"] == ("graph" if assignment == "graph" else "reg") and plan["pieces"][0]["estimate"]
    assert plan["tried"] == [{"k": 4, "largest_estimate_bytes": None}]  # the split estimated nothing; the plan did
    assert plan["estimate_peak_bytes"] == max(piece["estimate"]["peak_bytes"] for piece in plan["pieces"])


@pytest.mark.parametrize("k", [1, 4])
def test_a_micro_batch_plan_estimates_and_reports_without_slicing(setting, monkeypatch, k):
    """A plan's estimate and report count each micro-batch from its split (``count_layers``' sizes, the batch's edge
    weights bound in), slicing none, and give what its micro-batches as they run give: sizes, and per piece the
    estimate by component (a weighted batch: its slices carry the weights)."""
    graph, config, *_ = setting
    by_graph = load_config(None, OVERRIDES + ["micro_batch.assignment=graph", f"micro_batch.num_micro_batches={k}"])
    estimator = PeakEstimator(model_spec(config, graph))
    sampled = sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(0))
    batch = Batch([dataclasses.replace(b, edge_weight=torch.rand(b.num_edges, generator=torch.Generator().manual_seed(1)))
                   for b in sampled.blocks])
    planner = Planner(by_graph.micro_batch, estimator, torch.device("cpu"), graph_partition=graph_partition(by_graph, graph))
    plan = planner.plan(batch)
    assert plan.pieces == k and not plan.split.estimates  # the estimate is made when asked

    sliced = []
    slice_micro_batch = Batch.micro_batch
    monkeypatch.setattr(Batch, "micro_batch", lambda self, index: sliced.append(index) or slice_micro_batch(self, index))
    estimate, report = plan.estimate, json.loads(json.dumps(plan.report()))
    assert not sliced
    monkeypatch.undo()

    micro_batches = list(plan.micro_batches)
    assert all(b.edge_weight is not None for mb in micro_batches for b in mb.blocks)
    expected = [estimator.itemised(micro_batch.blocks, index > 0) for index, micro_batch in enumerate(micro_batches)]
    assert estimate == max(e.peak_bytes for e in expected)
    for row, micro_batch, itemised in zip(report["pieces"], micro_batches, expected, strict=True):
        assert row["layers"] == [{"src_nodes": b.num_src, "dst_nodes": b.num_dst, "edges": b.num_edges}
                                 for b in micro_batch.blocks]
        assert row["estimate"] == {"peak_bytes": itemised.peak_bytes, "at_peak": itemised.at_peak}


def test_under_a_budget_the_graph_partition_takes_the_first_batch_s_k_and_falls_back_where_it_misses(setting,
                                                                                                      monkeypatch):
    """Under a budget the run's first batch is planned per batch (REG), and its K is the graph's: a later batch
    whose graph split fits is split by the graph (its estimates those of its micro-batches as they run); one
    whose graph split misses, and whose missed micro-batches cut in two miss again (here a bisection that cuts
    nothing), is planned per batch instead (within the budget), counted in ``fallbacks``."""
    graph, config, *_ = setting
    estimator = PeakEstimator(model_spec(config, graph))
    first, second = (sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(s)) for s in (0, 1))
    estimate = lambda structures, accumulate: estimator.peak(structures, accumulate)
    partition = graph_partition(load_config(None, OVERRIDES + ["micro_batch.assignment=graph"]), graph)
    graph_at_2 = make_split(second.blocks, estimate, k=2, partitioner="graph", splitter=partition.splitter(second.output_nodes))
    budget = max(max(make_split(first.blocks, estimate, k=2).estimates), max(graph_at_2.estimates))
    assert estimator.peak(first.blocks) > budget  # so the first batch needs K = 2
    section = load_config(None, OVERRIDES + [f"micro_batch.budget={budget}"]).micro_batch
    planner = Planner(section, estimator, torch.device("cpu"), graph_partition=partition)
    plans = [planner.plan(first), planner.plan(second)]
    assert [(plan.partitioner, plan.pieces) for plan in plans] == [("reg", 2), ("graph", 2)]
    assert plans[1].split.estimates == [estimator.peak(micro_batch.blocks, index > 0)  # exact for the graph's split
                                        for index, micro_batch in enumerate(plans[1].micro_batches)]
    assert planner.fallbacks == 0

    tighter = max(make_split(first.blocks, estimate, k=4).estimates)
    misses = Planner(load_config(None, OVERRIDES + [f"micro_batch.budget={tighter}"]).micro_batch, estimator,
                     torch.device("cpu"), graph_partition=two_copies(graph))
    assert misses.plan(first).pieces == misses.graph_k == 4
    assert len(misses.graph_partition.splitter(second.output_nodes).split(4)) == 2  # the premise: 2 parts per copy
    monkeypatch.setattr(GraphSplitter, "halves", lambda self, k, seed, group: [group])
    plan = misses.plan(second)
    assert plan.partitioner == "reg" and max(plan.split.estimates) <= tighter and misses.fallbacks == 1
    # the graph's split at K = 4 missed (its micro-batches, halves of the batch, are about twice too large); the batch
    # tried the K that miss asks for, ⌈K · (largest − resident) / (budget − resident)⌉, missed again (one copy holds
    # about half of any K's parts) and was planned per batch; the next batches try the first miss's K, or the
    # per-batch search's if more
    splitter, resident = misses.graph_partition.splitter(second.output_nodes), estimator.resident_bytes

    def largest_at(k):
        return max(estimator.peak(sizes, index > 0) for index, sizes in enumerate(count_layers(second.blocks,
                                                                                               splitter.split(k))))

    asked = math.ceil(4 * (largest_at(4) - resident) / (tighter - resident))
    assert asked > 5 and largest_at(asked) > tighter
    assert misses.graph_k == max(asked, plan.pieces) and misses._missed_k == asked
    for _ in range(GRAPH_K_SHRINK_AFTER):  # batches that would fit with one micro-batch: never to a K that missed
        misses._fits(misses.graph_k, resident + 1)
    assert misses.graph_k == max(asked, plan.pieces)


def graph_assigned_under_a_budget(setting):
    """A planner assigning sampled batches by the graph partition, under 0.3 × the estimate of a first batch of
    every training node (fanouts 5, 10), which it has planned: ``(graph, estimator, generator, budget, planner, K)``
    with K that batch's (the graph's K)."""
    graph, config, *_ = setting
    estimator = PeakEstimator(model_spec(config, graph))
    generator = torch.Generator().manual_seed(0)
    first = sample_batch(graph, graph.train_idx, [5, 10], generator)
    budget = int(estimator.peak(first.blocks) * 0.3)
    by_graph = load_config(None, OVERRIDES + [f"micro_batch.budget={budget}", "micro_batch.assignment=graph"])
    planner = Planner(by_graph.micro_batch, estimator, torch.device("cpu"),
                      graph_partition=graph_partition(by_graph, graph))
    return graph, estimator, generator, budget, planner, planner.plan(first).pieces


def test_the_graph_partition_s_k_drops_to_what_its_batches_need(setting, caplog):
    """A first batch of every training node sets the graph's K under a budget; batches of half the training nodes
    then fit with room, and after GRAPH_K_SHRINK_AFTER of them the graph's K drops to the largest K the 1/K rule
    says they needed (logged), every plan within the budget and none planned per batch."""
    graph, estimator, generator, budget, planner, k = graph_assigned_under_a_budget(setting)
    needed = 0
    with caplog.at_level(logging.INFO, logger="betty_trainer.memory.planner"):
        for _ in range(GRAPH_K_SHRINK_AFTER):
            half = graph.train_idx[torch.randperm(graph.train_idx.numel(), generator=generator)[:100]]
            plan = planner.plan(sample_batch(graph, half, [5, 10], generator))
            assert plan.partitioner == "graph" and plan.pieces == k and max(plan.split.estimates) <= budget
            needed = max(needed, math.ceil(k * (max(plan.split.estimates) - estimator.resident_bytes)
                                           / (budget - estimator.resident_bytes)))
    assert needed < k and planner.graph_k == needed and planner.fallbacks == 0
    assert f"the graph partition's K: {k} → {needed} (its last 8 batches are estimated to fit with fewer)" in caplog.text
    plan = planner.plan(sample_batch(graph, half, [5, 10], generator))
    assert plan.pieces == needed and max(plan.split.estimates) <= budget


def test_assignment_auto_uses_the_graph_partition_for_sampled_batches_with_a_metis_partitioner(setting):
    graph = setting[0]
    chosen = {overrides: graph_partition(load_config(None, OVERRIDES + list(overrides)), graph) is not None
              for overrides in [(), ("sampling.fanouts=5,10",), ("sampling.batch_size=16",), ("sampling.batch_size=100000",),
                                ("sampling.fanouts=5,10", "micro_batch.partitioner=range"),
                                ("sampling.fanouts=5,10", "micro_batch.assignment=batch"), ("micro_batch.assignment=graph",)]}
    assert chosen == {(): False, ("sampling.fanouts=5,10",): True, ("sampling.batch_size=16",): True,
                      ("sampling.batch_size=100000",): False,
                      ("sampling.fanouts=5,10", "micro_batch.partitioner=range"): False,
                      ("sampling.fanouts=5,10", "micro_batch.assignment=batch"): False,
                      ("micro_batch.assignment=graph",): True}


def test_a_graph_split_with_parts_empty_of_the_batch_s_outputs_says_so(setting, caplog):
    """The graph's parts are the whole graph's: a batch may have no output in some, and then runs fewer micro-batches
    than asked, which the planner says once, naming the graph."""
    graph, config, *_ = setting
    section = load_config(None, OVERRIDES + ["micro_batch.num_micro_batches=2"]).micro_batch
    planner = Planner(section, PeakEstimator(model_spec(config, graph)), torch.device("cpu"), graph_partition=two_copies(graph))
    with caplog.at_level("WARNING", logger="betty_trainer"):
        plan = planner.plan(sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(0)))
    said = [r.getMessage() for r in caplog.records if "asks for 2 micro-batches" in r.getMessage()]
    assert plan.partitioner == "graph" and plan.pieces == 1
    assert len(said) == 1 and "graph made 1 (no output of the batch is in some of the graph's parts)" in said[0]


def test_layerwise_chunks_of_sampled_batches_are_the_graph_partition_s_parts(setting, monkeypatch):
    """micro_batch.mode=layerwise with assignment=graph and no budget: each layer's chunks are its dst nodes grouped by
    their parts in a K-way partition of the graph balancing every node, METIS running once for the run, not per batch;
    the chunks' step gives the gradients of the batch in one micro-batch, and its measured peak is the plan's
    estimate. Under a budget the chunk search cuts per batch, and runs no METIS of the graph."""
    import partition.partitioners as partitioners

    graph = setting[0]
    config = load_config(None, OVERRIDES + ["model.aggregator=pool"])  # a layer chunked by its dst sets: not ranged
    calls = []
    metis = partitioners.metis_kway
    monkeypatch.setattr(partitioners, "metis_kway", lambda *args: calls.append((args[0].shape[0], args[1])) or metis(*args))
    section = load_config(None, OVERRIDES + ["micro_batch.assignment=graph", "micro_batch.mode=layerwise",
                                             "micro_batch.num_micro_batches=4"]).micro_batch
    estimator = PeakEstimator(model_spec(config, graph))
    planner = Planner(section, estimator, torch.device("cpu"), graph_partition=graph_partition(
        load_config(None, OVERRIDES + ["micro_batch.assignment=graph"]), graph))
    features = HostFeatureStore(graph.x, pin=False)
    for step in range(2):
        batch = sample_batch(graph, graph.train_idx, [5, 10], torch.Generator().manual_seed(step))
        plan = planner.plan(batch)
        assert plan.method == "layerwise" and plan.partitioners == ["graph", "graph"]
        parts = planner.graph_partition.of_all_nodes().parts(4, planner.seed)
        for block, chunks, method in zip(batch.blocks, plan.chunks.layers, plan.partitioners):
            if method == "graph":  # every chunk one part: the parts of its dst nodes' global ids
                owners = [np.unique(parts[block.dst_nodes[chunk.dst].numpy()]) for chunk in chunks]
                assert all(owner.size == 1 for owner in owners) and len({int(o[0]) for o in owners}) == len(chunks)
        torch.manual_seed(0)
        model = build_model(config.model, graph)
        set_dropout_key(model, 0, step)
        optimizer = torch.optim.Adam(model.parameters())
        assert plan.measure(model, optimizer, features, graph.y, torch.device("cpu")) == [plan.estimated_peak]
        grads = []
        whole = load_config(None, OVERRIDES + ["micro_batch.num_micro_batches=1"]).micro_batch
        for run in (plan, Planner(whole, estimator, torch.device("cpu")).plan(batch)):
            model.zero_grad()
            run.run(model, features, graph.y, torch.device("cpu"))
            grads.append([p.grad.clone() for p in model.parameters()])
        for chunked, whole in zip(*grads):
            torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    chunk_partition = planner.graph_partition.of_all_nodes()
    assert chunk_partition._weights is None and chunk_partition is planner.graph_partition.of_all_nodes()
    assert calls == [(graph.num_nodes, 4)]  # all nodes balanced, kept for the run: one METIS of the graph, at K = 4
    # under a budget the search tries chunk counts the run has not partitioned: those are cut per batch
    budgeted = section.model_copy(update={"budget": 2 * plan.estimated_peak})
    searched = Planner(budgeted, estimator, torch.device("cpu"), graph_partition=planner.graph_partition).plan(batch)
    assert searched.partitioners == [section.partitioner] * 2
    assert [call for call in calls if call[0] == graph.num_nodes] == [(graph.num_nodes, 4)]


def test_the_graph_chunk_partitioner_needs_the_run_s_splitters(setting):
    from partition.chunks import search_chunks

    with pytest.raises(ValueError, match="give its splitters"):
        search_chunks(setting[2].blocks, None, k=2, partitioner="graph")


def test_a_built_in_model_on_a_torch_the_recorder_is_not_tested_with_is_estimated_as_a_custom_one(setting, monkeypatch,
                                                                                                  caplog):
    """The recorder refuses an untested torch (it reads private PyTorch API); the built-in model is then recorded or
    calibrated as a custom model is (here calibrated: the recorder refuses that too), with a warning naming why, and
    its plans fit the budget all the same."""
    from estimator import recorder
    from estimator.calibrate import CalibratedModel

    graph, _, batch, *_, full_peak = setting
    monkeypatch.setattr(recorder, "TESTED_TORCH", ())
    monkeypatch.delenv("BETTY_RECORDER_TRY_TORCH", raising=False)
    with pytest.raises(recorder.RecordingRefused, match="the recorder is tested with torch"):
        model_spec(load_config(None, OVERRIDES), graph)
    config = load_config(None, OVERRIDES + [f"micro_batch.budget={full_peak * 2 // 3}"])
    with caplog.at_level("WARNING", logger="betty_trainer.memory.planner"):
        planner = make_planner(config, graph, None, torch.device("cpu"), HostFeatureStore(graph.x, pin=False))
    assert isinstance(planner.estimator.calibrated.unweighted, CalibratedModel)
    assert "the memory recorder refused the built-in sage model (the recorder is tested with torch" in caplog.text
    plan = planner.plan(batch)
    assert plan.method == "micro_batches" and plan.pieces > 1 and plan.estimate <= planner.budget
    layerwise = load_config(None, OVERRIDES + [f"micro_batch.budget={full_peak}", "micro_batch.mode=layerwise"])
    with pytest.raises(ConfigError, match=r"needs a built-in model's estimate, and the memory recorder refused the "
                                          r"built-in sage model \(the recorder is tested with torch"):
        make_planner(layerwise, graph, None, torch.device("cpu"), HostFeatureStore(graph.x, pin=False))


def test_a_batch_whose_graph_split_misses_in_a_few_micro_batches_cuts_only_those_in_two(cora, caplog):
    """Cora's training nodes (fanouts 5, 10) under 0.2 × their estimate, split by the graph: the first batch sets
    the graph's K, the next batch's graph split at that K misses the budget in a few micro-batches, and cutting each
    of those in two by a bisection of its part (GraphSplitter.halves) fits in fewer micro-batches than the K the
    miss asks for. The batch takes that split: the micro-batches that fit as they were, each missed one in two
    halves of it, every estimate within the budget and exact for the micro-batches as they run; the graph's K stays
    (no move logged), counted in ``refined``, and can no longer drop to that K."""
    config = load_config(None, ["model.hidden=16", "train.progress=false"])
    estimator = PeakEstimator(model_spec(config, cora))
    first, second = (sample_batch(cora, cora.train_idx, [5, 10], torch.Generator().manual_seed(s)) for s in (0, 1))
    budget = int(estimator.peak(first.blocks) * 0.2)
    by_graph = load_config(None, ["model.hidden=16", "train.progress=false", f"micro_batch.budget={budget}",
                                  "micro_batch.assignment=graph"])
    planner = Planner(by_graph.micro_batch, estimator, torch.device("cpu"), graph_partition=graph_partition(by_graph, cora))
    k = planner.plan(first).pieces
    splitter, resident = planner.graph_partition.splitter(second.output_nodes), estimator.resident_bytes
    groups = splitter.split(k, planner.seed)
    estimates = [estimator.peak(sizes, index > 0) for index, sizes in enumerate(count_layers(second.blocks, groups))]
    missed = [group for group, estimate in zip(groups, estimates) if estimate > budget]
    asked = max(k + 1, math.ceil(k * (max(estimates) - resident) / (budget - resident)))
    assert planner.graph_k == k and 0 < len(missed) and k + len(missed) < asked  # the premise: a few missed

    with caplog.at_level(logging.INFO, logger="betty_trainer.memory.planner"):
        plan = planner.plan(second)
    assert plan.partitioner == "graph+halves" and plan.pieces == k + len(missed)  # as plan.json names it
    assert planner.graph_k == k and planner.refined == 1 and planner.fallbacks == 0
    assert "the graph partition's K" not in caplog.text
    kept = [group.tolist() for group, estimate in zip(groups, estimates) if estimate <= budget]
    pieces = [group.tolist() for group in plan.split.groups]
    assert [piece for piece in pieces if piece in kept] == kept
    for group in missed:
        halves = [piece for piece in pieces if set(piece) <= set(group.tolist())]
        assert len(halves) == 2 and sorted(halves[0] + halves[1]) == group.tolist()
    assert max(plan.split.estimates) <= budget
    assert plan.split.estimates == [estimator.peak(micro_batch.blocks, index > 0)
                                    for index, micro_batch in enumerate(plan.micro_batches)]
    for _ in range(GRAPH_K_SHRINK_AFTER):  # batches that would fit with one micro-batch: never to a K that was refined
        planner._fits(planner.graph_k, resident + 1)
    assert planner.graph_k == k


def test_a_batch_whose_graph_split_misses_tries_the_k_its_miss_asks_for_before_the_per_batch_search(setting, caplog):
    """The graph's K set too low for the next batch (one above the first batch's): its graph split misses the
    budget, and cutting its missed micro-batches in two would make more micro-batches than the K the miss asks for,
    ⌈K · (largest − resident) / (budget − resident)⌉ (at least K + 1); the batch tries that K on the graph, which
    fits: split by the graph, no fallback, and that K is the graph's from then on (logged)."""
    graph, estimator, generator, budget, planner, k = graph_assigned_under_a_budget(setting)
    low = k + 1
    planner.graph_k = low
    second = sample_batch(graph, graph.train_idx, [5, 10], generator)
    splitter, resident = planner.graph_partition.splitter(second.output_nodes), estimator.resident_bytes
    estimates = [estimator.peak(sizes, index > 0)
                 for index, sizes in enumerate(count_layers(second.blocks, splitter.split(low)))]
    at_low = max(estimates)
    asked = max(low + 1, math.ceil(low * (at_low - resident) / (budget - resident)))
    assert low + sum(estimate > budget for estimate in estimates) > asked  # halving the missed ones costs more
    with caplog.at_level(logging.INFO, logger="betty_trainer.memory.planner"):
        plan = planner.plan(second)
    assert at_low > budget and plan.partitioner == "graph" and plan.pieces == asked == planner.graph_k
    assert max(plan.split.estimates) <= budget and planner.fallbacks == 0
    assert f"the graph partition's K: {low} → {asked} (its largest micro-batch missed the budget)" in caplog.text
