"""The :class:`Graph` type: CSC in-edges, node features, labels and splits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from betty_trainer.errors import DatasetError


@dataclass
class Graph:
    """A node-classification graph stored as CSC in-edges (see DESIGN.md › Core types).

    The in-neighbours of node ``v`` are ``indices[indptr[v]:indptr[v + 1]]``.
    Edges are unique (no duplicates) and sorted by source within each node.
    ``indices`` is stored as int32 when ``N < 2³¹`` (half the bytes of the largest
    array); node ids handed out by samplers and blocks stay int64.

    Args:
        indptr: ``(N + 1,)`` int64, CSC row pointer over destination nodes.
        indices: ``(E,)`` int32 or int64, source node of each in-edge (converted to
            int32 when ``N < 2³¹``).
        x: ``(N, F)`` float32 (or float16) node features.
        y: ``(N,)`` int64 class labels in ``[0, num_classes)``.
        train_idx, val_idx, test_idx: int64 node ids of each split.
        num_classes: number of classes ``C``.
        name: dataset name, for logs.

    Raises:
        DatasetError: if shapes or dtypes are inconsistent.
    """

    indptr: Tensor
    indices: Tensor
    x: Tensor
    y: Tensor
    train_idx: Tensor
    val_idx: Tensor
    test_idx: Tensor
    num_classes: int
    name: str = "graph"

    def __post_init__(self) -> None:
        n = self.indptr.numel() - 1
        problems = []
        if self.indptr.dtype != torch.int64 or self.indices.dtype not in (torch.int32, torch.int64):
            problems.append("indptr must be int64 and indices int32 or int64")
        if n < 0 or int(self.indptr[-1]) != self.indices.numel():
            problems.append(f"indptr ends at {int(self.indptr[-1]) if n >= 0 else '?'} but there are {self.indices.numel()} edges")
        if self.x.dim() != 2 or self.x.shape[0] != n:
            problems.append(f"x has shape {tuple(self.x.shape)}, expected ({n}, F)")
        if self.y.shape != (n,):
            problems.append(f"y has shape {tuple(self.y.shape)}, expected ({n},)")
        if self.indices.numel() and (int(self.indices.min()) < 0 or int(self.indices.max()) >= n):
            problems.append("edge endpoints out of range")
        for split in ("train_idx", "val_idx", "test_idx"):
            idx = getattr(self, split)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                problems.append(f"{split} holds node ids outside [0, {n})")
        if problems:
            raise DatasetError(f"invalid graph {self.name!r}: " + "; ".join(problems))
        if self.indices.dtype == torch.int64 and n < 2**31:
            self.indices = self.indices.to(torch.int32)

    @classmethod
    def from_edges(
        cls,
        src: Tensor,
        dst: Tensor,
        num_nodes: int,
        *,
        symmetric: bool = True,
        drop_self_loops: bool = True,
        **fields,
    ) -> Graph:
        """Build a graph from an edge list, deduplicating and sorting edges.

        Args:
            src, dst: ``(E,)`` integer tensors, edge ``src[i] -> dst[i]``.
            num_nodes: ``N``.
            symmetric: also add every reverse edge (undirected graph).
            drop_self_loops: remove ``v -> v`` edges.
            **fields: ``x``, ``y``, split indices, ``num_classes``, ``name``.
        """
        src, dst = src.long(), dst.long()
        if symmetric:
            src, dst = torch.cat([src, dst]), torch.cat([dst, src])
        if drop_self_loops:
            keep = src != dst
            src, dst = src[keep], dst[keep]
        key = torch.unique(dst * num_nodes + src)  # sorted by dst, then src; duplicates gone
        dst, src = key // num_nodes, key % num_nodes
        indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
        return cls(indptr=indptr, indices=src, **fields)

    @property
    def num_nodes(self) -> int:
        return self.indptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def num_features(self) -> int:
        return self.x.shape[1]

    def in_degrees(self) -> Tensor:
        """``(N,)`` int64 in-degree of every node."""
        return self.indptr[1:] - self.indptr[:-1]

    def __repr__(self) -> str:
        return (
            f"Graph({self.name!r}, nodes={self.num_nodes}, edges={self.num_edges}, "
            f"features={self.num_features}, classes={self.num_classes}, "
            f"train/val/test={self.train_idx.numel()}/{self.val_idx.numel()}/{self.test_idx.numel()})"
        )
