"""The pool and LSTM GraphSAGE aggregators and GAT: per-node references, micro-batch exactness, config factory."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from betty_trainer import Block, load_config, plan_micro_batches, sample_batch
from betty_trainer.errors import ConfigError
from betty_trainer.models import GAT, GCN, GATConv, GraphSAGE, SAGEConv, build_model, set_dropout_key
from betty_trainer.models.lstm import LSTM
from tests.test_exactness import assert_same_gradients, gradients
from tests.test_labor import bonferroni_z

# 6 src nodes, 4 dst nodes (the first 4 src). dst 0 and 1 share in-degree 3 (one LSTM group of two),
# dst 2 is isolated, dst 3 has a self edge (3 → 3) that GAT must not count twice.
NEIGHBOURS = [[3, 1, 4], [0, 5, 2], [], [3, 2, 5, 1]]


def tiny_block() -> Block:
    indptr = torch.tensor([0] + [len(n) for n in NEIGHBOURS]).cumsum(0)
    indices = torch.tensor([s for n in NEIGHBOURS for s in n])
    return Block(torch.tensor([10, 11, 12, 13, 14, 15]), 4, indptr, indices)


def features(width: int) -> torch.Tensor:
    return torch.randn(6, width, generator=torch.Generator().manual_seed(0), requires_grad=True)


def randomise_biases(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        layer.bias.normal_()


@pytest.mark.parametrize("aggregator", ["pool", "lstm"])
def test_sage_aggregator_matches_a_per_node_loop(aggregator):
    torch.manual_seed(0)
    layer = SAGEConv(5, 3, aggregator)
    randomise_biases(layer)
    h = features(5)
    out = layer(tiny_block(), h)

    h_ref = h.detach().clone().requires_grad_(True)
    if aggregator == "lstm":  # PyTorch's fused LSTM, loaded with the layer's weights, is the reference
        reference_lstm = torch_lstm(layer.lstm)
    rows = []
    for d, neighbours in enumerate(NEIGHBOURS):
        if not neighbours:
            h_neigh = torch.zeros(5)
        elif aggregator == "pool":
            h_neigh = F.relu(layer.fc_pool(h_ref[neighbours])).max(0).values
        else:
            _, (hidden, _) = reference_lstm(h_ref[neighbours].unsqueeze(0))
            h_neigh = hidden[-1, 0]
        rows.append(layer.fc_self(h_ref[d]) + layer.fc_neigh(h_neigh) + layer.bias)
    reference = torch.stack(rows)

    # float32 against a per-row reference (torch.nn.LSTM): the same sums in another order, ~1e-7 relative per term
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    weights = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    (reference * weights).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)


def torch_lstm(lstm: LSTM) -> torch.nn.LSTM:
    """torch.nn.LSTM with ``lstm``'s weights (transposed; the bias split into bias_ih and bias_hh)."""
    reference = torch.nn.LSTM(lstm.input_size, lstm.hidden_size, batch_first=True)
    with torch.no_grad():
        reference.weight_ih_l0.copy_(lstm.weight_ih.t())
        reference.weight_hh_l0.copy_(lstm.weight_hh.t())
        reference.bias_ih_l0.copy_(lstm.bias - 0.25)
        reference.bias_hh_l0.fill_(0.25)
    return reference


@pytest.mark.parametrize("batch, length, width, hidden", [(1, 1, 3, 4), (7, 5, 6, 4), (3, 12, 8, 8)])
def test_unrolled_lstm_equals_torch_lstm(batch, length, width, hidden):
    """The aggregator's unrolled LSTM computes torch.nn.LSTM: same final hidden state, same
    gradients for the input and every parameter."""
    torch.manual_seed(0)
    ours = LSTM(width, hidden)
    reference = torch_lstm(ours)
    x = torch.randn(batch, length, width, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = ours(x.unbind(1))
    _, (expected, _) = reference(x_ref)
    # float32 against torch.nn.LSTM (fused gates, its own summation order): ~1e-7 relative per term
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-6)
    weights = torch.randn(batch, hidden)
    (out * weights).sum().backward()
    (expected[0] * weights).sum().backward()
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, **close)
    torch.testing.assert_close(ours.weight_ih.grad, reference.weight_ih_l0.grad.t(), **close)
    torch.testing.assert_close(ours.bias.grad, reference.bias_ih_l0.grad, **close)
    torch.testing.assert_close(ours.bias.grad, reference.bias_hh_l0.grad, **close)
    if length == 1:  # one step never reads W_hh (h_0 = 0): no gradient where torch's LSTM gives zeros
        assert ours.weight_hh.grad is None and not reference.weight_hh_l0.grad.any()
    else:
        torch.testing.assert_close(ours.weight_hh.grad, reference.weight_hh_l0.grad.t(), **close)


