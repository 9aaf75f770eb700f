"""GAT (Veličković et al., ICLR 2018) on blocks."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block
from betty_trainer.models.aggregate import ATTENTION_CHUNK_ELEMENTS, attention_aggregate, edge_dst_terms, edge_softmax
from betty_trainer.models.registry import Architecture, register
from betty_trainer.models.stack import LayerStack, layer_widths
from estimator.counts import INDEX_BYTES, LayerCounts
from estimator.tape import AGG, GRAD, HID, OVER, StepTape
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

    def memory_terms(self, tape: StepTape, c: LayerCounts, hd: int, hd_grad: bool):
        """What :meth:`forward` allocates (:class:`estimator.tape.StepTape`), returned as
        :meth:`SAGEConv.memory_terms <betty_trainer.models.sage.SAGEConv.memory_terms>` does: z = W h,
        per-edge scores, edge softmax, Σ α z, over E + D edges: the block's (its own self edges
        included, which get no attention) and one self edge per dst node."""
        z, linear_bwd = self.project_terms(tape, c.num_src, hd, hd_grad)
        result, propagate_bwd = self.propagate_terms(tape, c, z)
        tape.r.drop(z)  # forward's own reference (a temporary of propagate(block, project(h))); autograd keeps z

        def backward(grad: int) -> int | None:
            return linear_bwd(propagate_bwd(grad))

        return result, backward

    def project_terms(self, tape: StepTape, rows: int, hd: int, hd_grad: bool):
        """What :meth:`project` allocates on ``rows`` rows: ``(z handle, backward)`` (:meth:`StepTape.linear`)."""
        return tape.linear(hd, rows, self.in_feats, self.heads * self.out_feats, hd_grad, AGG)

    def propagate_terms(self, tape: StepTape, c: LayerCounts, z: int):
        """What :meth:`propagate` allocates from the projected rows ``z`` (a handle the caller holds):
        ``(output handle, backward)``; ``backward(grad)`` returns the handle of ``z``'s gradient."""
        heads, width, concat = self.heads, self.out_feats, self.concat
        r, f = tape.r, tape.f
        s, d, e = c.num_src, c.num_dst, c.num_edges
        e2, hf = e + d, heads * width
        edge_dst = edge_dst_terms(tape, c)
        loops = r.alloc(d * INDEX_BYTES, OVER)
        widened = r.alloc(e * INDEX_BYTES, OVER)  # the int32 src ends as int64, then cat(ends, loops): src, dst
        edge_src2 = r.alloc(e2 * INDEX_BYTES, AGG)
        r.drop(widened)
        edge_dst2 = r.alloc(e2 * INDEX_BYTES, AGG)
        r.drop(edge_dst)
        own = r.alloc(e2, OVER)  # the block's own self edges
        per_head = []  # z @ _per_head(att_src), then z[:D] @ _per_head(att_dst): (H, H·F), then the (rows, H) scores
        per_head.append(r.alloc(heads * hf * f, AGG))
        score_src = r.alloc(s * heads * f, AGG)
        per_head.append(r.alloc(heads * hf * f, AGG))
        score_dst = r.alloc(d * heads * f, AGG)
        r.save(z, z, *per_head)  # both products save z (the dst one a view of it) and their (H·F, H) matrix
        r.drop(*per_head)
        gathered = [r.alloc(e2 * heads * f, AGG) for _ in range(2)]
        scores = r.alloc(e2 * heads * f, AGG)
        r.save(edge_src2, edge_dst2)  # the two IndexSelectBackwards
        r.drop(*gathered)
        activated = r.alloc(e2 * heads * f, AGG)  # leaky_relu saves its input
        r.save(scores)
        r.drop(scores)
        log_weight = None
        if c.weighted:  # + log w: the weights' logs, then the loops' zeros
            converted = r.alloc(e * f, OVER) if f != 4 else None  # float32 weights cast to the scores' dtype
            logs = r.alloc(e * f, OVER)
            r.drop(converted)
            zeros = r.alloc(d * f, OVER)
            log_weight = r.alloc(e2 * f, OVER)
            r.drop(zeros, logs)
            summed = r.alloc(e2 * heads * f, AGG)
            r.drop(activated)
            activated = summed
        r.save(own)  # masked_fill_ in place on the scores; its backward keeps the mask
        peak = r.alloc(d * heads * f, AGG)  # edge_softmax: the per-dst max, then α in place on one tensor
        peak_gathered = r.alloc(e2 * heads * f, AGG)
        alpha = r.alloc(e2 * heads * f, AGG)  # scores − the max, exponentiated in place
        r.drop(peak_gathered)
        total = r.alloc(d * heads * f, AGG)
        r.drop(peak)
        r.transient(e2 * heads * f, AGG)  # the per-dst sums gathered, divided into α in place
        r.drop(total)
        r.save(alpha, edge_dst2)  # the softmax keeps its result and the dst ends
        out = r.alloc(d * hf * f, AGG)  # attention_aggregate: new_zeros, then one chunk's products at a time
        chunk = min(e2, max(1, ATTENTION_CHUNK_ELEMENTS // hf))
        r.transient(chunk * hf * f, AGG)
        r.save(z, edge_src2, edge_dst2)  # it saves z, alpha (the local's reference) and the edge ends
        r.drop(edge_dst2, edge_src2)
        if concat:
            result = r.alloc(d * hf * f, HID)  # + bias
        else:
            averaged = r.alloc(d * width * f, HID)
            result = r.alloc(d * width * f, HID)
            r.drop(averaged)
        r.drop(out, own, loops, score_src, score_dst, activated, log_weight)

        def backward(grad: int) -> int | None:
            tape.param_grad(hf if concat else width)  # bias
            tape.settle()
            if not concat:  # MeanBackward materialises the expanded gradient
                expanded = r.alloc(d * hf * f, GRAD)
                r.drop(grad)
                grad = expanded
            grad_z = r.alloc(s * hf * f, GRAD)  # attention_aggregate's backward: zeros_like(z)
            grad_alpha = r.alloc(e2 * heads * f, GRAD)  # empty_like(alpha), filled chunk by chunk
            grad_messages = r.alloc(chunk * hf * f, GRAD)  # grad.index_select(dst)
            gathered = r.alloc(chunk * hf * f, GRAD)  # z.index_select(src)
            product = r.alloc(chunk * hf * f, GRAD)
            r.drop(gathered)
            r.transient(chunk * heads * f, GRAD)  # .sum(-1), copied into grad_alpha
            r.drop(product, grad_messages, grad, z, alpha, edge_src2, edge_dst2)
            grad_softmax = r.alloc(e2 * heads * f, GRAD)  # edge_softmax's backward: α · ∂L/∂α, then in place
            sums = r.alloc(d * heads * f, GRAD)
            r.transient(e2 * heads * f, GRAD)  # the per-dst sums gathered
            r.drop(sums, grad_alpha, alpha, edge_dst2)
            masked = r.alloc(e2 * heads * f, GRAD)  # MaskedFillBackward: the gradient with the own edges' zeroed
            r.drop(grad_softmax, own)
            grad_scores = r.alloc(e2 * heads * f, GRAD)  # LeakyReluBackward
            r.drop(masked, scores)
            grad_score_dst = r.alloc(d * heads * f, GRAD)
            r.drop(edge_dst2)
            grad_score_src = r.alloc(s * heads * f, GRAD)
            r.drop(grad_scores, edge_src2)
            grad_z_dst = score_backward(d, grad_score_dst, per_head[1])
            if d < s:  # SliceBackward of Block.dst_rows (none when every src node is a dst node)
                sliced = r.alloc(s * hf * f, GRAD)
                r.drop(grad_z_dst)
                grad_z_dst = sliced
            grad_z = tape.accumulate(grad_z, grad_z_dst, first_is_view=True)  # ∂z through z.view(-1, H, F)
            grad_z_src = score_backward(s, grad_score_src, per_head[0])
            return tape.accumulate(grad_z, grad_z_src)  # into the first sum's own result: in place

        def score_backward(rows: int, grad_score: int, matrix: int) -> int:
            """MmBackward of ``z_rows @ _per_head(att)``: ∂(H·F, H) matrix, then ∂z_rows ``(rows, H·F)``; the node
            releases its saved z and matrix and the incoming gradient; BlockDiagBackward sums each head's
            ``(F,)`` piece, UnbindBackward stacks them into ∂att. Returns ∂z_rows."""
            grad_matrix = r.alloc(hf * heads * f, GRAD)
            grad_rows = r.alloc(rows * hf * f, GRAD)
            r.drop(matrix, z, grad_score)
            pieces = [r.alloc(width * f, GRAD) for _ in range(heads)]
            r.drop(grad_matrix)
            tape.param_grad(hf)
            tape.settle()
            r.drop(*pieces)
            return grad_rows

        return result, backward

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
