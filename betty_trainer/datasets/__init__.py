"""Datasets: the registry, the Planetoid loader and the synthetic SBM."""

from betty_trainer.datasets.planetoid import RestrictedUnpickler, load_planetoid, restricted_load
from betty_trainer.datasets.registry import DATASETS, DatasetSpec, cache_dir, load_dataset
from betty_trainer.datasets.synthetic import make_sbm

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "RestrictedUnpickler",
    "cache_dir",
    "load_dataset",
    "load_planetoid",
    "make_sbm",
    "restricted_load",
]
