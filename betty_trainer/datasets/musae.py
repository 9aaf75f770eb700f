"""MUSAE Facebook page-page network (Rozemberczki, Allen & Sarkar, "Multi-Scale Attributed Node
Embedding", J. Complex Networks 2021): edge CSV, feature JSON, target CSV.

Format (``../shared/datasets/musae-facebook/SOURCE.md``): ``facebook_edges.csv`` (header
``id_1,id_2``, each undirected edge once, 0-based), ``facebook.json`` (``{"<node>": [feature
ids]}``, 4,714 binary features), ``facebook_target.csv`` (header
``id,facebook_id,page_name,page_type``; quoted names with commas, so a real CSV parser:
pyarrow). Label = ``page_type`` (classes in alphabetical order: company, government,
politician, tvshow). No official split: a seeded random 50/25/25 split (LINKX-style).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.splits import random_split, row_normalize
from betty_trainer.errors import DatasetError

SPLIT = (0.5, 0.25)


def _read_table(path: Path, columns: list[str]):
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    if not path.is_file():
        raise DatasetError(f"missing dataset file {path}")
    try:
        table = pa_csv.read_csv(str(path))
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{path} is truncated or corrupt ({str(error).splitlines()[0]})") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DatasetError(f"{path} lacks the column(s) {', '.join(missing)}")
    return table


def load_musae_facebook(folder: Path, name: str = "musae-facebook", normalize_features: bool = True,
                        split_seed: int = 0) -> Graph:
    """Load the Facebook page-page graph from ``folder`` (see the module docstring).

    Args:
        folder: holds ``facebook_edges.csv``, ``facebook.json``, ``facebook_target.csv``.
        name: graph name.
        normalize_features: divide each binary feature row by its sum.
        split_seed: seed of the random split.

    Returns:
        A :class:`Graph`: 22,470 nodes, 341,646 directed edges (170,823 undirected, self
        loops dropped), ``x`` ``(22470, 4714)`` float32, 4 classes.

    Raises:
        DatasetError: a file is missing, truncated, or the files disagree (named).
    """
    target = _read_table(folder / "facebook_target.csv", ["id", "page_type"])
    ids = target.column("id").to_numpy()
    num_nodes = ids.size
    if not np.array_equal(ids, np.arange(num_nodes)):
        raise DatasetError(f"{folder / 'facebook_target.csv'}: ids should be 0..N-1 in order")
    classes, y = np.unique(np.asarray(target.column("page_type").to_pylist(), dtype=object).astype(str),
                           return_inverse=True)
    edges = _read_table(folder / "facebook_edges.csv", ["id_1", "id_2"])
    src, dst = edges.column("id_1").to_numpy(), edges.column("id_2").to_numpy()
    try:
        lists = json.loads((folder / "facebook.json").read_text())
    except FileNotFoundError:
        raise DatasetError(f"missing dataset file {folder / 'facebook.json'}") from None
    except (OSError, ValueError) as error:
        raise DatasetError(f"{folder / 'facebook.json'} is truncated or corrupt ({error})") from None
    try:
        rows = np.concatenate([np.full(len(f), int(node)) for node, f in lists.items()])
        cols = np.concatenate([np.asarray(f, dtype=np.int64) for f in lists.values()])
    except (TypeError, ValueError):
        raise DatasetError(f"{folder / 'facebook.json'} should map node ids to lists of feature ids") from None
    if len(lists) != num_nodes or rows.min() < 0 or rows.max() >= num_nodes or cols.min() < 0:
        raise DatasetError(f"{folder / 'facebook.json'} covers {len(lists)} nodes, the target file {num_nodes}")
    x = np.zeros((num_nodes, int(cols.max()) + 1), dtype=np.float32)
    x[rows, cols] = 1.0
    if normalize_features:
        row_normalize(x)
    train_idx, val_idx, test_idx = random_split(np.arange(num_nodes), *SPLIT, split_seed)
    return Graph.from_edges(src, dst, num_nodes, symmetric=True, drop_self_loops=True,
                            x=torch.from_numpy(x), y=torch.from_numpy(y.astype(np.int64)),
                            train_idx=train_idx, val_idx=val_idx, test_idx=test_idx,
                            num_classes=len(classes), name=name)
