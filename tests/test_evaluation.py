"""Layer-wise evaluation (one layer at a time over all nodes, as DGL's examples do) computes the same logits
and accuracies as evaluation on full-neighbourhood batches; models that are not a plain LayerStack fall back
to the batch evaluation."""

from __future__ import annotations

import pytest
import torch

from betty_trainer import (
    GCN,
    GraphSAGE,
    HostFeatureStore,
    evaluate,
    evaluate_splits,
    full_neighbourhood_batches,
    layerwise_logits,
)
from betty_trainer.models import GAT
from betty_trainer.models.stack import LayerStack, runs_layer_by_layer

CPU = torch.device("cpu")
MODELS = {
    "sage-mean": lambda g, layers: GraphSAGE(g.num_features, 32, g.num_classes, layers, "mean", 0.5),
    "gcn": lambda g, layers: GCN(g.num_features, 32, g.num_classes, g.in_degrees(), layers, 0.5),
    "gat": lambda g, layers: GAT(g.num_features, 8, g.num_classes, layers, 4, 0.5),
}


@torch.no_grad()
def batch_logits(model, graph, nodes, num_layers):
    """The old evaluation's logits: the model on full-neighbourhood batches of ``nodes`` (300 seeds each)."""
    model.eval()
    logits = torch.cat([model(batch.blocks, graph.x[batch.input_nodes])
                        for batch in full_neighbourhood_batches(graph, nodes, num_layers, batch_size=300)])
    model.train()
    return logits


@pytest.mark.parametrize("arch,num_layers", [("sage-mean", 2), ("sage-mean", 3), ("gcn", 2), ("gat", 2)])
def test_layerwise_logits_equal_full_neighbourhood_batch_logits_on_cora(cora, arch, num_layers):
    torch.manual_seed(0)
    model = MODELS[arch](cora, num_layers)
    model.train()  # evaluation must switch dropout off, and leave the mode as it was
    nodes = torch.cat([cora.val_idx, cora.test_idx])
    expected = batch_logits(model, cora, nodes, num_layers)
    got = layerwise_logits(model, cora, HostFeatureStore(cora.x, pin=False), CPU, nodes, chunk_size=700)
    assert model.training
    assert got.shape == expected.shape == (nodes.numel(), cora.num_classes)
    scale = expected.abs().max()
    # the exactness bound of tests/test_exactness.py: chunked evaluation regroups float32 sums
    assert scale > 0 and (got - expected).abs().max() <= 1e-5 * scale, (got - expected).abs().max() / scale
    assert torch.equal(got.argmax(1), expected.argmax(1))
    everything = layerwise_logits(model, cora, HostFeatureStore(cora.x, pin=False), CPU, chunk_size=1000)  # all nodes, by default
    assert torch.equal(everything[nodes], got)


@pytest.mark.parametrize("arch", ["sage-mean", "gat"])
def test_a_projected_layer_is_projected_once_per_node_over_several_chunks(cora, arch):
    """In chunks of 300 dst nodes (10 on Cora) layer 0 projects every node once and each chunk propagates its rows of
    the projection: the features are read once for the projection (and once more for SAGE mean's own dst rows),
    where the chunks' blocks would read some nodes many times."""
    torch.manual_seed(0)
    model = MODELS[arch](cora, 2)
    store = HostFeatureStore(cora.x, pin=False)
    got = layerwise_logits(model, cora, store, CPU, chunk_size=300)
    reads = cora.num_nodes * (2 if arch == "sage-mean" else 1)
    assert store.stats.misses == reads, (store.stats.misses, reads)
    blocks = sum(next(full_neighbourhood_batches(cora, chunk, 1)).input_nodes.numel()
                 for chunk in torch.arange(cora.num_nodes).split(300))
    assert blocks > reads, "the chunks' blocks read more rows than the projection does"
    expected = batch_logits(model, cora, torch.arange(cora.num_nodes), 2)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_evaluate_splits_gives_the_batch_evaluations_accuracies(cora, arch):
    torch.manual_seed(1)
    model = MODELS[arch](cora, 2)
    store = HostFeatureStore(cora.x, pin=False)
    splits = {"val": cora.val_idx, "test": cora.test_idx, "none": cora.val_idx[:0]}
    accuracy = evaluate_splits(model, cora, store, CPU, splits, num_layers=2)
    for name in ("val", "test"):
        batches = full_neighbourhood_batches(cora, splits[name], 2)
        assert accuracy[name] == evaluate(model, batches, HostFeatureStore(cora.x, pin=False), cora.y, CPU)
    assert accuracy["none"] != accuracy["none"], "an empty split's accuracy is nan"
    assert store.stats.misses == cora.num_nodes, "layer 0 reads every node's features once"


class TwoHopMean(torch.nn.Module):
    """A custom model (not a LayerStack): mean of the in-neighbours' features, twice, then a linear map."""

    def __init__(self, in_feats, classes):
        super().__init__()
        self.linear = torch.nn.Linear(in_feats, classes)
        self.calls = 0

    def forward(self, blocks, x):
        self.calls += 1
        for block in blocks:
            degree = block.in_degrees().clamp(min=1).unsqueeze(1).float()
            x = torch.zeros(block.num_dst, x.shape[1]).index_add_(0, block.edge_dst(), x[block.indices]) / degree
        return self.linear(x)


class SkipStack(GraphSAGE):
    """A LayerStack whose forward is not the stack's: layer-wise evaluation would not compute it."""

    def forward(self, blocks, x):
        return super().forward(blocks, x) + 1.0


@pytest.mark.parametrize("make", [lambda g: TwoHopMean(g.num_features, g.num_classes),
                                  lambda g: SkipStack(g.num_features, 16, g.num_classes, 2)],
                         ids=["custom-module", "stack-with-own-forward"])
