"""Dataset registry: name → loader, canonical download URL and sha256 of every raw file.

Where files come from, in order: ``data_dir`` (config ``dataset.data_dir`` or CLI
``--data-dir``), the ``BETTY_DATA_DIR`` environment variable, the download cache
(``BETTY_CACHE_DIR``, default ``~/.cache/betty-trainer/<dataset>``). Missing files are
downloaded into the cache when online. Every file's sha256 is checked before it is
parsed (unless ``verify_checksums`` is off).
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from betty_trainer.data.graph import Graph
from betty_trainer.datasets.npz import load_npz_graph
from betty_trainer.datasets.planetoid import PARTS, load_planetoid
from betty_trainer.datasets.synthetic import make_sbm
from betty_trainer.errors import DatasetError

_PLANETOID_URL = "https://raw.githubusercontent.com/kimiyoung/planetoid/af6abf468a772cc055bec88c52e4d6f51b7c37e3/data/"
_GRAPHDATA_URL = "https://raw.githubusercontent.com/EdisonLeeeee/GraphData/f8022c26b917346f2a461ffec0ec5ae24b36de68/datasets/"
NPZ_SPLIT_SEED = 0  # the split of the .npz datasets is part of the dataset, fixed like the SBM's seed


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
        name: registry key.
        description: one line for ``betty-train datasets``.
        files: raw file name → sha256 (hex); empty for generated datasets.
        base_url: canonical download location of ``files``.
        load: ``(folder, config) -> Graph``.
    """

    name: str
    description: str
    load: Callable[..., Graph]
    files: dict[str, str] = field(default_factory=dict)
    base_url: str = ""


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


_SHCHUR_SPLIT = "random 20/30 per class train/val, rest test (Shchur et al.)"

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "synthetic",
            "planted-partition SBM with class-informative features; no files (dataset.synthetic.*)",
            load=lambda folder, config: make_sbm(**config.synthetic.model_dump()),
        ),
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
    )
}


def cache_dir() -> Path:
    """The download cache: ``$BETTY_CACHE_DIR`` or ``~/.cache/betty-trainer``."""
    return Path(os.environ.get("BETTY_CACHE_DIR", Path.home() / ".cache" / "betty-trainer"))


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
        if not (folder / name).is_file():
            _download(spec.base_url + name, folder / name, sha)
    return folder


def _download(url: str, target: Path, sha256: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as error:
        raise DatasetError(
            f"cannot download {url} ({getattr(error, 'reason', error)}); offline, pass --data-dir or set "
            f"BETTY_DATA_DIR to a folder holding the files"
        ) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DatasetError(f"downloaded {url} but its sha256 does not match the registry; not saved")
    partial.write_bytes(data)
    os.replace(partial, target)


def verify_files(spec: DatasetSpec, folder: Path) -> None:
    """Check every raw file's sha256 against the registry.

    Raises:
        DatasetError: naming the first file whose checksum differs (truncated or tampered).
    """
    for name, expected in spec.files.items():
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        if digest != expected:
            raise DatasetError(
                f"{folder / name} fails its sha256 check (got {digest[:16]}…, expected {expected[:16]}…): "
                "the file is truncated, corrupt or not the registered one"
            )


def load_dataset(config) -> Graph:
    """Load the dataset a :class:`~betty_trainer.config.DatasetConfig` names.

    Raises:
        DatasetError: unknown name, missing/corrupt/tampered files, failed download.
    """
    spec = DATASETS.get(config.name)
    if spec is None:
        raise DatasetError(f"unknown dataset {config.name!r}; known: {', '.join(DATASETS)}")
    folder = resolve_folder(spec, config.data_dir) if spec.files else None
    if folder is not None and config.verify_checksums:
        verify_files(spec, folder)
    return spec.load(folder, config)
