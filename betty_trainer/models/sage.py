"""GraphSAGE (Hamilton, Ying & Leskovec, NeurIPS 2017) on blocks, with ``mean``, ``gcn``, ``pool`` and ``lstm``
aggregators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import (
    aggregate,
    aggregate_rows,
    aggregate_rows_transpose_,
    edge_weight,
    lstm_neighbours,
    lstm_neighbours_terms,
    max_neighbours,
    mean_neighbours,
    weight_totals,
)
from betty_trainer.models.lstm import LSTM
from betty_trainer.models.registry import Architecture, register
from betty_trainer.models.stack import LayerStack, layer_widths
from estimator.counts import LayerCounts
from estimator.tape import GRAD, HID, StepTape
from estimator.work import LayerSize, Work

AGGREGATORS = ("mean", "gcn", "pool", "lstm")
_LINEAR = ("mean", "gcn")  # aggregators that commute with W_neigh


class SAGEConv(nn.Module):
    """One GraphSAGE layer (Hamilton et al. 2017, Alg. 1, line 4–5; aggregators of §3.3) on a block.

    ``mean``: h'_d = W_self·h_d + W_neigh·mean_{s∈N(d)} h_s + b
    ``gcn``:  h'_d = W_neigh·(h_d + Σ_{s∈N(d)} h_s) / (|N(d)| + 1) + b; on a block with edge weights
              (LABOR, GNS) h'_d = W_neigh·(h_d + Σ w_e h_s) / (Σ w_e + 1) + b, Σ w_e estimating |N(d)|
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
        if self.projected_width is not None:  # as propagate(project(h)), without holding z past the aggregation
            out = self.aggregate(block, self.fc_neigh(h_src))
        else:
            out = self.fc_neigh(self.aggregate(block, h_src))
        if self.fc_self is not None:
            out = out + self.fc_self(block.dst_rows(h_src))
        return out + self.bias

    @property
    def projected_width(self) -> int | None:
        """Columns of :meth:`project`'s output, ``F_out``, when the layer projects before aggregating
        (``mean``/``gcn`` with ``F_in > F_out``); else ``None``, and layer-wise execution runs it whole."""
        return self.out_feats if self.aggregator in _LINEAR and self.in_feats > self.out_feats else None

    @property
    def propagate_is_affine(self) -> bool:
        """Whether :meth:`propagate` is ``A·z + g(h_dst)`` with ``A`` from the block alone (its structure and edge
        weights) and nothing learnable touching ``A·z``, so that no gradient reads ``z``'s values: true when the
        layer projects first (``mean``/``gcn`` with ``F_in > F_out``), a subclass overrides none of
        :meth:`project`, :meth:`propagate`, :meth:`aggregate` and the self term and bias (one that does states it
        itself), and no weight is parametrized (``torch.nn.utils.parametrize``): :meth:`projection_backward` writes
        the gradients of ``fc_neigh``, ``fc_self`` and the bias as this class computes them. Layer-wise execution then
        does not keep ``z`` for the layer's backward."""
        own = all(getattr(type(self), name) is getattr(SAGEConv, name)
                  for name in ("project", "propagate", "aggregate", "_plus_self_and_bias"))
        plain = not any(parametrize.is_parametrized(module) for module in self.modules())
        return self.projected_width is not None and own and plain

    @property
    def reads_dst_input(self) -> bool:
        """Whether :meth:`propagate` reads the dst nodes' input rows: ``mean``'s self term ``W_self·h_d``."""
        return self.fc_self is not None

    @property
    def aggregated_width(self) -> int | None:
        """Columns of the aggregation cache's row this layer reads as layer 0 (BatchGNN §3, "Input Feature
        Aggregation Cache"): ``mean``: the node's own features beside their neighbours' mean, ``2·F_in``; ``gcn``:
        the self-inclusive mean, ``F_in``; ``None`` for ``pool`` and ``lstm``, whose aggregation has parameters."""
        return {"mean": 2 * self.in_feats, "gcn": self.in_feats}.get(self.aggregator)

    def aggregated_input(self, block: Block, h_src: Tensor) -> Tensor:
        """The aggregation cache's rows of ``block``'s dst nodes: what :meth:`forward` computes from the block
        before any parameter touches it, ``mean``: ``[h_d | mean_{s∈N(d)} h_s]``; ``gcn``: ``(h_d + Σ_{s∈N(d)}
        h_s) / (|N(d)| + 1)`` (:meth:`aggregate`). :meth:`forward_aggregated` of them is :meth:`forward` of the
        block, up to float reassociation.

        Shapes:
            ``h_src`` ``(num_src, F_in)`` → ``(num_dst, aggregated_width)``.

        Raises:
            ValueError: ``pool`` or ``lstm`` (no cacheable aggregation).
        """
        if self.aggregated_width is None:
            raise ValueError(f"SAGE's {self.aggregator!r} aggregator has parameters: its aggregation cannot be cached")
        neighbourhood = self.aggregate(block, h_src)
        return torch.cat([block.dst_rows(h_src), neighbourhood], 1) if self.fc_self is not None else neighbourhood

    def forward_aggregated(self, rows: Tensor) -> Tensor:
        """:meth:`forward` from the aggregation cache's rows (:meth:`aggregated_input`) of the dst nodes:
        ``mean``: ``W_neigh·m_d + W_self·h_d + b`` on the rows' halves (views, no copy); ``gcn``: ``W_neigh·c_d + b``.

        Shapes:
            ``rows`` ``(num_dst, aggregated_width)`` → ``(num_dst, F_out)``.
        """
        if self.fc_self is None:
            return self.fc_neigh(rows) + self.bias
        out = self.fc_neigh(rows[:, self.in_feats:])
        out = out + self.fc_self(rows[:, :self.in_feats])
        return out + self.bias

    def project(self, h: Tensor) -> Tensor:
        """``z = W_neigh·h`` row by row, the part of a projecting layer's :meth:`forward` that reads no edge:
        layer-wise execution projects a layer's src rows once per pass and each chunk gathers its rows of
        ``z`` (``forward(block, h) == propagate(block, project(h), block.dst_rows(h))``, op for op).

        Shapes:
            ``h`` ``(rows, F_in)`` → ``(rows, F_out)``.
        """
        return self.fc_neigh(h)

    def propagate(self, block: Block, z: Tensor, h_dst: Tensor | None = None) -> Tensor:
        """The rest of a projecting layer's :meth:`forward`: the aggregation of the projected src rows ``z``
        ``(num_src, F_out)`` (:meth:`project`), ``mean``'s self term on the dst nodes' input rows ``h_dst``
        ``(num_dst, F_in)`` (unused by ``gcn``), and the bias → ``(num_dst, F_out)``.

        Raises:
            ValueError: ``mean`` without ``h_dst``.
        """
        self._check_dst_input(h_dst)
        return self._plus_self_and_bias(self.aggregate(block, z), h_dst)

    def _check_dst_input(self, h_dst: Tensor | None) -> None:
        if self.fc_self is not None and h_dst is None:
            raise ValueError("SAGEConv(mean).propagate needs h_dst, the dst nodes' input rows, for W_self·h_d")

    def _plus_self_and_bias(self, out: Tensor, h_dst: Tensor | None) -> Tensor:
        """``out + fc_self(h_dst)`` (``mean``) ``+ bias``: what :meth:`propagate` and :meth:`propagate_rows` add to
        the aggregation ``out`` ``(rows, F_out)``."""
        if self.fc_self is not None:
            out = out + self.fc_self(h_dst)
        return out + self.bias

    def propagate_rows(self, block: Block, begin: int, end: int, z: Tensor, h_dst: Tensor | None = None) -> Tensor:
        """:meth:`propagate` of the dst rows ``[begin, end)`` of ``block`` (an affine layer's row block in
        layer-wise execution), without autograd: ``z`` is the whole ``(num_src, F_out)`` projection, read at the
        block's src positions (:func:`~betty_trainer.models.aggregate.aggregate_rows`; the compiled CPU kernels),
        and ``h_dst`` the rows' ``(R, F_in)`` input rows (``mean``) → ``(R, F_out)``.

        Raises:
            ValueError: ``mean`` without ``h_dst``.
        """
        self._check_dst_input(h_dst)
        return self._plus_self_and_bias(aggregate_rows(block, begin, end, z, self_loop=self.aggregator == "gcn"), h_dst)

    def propagate_rows_backward(self, block: Block, begin: int, grad: Tensor, grad_z: Tensor) -> None:
        """The aggregation's part of :meth:`propagate_rows`'s backward from the rows' output gradient ``grad``
        ``(R, F_out)`` (rows ``[begin, begin + R)``): ``z``'s gradient added into ``grad_z`` ``(num_src, F_out)`` by
        the aggregation's transpose, which reads no value of ``z`` (the layer is affine in ``z``:
        :attr:`propagate_is_affine`) and allocates nothing. The parameters' gradients come from
        :meth:`projection_backward`."""
        aggregate_rows_transpose_(block, begin, grad, grad_z, self_loop=self.aggregator == "gcn")

    def projection_backward(self, x: Tensor, grad_z: Tensor, grad_dst: Tensor, input_grad: bool) -> Tensor | None:
        """The backward of a projecting ``mean``/``gcn`` layer's linear parts on ``R`` consecutive src rows of its
        (dropped-out) input ``x`` ``(R, F_in)``, without recomputing them: ``∂L/∂W_neigh += grad_zᵀ·x`` from those
        rows' ``∂L/∂z`` ``grad_z`` ``(R, F_out)``, and, for the first ``D' ≤ R`` of them that are dst nodes (a
        block's dst nodes are its first src nodes), ``∂L/∂W_self += grad_dstᵀ·x[:D']`` (``mean``) and ``∂L/∂b +=
        Σ grad_dst`` from their output gradient ``grad_dst`` ``(D', F_out)``. Gradients are added into ``.grad``
        in place (made when ``None``), as autograd accumulates them.

        Source: the gradients of GraphSAGE's ``W·CONCAT(h_v, h_N(v))`` (Hamilton et al. 2017, Alg. 1 line 5) split
        into ``W_self`` and ``W_neigh``, as ``torch.nn.Linear``'s backward computes them, in the parameters' dtype
        (inputs of another dtype raise torch's ``RuntimeError``).

        Returns:
            With ``input_grad``, ``∂L/∂x`` ``(R, F_in)`` (``grad_z·W_neigh``, plus ``grad_dst·W_self`` on its first
            ``D'`` rows); else ``None``.
        """
        x = x.detach()
        with torch.no_grad():
            _accumulate(self.fc_neigh.weight, lambda: grad_z.t().mm(x), lambda grad: grad.addmm_(grad_z.t(), x))
            dst = grad_dst.shape[0]
            if dst:
                _accumulate(self.bias, lambda: grad_dst.sum(0), lambda grad: grad.add_(grad_dst.sum(0)))
                if self.fc_self is not None:
                    _accumulate(self.fc_self.weight, lambda: grad_dst.t().mm(x[:dst]),
                                lambda grad: grad.addmm_(grad_dst.t(), x[:dst]))
            if not input_grad:
                return None
            grad_x = grad_z.mm(self.fc_neigh.weight)
            if dst and self.fc_self is not None:
                grad_x[:dst].addmm_(grad_dst, self.fc_self.weight)
            return grad_x

    def aggregate(self, block: Block, h_src: Tensor) -> Tensor:
        """The neighbourhood vector of every dst node (before ``W_neigh``): ``(num_src, F)`` → ``(num_dst, F)``."""
        if self.aggregator == "mean":
            return mean_neighbours(block, h_src)
        if self.aggregator == "gcn":  # 1 / (|N(d)| + 1); weighted: 1 / (Σ w + 1), Σ w estimating |N(d)|
            degree = block.in_degrees().to(h_src.dtype) if block.edge_weight is None else weight_totals(block, h_src.dtype)
            scale = degree.add_(1).reciprocal_()
            return aggregate(block, h_src, edge_weight(block, h_src.dtype), self_scale=scale, row_scale=scale)
        if self.aggregator == "pool":
            return max_neighbours(block, F.relu(self.fc_pool(h_src)))
        return lstm_neighbours(block, h_src, self.lstm)

    @property
    def memory_terms_written(self) -> bool:
        """Whether :meth:`memory_terms` are written for this aggregator (``lstm`` only; the others are recorded)."""
        return self.aggregator == "lstm"

    def memory_terms(self, tape: StepTape, c: LayerCounts, hd: int, hd_grad: bool):
        """What :meth:`forward` allocates on a block of counts ``c`` from the input ``hd`` (a handle on the
        tape; ``hd_grad``: it requires grad), op by op (:class:`estimator.tape.StepTape`), written by hand for the
        aggregator the recorder refuses (:class:`~betty_trainer.models.capabilities.WrittenMemoryTerms`): ``lstm``,
        whose in-degree groups have sizes that depend on the data.

        Returns:
            ``(output handle, backward)``; ``backward(grad)`` emits the layer's backward and returns
            the handle of ``hd``'s gradient, or ``None``.

        Raises:
            ValueError: another aggregator, whose terms are only recorded.
        """
        if not self.memory_terms_written:
            raise ValueError(f"SAGEConv({self.aggregator}) has no hand-written memory terms: they are recorded")
        return self._lstm_terms(tape, c, hd, self.in_feats, self.out_feats, hd_grad)

    def _combine_terms(self, tape: StepTape, c: LayerCounts, hd: int, neigh: int, a: int, b: int, hd_grad: bool):
        """``fc_neigh(neigh) + fc_self(h[:num_dst]) + bias`` (SAGE lstm). Returns (result,
        backward); backward gives (the gradient of ``h`` from the self term or ``None``, that of ``neigh``)."""
        r, f, d = tape.r, tape.f, c.num_dst
        neigh_out, neigh_bwd = tape.linear(neigh, d, a, b, True)
        r.drop(neigh)
        self_out, self_bwd = tape.linear(hd, d, a, b, hd_grad)
        summed = r.alloc(d * b * f, HID)
        r.drop(neigh_out, self_out)
        result = r.alloc(d * b * f, HID)  # + bias
        r.drop(summed)

        def backward(grad: int) -> tuple[int | None, int]:
            tape.param_grad(b)
            tape.settle()
            return _slice_backward_terms(tape, c, a, self_bwd(grad, free_grad=False)), neigh_bwd(grad)

        return result, backward

    def _lstm_terms(self, tape: StepTape, c: LayerCounts, hd: int, a: int, b: int, hd_grad: bool):
        neigh, lstm_bwd = lstm_neighbours_terms(tape, c, hd, a, hd_grad)
        result, combine_bwd = self._combine_terms(tape, c, hd, neigh, a, b, hd_grad)

        def backward(grad: int) -> int | None:
            grad_hd, grad_neigh = combine_bwd(grad)
            return lstm_bwd(grad_neigh, grad_hd)

        return result, backward

    def __repr__(self) -> str:
        return f"SAGEConv({self.in_feats}, {self.out_feats}, aggregator={self.aggregator!r})"


