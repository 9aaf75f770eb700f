"""GIN (Xu, Hu, Leskovec & Jegelka, ICLR 2019) on blocks: a sum aggregation and a two-layer MLP per layer."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import aggregate, edge_weight
from betty_trainer.models.registry import Architecture, register
from betty_trainer.models.stack import LayerStack, layer_widths
from estimator.work import LayerSize, Work


class GINConv(nn.Module):
    """One GIN layer: h'_d = MLP((1 + ε)·h_d + Σ_{s∈N(d)} h_s) with ε = 0 (GIN-0, Xu et al. 2019, Eq. 4.1), the
    MLP ``W₂·ReLU(W₁·x + b₁) + b₂``.

    The sum is one sparse matmul (:func:`~betty_trainer.models.aggregate.aggregate`, no per-edge feature
    tensor). ``W₁`` is linear, so with ``F_in > F_out`` it is applied before summing (the same function with
    less memory), as GCN and SAGE ``mean`` do. On a weighted block (LABOR, GNS) each neighbour is multiplied by
    its edge weight, an importance weight ``1/p``: the sum is then a Horvitz–Thompson estimate of the full one
    (DGL's ``GINConv`` with ``edge_weight``). The paper's MLP has batch normalisation; it has none here, since
    statistics over a batch would differ between a batch and its micro-batches.

    Args:
        in_feats: ``F_in``.
        out_feats: ``F_out`` (the MLP's hidden and output width).

    Shapes:
        ``h_src`` ``(num_src, F_in)`` → ``(num_dst, F_out)``.
    """

    def __init__(self, in_feats: int, out_feats: int):
        super().__init__()
        self.in_feats, self.out_feats = in_feats, out_feats
        self.linear1 = nn.Linear(in_feats, out_feats, bias=False)
        self.bias1 = nn.Parameter(torch.empty(out_feats))
        self.linear2 = nn.Linear(out_feats, out_feats, bias=False)
        self.bias2 = nn.Parameter(torch.empty(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_uniform_(self.linear1.weight, gain=gain)
        nn.init.xavier_uniform_(self.linear2.weight, gain=gain)
        nn.init.zeros_(self.bias1)
        nn.init.zeros_(self.bias2)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        project_first = self.in_feats > self.out_feats
        h = self.linear1(h_src) if project_first else h_src
        out = aggregate(block, h, edge_weight(block, h.dtype), self_scale=h.new_ones(block.num_dst))  # (1 + ε)·h_d + Σ h_s, ε = 0
        hidden = F.relu((out if project_first else self.linear1(out)) + self.bias1)
        return self.linear2(hidden) + self.bias2

    def __repr__(self) -> str:
        return f"GINConv({self.in_feats}, {self.out_feats})"


class GIN(LayerStack):
    """GIN: a :class:`~betty_trainer.models.stack.LayerStack` of :class:`GINConv` layers (Xu et al. 2019),
    classifying nodes from the last layer's output (no graph readout).

    Args:
        in_feats: ``F``.
        hidden: hidden width.
        out_feats: ``C``.
        num_layers: ``L ≥ 1``. Default ``2``.
        dropout: drop probability. Default ``0.5``.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)`` logits.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2, dropout: float = 0.5):
        super().__init__(layer_widths(in_feats, hidden, out_feats, num_layers), GINConv, dropout)


def gin_work(spec, size: LayerSize) -> Work:
    """One GIN layer's multiply-adds per pass (:attr:`~betty_trainer.models.registry.Architecture.work`):
    ``W₁`` (``a·b``) on the src rows when the layer projects first (``a > b``), else on the dst rows; ``W₂``
    (``b·b``) on the dst rows; the sum per edge at the width summed (``b`` when projected first, else ``a``)."""
    a, b = size.a, size.b
    first = a > b
    linear = (size.src if first else size.dst) * a * b + size.dst * b * b
    return Work(linear, size.edges * (b if first else a), size.gathered(b))


register(Architecture(
    "gin", "GIN (Xu et al. 2019) with ε = 0 and a two-layer MLP per layer", GIN,
    lambda config, graph: GIN(graph.num_features, config.hidden, graph.num_classes, config.num_layers,
                              config.dropout),
    gin_work))
