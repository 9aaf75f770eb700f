"""The layer stack every built-in model shares: layer → ReLU → node-keyed dropout, block by block."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.dropout import NodeDropout


class LayerStack(nn.Module):
    """``L`` graph layers applied to ``L`` blocks, input layer first.

    Dropout is applied to the input features and to every hidden representation
    (as DGL's GraphSAGE example does), keyed by each block's src node ids, and ReLU
    follows every layer but the last.

    Args:
        widths: ``[F, hidden, …, C]``, ``L + 1`` widths.
        make_layer: ``(in_feats, out_feats) -> nn.Module`` with ``forward(block, h_src)``.
        dropout: drop probability.
        make_output_layer: builds the last layer instead of ``make_layer`` when given
            (e.g. GAT, whose output layer averages its heads). Default ``None``.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)`` logits.
    """

    def __init__(self, widths: list[int], make_layer: Callable[[int, int], nn.Module], dropout: float,
                 make_output_layer: Callable[[int, int], nn.Module] | None = None):
        super().__init__()
        if len(widths) < 2:
            raise ValueError("a model needs at least one layer")
        hidden = [make_layer(a, b) for a, b in zip(widths[:-2], widths[1:-1])]
        self.layers = nn.ModuleList(hidden + [(make_output_layer or make_layer)(widths[-2], widths[-1])])
        self.dropout = NodeDropout(dropout)
        self.widths = tuple(widths)

    def apply_layer(self, layer: nn.Module, block: Block, h: Tensor) -> Tensor:
        """Run one layer; subclasses pass extra per-node inputs here."""
        return layer(block, h)

    def forward(self, blocks: list[Block], x: Tensor, consume_input: bool = False) -> Tensor:
        """Logits of ``blocks[-1]``'s dst nodes.

        Args:
            blocks: ``L`` blocks, input layer first; or ``L − 1`` (layers 1 … L − 1), and layer 0 reads the
                aggregation cache's rows of ``blocks[0]``'s src nodes in ``x`` (:meth:`aggregated_forward`).
            x: ``(blocks[0].num_src, F)`` input features, or with ``L − 1`` blocks ``(blocks[0].num_src,
                aggregated_width)`` cached rows.
            consume_input: the caller hands ``x`` over (a fresh gather that nothing else reads, as
                the training step's is): input dropout then overwrites it instead of keeping a
                dropped-out copy beside it, one ``(N_in, F)`` tensor less at the peak. Ignored when
                ``x`` requires grad.

        Raises:
            ValueError: if the number of blocks is neither the number of layers nor, for a layer 0 with an
                ``aggregated_width``, one fewer (at least one).
        """
        first = len(self.layers) - len(blocks)  # 1: layer 0 reads the aggregation cache
        if first not in (0, 1) or not blocks or (first and self.aggregated_width is None):
            raise ValueError(f"model has {len(self.layers)} layers but the batch has {len(blocks)} blocks (one fewer "
                             "only when layer 0 reads the aggregation cache: SAGE mean/gcn, GCN)")
        h = self.aggregated_forward(x, blocks[0].src_nodes, consume_input) if first else x
        for index, block in enumerate(blocks, start=first):
            h = self.layer_forward(index, block, h, consume_input)
        return h

    @property
    def aggregated_width(self) -> int | None:
        """Columns of an aggregation cache row layer 0 reads (its ``aggregated_width``), or ``None`` when layer 0
        cannot read one (BatchGNN §3)."""
        return getattr(self.layers[0], "aggregated_width", None)

    def aggregated_input(self, block: Block, x: Tensor) -> Tensor:
        """The aggregation cache's rows of ``block``'s dst nodes from the input features ``x`` of its src nodes:
        layer 0's ``aggregated_input`` (BatchGNN §3, "Input Feature Aggregation Cache").

        Shapes:
            ``x`` ``(block.num_src, F)`` → ``(block.num_dst, aggregated_width)``.
        """
        return self.layers[0].aggregated_input(block, x)

    def aggregated_forward(self, rows: Tensor, node_ids: Tensor, consume_input: bool = False) -> Tensor:
        """Layer 0 from the aggregation cache's rows of its dst nodes ``node_ids``: node-keyed dropout of the
        rows (``features.aggregation_cache: approximate`` only; exact runs have none), the layer's
        ``forward_aggregated``, ReLU. Equals :meth:`layer_forward` of layer 0 on the dst nodes' full-neighbourhood
        block without dropout, up to float reassociation.

        Shapes:
            ``rows`` ``(D, aggregated_width)``, ``node_ids`` ``(D,)`` int64 → ``(D, widths[1])``.
        """
        h = self.layers[0].forward_aggregated(self.dropout(rows, node_ids, 0, consume_input))
        return F.relu(h) if len(self.layers) > 1 else h

    def layer_forward(self, index: int, block: Block, h: Tensor, consume_input: bool = False) -> Tensor:
        """Layer ``index`` on one block: node-keyed dropout, the layer, then ReLU unless it is the output
        layer (``forward`` is these, block by block; layer-wise evaluation calls them one layer at a time).

        Shapes:
            ``h`` ``(block.num_src, widths[index])`` → ``(block.num_dst, widths[index + 1])``.
        """
        h = self.apply_layer(self.layers[index], block,
                             self.dropout(h, block.src_nodes, index, consume_input and index == 0))
        return F.relu(h) if index < len(self.layers) - 1 else h


def runs_layer_by_layer(model: object) -> bool:
    """Whether ``model`` can run one layer at a time: a :class:`LayerStack` (every built-in model, or a user
    model built on it) whose ``forward`` is the stack's own, so that :meth:`LayerStack.layer_forward` layer
    by layer computes what ``forward`` computes. Layer-wise evaluation and layer-wise training both need it."""
    return isinstance(model, LayerStack) and type(model).forward is LayerStack.forward


def layer_widths(in_feats: int, hidden: int, out_feats: int, num_layers: int) -> list[int]:
    """``[in_feats, hidden × (num_layers − 1), out_feats]``."""
    return [in_feats] + [hidden] * (num_layers - 1) + [out_feats]
