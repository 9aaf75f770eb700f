"""Vertex ownership: a 1-D partition of the vertices, and so of their in-edges, over ``P`` ranks (cooperative
paper §3.1: "we first partition the graph in 1D fashion by logically assigning each vertex and its incoming
edges to PEs").

A rank samples the in-edges of the seeds it owns, loads the features of the input nodes it owns, and computes
the embeddings of the nodes it owns; everything else reaches it by all-to-all. Two ownerships:

* ``random``: a balanced random assignment (part sizes differ by at most one), a permutation keyed by
  ``(seed, node id)`` hashes (:mod:`betty_trainer.rng`), so it is the same in every process without any
  communication;
* ``metis``: METIS on the symmetrised graph (Karypis & Kumar 1998) minimises the edges cut between ranks,
  hence the vertices they exchange (the paper's Table 7 reports the communicated vertices).

METIS on a large graph takes a while, so :func:`load_owners` keeps the result on disk beside the dataset's
cache, keyed by the graph's structure, ``P``, the kind and the seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.cache import cache_dir, writing_cache
from betty_trainer.rng import hash_ids, mix_key
from partition.metis import metis_kway
from partition.reg import symmetric_graph

Ownership = Literal["random", "metis"]
OWNERSHIPS: tuple[str, ...] = get_args(Ownership)
_OWNER_DOMAIN = 0x4F57  # "OW": keeps ownership hashes apart from sampling's and dropout's


def vertex_owners(graph: Graph, world_size: int, kind: Ownership = "random", seed: int = 0) -> Tensor:
    """The rank that owns each vertex (and its in-edges).

    Args:
        graph: the graph (CSC).
        world_size: ``P ≥ 1``, the number of ranks.
        kind: ``random`` or ``metis`` (see the module docstring).
        seed: the random permutation's or METIS's seed.

    Returns:
        ``(N,)`` int64 ranks in ``[0, P)``; ``random`` gives each rank ``⌊N/P⌋`` or ``⌈N/P⌉`` vertices.

    Raises:
        ValueError: ``world_size < 1``, more ranks than vertices, or an unknown ``kind``.
    """
    n = graph.num_nodes
    if world_size < 1 or world_size > max(n, 1):
        raise ValueError(f"cannot give {n} vertices to {world_size} ranks")
    if kind == "random":
        order = torch.argsort(hash_ids(mix_key(seed, _OWNER_DOMAIN), torch.arange(n)), stable=True)
        owners = torch.empty(n, dtype=torch.int64)
        owners[order] = torch.arange(n) % world_size
        return owners
    if kind == "metis":
        return torch.from_numpy(metis_kway(_symmetric_adjacency(graph), world_size, seed % 2**31)).long()
    raise ValueError(f"ownership must be one of {', '.join(OWNERSHIPS)}; got {kind!r}")


def _symmetric_adjacency(graph: Graph) -> sp.csr_matrix:
    """``A + Aᵀ`` with unit weights and no diagonal: METIS's input (:func:`partition.reg.symmetric_graph`)."""
    return symmetric_graph(graph.indptr.cpu().numpy(), graph.indices.cpu().numpy())


def structure_fingerprint(graph: Graph) -> str:
    """16 hex digits of the sha256 of the graph's CSC ``indptr`` and ``indices``: what an ownership depends on."""
    digest = hashlib.sha256()
    for tensor in (graph.indptr, graph.indices):
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_owners(graph: Graph, world_size: int, kind: Ownership = "random", seed: int = 0,
                folder: Path | None = None) -> Tensor:
    """:func:`vertex_owners`, computed once and kept on disk: ``<folder>/<kind>-P<P>-seed<seed>-<fingerprint>.npy``
    (default folder ``<cache dir>/<graph name>/ownership``, beside the dataset's converted arrays). A file that cannot
    be read (empty, truncated), of the wrong length or with ranks outside ``[0, P)`` is recomputed; a new file is
    written under a temporary name and renamed into place, so processes computing the same ownership at once never
    read a partial file (they compute the same array).

    Raises:
        ValueError: see :func:`vertex_owners`.
        DatasetError: the folder cannot be written (:func:`~betty_trainer.datasets.cache.writing_cache`).
    """
    folder = folder if folder is not None else cache_dir() / graph.name / "ownership"
    path = folder / f"{kind}-P{world_size}-seed{seed}-{structure_fingerprint(graph)}.npy"
    if path.exists():
        try:
            owners = torch.from_numpy(np.load(path, allow_pickle=False)).long()
        except (OSError, ValueError, EOFError):  # empty, truncated or not a .npy file: recomputed
            owners = None
        if owners is not None and owners.shape == (graph.num_nodes,) and \
                (owners.numel() == 0 or (int(owners.min()) >= 0 and int(owners.max()) < world_size)):
            return owners
    owners = vertex_owners(graph, world_size, kind, seed)
    partial = folder / f".{path.stem}.{uuid.uuid4().hex}.npy"
    try:
        with writing_cache(folder):
            folder.mkdir(parents=True, exist_ok=True)
            np.save(partial, owners.numpy())
            os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)  # a failed write leaves no partial file
    return owners
