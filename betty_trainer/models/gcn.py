"""GCN (Kipf & Welling, ICLR 2017) on blocks, normalised by the whole graph's degrees."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import aggregate, edge_weight
from betty_trainer.models.registry import Architecture, register
from betty_trainer.models.stack import LayerStack, layer_widths
from estimator.work import LayerSize, Work


class GCNConv(nn.Module):
    """One GCN layer: h'_d = Σ_{s∈N(d)∪{d}} W·h_s / sqrt(d̃_s·d̃_d) + b (Kipf & Welling 2017, Eq. 2).

    ``d̃ = in-degree + 1`` comes from the **whole graph** (a per-node vector given to
    the model), not from the block: a block's src out-degrees change when a batch
    is split into micro-batches, and the graph's do not, so the layer computes the
    same function on any micro-batch.

    On a sampled block the neighbour sum is a Horvitz–Thompson estimate of the full one: a
    weighted block's edges (LABOR, GNS) are multiplied by their weights, and an unweighted
    block's (neighbour sampling keeps a uniform ``k`` of a node's ``d`` in-edges, each with
    probability ``k/d``) by ``d / k``, the node's graph in-degree over its in-degree in the
    block (:func:`sampled_row_scale`): 1 for a full neighbourhood, so full-graph and micro-batch
    results are unchanged. Without it a sampled row would sum about ``k/d`` of its neighbourhood
    in training and all of it in full-neighbourhood evaluation.

    Args:
        in_feats: ``F_in``.
        out_feats: ``F_out``.

    Shapes:
        ``h_src`` ``(num_src, F_in)``, ``inv_sqrt_degree`` ``(num_src,)`` → ``(num_dst, F_out)``.
    """

    def __init__(self, in_feats: int, out_feats: int):
        super().__init__()
        self.in_feats, self.out_feats = in_feats, out_feats
        self.linear = nn.Linear(in_feats, out_feats, bias=False)
        self.bias = nn.Parameter(torch.empty(out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.linear.weight)
        nn.init.zeros_(self.bias)

    def forward(self, block: Block, h_src: Tensor, inv_sqrt_degree: Tensor) -> Tensor:
        project_first = self.in_feats > self.out_feats
        h = self.linear(h_src) if project_first else h_src
        out = self.aggregated_input(block, h, inv_sqrt_degree)
        return (out if project_first else self.linear(out)) + self.bias

    @property
    def aggregated_width(self) -> int:
        """Columns of the aggregation cache's row this layer reads as layer 0 (BatchGNN §3): ``F_in``."""
        return self.in_feats

    def aggregated_input(self, block: Block, h: Tensor, inv_sqrt_degree: Tensor) -> Tensor:
        """The normalised sum ``Σ_{s∈N(d)∪{d}} h_s / sqrt(d̃_s·d̃_d)`` of every dst node (Eq. 2 before ``W``), what
        :meth:`forward` aggregates; of the input features over the full neighbourhood, the aggregation cache's rows
        (BatchGNN §3), which :meth:`forward_aggregated` reads. ``inv_sqrt_degree``: ``(num_src,)`` of the src
        nodes.

        Shapes:
            ``h`` ``(num_src, F)`` → ``(num_dst, F)``.
        """
        norm = inv_sqrt_degree.to(h.dtype)
        dst_norm = norm[: block.num_dst]
        # 1/sqrt(d̃_s·d̃_d) per edge as a src and a dst scale; a weighted block's weights are the values, an
        # unweighted block's rows are scaled by d/k for a row that kept k of its d in-edges
        row_scale = dst_norm if block.edge_weight is not None else sampled_row_scale(block, dst_norm)
        return aggregate(block, h, edge_weight(block, h.dtype), self_scale=dst_norm * dst_norm, row_scale=row_scale,
                         col_scale=norm)

    def forward_aggregated(self, rows: Tensor) -> Tensor:
        """:meth:`forward` from the aggregation cache's rows (:meth:`aggregated_input` of the input features):
        ``W·c_d + b``.

        Shapes:
            ``rows`` ``(num_dst, F_in)`` → ``(num_dst, F_out)``.
        """
        return self.linear(rows) + self.bias

    def __repr__(self) -> str:
        return f"GCNConv({self.in_feats}, {self.out_feats})"


def sampled_row_scale(block: Block, dst_norm: Tensor) -> Tensor:
    """``(num_dst,)``: each dst node's ``1 / sqrt(d̃_d)`` (``dst_norm``) times ``d / k``, its graph in-degree
    ``d = 1/dst_norm² − 1`` (rounded: exact in float32 below about 2·10⁶, within a relative 10⁻⁶ above) over its
    in-degree ``k`` in the block (at least 1).

    The inverse of the inclusion probability ``k/d`` of each in-edge under neighbour sampling's uniform
    ``k``-subsets (Horvitz & Thompson 1952): the sampled sum is then unbiased for the full one. Exactly
    ``dst_norm`` on rows that kept every in-edge (of in-degree below about 2·10⁶)."""
    degree = dst_norm.pow(-2).sub_(1).round_()
    return degree.div_(block.in_degrees().clamp_(min=1)).mul_(dst_norm)


class GCN(LayerStack):
    """GCN: a :class:`~betty_trainer.models.stack.LayerStack` of :class:`GCNConv` layers.

    Args:
        in_feats: ``F``.
        hidden: hidden width.
        out_feats: ``C``.
        in_degrees: ``(N,)`` int64 in-degrees of the whole graph (``Graph.in_degrees()``).
        num_layers: ``L ≥ 1``.
        dropout: drop probability. Default ``0.5``.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)``.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, in_degrees: Tensor,
                 num_layers: int = 2, dropout: float = 0.5):
        super().__init__(layer_widths(in_feats, hidden, out_feats, num_layers), GCNConv, dropout)
        # a property of the graph, rebuilt from it: not saved in checkpoints
        self.register_buffer("inv_sqrt_degree", (in_degrees.float() + 1).rsqrt(), persistent=False)

    def apply_layer(self, layer: nn.Module, block: Block, h: Tensor) -> Tensor:
        return layer(block, h, self.inv_sqrt_degree[block.src_nodes])

    def aggregated_input(self, block: Block, x: Tensor) -> Tensor:
        """Layer 0's :meth:`GCNConv.aggregated_input` with the graph's degree normalisation of the block's src nodes."""
        return self.layers[0].aggregated_input(block, x, self.inv_sqrt_degree[block.src_nodes])


def gcn_work(spec, size: LayerSize) -> Work:
    """One GCN layer's multiply-adds per pass (:attr:`~betty_trainer.models.registry.Architecture.work`): ``W``
    (``a·b``) on the src rows when the layer projects first (``a > b``), else on the dst rows; the aggregation
    per edge at the width aggregated (``b`` when projected first, else ``a``)."""
    a, b = size.a, size.b
    first = a > b
    rows = size.projected if size.projected is not None else size.src if first else size.dst
    return Work(rows * a * b, size.edges * (b if first else a), size.gathered(b))


register(Architecture(
    "gcn", "GCN (Kipf & Welling 2017)", GCN,
    lambda config, graph: GCN(graph.num_features, config.hidden, graph.num_classes, graph.in_degrees(),
                              config.num_layers, config.dropout),
    gcn_work))
