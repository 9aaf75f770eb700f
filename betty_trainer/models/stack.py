"""The layer stack every built-in model shares: layer → ReLU → node-keyed dropout, block by block."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.dropout import NodeDropout, dropout_terms, keyed_mask_terms
from estimator.counts import LayerCounts
from estimator.tape import StepTape


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


    def layer_memory_terms(self, tape: StepTape, index: int, counts: LayerCounts, h: int, h_grad: bool,
                           consume_input: bool = False):
        """What :meth:`layer_forward` allocates for layer ``index`` on a block of counts ``counts`` from
        the input ``h`` (a handle; ``h_grad``: it requires grad; ``consume_input``: input dropout
        overwrites it in place, as the training step's fresh gather allows), op by op, written by hand: for a layer
        whose own terms are (:class:`~betty_trainer.models.capabilities.WrittenMemoryTerms`) where the recorder
        refuses it (:meth:`betty_trainer.models.recorded_terms.RecordedLayer.layer_memory_terms`).

        Returns:
            ``(output handle, backward)``; ``backward(grad)`` returns the handle of ``h``'s gradient
            (``None`` when ``h`` takes none).
        """
        r = tape.r
        width_out = self.widths[index + 1]
        hd, dropout_bwd = self._dropout_terms(tape, counts.num_src, self.widths[index], h, h_grad, consume_input)
        out, layer_bwd = self.layers[index].memory_terms(tape, counts, hd, h_grad)
        self._release_input(r, h, hd, consume_input)
        relu_bwd = None
        if index < len(self.layers) - 1:
            out, relu_bwd = tape.relu(out, counts.num_dst, width_out)
        dropout_bwd = dropout_bwd if h_grad else None

        def backward(grad: int) -> int | None:
            if relu_bwd is not None:
                grad = relu_bwd(grad)
            grad = layer_bwd(grad)
            if grad is not None and dropout_bwd is not None:
                grad = dropout_bwd(grad)
            return grad

        return out, backward


    def _dropout_terms(self, tape: StepTape, rows: int, width: int, h: int, h_grad: bool, consume_input: bool):
        """The node-keyed dropout of a layer's input ``h`` (``rows × width``): in place on a consumed input,
        else into a new tensor. Returns ``(dropped handle, backward or None)``; :meth:`_release_input` lets go
        of both once the layer has run."""
        if self.dropout.p > 0 and consume_input and not h_grad:  # dropout overwrites h in place
            keyed_mask_terms(tape, rows, width)
            return h, None
        if self.dropout.p > 0:
            return dropout_terms(tape, h, rows, width, h_grad)
        return h, None

    @staticmethod
    def _release_input(r, h: int, hd: int, consume_input: bool) -> None:
        """After a layer's forward: the dropout's output ``hd`` (where it is no view of ``h``: only autograd keeps
        it) and the caller's reference to the input ``h``, unless the caller handed it over (``consume_input``: it
        drops its own). Not before: the stack's ``forward`` passes ``h`` to :meth:`layer_forward` as an argument,
        whose frame holds it until the layer returns (measured: a hidden layer's input rows that nothing else
        keeps, a cooperative share's exchanged rows, live through the layer's forward)."""
        if hd != h:
            r.drop(hd)
        if not consume_input:
            r.drop(h)


def runs_layer_by_layer(model: object) -> bool:
    """Whether ``model`` can run one layer at a time: a :class:`LayerStack` (every built-in model, or a user
    model built on it) whose ``forward`` is the stack's own, so that :meth:`LayerStack.layer_forward` layer
    by layer computes what ``forward`` computes. Layer-wise evaluation and layer-wise training both need it."""
    return isinstance(model, LayerStack) and type(model).forward is LayerStack.forward


def layer_widths(in_feats: int, hidden: int, out_feats: int, num_layers: int) -> list[int]:
    """``[in_feats, hidden × (num_layers − 1), out_feats]``."""
    return [in_feats] + [hidden] * (num_layers - 1) + [out_feats]
