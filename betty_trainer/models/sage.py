"""GraphSAGE (Hamilton, Ying & Leskovec, NeurIPS 2017) on blocks, with ``mean``, ``gcn``, ``pool`` and ``lstm``
aggregators."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import aggregate, lstm_neighbours, max_neighbours, mean_neighbours, per_edge
from betty_trainer.models.lstm import LSTM
from betty_trainer.models.stack import LayerStack, layer_widths

AGGREGATORS = ("mean", "gcn", "pool", "lstm")
_LINEAR = ("mean", "gcn")  # aggregators that commute with W_neigh


class SAGEConv(nn.Module):
    """One GraphSAGE layer (Hamilton et al. 2017, Alg. 1, line 4–5; aggregators of §3.3) on a block.

    ``mean``: h'_d = W_self·h_d + W_neigh·mean_{s∈N(d)} h_s + b
    ``gcn``:  h'_d = W_neigh·(h_d + Σ_{s∈N(d)} h_s) / (|N(d)| + 1) + b
    ``pool``: h'_d = W_self·h_d + W_neigh·max_{s∈N(d)} ReLU(W_pool·h_s + b_pool) + b  (Eq. 3)
    ``lstm``: h'_d = W_self·h_d + W_neigh·LSTM(h_s for s ∈ N(d) in CSC edge order) + b

    ``pool`` takes the element-wise max; the ``lstm`` aggregator's LSTM has hidden
    size ``F_in`` and its final hidden state is the neighbourhood vector, computed
    per group of equal in-degree (Betty §4.4.3, Eq. 5), unrolled in plain ops
    (:class:`~betty_trainer.models.lstm.LSTM`) so its memory is known. Both follow DGL's
    ``SAGEConv``; an isolated dst node's neighbourhood vector is zero, and both
    ignore edge weights (those make the mean unbiased; a max or an LSTM has no such form).
    For ``mean``/``gcn`` with ``in_feats > out_feats`` the linear map is applied
    before aggregating (both are linear, so the result is the same with less memory).

    Args:
        in_feats: input width ``F_in``.
        out_feats: output width ``F_out``.
        aggregator: ``"mean"`` (default), ``"gcn"``, ``"pool"`` or ``"lstm"``.

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
        self.fc_pool = nn.Linear(in_feats, in_feats) if aggregator == "pool" else None
        self.lstm = LSTM(in_feats, in_feats) if aggregator == "lstm" else None
        self.fc_neigh = nn.Linear(in_feats, out_feats, bias=False)
        self.fc_self = nn.Linear(in_feats, out_feats, bias=False) if aggregator != "gcn" else None
        self.bias = nn.Parameter(torch.empty(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gain = nn.init.calculate_gain("relu")
        if self.fc_pool is not None:
            nn.init.xavier_uniform_(self.fc_pool.weight, gain=gain)
            nn.init.zeros_(self.fc_pool.bias)
        if self.lstm is not None:
            self.lstm.reset_parameters()
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)
        if self.fc_self is not None:
            nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.zeros_(self.bias)

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        if self.aggregator in _LINEAR and self.in_feats > self.out_feats:
            out = self.aggregate(block, self.fc_neigh(h_src))
        else:
            out = self.fc_neigh(self.aggregate(block, h_src))
        if self.fc_self is not None:
            out = out + self.fc_self(h_src[: block.num_dst])
        return out + self.bias

    def aggregate(self, block: Block, h_src: Tensor) -> Tensor:
        """The neighbourhood vector of every dst node (before ``W_neigh``): ``(num_src, F)`` → ``(num_dst, F)``."""
        if self.aggregator == "mean":
            return mean_neighbours(block, h_src)
        if self.aggregator == "gcn":
            scale = block.in_degrees().to(h_src.dtype).add_(1).reciprocal_()  # 1 / (|N(d)| + 1)
            values = per_edge(block, scale)
            if block.edge_weight is not None:
                values.mul_(block.edge_weight)
            return aggregate(block, h_src, values, self_scale=scale)
        if self.aggregator == "pool":
            return max_neighbours(block, F.relu(self.fc_pool(h_src)))
        return lstm_neighbours(block, h_src, self.lstm)

    def __repr__(self) -> str:
        return f"SAGEConv({self.in_feats}, {self.out_feats}, aggregator={self.aggregator!r})"


class GraphSAGE(LayerStack):
    """GraphSAGE: a :class:`~betty_trainer.models.stack.LayerStack` of :class:`SAGEConv` layers.

    Args:
        in_feats: feature width ``F``.
        hidden: hidden width.
        out_feats: number of classes ``C``.
        num_layers: ``L ≥ 1`` (one block per layer).
        aggregator: ``"mean"`` (default), ``"gcn"``, ``"pool"`` or ``"lstm"`` (see :class:`SAGEConv`).
        dropout: drop probability. Default ``0.5``.

    Shapes:
        ``blocks``: ``L`` blocks, input layer first; ``x`` ``(blocks[0].num_src, F)`` →
        ``(blocks[-1].num_dst, C)`` logits.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2,
                 aggregator: str = "mean", dropout: float = 0.5):
        super().__init__(layer_widths(in_feats, hidden, out_feats, num_layers),
                         lambda a, b: SAGEConv(a, b, aggregator), dropout)
