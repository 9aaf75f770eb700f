"""Datasets: the registry, loaders of real graphs (Planetoid, gnn-benchmark .npz, OGB, MUSAE, Facebook100,
SNAP edge lists), the synthetic SBM and power-law generators, and the on-disk cache of converted graphs."""

from betty_trainer.datasets.cache import cache_dir, load_cached, processed_dir, save_graph
from betty_trainer.datasets.download import download
from betty_trainer.datasets.edgelist import load_jlg, read_jlg
from betty_trainer.datasets.mat import load_facebook100
from betty_trainer.datasets.musae import load_musae_facebook
from betty_trainer.datasets.npz import load_npz_graph, read_npz, stratified_split
from betty_trainer.datasets.ogb import OGB_DATASETS, convert_ogb_directory, load_ogb
from betty_trainer.datasets.planetoid import load_planetoid
from betty_trainer.datasets.powerlaw import make_powerlaw, write_powerlaw
from betty_trainer.datasets.registry import (
    DATASETS,
    DatasetSpec,
    DatasetStatus,
    dataset_status,
    list_datasets,
    load_dataset,
    no_training_nodes_message,
    require_labels,
    structure_only_message,
)
from betty_trainer.datasets.safe_pickle import RestrictedUnpickler, restricted_load
from betty_trainer.datasets.splits import apply_split, random_split, read_split, split_sha256
from betty_trainer.datasets.synthetic import make_sbm

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "DatasetStatus",
    "OGB_DATASETS",
    "RestrictedUnpickler",
    "apply_split",
    "cache_dir",
    "convert_ogb_directory",
    "dataset_status",
    "download",
    "list_datasets",
    "load_cached",
    "load_dataset",
    "load_facebook100",
    "load_jlg",
    "load_musae_facebook",
    "load_npz_graph",
    "load_ogb",
    "load_planetoid",
    "make_powerlaw",
    "make_sbm",
    "no_training_nodes_message",
    "processed_dir",
    "random_split",
    "read_split",
    "read_jlg",
    "read_npz",
    "require_labels",
    "restricted_load",
    "save_graph",
    "split_sha256",
    "stratified_split",
    "structure_only_message",
    "write_powerlaw",
]
