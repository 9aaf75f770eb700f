"""What the benchmark scripts share: where the repository and the shared datasets are, a graph by name through the
dataset registry, comma-separated option values, and markdown tables.

The scripts import it as ``from common import ...`` (Python puts a script's own folder first on ``sys.path``), first
of all their imports (``benchmarks/ruff.toml`` keeps it there): importing it imports betty_trainer, whose process
settings (``betty_trainer/process.py``: the OpenMP wait policy, which torch's runtime reads when torch loads, huge
pages and the CUDA allocator's expandable segments) then hold for torch in every benchmark, and for DGL's side, which
inherits the environment. DGL's side (``dgl_channel.py``, run with DGL's interpreter, which has no betty_trainer)
imports it too, so it imports only the standard library otherwise; the registry is imported where a graph is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

try:  # betty_trainer's process settings, before the importing script loads torch
    import betty_trainer  # noqa: F401
except ImportError:  # DGL's side: its environment has no betty_trainer, and it inherits the settings from ours
    pass

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATASETS = REPO_ROOT.parent / "shared" / "datasets"
"""The shared datasets next to the checkout: one folder per source (see each folder's SOURCE.md)."""

ALIASES = {"ego-twitter": "snap-ego-twitter"}
"""Names the benchmarks' commands use for registered datasets."""

_FOLDERS = {"amazon-computers": "graphdata-npz", "amazon-photo": "graphdata-npz", "coauthor-cs": "graphdata-npz",
            "coauthor-physics": "graphdata-npz", "musae-facebook": "musae-facebook", "cora": "planetoid",
            "citeseer": "planetoid"}


def shared_folder(name: str, datasets: Path = SHARED_DATASETS) -> Path | None:
    """The folder of ``datasets`` that holds registered dataset ``name``'s raw files (``snap-*`` in ``snap-jlg``,
    ``fb100-*`` in ``facebook100``); ``None`` for a dataset without files there (generated, OGB)."""
    name = ALIASES.get(name, name)
    folder = _FOLDERS.get(name) or ("snap-jlg" if name.startswith("snap-") else
                                    "facebook100" if name.startswith("fb100-") else None)
    return datasets / folder if folder else None


SBM = {
    "sbm-30k": dict(num_nodes=30_000, num_features=128, avg_degree=10.0),
    "sbm-30k-d40": dict(num_nodes=30_000, num_features=128, avg_degree=40.0),
    "synthetic-100k": dict(num_nodes=100_000, num_features=64, avg_degree=10, train_per_class=200, num_val=1000,
                           num_test=1000),
    "sbm-100k": dict(num_nodes=100_000, num_features=64, avg_degree=10, train_per_class=20, num_val=100,
                     num_test=100),
}
"""Generated graphs by name (``betty_trainer.datasets.make_sbm``'s arguments): stochastic block models (5 classes,
70% of edges inside a class, the rest uniform), whose neighbourhoods share few nodes, unlike the co-purchase graphs
the defaults were tuned on. ``sbm-30k`` is the DGL comparisons' graph, ``sbm-30k-d40`` the layer-wise one (degree
40), ``synthetic-100k`` the estimator's, ``sbm-100k`` sampled planning's (most nodes outside the training set)."""


def load_graph(name: str, data_dir: Path | None = None, datasets: Path = SHARED_DATASETS):
    """One of :data:`SBM`, or the registered dataset ``name`` (or an :data:`ALIASES` name), loaded by
    ``betty_trainer.datasets.load_dataset``.

    Its raw files are read from ``data_dir``; else from ``$BETTY_DATA_DIR`` when set; else from its folder under
    ``datasets`` (:func:`shared_folder`); else the registry's download cache.

    Raises:
        DatasetError: unknown name, missing or corrupt files (the registry's message).
    """
    from betty_trainer.config import DatasetConfig
    from betty_trainer.datasets import load_dataset, make_sbm

    if name in SBM:
        return make_sbm(**SBM[name])
    if data_dir is None and not os.environ.get("BETTY_DATA_DIR"):
        data_dir = shared_folder(name, datasets)
    return load_dataset(DatasetConfig(name=ALIASES.get(name, name), data_dir=data_dir))


def int_list(text: str) -> list[int]:
    """``"1,8,16"`` → ``[1, 8, 16]`` (an argparse ``type``)."""
    return [int(part) for part in text.split(",") if part.strip()]


def float_list(text: str) -> list[float]:
    """``"0.5,0"`` → ``[0.5, 0.0]`` (an argparse ``type``)."""
    return [float(part) for part in text.split(",") if part.strip()]


def name_list(text: str) -> list[str]:
    """``"cora, citeseer"`` → ``["cora", "citeseer"]`` (an argparse ``type``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, its ``|---|`` rule, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
