"""What the estimator needs to know about a micro-batch: node and edge counts per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LayerCounts:
    """Sizes of one block (Betty Table 3: N, E, and the in-degree buckets L_i, B_i of Eq. 5).

    Attributes:
        num_src: src nodes (the dst nodes included).
        num_dst: dst nodes.
        num_edges: edges E.
        degree_histogram: ``((L, B), …)``: ``B`` dst nodes have in-degree ``L`` (L ≥ 1),
            ascending in ``L``.
    """

    num_src: int
    num_dst: int
    num_edges: int
    degree_histogram: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_csc(cls, indptr: Tensor, num_src: int) -> "LayerCounts":
        """Counts of a block from its ``(num_dst + 1,)`` int64 CSC pointer and src count."""
        degrees = indptr[1:] - indptr[:-1]
        values, counts = torch.unique(degrees[degrees > 0], return_counts=True)
        return cls(num_src, indptr.numel() - 1, int(indptr[-1]), tuple(zip(values.tolist(), counts.tolist())))
