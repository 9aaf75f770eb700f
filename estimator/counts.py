"""What the estimator needs to know about a micro-batch: node and edge counts per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

INDEX_BYTES = 8  # int64 node ids and CSC pointers


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


def counts_of(structures: Sequence[Any]) -> list[LayerCounts]:
    """:class:`LayerCounts` of each block or layer slice (anything with ``indptr`` and ``num_src``)."""
    return [LayerCounts.from_csc(s.indptr, s.num_src) for s in structures]


def block_structure_bytes(layers: Sequence[LayerCounts]) -> int:
    """Bytes of the blocks' int64 src ids, CSC pointers and indices: ``8·Σ_l (S_l + D_l + 1 + E_l)``."""
    return sum((c.num_src + c.num_dst + 1 + c.num_edges) * INDEX_BYTES for c in layers)
