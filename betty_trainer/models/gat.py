"""GAT (Veličković et al., ICLR 2018) on blocks."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import attention_aggregate, edge_softmax
from betty_trainer.models.registry import Architecture, register
from betty_trainer.models.stack import LayerStack, layer_widths
from estimator.work import LayerSize, Work


class GATConv(nn.Module):
    """One graph attention layer (Veličković et al. 2018, §2.1, Eq. 1–6) on a block.

    With ``z_s = W·h_s`` split into ``heads`` vectors ``z_s^k`` of width ``F_out``:

    e_sd^k = LeakyReLU(a_src^k·z_s^k + a_dst^k·z_d^k)   (Eq. 3, ``a = [a_dst ‖ a_src]``)
    α_sd^k = softmax over s ∈ N(d) ∪ {d} of e_sd^k      (Eq. 2–3)
    h'_d   = ‖_k Σ_s α_sd^k z_s^k + b  (``concat``, Eq. 5)  or  mean_k Σ_s α_sd^k z_s^k + b  (Eq. 6)

    Every dst node attends to itself (the dst ``d`` is src position ``d``, the
    dst-first convention): the layer appends one self edge per dst node to the
    block's edges, and gives any self edge the block already has no attention (its
    score is ``−∞``, so ``α = 0``: the softmax and the sum are those without it, and
    every tensor's size depends on the counts alone, not on how many such edges
    there are), so an isolated node attends only to itself. The block is not modified. On a weighted
    block (LABOR's or GNS's importance weights, ``w_e ≈ 1/π_e``) an edge's attention is
    ``α ∝ w_e·exp(e_sd)``, the softmax of ``e_sd + log w_e`` (self edges weigh 1): the
    self-normalised importance estimate of the full neighbourhood's attention, as the
    weighted mean is of the mean (an edge of integer weight w attends as w copies of it).
    There is no dropout on the attention coefficients (feature dropout is the model's
    node-keyed dropout).

    Args:
        in_feats: input width ``F_in``.
        out_feats: width per head ``F_out``.
        heads: attention heads ``H``. Default ``1``.
        concat: concatenate the heads (output width ``H·F_out``, hidden layers) if ``True``
            (default), else average them (output width ``F_out``, the output layer).
        negative_slope: LeakyReLU slope. Default ``0.2``.

    Shapes:
        ``h_src`` ``(num_src, F_in)`` → ``(num_dst, H·F_out)`` if ``concat`` else ``(num_dst, F_out)``.
        With ``return_attention_weights=True`` also ``(edge_index, alpha)``: ``edge_index``
        ``(2, E')`` int64 ``[src_local; dst_local]`` of the attended edges (the block's
        non-self edges in CSC order, then one self edge per dst node), ``alpha`` ``(E', H)``.

    Raises:
        ValueError: if ``heads < 1``.
    """

    def __init__(self, in_feats: int, out_feats: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2):
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be at least 1, got {heads}")
        self.in_feats, self.out_feats, self.heads = in_feats, out_feats, heads
        self.concat, self.negative_slope = concat, negative_slope
        self.linear = nn.Linear(in_feats, heads * out_feats, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, out_feats))
        self.att_dst = nn.Parameter(torch.empty(heads, out_feats))
        self.bias = nn.Parameter(torch.empty(heads * out_feats if concat else out_feats))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.linear.weight)
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)
        nn.init.zeros_(self.bias)

    def forward(self, block: Block, h_src: Tensor,
                return_attention_weights: bool = False) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        return self.propagate(block, self.project(h_src), return_attention_weights)

    reads_dst_input = False  # propagate reads z alone (a ProjectedLayer: betty_trainer.models.capabilities)
    propagate_is_affine = False  # attention reads z's values: layer-wise keeps z for the backward

    @property
    def projected_width(self) -> int:
        """Columns of :meth:`project`'s output, ``H·F_out``."""
        return self.heads * self.out_feats

    def project(self, h: Tensor) -> Tensor:
        """``z = W·h`` row by row (Eq. 1's shared linear map), the part of :meth:`forward` that reads no
        edge: layer-wise execution projects a layer's src rows once and gathers each chunk's rows of
        ``z`` (``forward(block, h) == propagate(block, project(h))``).

        Shapes:
            ``h`` ``(rows, F_in)`` → ``(rows, H·F_out)``.
        """
        return self.linear(h)

    def propagate(self, block: Block, z: Tensor,
                  return_attention_weights: bool = False) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        """The attention and aggregation of :meth:`forward` (Eq. 2–6) from the projected src rows ``z``
        ``(num_src, H·F_out)`` (:meth:`project`); output as :meth:`forward`'s."""
        edge_dst = block.edge_dst()
        loops = torch.arange(block.num_dst, device=edge_dst.device)
        edge_src, edge_dst = torch.cat([block.indices.long(), loops]), torch.cat([edge_dst, loops])
        own = edge_src == edge_dst  # the block's own self edges (the loops, last, are not)
        own[block.num_edges:].fill_(False)
        score_src = z @ _per_head(self.att_src)
        score_dst = block.dst_rows(z) @ _per_head(self.att_dst)
        z = z.view(-1, self.heads, self.out_feats)
        scores = score_src.index_select(0, edge_src) + score_dst.index_select(0, edge_dst)
        scores = F.leaky_relu(scores, self.negative_slope)
        if block.edge_weight is not None:  # softmax over w·exp(e): e + log w, self edges weighing 1
            log_weight = torch.cat([block.edge_weight.to(scores.dtype).log(), scores.new_zeros(block.num_dst)])
            scores = scores + log_weight.unsqueeze(1)
        scores.masked_fill_(own.unsqueeze(1), float("-inf"))  # the block's own self edges get no attention
        alpha = edge_softmax(scores, edge_dst, block.num_dst)
        out = attention_aggregate(z, alpha, edge_src, edge_dst, block.num_dst)
        out = out.flatten(1) if self.concat else out.mean(1)
        out = out + self.bias
        if return_attention_weights:
            attended = ~own  # data-dependent shapes, on this inspection path only
            return out, (torch.stack([edge_src, edge_dst])[:, attended], alpha[attended])
        return out

    def __repr__(self) -> str:
        return f"GATConv({self.in_feats}, {self.out_feats}, heads={self.heads}, concat={self.concat})"


def _per_head(att: Tensor) -> Tensor:
    """The ``(H·F, H)`` block-diagonal matrix of the attention vectors ``att`` ``(H, F)``, so that ``z @ it`` is
    ``(z.view(-1, H, F) * att).sum(-1)`` (Eq. 1's ``a^T [W h]`` per head) as one matrix product: neither direction
    then makes a ``(rows, H, F)`` product, and the backward's ``∂att`` is a product too, where the elementwise form
    reduces a ``(rows, H, F)`` tensor over its rows (on CUDA through a staging buffer of twice its size)."""
    return torch.block_diag(*att).t()


class GAT(LayerStack):
    """GAT: a :class:`~betty_trainer.models.stack.LayerStack` of :class:`GATConv` layers (Veličković et al. 2018).

    Hidden layers concatenate their heads (width ``hidden·heads``); the output
    layer averages them (width ``out_feats``), the paper's Eq. 5 and Eq. 6. Layers
    are separated by the stack's ReLU (the paper uses ELU).

    Args:
        in_feats: feature width ``F``.
        hidden: hidden width per head.
        out_feats: number of classes ``C``.
        num_layers: ``L ≥ 1``. Default ``2``.
        heads: attention heads in every layer. Default ``4``.
        dropout: drop probability. Default ``0.5``.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)`` logits.
    """

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int = 2, heads: int = 4,
                 dropout: float = 0.5):
        super().__init__(layer_widths(in_feats, hidden * heads, out_feats, num_layers),
                         lambda a, _: GATConv(a, hidden, heads), dropout,
                         make_output_layer=lambda a, b: GATConv(a, b, heads, concat=False))


def gat_work(spec, size: LayerSize) -> Work:
    """One GAT layer's multiply-adds per pass (:attr:`~betty_trainer.models.registry.Architecture.work`): ``W``
    (``a·b``, ``b`` the heads' width: the output layer's ``b`` times ``heads``, averaged after projecting) on the
    src rows (layer-wise: the block's projected rows); the attention and the aggregation, ``b`` per edge."""
    b = size.b * spec.heads if size.last else size.b
    rows = size.projected if size.projected is not None else size.src
    return Work(rows * size.a * b, size.edges * b, size.gathered(b))


register(Architecture(
    "gat", "GAT (Veličković et al. 2018) with ``heads`` attention heads", GAT,
    lambda config, graph: GAT(graph.num_features, config.hidden, graph.num_classes, config.num_layers,
                              config.heads, config.dropout),
    gat_work,
    {"heads": (int, Field(4, ge=1, description="attention heads (hidden layers concatenate them, the last averages)"))}))
