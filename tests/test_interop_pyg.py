"""PyG interop (issue 9): ``torch_geometric.nn.SAGEConv`` models train through our micro-batches.

A model written for PyG's ``NeighborSampler`` (``forward(x, adjs)``) runs through
:class:`~betty_trainer.models.interop.PyGModel`, and PyG layers inside our layer stack through
:class:`~betty_trainer.models.interop.PyGLayer`; both get the full batch's gradient from K = 4 micro-batches
(Betty §4.2.3) and compute our own mean-aggregator SAGE's logits when given its weights.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from benchmarks.custom_models import NeighborSamplerSAGE
from betty_trainer import GraphSAGE, sample_batch
from betty_trainer.memory.recorded import record_model
from betty_trainer.models.interop import PyGLayer, PyGModel
from betty_trainer.models.stack import LayerStack, layer_widths
from tests.interop_checks import (
    assert_computes_logits,
    assert_micro_batches_equal_full_batch,
    assert_trains_with_the_trainer,
)
from tests.test_recorder import adam, assert_recorded_within_1_percent

if importlib.util.find_spec("torch_geometric") is None:  # the test extra installs it: CI must run these tests
    message = "torch_geometric is not installed (pip install -e '.[test]' installs it)"
    if os.environ.get("CI"):
        raise ImportError(message)
    pytest.skip(message, allow_module_level=True)
with warnings.catch_warnings():  # PyG's import calls torch.jit.script, which current torch deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch_geometric.nn import SAGEConv

HIDDEN = 32


def pyg_stack(in_feats: int, classes: int, dropout: float) -> LayerStack:
    """PyG layers in our stack: its ReLU and its node-keyed dropout around ``torch_geometric.nn.SAGEConv``."""
    return LayerStack(layer_widths(in_feats, HIDDEN, classes, 2), lambda a, b: PyGLayer(SAGEConv(a, b)), dropout)


def copy_sage_weights(ours: GraphSAGE, convs) -> None:
    """Give PyG's SAGEConvs our SAGE's weights: PyG's ``lin_l`` (neighbours, with the bias) is our
    ``fc_neigh`` plus ``bias``, its ``lin_r`` (root) our ``fc_self``."""
    with torch.no_grad():
        for layer, conv in zip(ours.layers, convs):
            conv.lin_l.weight.copy_(layer.fc_neigh.weight)
            conv.lin_l.bias.copy_(layer.bias)
            conv.lin_r.weight.copy_(layer.fc_self.weight)


@pytest.fixture(scope="module")
def cora_batch(cora):
    return sample_batch(cora, cora.train_idx, [10, 25], torch.Generator().manual_seed(5))


def test_block_gives_pyg_its_bipartite_arguments(cora_batch):
    block = cora_batch.blocks[0]
    h = torch.randn(block.num_src, 3)
    (x_src, x_dst), edge_index, size = block.pyg_inputs(h)
    assert x_src is h and torch.equal(x_dst, h[: block.num_dst]) and size == (block.num_src, block.num_dst)
    assert torch.equal(edge_index, block.to_pyg().edge_index) and block.to_pyg().size == size
    for d in (0, block.num_dst // 2, block.num_dst - 1):  # dst d's in-edges are its CSC slice
        mine = edge_index[1] == d
        assert edge_index[0, mine].tolist() == block.indices[block.indptr[d]:block.indptr[d + 1]].tolist()
    with pytest.raises(ValueError, match="src nodes"):
        block.pyg_inputs(h[1:])


def test_pyg_sage_computes_our_sage_logits(cora, cora_batch):
    torch.manual_seed(0)
    ours = GraphSAGE(cora.num_features, HIDDEN, cora.num_classes, 2, "mean", dropout=0.0)
    theirs = NeighborSamplerSAGE(cora.num_features, HIDDEN, cora.num_classes)
    stacked = pyg_stack(cora.num_features, cora.num_classes, 0.0)
    copy_sage_weights(ours, theirs.convs)
    copy_sage_weights(ours, [layer.conv for layer in stacked.layers])
    assert cora_batch.output_nodes.numel() == cora.train_idx.numel()
    assert_computes_logits(ours, [PyGModel(theirs), stacked], cora_batch, cora)


def test_pyg_model_micro_batches_equal_full_batch(cora, cora_batch):
    torch.manual_seed(0)
    model = PyGModel(NeighborSamplerSAGE(cora.num_features, HIDDEN, cora.num_classes))
    assert_micro_batches_equal_full_batch(model, cora_batch, cora)


def test_pyg_layers_in_our_stack_keep_dropout_exact(cora, cora_batch):
    torch.manual_seed(0)
    model = pyg_stack(cora.num_features, cora.num_classes, 0.5)
    assert_micro_batches_equal_full_batch(model, cora_batch, cora, model.dropout)


def test_a_pyg_model_trains_with_the_trainer(tmp_path):
    torch.manual_seed(0)
    assert_trains_with_the_trainer(PyGModel(NeighborSamplerSAGE(32, HIDDEN, 5)), tmp_path, epochs=3)


@pytest.mark.parametrize("k", [1, 4])
def test_the_recorder_estimates_a_pyg_model(cora, k):
    """``PyGModel`` around ``torch_geometric.nn.SAGEConv``: PyG's ops go through PyTorch's dispatcher, so the
    recorder records it (byte-exact on Cora at K = 1 and 4 with torch 2.13)."""
    torch.manual_seed(0)
    model = PyGModel(NeighborSamplerSAGE(cora.num_features, HIDDEN, cora.num_classes))
    assert_recorded_within_1_percent(model, record_model(model, cora, 2, adam), cora, k)