def test_lstm_aggregator_reads_neighbours_in_csc_order():
    """Guards the test above: the LSTM result depends on the edge order, so that test checks the order."""
    torch.manual_seed(0)
    layer = SAGEConv(5, 3, "lstm")
    block = tiny_block()
    reordered = Block(block.src_nodes, 4, block.indptr, torch.tensor([4, 1, 3, 2, 5, 0, 1, 5, 2, 3]))
    h = features(5)
    # above float32 round-off of these O(1) outputs (~1e-7): the order really changes each row
    assert (layer(block, h)[:2] - layer(reordered, h)[:2]).abs().amax(1).min() > 1e-6


@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
def test_gat_matches_a_per_node_loop(concat):
    torch.manual_seed(0)
    heads, width = 3, 2
    layer = GATConv(5, width, heads, concat=concat)
    randomise_biases(layer)
    h = features(5)
    out, (edge_index, alpha) = layer(tiny_block(), h, return_attention_weights=True)

    z = layer.linear(h).view(6, heads, width)
    rows, alphas = [], []
    for d, neighbours in enumerate(NEIGHBOURS):
        attended = [s for s in neighbours if s != d] + [d]
        scores = F.leaky_relu((z[attended] * layer.att_src).sum(-1) + (z[d] * layer.att_dst).sum(-1), 0.2)
        weights = torch.softmax(scores, 0)
        total = (weights.unsqueeze(-1) * z[attended]).sum(0)
        rows.append((total.flatten() if concat else total.mean(0)) + layer.bias)
        alphas.append((attended, weights))
    # float32 against a per-row softmax reference: the same sums in another order, ~1e-7 relative per term
    torch.testing.assert_close(out, torch.stack(rows), rtol=1e-5, atol=1e-6)

    # one self edge per dst node, after the block's other edges; the block's own 3 → 3 edge is not counted twice
    loops = edge_index[0] == edge_index[1]
    assert loops.sum() == 4 and torch.equal(edge_index[1, loops], torch.arange(4))
    assert edge_index.shape[1] == sum(len(n) for n in NEIGHBOURS) - 1 + 4
    for d, (attended, weights) in enumerate(alphas):
        mine = edge_index[1] == d
        assert edge_index[0, mine].tolist() == attended
        torch.testing.assert_close(alpha[mine], weights)  # float32 defaults: a segment softmax vs torch.softmax
    torch.testing.assert_close(torch.zeros(4, heads).index_add_(0, edge_index[1], alpha), torch.ones(4, heads))
    weighted = torch.zeros(4, heads, width).index_add_(0, edge_index[1], alpha.unsqueeze(-1) * z[edge_index[0]])
    expected = weighted.flatten(1) if concat else weighted.mean(1)
    torch.testing.assert_close(out, expected + layer.bias)
    torch.testing.assert_close(out[2], (z[2].flatten() if concat else z[2].mean(0)) + layer.bias)


@pytest.mark.parametrize("arch", ["sage-pool", "sage-lstm", "gat"])
def test_micro_batches_equal_full_batch(request, arch):
    # The LSTM runs one step per in-degree up to the largest (~1000 small sequential steps per layer for
    # a full neighbourhood), so that model reads Cora's first 64 feature columns (the cora64 fixture)
    # of a batch sampled with fanout 5 (in-degrees 1–5: five groups per layer).
    lstm = arch == "sage-lstm"
    graph = request.getfixturevalue("cora64" if lstm else "cora")
    torch.manual_seed(0)
    if arch == "gat":
        model = GAT(graph.num_features, 8, graph.num_classes, 2, heads=4, dropout=0.5)
    else:
        model = GraphSAGE(graph.num_features, 16, graph.num_classes, 2, arch.removeprefix("sage-"), 0.5)
    set_dropout_key(model, seed=0, step=2)
    # 100 seeds, not Cora's 140 (20 per class): with balanced classes and GAT's near-uniform initial
    # predictions the output bias gradient Σ(p − y) cancels to ~0 and its relative error is rounding noise.
    fanouts = [5, 5] if lstm else [None, None]
    batch = sample_batch(graph, graph.train_idx[:100], fanouts, torch.Generator().manual_seed(5))
    reference = gradients(model, [batch], graph)
    micro_batches = plan_micro_batches(batch, 4, "reg", 0)
    assert len(micro_batches) == 4
    assert_same_gradients(reference, gradients(model, micro_batches, graph))


