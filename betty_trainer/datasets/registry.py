"""Dataset registry: name → loader, canonical download URL and sha256 of every raw file.

Where files come from, in order: ``data_dir`` (config ``dataset.data_dir`` or CLI
``--data-dir``), the ``BETTY_DATA_DIR`` environment variable, the download cache
(``BETTY_CACHE_DIR``, default ``~/.cache/betty-trainer/<dataset>``). Missing files are
downloaded into the cache when online (:func:`~betty_trainer.datasets.download.download`:
streamed, resumable, checksummed). Every file's sha256 is checked before it is parsed
(unless ``verify_checksums`` is off).

Kinds of entries: ``files`` (raw files with pinned sha256, parsed on every load: small
graphs), ``ogb`` (an OGB zip converted once into the on-disk cache,
:mod:`~betty_trainer.datasets.ogb`), ``generated`` (no files; the power-law graph is
generated once into the on-disk cache, the SBM in memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.cache import cache_dir
from betty_trainer.datasets.download import download, sha256_of
from betty_trainer.datasets.edgelist import load_jlg
from betty_trainer.datasets.mat import load_facebook100
from betty_trainer.datasets.musae import load_musae_facebook
from betty_trainer.datasets.npz import load_npz_graph
from betty_trainer.datasets.ogb import OGB_DATASETS, load_ogb
from betty_trainer.datasets.planetoid import PARTS, load_planetoid
from betty_trainer.datasets.powerlaw import make_powerlaw
from betty_trainer.datasets.splits import apply_split, split_files
from betty_trainer.datasets.synthetic import make_sbm
from betty_trainer.errors import DatasetError

_PLANETOID_URL = "https://raw.githubusercontent.com/kimiyoung/planetoid/af6abf468a772cc055bec88c52e4d6f51b7c37e3/data/"
_GRAPHDATA_URL = "https://raw.githubusercontent.com/EdisonLeeeee/GraphData/f8022c26b917346f2a461ffec0ec5ae24b36de68/datasets/"
_MUSAE_URL = "https://raw.githubusercontent.com/benedekrozemberczki/MUSAE/5f901232957b6c9985d750aac48cda39a4b24285/input/"
_FB100_URL = ("https://raw.githubusercontent.com/CUAI/Non-Homophily-Large-Scale/"
              "82f8f05c5c3ec16bd5b505cc7ad62ab5e09051e6/data/facebook100/")
_SNAP_URL = "https://raw.githubusercontent.com/JuliaGraphs/SNAPDatasets.jl/dadd14a69b908d3dfc824d7c9f8c04f6fda72e59/data/"
NPZ_SPLIT_SEED = 0  # the split of the .npz datasets is part of the dataset, fixed like the SBM's seed


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
        name: registry key.
        description: one line for ``betty-train datasets``.
        files: raw file name → sha256 (hex); empty for generated and OGB datasets.
        base_url: canonical download location of ``files`` (``base_url + name``).
        load: ``(folder, config) -> Graph``.
        urls: file name → full URL, where it is not ``base_url + name`` (a renamed file).
        kind: ``files``, ``ogb`` or ``generated`` (see the module docstring).
        structure_only: the graph has no labels or splits (SNAP edge lists): it serves the sampling and
            partitioning benchmarks and the Python API, not ``train`` or ``plan`` (:func:`require_labels`).
    """

    name: str
    description: str
    load: Callable[..., Graph]
    files: dict[str, str] = field(default_factory=dict)
    base_url: str = ""
    urls: dict[str, str] = field(default_factory=dict)
    kind: str = "files"
    structure_only: bool = False

    def url(self, file: str) -> str:
        """Canonical download URL of raw file ``file``."""
        return self.urls.get(file, self.base_url + file)


def _planetoid(name: str, description: str, sha256: dict[str, str]) -> DatasetSpec:
    files = {f"ind.{name}.{part}": sha256[part] for part in PARTS}
    return DatasetSpec(
        name, description,
        load=lambda folder, config: load_planetoid(name, folder, config.normalize_features),
        files=files, base_url=_PLANETOID_URL,
    )


