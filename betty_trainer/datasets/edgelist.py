"""SNAP graphs as Graphs.jl ``.jlg`` edge lists (SNAPDatasets.jl): structure only, no features or labels.

Format (``../shared/datasets/snap-jlg/SOURCE.md``): a gzip text file whose first line is
``n,e,d|u,name[,...]`` (vertices, edges, directed or undirected), then ``e`` lines
``src,dst`` with 1-based ids. Undirected files list each edge once. Leskovec & Krevl,
"SNAP Datasets", 2014. The lines are parsed by pyarrow's CSV reader.

These graphs have no node features or labels: the loader gives each node one feature,
``log(1 + in-degree)``, labels ``-1`` and empty splits, so they serve sampling,
partitioning and redundancy benchmarks (or a user attaches ``x``/``y`` of their own).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from betty_trainer.data.graph import Graph
from betty_trainer.errors import DatasetError


def read_jlg(path: Path) -> tuple[int, bool, np.ndarray, np.ndarray]:
    """``(num_nodes, directed, src, dst)`` of a ``.jlg`` file, ids made 0-based (int64).

    Raises:
        DatasetError: missing file, bad header, truncated/corrupt body, or a line count or
            id range that disagrees with the header (the message names the file).
    """
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    try:
        with gzip.open(path, "rt") as handle:
            header = handle.readline().strip().split(",")
    except FileNotFoundError:
        raise DatasetError(f"missing dataset file {path}") from None
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path} is not a gzip .jlg file ({error})") from None
    try:
        num_nodes, num_edges, kind = int(header[0]), int(header[1]), header[2]
        if kind not in ("d", "u"):
            raise ValueError(kind)
    except (IndexError, ValueError):
        raise DatasetError(f"{path}: first line should be 'n,e,d|u,name', got {','.join(header)!r}") from None
    try:
        stream = pa.CompressedInputStream(pa.OSFile(str(path)), "gzip")
        table = pa_csv.read_csv(stream, read_options=pa_csv.ReadOptions(skip_rows=1, column_names=["src", "dst"]),
                                convert_options=pa_csv.ConvertOptions(column_types={"src": pa.int64(), "dst": pa.int64()}))
    except (pa.ArrowException, OSError, EOFError) as error:
        raise DatasetError(f"{path} is truncated or corrupt ({str(error).splitlines()[0]})") from None
    src = table.column("src").to_numpy() - 1
    dst = table.column("dst").to_numpy() - 1
    if src.size != num_edges:
        raise DatasetError(f"{path} has {src.size} edge lines, its header says {num_edges}: truncated or corrupt")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
        raise DatasetError(f"{path} names vertices outside 1..{num_nodes}")
    return num_nodes, kind == "d", src, dst


def load_jlg(path: Path, name: str, to_undirected: bool | None = None) -> Graph:
    """Load a ``.jlg`` SNAP graph (structure only; see the module docstring).

    Args:
        path: the ``.jlg`` file.
        name: graph name.
        to_undirected: add reverse edges to a directed graph (undirected files always get
            them); ``None`` = keep a directed graph directed.

    Returns:
        A :class:`Graph` without self loops or duplicate edges; ``x`` ``(N, 1)`` float32
        ``log(1 + in-degree)``, ``y`` all ``-1``, empty splits, ``num_classes`` 0.

    Raises:
        DatasetError: as :func:`read_jlg`.
    """
    num_nodes, directed, src, dst = read_jlg(path)
    graph = Graph.from_edges(src, dst, num_nodes, symmetric=not directed or bool(to_undirected), drop_self_loops=True,
                             x=torch.zeros(num_nodes, 1), y=torch.full((num_nodes,), -1, dtype=torch.int64),
                             train_idx=torch.zeros(0, dtype=torch.int64), val_idx=torch.zeros(0, dtype=torch.int64),
                             test_idx=torch.zeros(0, dtype=torch.int64), num_classes=0, name=name)
    graph.x = torch.log1p(graph.in_degrees().to(torch.float32)).unsqueeze(1)
    return graph