def test_other_models_fall_back_to_batch_evaluation(cora, make):
    torch.manual_seed(2)
    model = make(cora)
    assert not runs_layer_by_layer(model)
    splits = {"val": cora.val_idx, "test": cora.test_idx}
    accuracy = evaluate_splits(model, cora, HostFeatureStore(cora.x, pin=False), CPU, splits, num_layers=2, chunk_size=400)
    for name, nodes in splits.items():
        assert accuracy[name] == evaluate(model, full_neighbourhood_batches(cora, nodes, 2),
                                          HostFeatureStore(cora.x, pin=False), cora.y, CPU)
    assert isinstance(model, LayerStack) or model.calls > 2, "batch evaluation, chunk by chunk"


def test_layerwise_logits_refuses_empty_nodes_and_bad_chunks(cora):
    model = MODELS["gcn"](cora, 2)
    with pytest.raises(ValueError, match="at least one node"):
        layerwise_logits(model, cora, HostFeatureStore(cora.x, pin=False), CPU, cora.val_idx[:0])
    with pytest.raises(ValueError, match="chunk_size"):
        layerwise_logits(model, cora, HostFeatureStore(cora.x, pin=False), CPU, chunk_size=0)


def test_fitting_chunks_halves_the_chunk_after_each_out_of_memory_error_and_says_which_chunk_ran(caplog):
    from betty_trainer.errors import TrainingError
    from betty_trainer.training.evaluation import fitting_chunks

    tried = []

    def compute(chunk):
        tried.append(chunk)
        if chunk > 3:
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        return f"ran with {chunk}"

    with caplog.at_level("WARNING", logger="betty_trainer.training.evaluation"):
        assert fitting_chunks(compute, 9, CPU) == ("ran with 3", 3)
    assert tried == [9, 5, 3]  # halved, rounded up
    assert [r.getMessage() for r in caplog.records] == [
        "evaluation ran out of memory on cpu; evaluating again with 5 nodes per chunk",
        "evaluation ran out of memory on cpu; evaluating again with 3 nodes per chunk"]
    with pytest.raises(TrainingError, match="out of memory on cpu with one node per chunk; free device memory, or "
                                            r"evaluate on the CPU \(CUDA_VISIBLE_DEVICES= hides the GPU"):
        fitting_chunks(lambda chunk: compute(chunk + 3), 2, CPU)
    with pytest.raises(ValueError, match="a bug"):  # any other error passes at once
        fitting_chunks(lambda chunk: (_ for _ in ()).throw(ValueError("a bug")), 8, CPU)


def out_of_memory_above(max_dst: int, monkeypatch) -> list[int]:
    """Make layer-wise evaluation raise ``torch.cuda.OutOfMemoryError`` for a chunk of more than ``max_dst`` dst nodes
    (injected where a chunk's layer runs); returns the list each chunk's dst count is appended to."""
    import betty_trainer.training.evaluation as evaluation

    layer_rows, chunks = evaluation._layer_rows, []

    def failing_above(model, index, block, *rest):
        chunks.append(block.num_dst)
        if block.num_dst > max_dst:
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        return layer_rows(model, index, block, *rest)

    monkeypatch.setattr(evaluation, "_layer_rows", failing_above)
    return chunks


@pytest.mark.parametrize("arch", ["sage-mean", "gat"])
def test_evaluation_out_of_device_memory_retries_in_smaller_chunks_with_the_same_accuracies(cora, arch, monkeypatch):
    """An out-of-memory error raised by any chunk of more than 500 dst nodes (injected where a chunk's layer runs):
    evaluate_splits evaluates again with 8192 nodes per chunk halved down to 256, and gets the accuracies that the
    default chunk gives without the error."""
    torch.manual_seed(0)
    model = MODELS[arch](cora, 2)
    splits = {"val": cora.val_idx, "test": cora.test_idx}
    features = HostFeatureStore(cora.x, pin=False)
    expected = evaluate_splits(model, cora, features, CPU, splits, 2)
    chunks = out_of_memory_above(500, monkeypatch)
    assert evaluate_splits(model, cora, features, CPU, splits, 2) == expected
    # 2708 nodes: 8192, 4096, 2048, 1024 and 512 fail at their first chunk, 256 runs every chunk of both layers
    assert chunks[:5] == [cora.num_nodes] * 2 + [2048, 1024, 512] and max(chunks[5:]) == 256
    assert sum(chunks[5:]) == cora.num_nodes + splits["val"].numel() + splits["test"].numel()


def test_batch_evaluation_retried_after_out_of_device_memory_leaves_the_model_in_its_mode(cora, monkeypatch):
    """A model that is no LayerStack is evaluated on full-neighbourhood batches; an out-of-memory error in a batch of
    more than 1000 seeds is retried in smaller batches with the same accuracies, and the model is in training mode
    afterwards as before (it was left in eval mode by the failed attempt, and every later epoch trained so)."""
    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, blocks, x):
            if blocks[-1].num_dst > 1000:
                raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
            return self.inner(blocks, x)

    torch.manual_seed(0)
    inner = MODELS["sage-mean"](cora, 2)
    model = Wrapped(inner).train()
    assert not runs_layer_by_layer(model)
    splits = {"val": cora.val_idx, "test": torch.cat([cora.test_idx, cora.train_idx, cora.val_idx])}  # 1140 nodes
    features = HostFeatureStore(cora.x, pin=False)
    expected = evaluate_splits(inner, cora, features, CPU, splits, 2, chunk_size=500)
    got = evaluate_splits(model, cora, features, CPU, splits, 2)
    assert model.training and inner.training
    assert got.keys() == expected.keys()
    assert all(abs(got[name] - expected[name]) < 1e-12 for name in got)
