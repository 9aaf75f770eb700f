"""GraphSAGE (Hamilton, Ying & Leskovec, NeurIPS 2017) on blocks, with ``mean`` and ``gcn`` aggregators."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from betty_trainer.block import Block
from betty_trainer.models.aggregate import mean_neighbours, sum_neighbours
from betty_trainer.models.stack import LayerStack, layer_widths

AGGREGATORS = ("mean", "gcn")


class SAGEConv(nn.Module):
    """One GraphSAGE layer (Hamilton et al. 2017, Alg. 1, line 4–5) on a block.

    ``mean``: h'_d = W_self·h_d + W_neigh·mean_{s∈N(d)} h_s + b
    ``gcn``:  h'_d = W_neigh·(h_d + Σ_{s∈N(d)} h_s) / (|N(d)| + 1) + b

    When ``in_feats > out_feats`` the linear map is applied before aggregating
    (both are linear, so the result is the same with less memory).

    Args:
        in_feats: input width ``F_in``.
        out_feats: output width ``F_out``.
        aggregator: ``"mean"`` (default) or ``"gcn"``.

    Shapes:
        block with ``num_src`` src / ``num_dst`` dst nodes; ``h_src`` ``(num_src, F_in)`` →
        ``(num_dst, F_out)``.

    Raises:
        ValueError: for an unknown aggregator.
    """

    def __init__(self, in_feats: int, out_feats: int, aggregator: str = "mean"):
        super().__init__()
        if aggregator not in AGGREGATORS:
            raise ValueError(f"unknown SAGE aggregator {aggregator!r}; choose one of {AGGREGATORS}")
        self.in_feats, self.out_feats, self.aggregator = in_feats, out_feats, aggregator
        self.fc_neigh = nn.Linear(in_feats, out_feats, bias=False)
        self.fc_self = nn.Linear(in_feats, out_feats, bias=False) if aggregator == "mean" else None
        self.bias = nn.Parameter(torch.empty(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)
        if self.fc_self is not None:
            nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.zeros_(self.bias)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        project_first = self.in_feats > self.out_feats
        h = self.fc_neigh(h_src) if project_first else h_src
        if self.aggregator == "mean":
            neigh = mean_neighbours(block, h)
        else:
            degree = block.in_degrees().to(h.dtype).unsqueeze(1)
            neigh = (sum_neighbours(block, h, block.edge_weight) + h[: block.num_dst]) / (degree + 1)
        out = neigh if project_first else self.fc_neigh(neigh)
        if self.fc_self is not None:
            out = out + self.fc_self(h_src[: block.num_dst])
        return out + self.bias

    def __repr__(self) -> str:
        return f"SAGEConv({self.in_feats}, {self.out_feats}, aggregator={self.aggregator!r})"


class GraphSAGE(LayerStack):
    """GraphSAGE: a :class:`~betty_trainer.models.stack.LayerStack` of :class:`SAGEConv` layers.

    Args:
        in_feats: feature width ``F``.
        hidden: hidden width.
        out_feats: number of classes ``C``.
        num_layers: ``L ≥ 1`` (one block per layer).
        aggregator: ``"mean"`` or ``"gcn"``.
        dropout: drop probability. Default ``0.5``.

    Shapes:
        ``blocks``: ``L`` blocks, input layer first; ``x`` ``(blocks[0].num_src, F)`` →
        ``(blocks[-1].num_dst, C)`` logits.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 aggregator: str = "mean", dropout: float = 0.5):
        super().__init__(layer_widths(in_feats, hidden, out_feats, num_layers),
                         lambda a, b: SAGEConv(a, b, aggregator), dropout)
