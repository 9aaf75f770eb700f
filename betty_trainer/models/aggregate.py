"""Message aggregation over a block's in-edges (the gather–scatter every built-in layer uses):
sum, mean, max, LSTM over in-degree groups, and edge softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from betty_trainer.block import Block
from betty_trainer.models.lstm import LSTM


def sum_neighbours(block: Block, h_src: Tensor, edge_weight: Tensor | None = None) -> Tensor:
    """Sum of (optionally weighted) src features over each dst node's in-edges.

    Edges are added in CSC order, so a micro-batch (whose blocks keep the full
    batch's per-dst edge order) produces bit-identical sums for its dst nodes.

    Args:
        block: the block.
        h_src: ``(num_src, F)`` src features.
        edge_weight: optional ``(E,)`` per-edge multiplier.

    Returns:
        ``(num_dst, F)``, dtype of ``h_src``.
    """
    messages = h_src.index_select(0, block.indices)
    if edge_weight is not None:
        messages = messages * edge_weight.unsqueeze(1).to(messages.dtype)
    out = torch.zeros(block.num_dst, h_src.shape[1], dtype=h_src.dtype, device=h_src.device)
    return out.index_add_(0, block.edge_dst(), messages)


def mean_neighbours(block: Block, h_src: Tensor) -> Tensor:
    """Mean of src features over each dst node's in-edges; weighted by ``block.edge_weight``
    (normalised by the weight sum) when the block has weights. Isolated dst nodes get zeros.

    Shapes:
        ``(num_src, F)`` → ``(num_dst, F)``.
    """
    if block.edge_weight is None:
        norm = block.in_degrees()
    else:
        norm = torch.zeros(block.num_dst, dtype=h_src.dtype, device=h_src.device)
        norm.index_add_(0, block.edge_dst(), block.edge_weight.to(h_src.dtype))
    total = sum_neighbours(block, h_src, block.edge_weight)
    norm = torch.where(norm > 0, norm, torch.ones_like(norm)).to(h_src.dtype)
    return total / norm.unsqueeze(1)


def max_neighbours(block: Block, h_src: Tensor) -> Tensor:
    """Element-wise max of src features over each dst node's in-edges (a vectorised segment max).

    Isolated dst nodes get zeros. Edge weights are not used. Where several edges
    tie for a maximum, the gradient is shared equally among them (``scatter_reduce``'s rule).

    Shapes:
        ``(num_src, F)`` → ``(num_dst, F)``.
    """
    messages = h_src.index_select(0, block.indices)
    index = block.edge_dst().unsqueeze(1).expand_as(messages)
    out = torch.zeros(block.num_dst, h_src.shape[1], dtype=h_src.dtype, device=h_src.device)
    return out.scatter_reduce_(0, index, messages, "amax", include_self=False)


def in_degree_groups(block: Block) -> list[tuple[int, Tensor]]:
    """The dst nodes grouped by in-degree: ``(L_i, dst positions with in-degree L_i)``, ``L_i`` ascending.

    These are the ``(L_i, B_i)`` buckets of Betty §4.4.3, Eq. 5 (an LSTM aggregator
    runs once per bucket on a dense ``(B_i, L_i, F)`` tensor). Degree-0 nodes form
    a group too when present.

    Returns:
        One ``(length, dst)`` pair per distinct in-degree; ``dst`` is ``(B_i,)`` int64, ascending.
    """
    degrees = block.in_degrees()
    order = torch.argsort(degrees, stable=True)
    lengths, counts = torch.unique_consecutive(degrees[order], return_counts=True)
    return list(zip(lengths.tolist(), order.split(counts.tolist())))


def lstm_neighbours(block: Block, h_src: Tensor, lstm: LSTM) -> Tensor:
    """Final hidden state of ``lstm`` run over each dst node's in-neighbour features in CSC edge order.

    Dst nodes are grouped by in-degree (:func:`in_degree_groups`) so the LSTM runs
    once per distinct degree on a dense ``(B_i, L_i, F)`` batch (Betty §4.4.3, Eq. 5;
    DGL's degree bucketing). Isolated dst nodes get zeros. Edge weights are not used.

    Args:
        block: the block.
        h_src: ``(num_src, F)`` src features.
        lstm: an :class:`~betty_trainer.models.lstm.LSTM` with input size ``F``.

    Returns:
        ``(num_dst, lstm.hidden_size)``, the final hidden state per dst node.
    """
    out = torch.zeros(block.num_dst, lstm.hidden_size, dtype=h_src.dtype, device=h_src.device)
    rows, finals = [], []
    for length, dst in in_degree_groups(block):
        if length == 0:
            continue
        edges = block.indptr[dst].unsqueeze(1) + torch.arange(length, device=dst.device)
        sequences = h_src.index_select(0, block.indices[edges].flatten()).view(len(dst), length, -1)
        rows.append(dst)
        finals.append(lstm(sequences.unbind(1)))
    if not rows:
        return out
    return out.index_copy_(0, torch.cat(rows), torch.cat(finals))


def edge_softmax(scores: Tensor, edge_dst: Tensor, num_dst: int) -> Tensor:
    """Softmax of edge scores over each dst node's in-edges (vectorised).

    Subtracts the per-dst max (treated as a constant, so the gradient is the
    softmax's own), exponentiates, and divides by the per-dst sum.

    Args:
        scores: ``(E, H)`` scores, one column per attention head.
        edge_dst: ``(E,)`` int64 dst position of every edge.
        num_dst: number of dst nodes.

    Returns:
        ``(E, H)`` weights; those of one dst node sum to 1 in every column.
    """
    index = edge_dst.unsqueeze(1).expand_as(scores)
    peak = torch.zeros(num_dst, scores.shape[1], dtype=scores.dtype, device=scores.device)
    peak.scatter_reduce_(0, index, scores.detach(), "amax", include_self=False)
    weights = torch.exp(scores - peak.index_select(0, edge_dst))
    total = torch.zeros_like(peak).index_add_(0, edge_dst, weights)
    return weights / total.index_select(0, edge_dst)