@pytest.mark.parametrize("overrides, kind, layer_kind", [
    (["model.arch=sage", "model.aggregator=pool"], GraphSAGE, SAGEConv),
    (["model.arch=sage", "model.aggregator=lstm"], GraphSAGE, SAGEConv),
    (["model.arch=gcn"], GCN, torch.nn.Module),
    (["model.arch=gat", "model.heads=2"], GAT, GATConv),
])
def test_build_model_from_config(cora, overrides, kind, layer_kind):
    config = load_config(None, [*overrides, "model.hidden=8", "model.num_layers=3"])
    model = build_model(config.model, cora)
    assert isinstance(model, kind) and len(model.layers) == 3
    assert all(isinstance(layer, layer_kind) for layer in model.layers)
    if kind is GraphSAGE:
        assert all(layer.aggregator == config.model.aggregator for layer in model.layers)
    if kind is GAT:
        first, middle, last = model.layers
        assert (first.in_feats, first.out_feats, first.heads, first.concat) == (cora.num_features, 8, 2, True)
        assert (middle.in_feats, middle.out_feats, middle.concat) == (16, 8, True)
        assert (last.in_feats, last.out_feats, last.heads, last.concat) == (16, cora.num_classes, 2, False)
    model.eval()
    batch = sample_batch(cora, cora.train_idx[:8], [2, 2, 2], torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(batch.blocks, cora.x[batch.input_nodes])
    assert logits.shape == (8, cora.num_classes) and torch.isfinite(logits).all()


@pytest.mark.parametrize("override, fragment", [
    ("model.aggregator=max", "'mean', 'gcn', 'pool' or 'lstm'"),
    ("model.arch=mlp", "'gat', 'gcn'"),
    ("model.heads=0", "greater than or equal to 1"),
])
def test_config_rejects_unknown_model_choices(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, [override])


def test_gcn_checkpoints_hold_no_graph_sized_state(cora):
    """GCN's whole-graph degree normalisation is rebuilt from the graph, not saved: its state dict holds
    only parameters, and a model built afresh and loaded from it computes the same logits."""
    config = load_config(None, ["model.arch=gcn", "model.hidden=16"])
    torch.manual_seed(0)
    model = build_model(config.model, cora).eval()
    state = model.state_dict()
    assert set(state) == {name for name, _ in model.named_parameters()}
    fresh = build_model(config.model, cora).eval()
    fresh.load_state_dict(state)
    batch = sample_batch(cora, cora.test_idx[:50], [None, None])
    x = cora.x[batch.input_nodes]
    torch.testing.assert_close(fresh(batch.blocks, x), model(batch.blocks, x), rtol=0, atol=0)


def gcn_samples(graph, sampler, dst, repetitions):
    """A one-feature ``GCNConv`` (weight 1, no bias, float64) on ``repetitions`` sampled blocks of ``dst``: their
    outputs ``(repetitions, len(dst))`` and the full-neighbourhood output ``(len(dst),)``."""
    from betty_trainer.models.gcn import GCNConv
    from betty_trainer.sampling import NeighborSampler, SampleKey

    conv = GCNConv(1, 1).double()
    with torch.no_grad():
        conv.linear.weight.fill_(1.0)
        conv.bias.zero_()
    inv_sqrt_degree = (graph.in_degrees().double() + 1).rsqrt()
    h = graph.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10  # a non-constant signal

    def run(block):
        with torch.no_grad():
            return conv(block, h[block.src_nodes].unsqueeze(1), inv_sqrt_degree[block.src_nodes]).squeeze(1)

    full = run(NeighborSampler(graph, [None]).sample(dst, SampleKey(0)).blocks[0])
    return torch.stack([run(sampler.sample(dst, SampleKey(1, 0, r)).blocks[0]) for r in range(repetitions)]), full


@pytest.mark.parametrize("kind", ["ns", "labor"])
def test_gcn_on_sampled_blocks_is_unbiased(computers, kind, monkeypatch):
    """GCN's sum over a sampled neighbourhood estimates the full one without bias (Horvitz–Thompson: ``d/k`` per
    kept edge under neighbour sampling, the weights ``1/p`` under LABOR): over R samples the mean output is within
    a Bonferroni bound of its standard error for every dst node. Without the ``d/k`` scale, neighbour sampling's
    sum is about ``k/d`` of the full one and the same check fails."""
    from betty_trainer.models import gcn
    from betty_trainer.sampling import LaborSampler, NeighborSampler

    degree = computers.in_degrees()
    candidates = torch.nonzero(degree > 30).flatten()
    dst = candidates[torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(0))[:300]]
    sampler = NeighborSampler(computers, [10]) if kind == "ns" else LaborSampler(computers, [10])
    repetitions = 300
    samples, full = gcn_samples(computers, sampler, dst, repetitions)
    z = (samples.mean(0) - full) / (samples.std(0) / repetitions**0.5)
    assert float(z.abs().max()) < bonferroni_z(dst.numel()), float(z.abs().max())
    if kind == "ns":
        monkeypatch.setattr(gcn, "sampled_row_scale", lambda block, dst_norm: dst_norm)
        samples, full = gcn_samples(computers, sampler, dst, 50)
        z = (samples.mean(0) - full) / (samples.std(0) / 50**0.5)
        assert float(z.abs().max()) > bonferroni_z(dst.numel())
