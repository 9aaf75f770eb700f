"""The :class:`Graph` type: CSC in-edges, node features, labels and splits."""

from __future__ import annotations

import functools
from dataclasses import InitVar, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from betty_trainer.errors import DatasetError


@runtime_checkable
class DGLGraphLike(Protocol):
    """What :meth:`Graph.from_dgl` reads of a ``dgl.DGLGraph`` (without importing DGL): node data, edges and
    the node count."""

    ndata: Any

    def edges(self, *args, **kwargs) -> Any: ...

    def num_nodes(self, *args, **kwargs) -> int: ...

@dataclass
class Graph:
    """A node-classification graph stored as CSC in-edges (see docs/design.md › Core types).

    The in-neighbours of node ``v`` are ``indices[indptr[v]:indptr[v + 1]]``.
    Edges are unique (no duplicates) and sorted by source within each node.
    ``indices`` is stored as int32 when ``N < 2³¹`` (half the bytes of the largest
    array); node ids handed out by samplers and blocks stay int64.

    Args:
        indptr: ``(N + 1,)`` int64, CSC row pointer over destination nodes.
        indices: ``(E,)`` int32 or int64, source node of each in-edge (converted to
            int32 when ``N < 2³¹``).
        x: ``(N, F)`` float32 (or float16) node features, all finite.
        y: ``(N,)`` int64 class labels in ``[0, num_classes)``, or -1 for an unlabelled node (in no split).
        train_idx, val_idx, test_idx: int64 node ids of each split, in ``[0, N)``, each id in at most one
            split and once.
        num_classes: number of classes ``C``; default (``None``) ``max(y) + 1``.
        name: dataset name, for logs.
        check_features: scan ``x`` for NaN and infinity (a cached graph, checked when it was converted, skips
            the scan so that mapping it stays cheap).

    Tensors may be given as numpy arrays (or lists): unsigned ids and labels become int64, float64, integer or
    boolean features float32.

    Raises:
        DatasetError: shapes or dtypes are inconsistent, ``indptr`` does not start at 0 or decreases, a label
            or split id is out of range, a node is in two
            splits or twice in one, or a feature is NaN or infinite (the message names the first row and column).
    """

    indptr: Tensor
    indices: Tensor
    x: Tensor
    y: Tensor
    train_idx: Tensor
    val_idx: Tensor
    test_idx: Tensor
    num_classes: int | None = None
    name: str = "graph"
    check_features: InitVar[bool] = True

    def __post_init__(self, check_features: bool = True) -> None:
        for name in ("indptr", "indices", "x", "y", "train_idx", "val_idx", "test_idx"):
            if not isinstance(getattr(self, name), Tensor):
                setattr(self, name, _as_tensor(name, getattr(self, name)))
        n = self.indptr.numel() - 1
        if self.num_classes is None:
            self.num_classes = int(self.y.max()) + 1 if self.y.numel() else 0
        problems = []
        if self.indptr.dtype != torch.int64 or self.indices.dtype not in (torch.int32, torch.int64):
            problems.append("indptr must be int64 and indices int32 or int64")
        problems += _pointer_problems(self.indptr, self.indices.numel())
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
        if not problems:
            problems = _label_and_split_problems(self)
        if not problems and check_features:
            problems = _non_finite_feature(self.x)
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

        The public "graph from arrays" entry point; :func:`csc_from_edges` does the work in
        numpy (one int64 key per edge, sorted in place), so a 50M-edge list needs about
        1.2 GB beyond itself.

        Args:
            src, dst: ``(E,)`` integer tensors or numpy arrays, edge ``src[i] -> dst[i]``.
            num_nodes: ``N``.
            symmetric: also add every reverse edge (undirected graph).
            drop_self_loops: remove ``v -> v`` edges.
            **fields: ``x``, ``y``, split indices, ``num_classes``, ``name``.

        Raises:
            DatasetError: an endpoint outside ``[0, N)``, or fields inconsistent with the graph.
        """
        indptr, indices = csc_from_edges(_as_numpy(src), _as_numpy(dst), num_nodes,
                                         symmetric=symmetric, drop_self_loops=drop_self_loops)
        return cls(indptr=torch.from_numpy(indptr), indices=torch.from_numpy(indices), **fields)

    @classmethod
    def from_scipy(cls, adjacency, *, symmetric: bool = False, drop_self_loops: bool = True, **fields) -> Graph:
        """Build a graph from a sparse adjacency matrix whose entry ``(i, j) ≠ 0`` is an edge ``i → j``.

        The CSC form of ``adjacency`` is already the in-edge layout (column ``j`` lists the
        sources of ``j``'s in-edges); explicit zeros are dropped, values are otherwise ignored
        (the graph is unweighted), duplicate entries become one edge.

        Args:
            adjacency: ``(N, N)`` ``scipy.sparse`` matrix or array, any format.
            symmetric: also add every reverse edge (``A + Aᵀ``).
            drop_self_loops: remove the diagonal.
            **fields: ``x`` ``(N, F)``, ``y`` ``(N,)``, split indices, ``num_classes``, ``name``.

        Returns:
            A :class:`Graph` with ``N = adjacency.shape[0]``.

        Raises:
            DatasetError: ``adjacency`` is not square, or the fields are inconsistent with it.
        """
        import scipy.sparse as sp

        if not sp.issparse(adjacency) or adjacency.shape[0] != adjacency.shape[1]:
            raise DatasetError(f"from_scipy needs a square scipy.sparse adjacency, got "
                               f"{type(adjacency).__name__} of shape {getattr(adjacency, 'shape', '?')}")
        coo = sp.coo_matrix(adjacency)
        keep = coo.data != 0
        return cls.from_edges(torch.from_numpy(coo.row[keep].astype(np.int64)),
                              torch.from_numpy(coo.col[keep].astype(np.int64)), adjacency.shape[0],
                              symmetric=symmetric, drop_self_loops=drop_self_loops, **fields)

    @classmethod
    def from_dgl(
        cls,
        g,
        *,
        feat: str = "feat",
        label: str = "label",
        masks: tuple[str, str, str] = ("train_mask", "val_mask", "test_mask"),
        num_classes: int | None = None,
        symmetric: bool = False,
        drop_self_loops: bool = True,
        name: str = "dgl",
    ) -> Graph:
        """Build a graph from a homogeneous ``dgl.DGLGraph`` laid out as DGL's node-classification datasets are
        (``CoraGraphDataset()[0]``, ``AsNodePredDataset``): features, labels and split masks in ``g.ndata``.

        DGL is not imported: ``g`` is read through its ``num_nodes()``, ``edges()``, ``is_homogeneous`` and
        ``ndata``. Its edges are kept as they are (a DGL dataset graph already holds both directions),
        except that duplicate edges become one, as :class:`Graph` requires, and self-loops are dropped as
        every loader drops them (GAT and SAGE add a node's own row themselves; the memory estimate assumes
        blocks without them).

        Args:
            g: the graph, on any device (tensors are copied to the CPU).
            feat, label: ``g.ndata`` keys of the ``(N, F)`` float features and ``(N,)`` integer labels.
            masks: ``g.ndata`` keys of the ``(N,)`` boolean train / validation / test masks; a missing one
                gives an empty split.
            num_classes: ``C``; default ``max(label) + 1``.
            symmetric: also add every reverse edge. Default ``False``.
            drop_self_loops: remove ``v → v`` edges. Default ``True``; ``False`` keeps them.
            name: dataset name, for logs.

        Returns:
            A :class:`Graph` with DGL's node ids; ``x`` is float32 unless it is float16.

        Raises:
            DatasetError: ``g`` is not a homogeneous DGL graph, or lacks ``feat`` or ``label``.
        """
        if not isinstance(g, DGLGraphLike):
            raise DatasetError(f"from_dgl needs a dgl.DGLGraph, got {type(g).__name__}")
        if not getattr(g, "is_homogeneous", True):
            raise DatasetError(f"from_dgl needs a homogeneous graph, got node types {g.ntypes} and edge types "
                               f"{g.etypes}; convert it with dgl.to_homogeneous or pick one type")
        data = {key: value for key, value in g.ndata.items()}
        missing = [key for key in (feat, label) if key not in data]
        if missing:
            raise DatasetError(f"the DGL graph has no ndata[{missing[0]!r}] (it has {sorted(data)}); name the "
                               "features and labels with feat=... and label=...")
        n = g.num_nodes()
        x = data[feat].detach().cpu()
        y = data[label].detach().cpu().long()
        splits = [torch.nonzero(data[key].detach().cpu().bool()).view(-1) if key in data
                  else torch.empty(0, dtype=torch.int64) for key in masks]
        src, dst = g.edges()
        return cls.from_edges(src, dst, n, symmetric=symmetric, drop_self_loops=drop_self_loops,
                              x=x if x.dtype == torch.float16 else x.float(), y=y, train_idx=splits[0],
                              val_idx=splits[1], test_idx=splits[2],
                              num_classes=int(y.max()) + 1 if num_classes is None else num_classes, name=name)

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

    @functools.cached_property
    def max_in_degree(self) -> int:
        """The largest in-degree (0 without nodes), computed once per graph (one pass over ``indptr``)."""
        return int(self.in_degrees().max()) if self.num_nodes else 0

    def out_degrees(self) -> Tensor:
        """``(N,)`` int64 out-degree of every node: the in-neighbour lists that hold it, so how many dst
        nodes can sample it as a neighbour (its degree on an undirected graph). What predicts how often a
        node's features are read, and GNS's ``deg(v)`` (Eq. 6)."""
        return torch.bincount(self.indices.long(), minlength=self.num_nodes)

    def __repr__(self) -> str:
        return (
            f"Graph({self.name!r}, nodes={self.num_nodes}, edges={self.num_edges}, "
            f"features={self.num_features}, classes={self.num_classes}, "
            f"train/val/test={self.train_idx.numel()}/{self.val_idx.numel()}/{self.test_idx.numel()})"
        )


_SPLITS = ("train_idx", "val_idx", "test_idx")


def _label_and_split_problems(graph: Graph) -> list[str]:
    """What is wrong with ``graph``'s labels and splits (shapes already agree): labels outside ``[-1, C)``, a
    split node unlabelled, a split not 1-D integer, a node in two splits or twice in one."""
    y, c = graph.y, graph.num_classes
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        return [f"y has dtype {y.dtype}, expected integer class labels"]
    for split in _SPLITS:
        idx = getattr(graph, split)
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            return [f"{split} must be a 1-D integer tensor of node ids, got {idx.dtype} of shape {tuple(idx.shape)}"]
    if y.numel() and (int(y.min()) < -1 or int(y.max()) >= c):
        bad = int(torch.nonzero((y < -1) | (y >= c))[0])
        return [f"node {bad} has label {int(y[bad])}, outside [0, num_classes={c}) (-1 marks an unlabelled node); "
                "pass num_classes=max(y)+1 or leave it out to infer it"]
    splits = [(split, getattr(graph, split).long()) for split in _SPLITS]
    for split, idx in splits:
        unlabelled = idx[y[idx] < 0] if idx.numel() else idx
        if unlabelled.numel():
            return [f"{split} holds node {int(unlabelled[0])}, which has no label (-1)"]
    owner = torch.cat([torch.full((idx.numel(),), i) for i, (_, idx) in enumerate(splits)])
    ids = torch.cat([idx for _, idx in splits])
    order = torch.argsort(ids, stable=True)
    ids, owner = ids[order], owner[order]
    repeated = torch.nonzero(ids[1:] == ids[:-1]).view(-1)
    if repeated.numel():
        i = int(repeated[0])
        first, second = _SPLITS[int(owner[i])], _SPLITS[int(owner[i + 1])]
        where = f"twice in {first}" if first == second else f"in both {first} and {second}"
        return [f"node {int(ids[i])} is {where}; splits must be disjoint and without repeats"]
    return []


def _pointer_problems(indptr: Tensor, num_edges: int) -> list[str]:
    """What is wrong with a CSC pointer over ``num_edges`` edges: it must start at 0, never decrease (a negative
    in-degree) and end at ``num_edges``."""
    if indptr.numel() == 0 or int(indptr[-1]) != num_edges:
        return [f"indptr ends at {int(indptr[-1]) if indptr.numel() else '?'} but there are {num_edges} edges"]
    if int(indptr[0]) != 0:
        return ["indptr must start at 0"]
    decreasing = torch.nonzero(indptr[1:] < indptr[:-1])
    if decreasing.numel():
        node = int(decreasing[0])
        return [f"indptr decreases at node {node} (in-degree {int(indptr[node + 1] - indptr[node])})"]
    return []


def _non_finite_feature(x: Tensor, rows: int = 1 << 16) -> list[str]:
    """The first NaN or infinite entry of ``x`` (scanned ``rows`` rows at a time), as a problem; ``[]`` if none."""
    for start in range(0, x.shape[0], rows):
        bad = torch.nonzero(~torch.isfinite(x[start:start + rows]))
        if bad.numel():
            row, column = int(bad[0, 0]) + start, int(bad[0, 1])
            return [f"feature x[{row}, {column}] is {float(x[row, column])}; replace non-finite features "
                    "(e.g. torch.nan_to_num) before training"]
    return []


def _as_tensor(name: str, value) -> Tensor:
    """A :class:`Graph` field given as a numpy array (or a list) as a tensor: a copy only where torch needs one
    (negative strides) or the dtype changes (unsigned ids and labels become int64; float64, integer or boolean
    features float32).

    Raises:
        DatasetError: ``value`` is not an array of numbers (named by ``name``).
    """
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise DatasetError(f"{name} must be a tensor or numpy array, got {type(value).__name__} ({error})") from None
    if array.dtype.kind not in "biuf":
        raise DatasetError(f"{name} must be a tensor or numpy array of numbers, got {type(value).__name__} of dtype "
                           f"{array.dtype}")
    if name == "x" and array.dtype not in (np.float16, np.float32):
        array = array.astype(np.float32)
    elif array.dtype.kind == "u":
        array = array.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(array))


def _as_numpy(ids) -> np.ndarray:
    if isinstance(ids, Tensor):
        return ids.detach().cpu().numpy()
    return np.asarray(ids)


def csc_from_edges(src: np.ndarray, dst: np.ndarray, num_nodes: int, *, symmetric: bool = False,
                   drop_self_loops: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """CSC in-edge arrays of an edge list, deduplicated and sorted by (destination, source).

    One int64 key ``dst · N + src`` per edge is sorted in place and deduplicated; apart
    from the inputs, the peak is about three arrays of ``E`` int64 (the keys, the
    destinations recovered from them, and the ``indices`` output), so a 50M-edge graph
    needs about 1.2 GB on top of its edge list.

    Args:
        src, dst: ``(E,)`` integer arrays, edge ``src[i] → dst[i]``, ids in ``[0, num_nodes)``.
        num_nodes: ``N``.
        symmetric: also add every reverse edge (an undirected graph).
        drop_self_loops: remove ``v → v`` edges.

    Returns:
        ``(indptr, indices)``: ``(N + 1,)`` int64 and ``(E',)`` int32 when ``N < 2³¹`` (else
        int64), the in-neighbours of ``v`` being ``indices[indptr[v]:indptr[v + 1]]``.

    Raises:
        DatasetError: an endpoint lies outside ``[0, N)`` or the lengths differ.
    """
    src, dst = np.asarray(src), np.asarray(dst)
    if src.shape != dst.shape or src.ndim != 1:
        raise DatasetError(f"edge lists must be two 1-D arrays of one length, got {src.shape} and {dst.shape}")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
        raise DatasetError(f"edge endpoints outside [0, {num_nodes})")
    n = np.int64(num_nodes)
    loops = (src != dst) if drop_self_loops else None
    keys = dst.astype(np.int64) * n
    keys += src
    if loops is not None:
        keys = keys[loops]
    if symmetric:
        reverse = src.astype(np.int64) * n
        reverse += dst
        keys = np.concatenate([keys, reverse[loops] if loops is not None else reverse])
        del reverse
    keys.sort()
    if keys.size > 1:
        distinct = np.empty(keys.size, dtype=bool)
        distinct[0] = True
        np.not_equal(keys[1:], keys[:-1], out=distinct[1:])
        if not distinct.all():
            keys = keys[distinct]
        del distinct
    heads = keys // n
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(heads, minlength=num_nodes), out=indptr[1:])
    keys -= heads * n
    del heads
    return indptr, keys.astype(np.int32 if num_nodes < 2**31 else np.int64)
