"""Custom models written only from ``torch.nn`` and ``torch_geometric.nn`` ops, as a user of ``train(config,
model=...)`` writes them: what the recorder (``estimator.recorder``) estimates in ``tests/test_recorder.py`` and
``benchmarks/estimator_accuracy.py --custom``. Each takes ``(in_feats, hidden, num_classes)`` and runs
``forward(blocks, x)`` on a batch's blocks (input layer first), or is wrapped in an adaptor
(:class:`~betty_trainer.models.interop.PyGModel`). PyG is imported where a model needs it.

Importable from the tests (``from benchmarks.custom_models import ...``): it imports nothing from this folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.interop import PyGModel


def neighbour_sum(block: Block, h: torch.Tensor) -> torch.Tensor:
    """``(num_dst, F)`` sum of the in-neighbours' rows of ``h``, from torch ops only."""
    return h.new_zeros(block.num_dst, h.shape[1]).index_add_(0, block.edge_dst(), h.index_select(0, block.indices))


class GINStyle(nn.Module):
    """GIN (Xu et al. 2019): per layer an MLP of ``(1 + ε)·h_v + Σ_u h_u``, ReLU between layers."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int):
        super().__init__()
        widths = [in_feats, hidden, num_classes]
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(a, hidden), nn.ReLU(), nn.Linear(hidden, b))
                                  for a, b in zip(widths, widths[1:]))
        self.eps = nn.Parameter(torch.zeros(len(self.mlps)))

    def forward(self, blocks, x):
        h = x
        for index, (block, mlp) in enumerate(zip(blocks, self.mlps)):
            h = mlp((1 + self.eps[index]) * h[: block.num_dst] + neighbour_sum(block, h))
            h = torch.relu(h) if index < len(blocks) - 1 else h
        return h


class JumpingKnowledge(nn.Module):
    """JK-Net (Xu et al. 2018) with concatenation: mean-aggregation layers with dropout, and the classifier reads
    the input and every layer's output of the output nodes, concatenated."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(in_feats, hidden), nn.Linear(hidden, hidden)])
        self.dropout = nn.Dropout(0.5)
        self.classify = nn.Linear(in_feats + 2 * hidden, num_classes)

    def forward(self, blocks, x):
        outputs, h = [x], x
        for block, layer in zip(blocks, self.layers):
            mean = neighbour_sum(block, h) / block.in_degrees().clamp(min=1).unsqueeze(1)
            h = torch.relu(layer(self.dropout(mean)))
            outputs = [output[: block.num_dst] for output in outputs] + [h]
        return self.classify(torch.cat(outputs, dim=1))


class TwoHeadGAT(nn.Module):
    """Two ``torch_geometric.nn.GATConv`` layers of two heads each (concatenated, then averaged at the output) that
    attend with two structural edge features: ``log(1 + in-degree)`` of the edge's dst node and ``1 / (1 + s)`` of
    its src position ``s`` (made from the block with shape-static ops; no self loops added, a block's dst nodes are
    its first src nodes)."""

    def __init__(self, in_feats: int, hidden: int, num_classes: int):
        super().__init__()
        with warnings.catch_warnings():  # PyG's import calls torch.jit.script, which current torch deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch_geometric.nn import GATConv
        self.convs = nn.ModuleList([
            GATConv(in_feats, hidden // 2, heads=2, edge_dim=2, add_self_loops=False),
            GATConv(hidden, num_classes, heads=2, concat=False, edge_dim=2, add_self_loops=False)])

    def forward(self, blocks, x):
        h = x
        for index, (block, conv) in enumerate(zip(blocks, self.convs)):
            dst = block.edge_dst()
            edge_attr = torch.stack([block.in_degrees().to(h.dtype)[dst].log1p(),
                                     1 / (1 + block.indices.to(h.dtype))], 1)
            h = conv((h, h[: block.num_dst]), torch.stack([block.indices.long(), dst]), edge_attr,
                     size=(block.num_src, block.num_dst))
            h = torch.relu(h) if index < len(blocks) - 1 else h
        return h


class NeighborSamplerSAGE(nn.Module):
    """GraphSAGE written as PyG's Reddit / ogbn-products examples write it for ``NeighborSampler``
    (``forward(x, adjs)``; :class:`~betty_trainer.models.interop.PyGModel` adapts it)."""

    def __init__(self, in_feats: int, hidden: int, classes: int):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch_geometric.nn import SAGEConv
        self.convs = nn.ModuleList([SAGEConv(in_feats, hidden), SAGEConv(hidden, classes)])

    def forward(self, x, adjs):
        for i, (edge_index, _, size) in enumerate(adjs):
            x = self.convs[i]((x, x[: size[1]]), edge_index)
            if i != len(self.convs) - 1:
                x = F.relu(x)
        return x


CUSTOM_MODELS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "gin": GINStyle,
    "jk-net": JumpingKnowledge,
    "gat-2-heads-edge-features": TwoHeadGAT,
    "pyg-sage": lambda in_feats, hidden, classes: PyGModel(NeighborSamplerSAGE(in_feats, hidden, classes)),
}
"""The custom models by name: ``(in_feats, hidden, num_classes) → model``."""
