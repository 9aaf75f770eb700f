"""Redundancy of a batch partition (Betty §4.3.1, Fig. 16)."""

from __future__ import annotations

from collections.abc import Sequence

from partition.slicing import BlockStructure


def redundancy(full_batch: Sequence[BlockStructure], micro_batches: Sequence[Sequence[BlockStructure]]) -> list[float]:
    """Per-layer redundancy ``Σ_k |src nodes of layer l in micro-batch k| / |src nodes of layer l|``.

    ``1.0`` means no node is repeated across micro-batches; layer 0 is the input-node
    redundancy (how many times over input features are gathered).

    Args:
        full_batch: the full batch's blocks, input layer first.
        micro_batches: each micro-batch's blocks, input layer first.

    Returns:
        ``L`` floats, input layer first.
    """
    return [
        sum(mb[layer].num_src for mb in micro_batches) / max(block.num_src, 1)
        for layer, block in enumerate(full_batch)
    ]
