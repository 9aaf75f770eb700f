"""The :class:`Block` (message-flow graph) and :class:`Batch` types (DESIGN.md › Core types)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import Tensor

from partition import LayerSlice, slice_layers


@dataclass
class Block:
    """One bipartite layer of a batch (a message-flow graph, as DGL calls it).

    Follows the DGL convention: the first ``num_dst`` src nodes are the dst
    nodes. The in-edges of local dst ``d`` are ``indices[indptr[d]:indptr[d + 1]]``
    (local src positions).

    Args:
        src_nodes: ``(num_src,)`` int64 global node ids; ``src_nodes[:num_dst]`` are the dst nodes.
        num_dst: number of dst nodes.
        indptr: ``(num_dst + 1,)`` int64 local CSC pointer.
        indices: ``(E,)`` int64 local src positions.
        edge_weight: optional ``(E,)`` float32 per-edge weight (importance weights of GNS/LABOR).
    """

    src_nodes: Tensor
    num_dst: int
    indptr: Tensor
    indices: Tensor
    edge_weight: Tensor | None = None

    @property
    def num_src(self) -> int:
        return self.src_nodes.numel()

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def dst_nodes(self) -> Tensor:
        """``(num_dst,)`` int64 global ids of the dst nodes."""
        return self.src_nodes[: self.num_dst]

    def in_degrees(self) -> Tensor:
        """``(num_dst,)`` int64 in-degree of each dst node within the block."""
        return self.indptr[1:] - self.indptr[:-1]

    def edge_dst(self) -> Tensor:
        """``(E,)`` int64 local dst position of every edge (CSC expanded)."""
        return torch.repeat_interleave(torch.arange(self.num_dst, device=self.indptr.device), self.in_degrees())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Block":
        """A copy of the block with every tensor on ``device``."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Block(move(self.src_nodes), self.num_dst, move(self.indptr), move(self.indices), move(self.edge_weight))

    def restrict(self, layer: LayerSlice) -> "Block":
        """The sub-block described by ``layer`` (see :func:`partition.slice_layers`)."""
        weight = None if self.edge_weight is None else self.edge_weight[layer.edge_ids]
        return Block(self.src_nodes[layer.src_index], layer.num_dst, layer.indptr, layer.indices, weight)

    def edge_index(self) -> Tensor:
        """``(2, E)`` int64 ``[src_local; dst_local]`` (PyG's ``edge_index`` convention)."""
        return torch.stack([self.indices, self.edge_dst()])

    def to_dgl(self):
        """Convert to a ``dgl.Block`` (needs the ``dgl`` extra); global ids go to ``ndata[dgl.NID]``.

        Raises:
            ImportError: if DGL is not installed.
        """
        import dgl

        block = dgl.create_block(
            (self.indices, self.edge_dst()), num_src_nodes=self.num_src, num_dst_nodes=self.num_dst
        )
        block.srcdata[dgl.NID] = self.src_nodes
        block.dstdata[dgl.NID] = self.dst_nodes
        if self.edge_weight is not None:
            block.edata["w"] = self.edge_weight
        return block

    def __repr__(self) -> str:
        return f"Block(num_src={self.num_src}, num_dst={self.num_dst}, num_edges={self.num_edges})"


@dataclass
class Batch:
    """A full batch, mini-batch or micro-batch: ``L`` blocks ordered input layer → output layer.

    Args:
        blocks: the blocks; ``blocks[l].num_dst == blocks[l + 1].num_src``.
    """

    blocks: list[Block]

    @property
    def input_nodes(self) -> Tensor:
        """``(N_in,)`` int64 global ids whose features the batch reads."""
        return self.blocks[0].src_nodes

    @property
    def output_nodes(self) -> Tensor:
        """``(N_out,)`` int64 global ids of the seed/output nodes."""
        return self.blocks[-1].dst_nodes

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return replace(self, blocks=[b.to(device, non_blocking) for b in self.blocks])

    def micro_batch(self, output_index: Tensor) -> "Batch":
        """The micro-batch computing the outputs at positions ``output_index`` (Betty §4.2.3).

        Args:
            output_index: ``(m,)`` int64 positions among ``output_nodes``.
        """
        return self.restrict(slice_layers(self.blocks, output_index))

    def restrict(self, layers: Sequence[LayerSlice]) -> "Batch":
        """The sub-batch described by one :class:`LayerSlice` per block (see :func:`partition.slice_layers`)."""
        return Batch([block.restrict(layer) for block, layer in zip(self.blocks, layers)])

    def split(self, groups: Sequence[Tensor]) -> list["Batch"]:
        """One micro-batch per group of output positions."""
        return [self.micro_batch(group) for group in groups]

    def __repr__(self) -> str:
        sizes = " → ".join(str(b.num_src) for b in self.blocks) + f" → {self.blocks[-1].num_dst}"
        return f"Batch(layers={self.num_layers}, nodes per layer: {sizes})"