def _npz(name: str, file: str, sha256: str, description: str) -> DatasetSpec:
    return DatasetSpec(
        name, description,
        load=lambda folder, config: load_npz_graph(folder / file, name, config.normalize_features, NPZ_SPLIT_SEED),
        files={file: sha256}, base_url=_GRAPHDATA_URL,
    )


def _ogb(name: str) -> DatasetSpec:
    spec = OGB_DATASETS[name]
    return DatasetSpec(name, spec.description, kind="ogb", base_url=spec.url,
                       load=lambda folder, config: load_ogb(name, config.data_dir, to_undirected=config.to_undirected,
                                                            mmap=config.mmap))


def _snap(name: str, path: str, sha256: str, description: str) -> DatasetSpec:
    file = path.rsplit("/", 1)[-1]
    return DatasetSpec(name, description + f"; {STRUCTURE_ONLY}",
                       load=lambda folder, config: load_jlg(folder / file, name, config.to_undirected),
                       files={file: sha256}, base_url=_SNAP_URL, urls={file: _SNAP_URL + path}, structure_only=True)


STRUCTURE_ONLY = ("structure only: no labels or splits, x = log(1+in-degree); for sampling benchmarks, "
                  "not train or plan")
"""How ``betty-train datasets`` describes a structure-only dataset."""


def _fb100(name: str, file: str, upstream: str, sha256: str, description: str) -> DatasetSpec:
    return DatasetSpec(name, description + ", gender labels, one-hot attributes, random 50/25/25 split (LINKX)",
                       load=lambda folder, config: load_facebook100(folder / file, name),
                       files={file: sha256}, base_url=_FB100_URL, urls={file: _FB100_URL + upstream})


