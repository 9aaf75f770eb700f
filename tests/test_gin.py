"""GIN (betty_trainer/models/gin.py), the built-in architecture that is one file: its layer computes the paper's
sum and MLP, micro-batches and layer-wise chunks give the full batch's gradients, its memory estimate matches
the measured CPU peak as every other model's does, and its work terms count its maps."""

from __future__ import annotations

import pytest
import torch

from betty_trainer import Batch, plan_micro_batches, sample_batch
from betty_trainer.datasets import make_sbm
from betty_trainer.models import set_dropout_key
from betty_trainer.models.gin import GIN, GINConv, gin_work
from estimator.work import MASK_COST, step_work
from tests.test_estimator import DEFAULT_TOLERANCE, estimate_and_measure, weighted
from tests.test_exactness import assert_same_gradients, gradients
from tests.test_layerwise import assert_layerwise_estimate, assert_same, full_batch_gradients, layerwise_gradients


@pytest.mark.parametrize("widths", [(6, 4), (3, 5)], ids=["projects-first", "sums-first"])
@pytest.mark.parametrize("edge_weights", [False, True], ids=["unweighted", "weighted"])
def test_gin_layer_is_the_mlp_of_each_node_plus_the_sum_of_its_neighbours(widths, edge_weights):
    """``h'_d = W₂·ReLU(W₁·(h_d + Σ_{s→d} w_e·h_s) + b₁) + b₂`` (Xu et al. 2019, Eq. 4.1, ε = 0), written edge by
    edge in float64, whichever of ``W₁`` and the sum runs first."""
    graph = make_sbm(num_nodes=40, num_classes=2, num_features=widths[0], avg_degree=3.0, homophily=0.5,
                     feature_signal=0.3, train_per_class=3, num_val=4, num_test=4, seed=1)
    block = sample_batch(graph, graph.train_idx, [None]).blocks[0]
    if edge_weights:
        block = weighted(Batch([block])).blocks[0]
    torch.manual_seed(0)
    layer = GINConv(*widths).double()
    for bias in (layer.bias1, layer.bias2):
        torch.nn.init.normal_(bias)
    h = graph.x[block.src_nodes].double()
    weights = block.edge_weight.double() if edge_weights else torch.ones(block.num_edges, dtype=torch.float64)
    summed = h[: block.num_dst].clone()
    for d in range(block.num_dst):
        for e in range(int(block.indptr[d]), int(block.indptr[d + 1])):
            summed[d] += weights[e] * h[block.indices[e]]
    hidden = torch.relu(summed @ layer.linear1.weight.T + layer.bias1)
    expected = hidden @ layer.linear2.weight.T + layer.bias2
    assert block.num_edges > 0 and block.num_dst < block.num_src
    torch.testing.assert_close(layer(block, h), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fanouts", [[None, None], [10, 25]], ids=["full-neighbourhood", "sampled-10-25"])
@pytest.mark.parametrize("edge_weights", [False, True], ids=["unweighted", "weighted"])
def test_gin_micro_batches_equal_full_batch(cora, fanouts, edge_weights):
    torch.manual_seed(0)
    model = GIN(cora.num_features, 32, cora.num_classes, 2, 0.5)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(5))
    if edge_weights:
        batch = weighted(batch)
    reference = gradients(model, [batch], cora)
    for partitioner in ("reg", "metis"):
        for k in (2, 8):
            assert_same_gradients(reference, gradients(model, plan_micro_batches(batch, k, partitioner, seed=1), cora))


@pytest.mark.parametrize("hidden", [16, 256], ids=["projects-first", "sums-first"])
def test_gin_layerwise_equals_full_batch(cora64, hidden):
    torch.manual_seed(0)
    model = GIN(cora64.num_features, hidden, cora64.num_classes, 2, 0.5)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora64, cora64.train_idx, [10, 25], torch.Generator().manual_seed(5))
    reference = full_batch_gradients(model, batch, cora64)
    for k in (2, 8):
        assert_same(reference, layerwise_gradients(model, batch, cora64, k))


@pytest.mark.parametrize("dataset, overrides, k, fanouts", [
    ("cora", ["model.arch=gin", "model.hidden=64"], 2, None),  # 1433 → 64 → 7: every layer projects first
    ("cora64", ["model.arch=gin", "model.hidden=256", "model.num_layers=3"], 4, [5, 10, 15]),  # 64 < 256: sums first
    ("citeseer", ["model.arch=gin", "model.hidden=16", "model.dropout=0"], 8, None),
])
def test_gin_estimate_matches_the_measured_peak(request, dataset, overrides, k, fanouts):
    """As tests/test_estimator.py's CASES, within their default tolerance (GIN has no entry of its own)."""
    for estimate, measured in estimate_and_measure(request.getfixturevalue(dataset), overrides, k, fanouts):
        assert abs(estimate - measured) <= DEFAULT_TOLERANCE * measured, (estimate, measured)


@pytest.mark.parametrize("hidden", [16, 256], ids=["projects-first", "sums-first"])
def test_gin_layerwise_estimate(cora64, hidden):
    torch.manual_seed(0)
    assert_layerwise_estimate(GIN(cora64.num_features, hidden, cora64.num_classes, 2, 0.5), "gin", cora64,
                              [None, None])


@pytest.mark.parametrize("a, b, linear, aggregate", [
    (8, 4, 10 * 8 * 4 + 4 * 4 * 4, 20 * 4),  # W₁ on the src rows before the sum (8 > 4), W₂ on the dst rows
    (2, 8, 4 * 2 * 8 + 4 * 8 * 8, 20 * 2),  # the sum first, then W₁ and W₂ on the dst rows
])
def test_gin_work_counts_its_two_maps_and_the_sum(a, b, linear, aggregate):
    """One layer ``a → b``, 10 src rows, 4 dst rows, 20 edges: a micro-batch runs it forward and backward (the
    input layer's input takes no gradient), a layer-wise step once more."""
    from types import SimpleNamespace

    spec = SimpleNamespace(arch="gin", aggregator="mean", widths=[a, b], heads=1, layer_work=gin_work)
    piece = SimpleNamespace(num_src=10, num_dst=4, num_edges=20)
    gather = 10 * a * MASK_COST
    assert step_work(spec, [[piece]], layerwise=False) == 2 * (linear + aggregate) + gather
    assert step_work(spec, [[piece]], layerwise=True) == 3 * (linear + aggregate) + 2 * gather
