"""The input-feature aggregation cache (BatchGNN §3, App. B–C; ``features.aggregation_cache``): exact gradients and
losses against the uncached run, the config's refusals, the on-disk cache, and the estimate against the measured
peak."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from betty_trainer import accumulate_gradients, plan_micro_batches
from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.datasets.aggregation import aggregation_dir
from betty_trainer.errors import ConfigError
from betty_trainer.execution.micro_batches import measure_training_step
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import build_model, set_dropout_key
from betty_trainer.sampling.base import SampleKey
from betty_trainer.sampling.schedule import first_batch, make_sampler
from betty_trainer.training.aggregation import aggregation_kind, check_aggregation_cache, input_features
from betty_trainer.training.dry_run import dry_run
from betty_trainer.training.trainer import train
from estimator.counts import counts_of
from estimator.estimate import estimate_micro_batch
from tests.test_estimator import DEFAULT_TOLERANCE
from tests.test_exactness import assert_same_gradients

CPU = torch.device("cpu")
MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"],
          "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "gcn": ["model.arch=gcn"]}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test writes its aggregation caches into its own folder."""
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cached_config(model, *more):
    return load_config(None, [*MODELS[model], "model.hidden=32", "model.dropout=0", "sampling.sampler=full",
                              "features.aggregation_cache=true", *more])


def step(model, micro_batches, rows, graph):
    """The batch's loss and every parameter's gradient, accumulated over ``micro_batches``."""
    model.zero_grad(set_to_none=True)
    result = accumulate_gradients(model, micro_batches, HostFeatureStore(rows, pin=False), graph.y, CPU)
    return result.loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("model_name, fanouts", [("sage-mean", [-1, -1]), ("sage-mean", [-1, 5, 10]),
                                                  ("sage-gcn", [-1, -1]), ("gcn", [-1, -1])])
def test_cached_layer_zero_gives_the_uncached_gradients(cora, model_name, fanouts):
    """Layer 0 over the full neighbourhood, no dropout: the cached run's loss and gradients (every parameter) equal
    the uncached run's within the exactness bound (tests/test_exactness.py), with the batch whole and in
    micro-batches; the cached batch is the uncached one without its layer-0 block (the sampled layers above it
    drawn alike), so its input rows are layer 0's dst nodes."""
    config = cached_config(model_name, f"model.num_layers={len(fanouts)}", "sampling.sampler=ns",
                           f"sampling.fanouts={fanouts}")
    plain = config.model_copy(update={"features": config.features.model_copy(update={"aggregation_cache": False})})
    torch.manual_seed(0)
    model = build_model(config.model, cora)
    uncached = first_batch(plain, cora, make_sampler(plain, cora))
    cached = first_batch(config, cora, make_sampler(config, cora))
    assert cached.num_layers == len(fanouts) - 1
    for ours, theirs in zip(cached.blocks, uncached.blocks[1:]):
        assert torch.equal(ours.src_nodes, theirs.src_nodes) and torch.equal(ours.indices, theirs.indices)
    rows = input_features(config, cora)
    assert rows.shape == (cora.num_nodes, model.aggregated_width)
    reference_loss, reference = step(model, [uncached], cora.x, cora)
    for k in (1, 4):
        loss, gradients = step(model, plan_micro_batches(cached, k, "reg", 0), rows, cora)
        assert abs(loss - reference_loss) <= 1e-6 * reference_loss
        assert_same_gradients(reference, gradients)


def test_the_cache_changes_a_sampled_layer_zero(cora):
    """Guards the test above: under ``approximate`` with a sampled layer 0 the cached gradient is not the uncached
    one (the comparison can fail), by far more than the exactness bound."""
    sampled = [*MODELS["sage-mean"], "model.hidden=32", "model.dropout=0", "sampling.fanouts=[2,5]"]
    config = load_config(None, [*sampled, "features.aggregation_cache=approximate"])
    plain = load_config(None, sampled)
    torch.manual_seed(0)
    model = build_model(config.model, cora)
    _, reference = step(model, [first_batch(plain, cora, make_sampler(plain, cora))], cora.x, cora)
    _, gradients = step(model, [first_batch(config, cora, make_sampler(config, cora))], input_features(config, cora),
                        cora)
    assert (reference[0] - gradients[0]).abs().max() > 1e-3 * reference[0].abs().max()