_SHCHUR_SPLIT = "random 20/30 per class train/val, rest test (Shchur et al.)"

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "synthetic",
            "planted-partition SBM with class-informative features; no files (dataset.synthetic.*)",
            load=lambda folder, config: make_sbm(**config.synthetic.model_dump()), kind="generated",
        ),
        DatasetSpec(
            "powerlaw",
            "power-law planted partition (Chung-Lu degrees), products-scale by default, generated once into the "
            "cache (dataset.powerlaw.*)",
            load=lambda folder, config: make_powerlaw(mmap=config.mmap, **config.powerlaw.model_dump()),
            kind="generated",
        ),
        *(_ogb(name) for name in OGB_DATASETS),
        _planetoid("cora", "Cora citation graph, 2,708 nodes, 7 classes, Planetoid public split 140/500/1000", {
            "x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
            "y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
            "tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
            "ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
            "allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
            "ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
            "graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
            "test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
        }),
        _planetoid("citeseer", "CiteSeer citation graph, 3,327 nodes, 6 classes, Planetoid public split 120/500/1000", {
            "x": "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6",
            "y": "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924",
            "tx": "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21",
            "ty": "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce",
            "allx": "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668",
            "ally": "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95",
            "graph": "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7",
            "test.index": "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4",
        }),
        _npz("amazon-computers", "amazon_cs.npz",
             "a6942db609f196b53503d91b99a02ad8d052d5d9be8ef41db976fb65f66ed1f3",
             f"Amazon Computers co-purchase graph, 13,752 nodes, 491,722 edges, 10 classes, {_SHCHUR_SPLIT}"),
        _npz("amazon-photo", "amazon_photo.npz",
             "bdb98b54cd3125bfa69b23ba0aae84fabcb770c6727175b8f6eb1d64f3be4b2b",
             f"Amazon Photo co-purchase graph, 7,650 nodes, 238,162 edges, 8 classes, {_SHCHUR_SPLIT}"),
        _npz("coauthor-cs", "coauthor_cs.npz",
             "7b7b51bf270d341f1c4231834c58a526bb04db003fd76a6d2f51ad7d252005ed",
             f"Coauthor CS co-authorship graph, 18,333 nodes, 163,788 edges, 15 classes, {_SHCHUR_SPLIT}"),
        _npz("coauthor-physics", "coauthor_phy.npz",
             "1c930d99910763bc5f0c1aa90e8baa945f5ad6027663fe5332d0f08fde33cd7d",
             f"Coauthor Physics co-authorship graph, 34,493 nodes, 495,924 edges, 5 classes, {_SHCHUR_SPLIT}"),
        DatasetSpec(
            "musae-facebook",
            "MUSAE Facebook page-page graph, 22,470 nodes, 170,823 undirected edges, 4,714 binary features, "
            "4 classes, random 50/25/25 split",
            load=lambda folder, config: load_musae_facebook(folder, "musae-facebook", config.normalize_features),
            files={
                "facebook_edges.csv": "7c50d8f02a75cc0829577814a1fc14535164daa38d79c3612340c9e9cdbd4022",
                "facebook.json": "ea870537646a93642a0008d38aa9bfeff02018070ba97b1f3f469d9622626436",
                "facebook_target.csv": "7bd96eafea3c2ca40f44bfa9e73642194696c21e38c7b29ed409c32ad14075cd",
            },
            base_url=_MUSAE_URL,
            urls={"facebook_edges.csv": _MUSAE_URL + "edges/facebook_edges.csv",
                  "facebook.json": _MUSAE_URL + "features/facebook.json",
                  "facebook_target.csv": _MUSAE_URL + "target/facebook_target.csv"},
        ),
        _fb100("fb100-amherst41", "Amherst41.mat", "Amherst41.mat",
               "3108e4b2edb01be05c5a61147583a40e61012820fff7eebe621dd26018caaf00",
               "Facebook100 Amherst41, 2,235 nodes, 90,954 undirected edges"),
        _fb100("fb100-cornell5", "Cornell5.mat", "Cornell5.mat",
               "d9ff76ae34e855cb77b0779a3a320f7f73f848901cb13352e2734c17804c4aec",
               "Facebook100 Cornell5, 18,660 nodes, 790,777 undirected edges"),
        _fb100("fb100-johns-hopkins55", "Johns_Hopkins55.mat", "Johns%20Hopkins55.mat",
               "fc7243bf257155df03afbc397ab34b5f8eb8e75f40cd1603398e207a033ef50f",
               "Facebook100 Johns Hopkins55, 5,180 nodes, 186,586 undirected edges"),
        _fb100("fb100-reed98", "Reed98.mat", "Reed98.mat",
               "d12ec74dc8c6e237385975b976c3709555a83629a1260be693fb688e3446070e",
               "Facebook100 Reed98, 962 nodes, 18,812 undirected edges"),
        _snap("snap-ego-twitter", "ego-twitter/ego-twitter-undirected.jlg",
              "7f81dda501ad839152246ff328db8108d84b9646534a7236726e8f7e62ef6d11",
              "SNAP ego-Twitter (symmetrised), 81,306 nodes, 1,342,310 undirected edges"),
        _snap("snap-slashdot", "soc-slashdot0902/soc-slashdot0902-directed.jlg",
              "713b5c637cdaffc3887856ef44066e36e2c91aa83c4e62434bdafc5095a930cb",
              "SNAP soc-Slashdot0902, 82,168 nodes, 870,161 directed edges without self loops"),
        _snap("snap-cit-hepph", "arxiv_cit/arxiv-cit-hep-ph.jlg",
              "817dfd8b3c98ee4eee1e1ff5e98986e49fe9727ec233436915ec7f254a2e9684",
              "SNAP cit-HepPh citations, 34,546 nodes, 421,578 directed edges"),
        _snap("snap-cit-hepth", "arxiv_cit/arxiv-cit-hep-th.jlg",
              "3d44ba807d7759d98503cac7a6807da056adc44f5fda1a298177b5fbcfde0469",
              "SNAP cit-HepTh citations, 27,770 nodes, 352,807 directed edges"),
        _snap("snap-email-enron", "email-enron/email-enron.jlg",
              "aa8777b645800c4937ce3a39270e0da004478aa528aad9c9d305f76e900009c4",
              "SNAP email-Enron, 36,692 nodes, 183,831 undirected edges"),
        _snap("snap-ca-astroph", "ca-astroph/astro-ph-cc1.jlg",
              "f29be53e9f5e66a87fbb0e202515987f449d7b3e26559004bf9be06487a21278",
              "SNAP ca-AstroPh (largest component), 17,903 nodes, 197,031 undirected edges"),
        _snap("snap-ca-condmat", "ca-condmat/ca-condmat-cc1.jlg",
              "4b113f85cf69244cd467136952f493330d006b645d94c0c8510108642f0c57c1",
              "SNAP ca-CondMat (largest component), 21,363 nodes, 91,342 undirected edges"),
        _snap("snap-as-caida", "as-caida/as-caida20071105.jlg",
              "10cb0f45dcf3f515c68709e08fbb2cc4cf228c8e50553ab4b78255099aa195a4",
              "SNAP as-CAIDA 2007-11-05, 26,475 nodes, 53,381 undirected edges"),
        _snap("snap-ego-facebook", "facebook-combined/facebook-combined.jlg",
              "fd6c75b604c81d2bc17542423e5198e2b099f5dc648f9612ad0de8e7e227c4e6",
              "SNAP ego-Facebook (combined), 4,039 nodes, 88,234 undirected edges"),
    )
}


