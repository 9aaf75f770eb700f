"""Neighbour sampling into blocks: full neighbourhood or uniform per-layer fanouts (DESIGN.md › NS)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from betty_trainer.block import Batch, Block
from betty_trainer.graph import Graph
from partition.slicing import gather_rows, relabel_dst_first


def sample_batch(
    graph: Graph,
    seeds: Tensor,
    fanouts: Sequence[int | None],
    generator: torch.Generator | None = None,
) -> Batch:
    """Sample the multi-layer batch that computes ``seeds``, output layer first, vectorised.

    Each dst node keeps all its in-edges if its degree is at most the layer's
    fanout, else a uniform sample of ``fanout`` in-edges without replacement
    (GraphSAGE, Hamilton et al. 2017, Alg. 2). Kept edges stay in CSC order.

    Args:
        graph: the graph.
        seeds: ``(B,)`` int64 output node ids (distinct).
        fanouts: one entry per layer, **input layer first** (DGL's convention); ``None``
            or ``-1`` means the full neighbourhood.
        generator: source of randomness; the same generator state gives the same batch.

    Returns:
        A :class:`Batch` of ``len(fanouts)`` blocks, input layer first.

    Raises:
        ValueError: if a fanout is 0 or below -1.
    """
    dst = seeds.long()
    blocks = []
    for fanout in reversed(list(fanouts)):
        if fanout is not None and (fanout == 0 or fanout < -1):
            raise ValueError(f"fanout must be positive, or -1/None for the full neighbourhood; got {fanout}")
        block = sample_block(graph, dst, None if fanout in (None, -1) else fanout, generator)
        blocks.append(block)
        dst = block.src_nodes
    blocks.reverse()
    return Batch(blocks)


def sample_block(graph: Graph, dst: Tensor, fanout: int | None, generator: torch.Generator | None = None) -> Block:
    """Sample one block whose dst nodes are ``dst`` (see :func:`sample_batch`).

    Args:
        graph: the graph.
        dst: ``(n,)`` int64 distinct global ids of the dst nodes.
        fanout: at most this many in-edges per dst node; ``None`` keeps all.
        generator: source of randomness.

    Returns:
        A :class:`Block` with ``src_nodes[:n] == dst``.
    """
    pointer, candidates = gather_rows(graph.indptr, dst)
    degree = pointer[1:] - pointer[:-1]
    if fanout is not None and bool((degree > fanout).any()):
        # The k smallest of i.i.d. uniform keys per dst are k draws without replacement.
        total = candidates.numel()
        segment = torch.repeat_interleave(torch.arange(dst.numel()), degree)
        keys = torch.rand(total, generator=generator, dtype=torch.float64)
        order = torch.argsort(segment.double() + keys)
        rank = torch.arange(total) - pointer[:-1][segment[order]]
        candidates = candidates[torch.sort(order[rank < fanout]).values]
        pointer = torch.zeros_like(pointer)
        torch.cumsum(torch.clamp(degree, max=fanout), 0, out=pointer[1:])

    src_nodes, local = relabel_dst_first(dst, graph.indices[candidates], graph.num_nodes)
    return Block(src_nodes, dst.numel(), pointer, local)
