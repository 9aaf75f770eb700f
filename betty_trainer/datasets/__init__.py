"""Datasets: the registry, the Planetoid and gnn-benchmark (.npz) loaders and the synthetic SBM."""

from betty_trainer.datasets.npz import load_npz_graph, read_npz, stratified_split
from betty_trainer.datasets.planetoid import load_planetoid
from betty_trainer.datasets.registry import DATASETS, DatasetSpec, cache_dir, load_dataset
from betty_trainer.datasets.safe_pickle import RestrictedUnpickler, restricted_load
from betty_trainer.datasets.synthetic import make_sbm

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "RestrictedUnpickler",
    "cache_dir",
    "load_dataset",
    "load_npz_graph",
    "load_planetoid",
    "make_sbm",
    "read_npz",
    "restricted_load",
    "stratified_split",
]