def resolve_folder(spec: DatasetSpec, data_dir: Path | None) -> Path:
    """Where ``spec``'s files are read from (see module docstring); downloads missing files
    into the cache when no folder was given.

    Raises:
        DatasetError: the given folder lacks files, or the download fails (offline).
    """
    given = data_dir or (Path(os.environ["BETTY_DATA_DIR"]) if os.environ.get("BETTY_DATA_DIR") else None)
    if given is not None:
        missing = [name for name in spec.files if not (given / name).is_file()]
        if missing:
            raise DatasetError(
                f"{spec.name}: {len(missing)} file(s) missing in {given} (e.g. {missing[0]}); "
                f"point --data-dir at the folder holding {', '.join(list(spec.files)[:2])}, …"
            )
        return given
    folder = cache_dir() / spec.name
    for name, sha in spec.files.items():
        download(spec.url(name), folder / name, sha)  # a file already there is kept
    return folder


def verify_files(spec: DatasetSpec, folder: Path) -> None:
    """Check every raw file's sha256 against the registry.

    Raises:
        DatasetError: naming the first file whose checksum differs (truncated or tampered).
    """
    for name, expected in spec.files.items():
        digest = sha256_of(folder / name)
        if digest != expected:
            raise DatasetError(
                f"{folder / name} fails its sha256 check (got {digest[:16]}…, expected {expected[:16]}…): "
                "the file is truncated, corrupt or not the registered one"
            )


def structure_only_message(name: str) -> str:
    """One line saying that dataset ``name`` is structure only, what it serves and what to train on instead
    (the refusal of :func:`require_labels`; also for a trainer that finds no training nodes)."""
    return (f"dataset {name!r} is structure only (a SNAP edge list: no labels or splits; its one feature is "
            "log(1+in-degree)), so it cannot be trained or planned on; it serves the sampling benchmarks "
            f"(python benchmarks/sampling.py --graph {name}) and the Python API; to train, choose a labelled "
            "dataset (`betty-train datasets` lists them) or give the graph labels y and a train_idx in Python "
            "(Graph.from_edges(..., y=..., train_idx=...))")


def no_training_nodes_message(name: str) -> str:
    """One line for a graph named ``name`` whose ``train_idx`` is empty: :func:`structure_only_message`
    for a registered structure-only dataset, else what to change."""
    spec = DATASETS.get(name)
    if spec is not None and spec.structure_only:
        return structure_only_message(name)
    return (f"dataset {name!r} has no training nodes (its train_idx is empty): give the graph labels y and a "
            "train_idx, or choose a labelled dataset (`betty-train datasets` lists them)")


def require_labels(name: str) -> None:
    """Refuse to train or plan on a registered structure-only dataset, before its files are read.

    Raises:
        DatasetError: ``name`` is a :attr:`DatasetSpec.structure_only` dataset (message:
            :func:`structure_only_message`). An unknown name passes (:func:`load_dataset` refuses it).
    """
    spec = DATASETS.get(name)
    if spec is not None and spec.structure_only:
        raise DatasetError(structure_only_message(name))


