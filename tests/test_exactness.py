"""Micro-batch gradient accumulation equals the full-batch gradient (Betty §4.2), dropout on or off."""

from __future__ import annotations

import pytest
import torch

from betty_trainer import GCN, GraphSAGE, accumulate_gradients, plan_micro_batches, sample_batch
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.execution.micro_batches import MicroBatches
from betty_trainer.models import set_dropout_key
from partition import GraphPartition, make_split

CPU = torch.device("cpu")


def gradients(model, micro_batches, graph):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro_batches, HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    return [p.grad.clone() for p in model.parameters()]


def assert_same_gradients(reference, candidate):
    for ref, got in zip(reference, candidate):
        scale = ref.abs().max()
        assert scale > 0
        # float32 reassociation: micro-batches regroup each gradient's sum (2⁻²⁴ ≈ 6e-8 per addition, summed over
        # hundreds of terms, some cancelling), far under 1e-5 of the largest entry
        assert (ref - got).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("fanouts", [[None, None], [10, 25]], ids=["full-neighbourhood", "sampled-10-25"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_sage_mean_micro_batches_equal_full_batch(cora, fanouts, dropout):
    torch.manual_seed(0)
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", dropout)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(5))
    reference = gradients(model, [batch], cora)
    for partitioner in ("reg", "metis", "range", "random"):
        for k in (2, 4, 8):
            micro_batches = plan_micro_batches(batch, k, partitioner, seed=1)
            assert len(micro_batches) == k
            assert_same_gradients(reference, gradients(model, micro_batches, cora))


@pytest.mark.parametrize("fanouts", [[None, None], [10, 25]], ids=["full-neighbourhood", "sampled-10-25"])
def test_micro_batches_split_by_the_graph_partition_equal_full_batch(cora, fanouts):
    """Any assignment of the outputs gives the full batch's gradient: here the run's graph partition's (each
    output in its node's part), whose groups follow the graph rather than the batch."""
    torch.manual_seed(0)
    model = GraphSAGE(cora.num_features, 64, cora.num_classes, 2, "mean", 0.5)
    set_dropout_key(model, seed=3, step=11)
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(5))
    reference = gradients(model, [batch], cora)
    graph = GraphPartition(cora.indptr, cora.indices)
    for k in (2, 8):
        split = make_split(batch.blocks, k=k, partitioner="graph", seed=1, splitter=graph.splitter(batch.output_nodes))
        assert len(split.groups) == k
        assert_same_gradients(reference, gradients(model, MicroBatches(batch, split.groups), cora))


@pytest.mark.parametrize("arch", ["sage-gcn", "gcn"])
def test_other_models_micro_batches_equal_full_batch(cora, arch):
    torch.manual_seed(0)
    if arch == "gcn":
        model = GCN(cora.num_features, 32, cora.num_classes, cora.in_degrees(), 2, 0.5)
    else:
        model = GraphSAGE(cora.num_features, 32, cora.num_classes, 2, "gcn", 0.5)
    set_dropout_key(model, seed=0, step=2)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    reference = gradients(model, [batch], cora)
    assert_same_gradients(reference, gradients(model, plan_micro_batches(batch, 4, "reg", 0), cora))


def test_dropout_changes_gradients(cora):
    """Guards the test above: with dropout the masks really apply (the gradient differs from p=0)."""
    torch.manual_seed(0)
    model = GraphSAGE(cora.num_features, 16, cora.num_classes, 2, "mean", 0.5)
    batch = sample_batch(cora, cora.train_idx, [None, None])
    with_dropout = gradients(model, [batch], cora)
    model.dropout.p = 0.0
    without = gradients(model, [batch], cora)
    # dropout must move the gradient by far more than the exactness bound above (1e-5): 100x that
    assert (with_dropout[0] - without[0]).abs().max() > 1e-3 * without[0].abs().max()
