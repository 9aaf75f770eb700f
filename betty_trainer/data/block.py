"""The :class:`Block` (message-flow graph) and :class:`Batch` types (docs/design.md › Core types)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from partition import LayerSlice, slice_layers
from partition.slicing import LOCAL_INDEX


class PyGAdj(NamedTuple):
    """One block as PyG's bipartite message passing takes it: the ``(edge_index, e_id, size)`` triple
    that PyG's ``NeighborSampler`` hands a model per layer (input layer first), so a model written for
    it, ``for edge_index, _, size in adjs: x = conv((x, x[: size[1]]), edge_index)``, runs unchanged.

    Args:
        edge_index: ``(2, E)`` int64 ``[src_local; dst_local]``.
        e_id: always ``None`` (a block's edges carry no global edge ids).
        size: ``(num_src, num_dst)``.
    """

    edge_index: Tensor
    e_id: Tensor | None
    size: tuple[int, int]


@dataclass
class BlockTranspose:
    """The CSR of a block's transposed adjacency ``Aᵀ`` (``num_src × num_dst``), kept with the block between steps
    so that the backward of its sparse aggregation gathers instead of scattering (``betty_trainer.models.aggregate``;
    issue 23's kept transpose: which blocks keep one is the planner's choice, ``betty_trainer.memory.planner``).

    Args:
        pointer: ``(num_src + 1,)`` int32: src row ``s``'s edges are ``positions[pointer[s]:pointer[s + 1]]``.
        positions: ``(E,)`` local dst positions, each src row's edges in dst order: int16 for a block of fewer than
            ``2¹⁵`` dst nodes, int32 otherwise (``estimator.counts.kept_transpose_bytes``).
        values: ``(E,)`` float32 the block's edge weights in that order, or ``None`` for an unweighted block.
        source: the block's ``(indptr, indices, edge_weight)`` it was made of: those tensors themselves (no copy),
            so that a block whose structure or weights are other tensors, or were changed in place since, is not
            served a stale transpose (:meth:`serves`).
    """

    pointer: Tensor
    positions: Tensor
    values: Tensor | None
    source: tuple[Tensor, Tensor, Tensor | None] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        self._versions = _versions(self.source)

    def serves(self, block: "Block") -> bool:
        """Whether this is ``block``'s transpose: made of the very tensors ``block`` holds, unchanged since (their
        in-place version counters, ``Tensor._version``, as when it was made)."""
        theirs = (block.indptr, block.indices, block.edge_weight)
        return all(mine is other for mine, other in zip(self.source, theirs)) and _versions(theirs) == self._versions

    def tensors(self) -> list[Tensor]:
        """``pointer``, ``positions`` and, where it has them, ``values``."""
        return [t for t in (self.pointer, self.positions, self.values) if t is not None]


def _versions(tensors: Sequence[Tensor | None]) -> tuple[int | None, ...]:
    """The in-place version counter of each tensor (``None`` for none)."""
    return tuple(None if t is None else t._version for t in tensors)


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
        indices: ``(E,)`` int32 local src positions (:data:`partition.slicing.LOCAL_INDEX`; other integer
            dtypes are converted on construction).
        edge_weight: optional ``(E,)`` float32 per-edge weight (importance weights of GNS/LABOR).

    Attributes:
        transpose: ``Aᵀ``'s CSR where the block keeps it between steps (:class:`BlockTranspose`, set by
            ``betty_trainer.models.aggregate.keep_transposes``; not an argument, so ``dataclasses.replace`` makes a
            block without it), else ``None``; :attr:`kept_transpose` is it where it is still the block's.

    Raises:
        ValueError: ``2³¹`` or more src nodes (the int32 local positions cannot number them).
    """

    src_nodes: Tensor
    num_dst: int
    indptr: Tensor
    indices: Tensor
    edge_weight: Tensor | None = None
    transpose: BlockTranspose | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.src_nodes.numel() >= 2**31:
            raise ValueError(f"a block of {self.src_nodes.numel()} src nodes: at most 2³¹ − 1 fit its int32 indices")
        if self.indices.dtype != LOCAL_INDEX:
            self.indices = self.indices.to(LOCAL_INDEX)

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

    def dst_rows(self, h_src: Tensor) -> Tensor:
        """The dst nodes' rows of ``h_src`` ``(num_src, F)``: its first ``num_dst`` rows (dst-first order), or
        ``h_src`` itself when every src node is a dst node (a full graph), so that autograd makes no
        zero-filled ``(num_src, F)`` gradient for a slice that keeps every row."""
        return h_src if self.num_dst == h_src.shape[0] else h_src[: self.num_dst]

    def in_degrees(self) -> Tensor:
        """``(num_dst,)`` int64 in-degree of each dst node within the block."""
        return self.indptr[1:] - self.indptr[:-1]

    def edge_dst(self) -> Tensor:
        """``(E,)`` int64 local dst position of every edge (CSC expanded)."""
        return torch.repeat_interleave(torch.arange(self.num_dst, device=self.indptr.device), self.in_degrees(),
                                       output_size=self.num_edges)

    def tensors(self) -> list[Tensor]:
        """The block's tensors: ``src_nodes``, ``indptr``, ``indices`` and, where it has them, ``edge_weight`` and
        its kept transpose's (:attr:`kept_transpose`)."""
        kept = [] if self.kept_transpose is None else self.kept_transpose.tensors()
        return [t for t in (self.src_nodes, self.indptr, self.indices, self.edge_weight) if t is not None] + kept

    @property
    def kept_transpose(self) -> BlockTranspose | None:
        """:attr:`transpose` where it is made of this block's own tensors as they are (:meth:`BlockTranspose.serves`),
        else ``None``; a transpose that no longer serves the block is let go here (its bytes, and the old tensors it
        refers to, are not held for nothing)."""
        kept = self.transpose
        if kept is not None and not kept.serves(self):
            self.transpose = kept = None
        return kept

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Block":
        """A copy of the block with every tensor on ``device``; its kept transpose comes along where the tensors
        stay where they are (the CPU kernels read it there; a copy to another device would be host→device bytes
        that nothing reads)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        moved = Block(move(self.src_nodes), self.num_dst, move(self.indptr), move(self.indices), move(self.edge_weight))
        kept = self.kept_transpose
        if kept is not None and kept.serves(moved):
            moved.transpose = kept
        return moved

    def restrict(self, layer: LayerSlice) -> "Block":
        """The sub-block described by ``layer`` (see :func:`partition.slice_layers`)."""
        weight = None if self.edge_weight is None else self.edge_weight[layer.edge_ids]
        return Block(self.src_nodes[layer.src_index], layer.num_dst, layer.indptr, layer.indices, weight)

    @property
    def size(self) -> tuple[int, int]:
        """``(num_src, num_dst)``: the ``size`` argument of a ``torch_geometric.nn`` layer on this block."""
        return self.num_src, self.num_dst

    def edge_index(self) -> Tensor:
        """``(2, E)`` int64 ``[src_local; dst_local]`` (PyG's ``edge_index`` convention), edges in CSC order
        (grouped by dst, as ``indices`` and ``edge_weight``)."""
        return torch.stack([self.indices.long(), self.edge_dst()])

    def pyg_inputs(self, h_src: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor, tuple[int, int]]:
        """The arguments of a ``torch_geometric.nn`` layer's bipartite call on this block:
        ``conv(*block.pyg_inputs(h))`` is ``conv((h, h[:num_dst]), edge_index, size)``.

        The dst nodes are the first ``num_dst`` src nodes (see the class docstring), so ``x_dst`` is a view
        of ``h_src``, not a copy.

        Args:
            h_src: ``(num_src, F)`` src node representations.

        Returns:
            ``((x_src, x_dst), edge_index, size)``: ``(num_src, F)`` and ``(num_dst, F)``, ``(2, E)`` int64,
            ``(num_src, num_dst)``.

        Raises:
            ValueError: if ``h_src`` does not have ``num_src`` rows.
        """
        if h_src.shape[0] != self.num_src:
            raise ValueError(f"h_src has {h_src.shape[0]} rows but the block has {self.num_src} src nodes")
        return (h_src, self.dst_rows(h_src)), self.edge_index(), self.size

    def to_pyg(self) -> PyGAdj:
        """The block as the ``(edge_index, e_id, size)`` triple of PyG's ``NeighborSampler`` (see :class:`PyGAdj`)."""
        return PyGAdj(self.edge_index(), None, self.size)

    def to_dgl(self):
        """Convert to a ``dgl.Block`` (needs the ``dgl`` extra) on the block's device.

        The graph is built from the CSC arrays as they are, so DGL's edge ``e`` is this block's edge ``e``
        (``indices[e]``, ``edge_weight[e]``); global node ids go to ``srcdata``/``dstdata[dgl.NID]`` and
        edge weights, when present, to ``edata["w"]`` (pass them to a layer as ``edge_weight``).

        Returns:
            A ``dgl.Block`` with ``num_src`` src and ``num_dst`` dst nodes and ``E`` edges, int64 ids.

        Raises:
            ImportError: if DGL is not installed.
        """
        import dgl

        edge_ids = torch.arange(self.num_edges, device=self.indices.device)
        block = dgl.create_block(("csc", (self.indptr, self.indices.long(), edge_ids)),
                                 num_src_nodes=self.num_src, num_dst_nodes=self.num_dst)
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