def load_dataset(config) -> Graph:
    """Load the dataset a :class:`~betty_trainer.config.DatasetConfig` names, with the split of
    ``config.split`` in place of its own when one is given (:func:`~betty_trainer.datasets.splits.apply_split`).

    Raises:
        DatasetError: unknown name, missing/corrupt/tampered files, failed download, or a split file that is
            missing, unreadable or does not fit the graph (named).
    """
    spec = DATASETS.get(config.name)
    if spec is None:
        raise DatasetError(f"unknown dataset {config.name!r}; known: {', '.join(DATASETS)}")
    if config.split is not None:
        split_files(config.split)  # a missing split file is named before a large dataset is read
    folder = resolve_folder(spec, config.data_dir) if spec.files else None
    if folder is not None and config.verify_checksums:
        verify_files(spec, folder)
    graph = spec.load(folder, config)
    return graph if config.split is None else apply_split(graph, config.split)


@dataclass(frozen=True)
class DatasetStatus:
    """What ``betty-train datasets`` shows for one registered dataset.

    Attributes:
        name, kind, description: from the :class:`DatasetSpec`.
        raw: where the raw files are read from and how many are present, e.g.
            ``"/data/planetoid (8/8 files)"``, ``"cache ~/.cache/… (0/8 files; downloaded when online)"``,
            ``"generated"``.
        processed: converted caches, ``(folder, bytes on disk)`` each (OGB, power-law graphs).
        structure_only: from the :class:`DatasetSpec` (no labels or splits).
    """

    name: str
    kind: str
    description: str
    raw: str
    processed: tuple[tuple[Path, int], ...]
    structure_only: bool = False


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def dataset_status(spec: DatasetSpec, data_dir: Path | None = None) -> DatasetStatus:
    """Where ``spec``'s files and converted caches are now (reads directory entries only, never a file's data).

    Args:
        spec: a registered dataset.
        data_dir: the folder ``--data-dir`` names, if any (else ``BETTY_DATA_DIR``, else the cache).
    """
    given = data_dir or (Path(os.environ["BETTY_DATA_DIR"]) if os.environ.get("BETTY_DATA_DIR") else None)
    home = cache_dir() / spec.name
    if spec.kind == "generated":
        raw = "generated"
    elif spec.kind == "ogb":
        ogb = OGB_DATASETS[spec.name]
        places = ([given, given / ogb.folder] if given else []) + [home / ogb.folder, home / "extracted" / ogb.folder]
        found = next((place for place in places if (place / "raw").is_dir()), None)
        if found is not None:
            raw = f"{found} (unzipped)"
        elif given is not None and (given / ogb.archive).is_file():
            raw = f"{given / ogb.archive} (zip, not unzipped yet)"
        elif (home / ogb.archive).is_file():
            raw = f"{home / ogb.archive} (zip, not unzipped yet)"
        else:
            raw = f"not downloaded ({ogb.url})"
    else:
        folder = given if given is not None else home
        present = sum((folder / name).is_file() for name in spec.files)
        where = str(folder) if given is not None else f"cache {folder}"
        suffix = "" if present == len(spec.files) or given is not None else "; downloaded when online"
        raw = f"{where} ({present}/{len(spec.files)} files{suffix})"
    processed_root = home / "processed"
    processed = tuple(
        (folder, _folder_bytes(folder))
        for folder in sorted(processed_root.iterdir()) if folder.is_dir() and not folder.name.startswith(".")
    ) if processed_root.is_dir() else ()
    return DatasetStatus(spec.name, spec.kind, spec.description, raw, processed, spec.structure_only)


def list_datasets(data_dir: Path | None = None) -> list[DatasetStatus]:
    """:func:`dataset_status` of every registered dataset, in registry order (for ``betty-train datasets``)."""
    return [dataset_status(spec, data_dir) for spec in DATASETS.values()]
