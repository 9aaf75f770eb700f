"""Message aggregation over a block's in-edges (the gather–scatter every built-in layer uses)."""

from __future__ import annotations

import torch
from torch import Tensor

from betty_trainer.block import Block


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
    messages = h_src[block.indices]
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