def _accumulate(parameter: nn.Parameter, make: Callable[[], Tensor], add_: Callable[[Tensor], object]) -> None:
    """A gradient contribution added as autograd's ``AccumulateGrad`` adds it: into ``parameter.grad`` in place
    (``add_(parameter.grad)``), or, when ``.grad`` is ``None``, as a new tensor (``make()``); nothing for a frozen
    parameter (``requires_grad=False``)."""
    if not parameter.requires_grad:
        return
    if parameter.grad is None:
        parameter.grad = make()
    else:
        add_(parameter.grad)


def _slice_backward_terms(tape: StepTape, c: LayerCounts, width: int, grad_dst: int | None) -> int | None:
    """The gradient of ``h_src`` from that of :meth:`Block.dst_rows`: ``SliceBackward`` makes a zero-filled
    ``(S, width)`` tensor holding ``grad_dst`` in its first rows; a block whose dst nodes are all its src
    nodes takes no slice, and the gradient is ``grad_dst`` itself."""
    if grad_dst is None or c.num_dst == c.num_src:
        return grad_dst
    sliced = tape.r.alloc(c.num_src * width * tape.f, GRAD)
    tape.r.drop(grad_dst)
    return sliced


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


def sage_work(spec, size: LayerSize) -> Work:
    """One SAGE layer's multiply-adds per pass (:attr:`~betty_trainer.models.registry.Architecture.work`):
    ``W_neigh`` (``a·b``) on the src rows when the layer projects first (``mean``/``gcn`` with ``a > b``; layer-wise,
    on the block's projected rows), else on the dst rows; ``W_self`` (every aggregator but ``gcn``) on the dst
    rows; ``pool``'s ``fc_pool`` (``a·a``) on the src rows; the aggregation per edge at the width aggregated
    (``b`` when projected first, else ``a``), ``lstm``: an LSTM step per edge, ``8·a²`` (four gates over the
    input and the hidden state)."""
    a, b = size.a, size.b
    first = spec.aggregator in _LINEAR and a > b
    rows = size.projected if size.projected is not None else size.src if first else size.dst
    if spec.aggregator != "gcn":
        rows += size.dst  # fc_self
    linear, aggregate = rows * a * b, size.edges * (b if first else a)
    if spec.aggregator == "pool":
        linear += size.src * a * a  # fc_pool, before the max
    elif spec.aggregator == "lstm":
        aggregate = size.edges * 8 * a * a
    return Work(linear, aggregate, size.gathered(b, dst_input=spec.aggregator == "mean"))


register(Architecture(
    "sage", "GraphSAGE (Hamilton et al. 2017) with one of :data:`~betty_trainer.models.sage.AGGREGATORS`",
    GraphSAGE,
    lambda config, graph: GraphSAGE(graph.num_features, config.hidden, graph.num_classes, config.num_layers,
                                    config.aggregator, config.dropout),
    sage_work,
    {"aggregator": (Literal[AGGREGATORS], Field("mean", description="GraphSAGE aggregator"))}))
