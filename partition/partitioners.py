"""Partitioners that split a batch's output nodes into K micro-batches (Betty §4.3, Fig. 16 baselines).

Every partitioner has the signature ``(output_block, k, seed, vertex_weights) ->
(num_dst,) int64 part ids``; :data:`PARTITIONERS` maps names to them. ``vertex_weights``
(``(num_dst,)`` positive int64 or ``None``) is what METIS balances; range and random
balance output counts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from partition.metis import metis_kway
from partition.reg import build_reg, output_adjacency
from partition.slicing import BlockStructure

Partitioner = Callable[[BlockStructure, int, int, "np.ndarray | None"], np.ndarray]


def range_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """Contiguous ranges of the outputs in batch order (Betty's "range" baseline)."""
    return (np.arange(block.num_dst) * k) // max(block.num_dst, 1)


def random_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """A uniformly random balanced assignment, deterministic from ``seed`` ("random" baseline)."""
    generator = torch.Generator().manual_seed(seed)
    parts = np.empty(block.num_dst, dtype=np.int64)
    parts[torch.randperm(block.num_dst, generator=generator).numpy()] = range_partition(block, k, seed)
    return parts


def induced_metis_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the graph the output block's edges induce on the outputs ("metis" baseline).

    With full neighbourhoods this is the original graph induced on the outputs.
    """
    at = output_adjacency(block)[:, : block.num_dst]
    induced = ((at + at.T) > 0).astype(np.int64).tocsr()
    induced.setdiag(0)
    induced.eliminate_zeros()
    return metis_kway(induced, k, seed, vertex_weights)


def reg_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the weighted REG (Betty Algorithm 1, with the shared-neighbour counts as edge weights)."""
    return metis_kway(build_reg(block, weighted=True), k, seed, vertex_weights)


def unweighted_reg_partition(block: BlockStructure, k: int, seed: int, vertex_weights: np.ndarray | None = None) -> np.ndarray:
    """METIS on the REG with all weights 1 (what the paper's artifact ran; for comparison)."""
    return metis_kway(build_reg(block, weighted=False), k, seed, vertex_weights)


PARTITIONERS: dict[str, Partitioner] = {
    "reg": reg_partition,
    "reg_unweighted": unweighted_reg_partition,
    "metis": induced_metis_partition,
    "range": range_partition,
    "random": random_partition,
}


def partition_outputs(output_block: BlockStructure, k: int, method: str = "reg", seed: int = 0,
                      vertex_weights: np.ndarray | None = None) -> list[Tensor]:
    """Split the output nodes of a batch into ``k`` groups.

    Args:
        output_block: the batch's last block.
        k: number of micro-batches, ``1 ≤ k ≤ num_dst``.
        method: a key of :data:`PARTITIONERS`.
        seed: seed of the partitioner's randomness.
        vertex_weights: optional ``(num_dst,)`` positive int64 costs METIS balances.

    Returns:
        Non-empty, sorted ``int64`` tensors of output positions, disjoint and covering
        ``range(num_dst)``; fewer than ``k`` only if METIS leaves a part empty.

    Raises:
        ValueError: for an unknown method or ``k`` out of range.
    """
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {method!r}; choose one of {sorted(PARTITIONERS)}")
    n = output_block.num_dst
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} output nodes into {k} micro-batches")
    parts = torch.from_numpy(np.ascontiguousarray(PARTITIONERS[method](output_block, k, seed, vertex_weights)))
    order = torch.argsort(parts, stable=True)
    counts = torch.bincount(parts, minlength=k)
    return [group for group in torch.split(order, counts.tolist()) if group.numel()]