@pytest.mark.parametrize("overrides, message", [
    (["sampling.fanouts=[10,-1]"], "layer 0 samples its neighbourhood"),
    (["sampling.sampler=labor", "sampling.fanouts=[-1,-1]"], "layer 0 samples its neighbourhood"),
    (["model.dropout=0.5"], "model.dropout=0.5 masks the input features"),
    (["model.aggregator=pool", "model.dropout=0"], "model.aggregator mean or gcn"),
    (["model.arch=gat", "model.dropout=0"], "model.aggregator mean or gcn"),
    (["model.num_layers=1", "model.dropout=0"], "at least 2"),
    (["micro_batch.mode=layerwise", "model.dropout=0"], "micro_batch.mode=micro_batches"),
])
def test_config_refuses_what_the_cache_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match="features.aggregation_cache") as error:
        load_config(None, ["features.aggregation_cache=true", *overrides])
    assert message in str(error.value)


def test_approximate_allows_sampling_and_dropout_with_one_warning(cora, caplog):
    config = load_config(None, ["features.aggregation_cache=approximate", "sampling.fanouts=[5,10]"])
    assert config.features.aggregation_cache == "approximate" and config.model.dropout == 0.5
    assert make_sampler(config, cora).sample(cora.train_idx[:8], SampleKey(0)).num_layers == 1
    with caplog.at_level(logging.WARNING):
        check_aggregation_cache(config, None)
        input_features(config, cora)
    warnings = [record for record in caplog.records if "aggregation_cache=approximate" in record.getMessage()]
    assert len(warnings) == 1 and "BatchGNN App. B" in warnings[0].getMessage()


def test_the_cache_is_kept_on_disk_and_keyed_by_the_features(cora, cache_dir):
    config = cached_config("gcn")
    rows = input_features(config, cora)
    folder = aggregation_dir(cora, "gcn")
    assert folder.parent == cache_dir / cora.name / "aggregation"
    assert np.load(folder / "table.npy", allow_pickle=False).shape == tuple(rows.shape)  # a plain .npy, no pickle
    assert torch.equal(input_features(config, cora), rows)
    np.save(folder / "table.npy", np.zeros(tuple(rows.shape), np.float32), allow_pickle=False)
    assert not input_features(config, cora).any()  # read back from the folder, not computed again
    other = dataclasses.replace(cora, x=cora.x * 2)  # same graph, other features: another folder, other rows
    assert aggregation_dir(other, "gcn") != folder
    assert torch.allclose(input_features(config, other), 2 * rows)
    assert aggregation_dir(cora, "sage-mean") != folder


