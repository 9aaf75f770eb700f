"""The input-feature aggregation cache on disk (BatchGNN §3, "Input Feature Aggregation Cache"; App. B–C): per
node, layer 0's aggregation of the static input features over its full neighbourhood, computed once and kept
beside the dataset's converted arrays.

One folder per graph, features and aggregation: ``<cache_dir>/<dataset>/aggregation/<kind>-<key>/`` holding
``table.npy`` (``(N, W)`` float32, written by ``np.save`` without pickle, read with ``allow_pickle=False``) and
``meta.json``. ``<key>`` is the BLAKE2b digest of the graph's CSC structure and of **all** its feature rows, so
another graph, another feature preprocessing or another aggregation gets its own folder; a folder is written under
a temporary name and renamed into place when complete (:class:`~betty_trainer.datasets.cache.CacheWriter`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.data.graph import Graph
from betty_trainer.datasets.cache import CacheWriter, cache_dir, read_meta

log = logging.getLogger(__name__)

AGGREGATION_FORMAT = 1
_HASH_ROWS = 1 << 14  # feature rows hashed at once (bounded copies for a memory-mapped or non-contiguous x)


def graph_features_key(graph: Graph) -> str:
    """16 hex digits of the BLAKE2b digest of ``graph``'s ``indptr``, ``indices`` and every row of ``x`` (its
    dtype and shape too): what an aggregation of the features over the graph depends on. Reads the features
    once (about a second per GB)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{tuple(graph.x.shape)} {graph.x.dtype}".encode())
    for tensor in (graph.indptr, graph.indices):
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for start in range(0, graph.num_nodes, _HASH_ROWS):
        digest.update(graph.x[start:start + _HASH_ROWS].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def aggregation_dir(graph: Graph, kind: str) -> Path:
    """The folder of ``graph``'s aggregation cache of ``kind`` (see the module docstring)."""
    return cache_dir() / graph.name / "aggregation" / f"{kind}-{graph_features_key(graph)}"


def whole_graph_block(graph: Graph) -> Block:
    """The block of every in-edge of the graph, every node a dst node (``src_nodes = arange(N)``, the graph's
    own CSC arrays): layer 0's full-neighbourhood block of all nodes at once."""
    return Block(torch.arange(graph.num_nodes), graph.num_nodes, graph.indptr, graph.indices)


def aggregation_table(graph: Graph, kind: str, aggregate: Callable[[Block, Tensor], Tensor]) -> Tensor:
    """``graph``'s aggregation cache of ``kind``: ``aggregate(whole_graph_block(graph), graph.x)`` (no gradient),
    read from its folder when one was written for the same structure and features (memory-mapped
    copy-on-write), else computed once and written there (BatchGNN §3; the time it took is logged).

    Computing holds the features and the ``(N, W)`` result in host memory at once.

    Args:
        graph: the graph (its features are the static input features).
        kind: names the aggregation (``sage-mean``, ``sage-gcn``, ``gcn``): one folder per kind.
        aggregate: ``(block, x) -> (num_dst, W)`` rows: layer 0's own aggregation
            (:meth:`~betty_trainer.models.stack.LayerStack.aggregated_input`).

    Returns:
        ``(N, W)`` float32 rows, row ``v`` of node ``v``.
    """
    folder = aggregation_dir(graph, kind)
    table = _load(folder, graph.num_nodes)
    if table is not None:
        return table
    started = time.perf_counter()
    with torch.no_grad():
        rows = aggregate(whole_graph_block(graph), graph.x).contiguous()
    _save(folder, rows.numpy(), {"name": graph.name, "kind": kind, "num_nodes": int(graph.num_nodes)})
    log.info("aggregation cache %s of %s: %d x %d rows computed in %.2f s and kept in %s", kind, graph.name,
             rows.shape[0], rows.shape[1], time.perf_counter() - started, folder)
    return rows


def _load(folder: Path, num_nodes: int) -> Tensor | None:
    """The table in ``folder`` if it is complete and of this format, else ``None`` (then it is rebuilt)."""
    meta = read_meta(folder)
    if meta is None:
        return None
    try:
        array = np.load(folder / "table.npy", mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # empty, truncated or not a .npy file
        log.warning("aggregation cache %s cannot be read (%s); rebuilding", folder, type(error).__name__)
        return None
    if meta.get("aggregation_format") != AGGREGATION_FORMAT \
            or list(array.shape) != meta.get("arrays", {}).get("table", {}).get("shape") \
            or array.shape[0] != num_nodes or array.dtype != np.float32:
        log.warning("aggregation cache %s is stale or truncated; rebuilding", folder)
        return None
    return torch.from_numpy(array)


def _save(folder: Path, array: np.ndarray, meta: dict) -> None:
    """Write ``array`` as ``table.npy`` and ``meta.json`` into ``folder``, atomically
    (:class:`~betty_trainer.datasets.cache.CacheWriter`)."""
    with CacheWriter(folder, required=("table",)) as writer:
        writer.save("table", array)
        writer.commit({**meta, "aggregation_format": AGGREGATION_FORMAT})