@pytest.mark.parametrize("model_name", list(MODELS))
def test_the_table_leaves_the_global_rng_as_it_was_and_builds_no_model_when_cached(cora, model_name, monkeypatch):
    """Computing the table builds the model whose layer 0 aggregates, and reading it back builds nothing; neither
    draws from torch's global RNG, so a run's parameters and draws are the same whether the table was on disk."""
    config = cached_config(model_name)
    built = []
    monkeypatch.setattr("betty_trainer.training.aggregation.build_model",
                        lambda *args: built.append(args) or build_model(*args))
    for on_disk in (False, True):
        assert aggregation_dir(cora, aggregation_kind(config)).exists() == on_disk
        torch.manual_seed(5)
        before = torch.random.get_rng_state()
        input_features(config, cora)
        assert torch.equal(torch.random.get_rng_state(), before)
        assert len(built) == 1, "built once, to compute the table; not again to read it back"


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_estimate_of_a_cached_step_against_its_measured_peak(cora, model_name, dropout):
    """K = 3, so micro-batches 2 and 3 accumulate; dropout 0.5 (``approximate``) masks the cached rows in place."""
    mode = "true" if dropout == 0 else "approximate"
    config = load_config(None, [*MODELS[model_name], "model.hidden=64", f"model.dropout={dropout}",
                                "model.num_layers=3", "sampling.fanouts=[-1,5,10]", f"features.aggregation_cache={mode}"])
    torch.manual_seed(0)
    model = build_model(config.model, cora)
    set_dropout_key(model, 0, 0)
    optimizer = torch.optim.Adam(model.parameters())
    batch = first_batch(config, cora, make_sampler(config, cora))
    features = HostFeatureStore(input_features(config, cora), pin=False)
    micro_batches = plan_micro_batches(batch, 3, "reg", 0)
    measure_training_step(model, optimizer, micro_batches[0], features, cora.y, "cpu")  # Adam state exists
    spec = model_spec(config, cora)
    assert spec.num_blocks == 2 and spec.input_width == model.aggregated_width
    for index, micro_batch in enumerate(micro_batches):
        estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0)
        measured = measure_training_step(model, optimizer, micro_batch, features, cora.y, "cpu",
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
        assert estimate.totals["input_features"] == micro_batch.input_nodes.numel() * model.aggregated_width * 4
        assert abs(estimate.peak_bytes - measured) <= DEFAULT_TOLERANCE * measured, (index, estimate.peak_bytes, measured)


def test_plan_shows_the_cache_and_the_uncached_plan(cora, planetoid_dir):
    """``betty-train plan``'s report: the cache's bytes where they live, the smaller layer 0 (no layer-0 block) and
    the uncached plan of the same batch, whose estimate here (3 layers, micro-batches) is the larger."""
    config = load_config(None, [f"dataset.data_dir={planetoid_dir}", "dataset.name=cora", *MODELS["sage-mean"],
                                "model.hidden=64", "model.dropout=0", "model.num_layers=3", "sampling.fanouts=[-1,5,10]",
                                "features.aggregation_cache=true", "micro_batch.num_micro_batches=4",
                                "train.device=cpu"])
    report = dry_run(config, measure=True, graph=cora)
    cache = report["aggregation_cache"]
    assert cache["host_bytes"] == cora.num_nodes * 2 * cora.num_features * 4 and cache["device_bytes"] == 0
    assert len(report["full_batch"]["layers"]) == 2 and len(cache["uncached"]["layers"]) == 3
    assert report["full_batch"]["layers"][0]["src_nodes"] == cache["uncached"]["layers"][1]["src_nodes"]
    assert cache["uncached"]["estimate_peak_bytes"] > report["estimate_peak_bytes"]
    assert abs(report["error"]) <= DEFAULT_TOLERANCE


def test_training_with_the_cache_follows_the_uncached_run(cora, tmp_path):
    """``train()`` end to end, 3 epochs of 2 micro-batches: every epoch's loss and accuracies as without the cache
    (evaluation runs the uncached layer 0), and the cache's rows gathered in place of the features."""
    overrides = [*MODELS["sage-mean"], "model.hidden=16", "model.dropout=0", "sampling.sampler=full",
                 "micro_batch.num_micro_batches=2", "optim.epochs=3", "train.device=cpu", "train.progress=false"]
    runs = {}
    for mode in ("false", "true"):
        result = train(load_config(None, [*overrides, f"features.aggregation_cache={mode}"]), graph=cora,
                       run_dir=tmp_path / mode)
        runs[mode] = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for plain, cached in zip(runs["false"], runs["true"], strict=True):
        assert abs(plain["loss"] - cached["loss"]) <= 1e-5 * plain["loss"]
        assert (plain["train_acc"], plain["val_acc"]) == (cached["train_acc"], cached["val_acc"])


def test_a_custom_model_is_refused(cora, tmp_path):
    config = cached_config("sage-mean", "train.device=cpu")
    with pytest.raises(ConfigError, match="needs a built-in model"):
        train(config, model=torch.nn.Linear(cora.num_features, cora.num_classes), graph=cora, run_dir=tmp_path / "run")


def test_plan_under_a_budget_only_the_cache_meets(cora):
    """3 layers, hidden 16: a one-output micro-batch's receptive field is 3 hops of 1433 columns without the cache
    and 2 hops of 2866 with it, so a 4 MiB budget has a cached plan and no uncached one; the report says so
    instead of failing."""
    config = load_config(None, [*MODELS["sage-mean"], "model.hidden=16", "model.dropout=0", "model.num_layers=3",
                                "sampling.sampler=full", "features.aggregation_cache=true", "train.device=cpu",
                                "micro_batch.budget=4MiB"])
    report = dry_run(config, graph=cora)
    assert report["estimate_peak_bytes"] <= 4 * 2**20
    assert "is impossible" in report["aggregation_cache"]["uncached"]["refused"]


@pytest.mark.parametrize("whole_graph", [False, True], ids=["training-seeds", "full-graph"])
def test_auto_keeps_the_cache_only_where_the_estimate_is_lower(cora, whole_graph):
    """``micro_batch.mode: auto``, 2 layers, K = 1: the cache stays where layer 0's dst nodes are far fewer than its
    src nodes (Cora's 140 training seeds: 644 against 1664) and is left out where they are all the graph's nodes
    (every node a seed: 2F columns a node gathered instead of F; BatchGNN Table 5), as the two plans' estimates say.
    The seeds are shuffled: in order, both plans would read their input rows in place (``HostFeatureStore.view``), with
    no gather of either width to compare."""
    none = torch.empty(0, dtype=torch.int64)
    seeds = torch.randperm(cora.num_nodes, generator=torch.Generator().manual_seed(0))
    graph = dataclasses.replace(cora, train_idx=seeds, val_idx=none, test_idx=none) \
        if whole_graph else cora
    config = cached_config("sage-mean", "micro_batch.mode=auto", "train.device=cpu", "micro_batch.num_micro_batches=1")
    report = dry_run(config, graph=graph)
    cache = report["aggregation_cache"]
    uncached = cache["uncached"]["estimate_peak_bytes"]
    assert cache["used"] is not whole_graph
    assert report["estimate_peak_bytes"] < uncached if cache["used"] else report["estimate_peak_bytes"] == uncached
    assert len(report["full_batch"]["layers"]) == 2 - cache["used"]
