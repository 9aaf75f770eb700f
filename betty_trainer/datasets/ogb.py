"""OGB node-property datasets (ogbn-arxiv, ogbn-products, ogbn-papers100M) from their distributed directories.

Format (Hu et al., "Open Graph Benchmark", NeurIPS 2020; the ``ogb`` package's
``read_csv_graph_raw`` / ``read_binary_graph_raw``): a dataset directory holds

- ``raw/num-node-list.csv.gz``, ``raw/num-edge-list.csv.gz``: one integer each (one graph);
- ``raw/edge.csv.gz``: ``E`` rows ``src,dst`` (no header); edge ``src → dst``;
- ``raw/node-feat.csv.gz``: ``N`` rows of ``F`` floats; ``raw/node-label.csv.gz``: ``N`` rows,
  one class id (``nan`` = unlabelled, as in papers100M);
- ``split/<scheme>/{train,valid,test}.csv.gz``: one node id per row;
- binary variant (papers100M, ``papers100M-bin.zip``): ``raw/data.npz`` with
  ``edge_index`` ``(2, E)``, ``node_feat`` ``(N, F)``, ``num_nodes_list``, ``num_edges_list``
  and ``raw/node-label.npz`` with ``node_label`` ``(N, 1)``; same split files.

The CSVs are read with pyarrow's streaming CSV reader (gzip decompressed by it), block
by block, straight into the on-disk cache (:mod:`betty_trainer.datasets.cache`); the
``.npz`` members are streamed from the zip without loading them whole. Conversion runs
once; later loads map the cached ``.npy`` files.

ogbn-products stores each undirected edge once (``add_inverse_edge`` in OGB's
``master.csv``), so its reverse edges are always added; ``to_undirected`` adds them to the
directed citation graphs too (as GraphSAGE-style training on ogbn-arxiv usually does).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from numpy.lib import format as npy_format

from betty_trainer.data.graph import Graph, csc_from_edges
from betty_trainer.datasets.cache import (
    CacheWriter,
    cache_dir,
    file_fingerprint,
    load_cached,
    processed_dir,
    read_back,
    writing_cache,
)
from betty_trainer.datasets.download import download
from betty_trainer.datasets.npz import open_archive
from betty_trainer.errors import DatasetError

log = logging.getLogger(__name__)

OGB_URL = "http://snap.stanford.edu/ogb/data/nodeproppred/"
CSV_BLOCK_BYTES = 1 << 24
SPLITS = (("train_idx", "train"), ("val_idx", "valid"), ("test_idx", "test"))


@dataclass(frozen=True)
class OgbNodeDataset:
    """One OGB node-property dataset as distributed (OGB's ``master.csv`` row).

    Attributes:
        name: registry name, e.g. ``ogbn-arxiv``.
        archive: the zip at :data:`OGB_URL`, e.g. ``arxiv.zip``.
        folder: the directory the zip unpacks to, e.g. ``arxiv``.
        split: split scheme (``split/<split>/``).
        add_inverse_edge: the raw edges list each undirected edge once.
        binary: raw arrays in ``.npz`` files instead of gzip CSVs.
        num_nodes, num_edges, num_features, num_classes: published sizes (edges as stored raw).
        description: one line for ``betty-train datasets``.
    """

    name: str
    archive: str
    folder: str
    split: str
    add_inverse_edge: bool
    binary: bool
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    description: str

    @property
    def url(self) -> str:
        """Canonical download URL of :attr:`archive`."""
        return OGB_URL + self.archive


OGB_DATASETS: dict[str, OgbNodeDataset] = {
    spec.name: spec
    for spec in (
        OgbNodeDataset("ogbn-arxiv", "arxiv.zip", "arxiv", "time", False, False, 169_343, 1_166_243, 128, 40,
                       "OGB arXiv citation graph, 169,343 nodes, 1,166,243 directed edges, 40 classes, time split"),
        OgbNodeDataset("ogbn-products", "products.zip", "products", "sales_ranking", True, False,
                       2_449_029, 61_859_140, 100, 47,
                       "OGB Amazon co-purchase graph, 2,449,029 nodes, 61,859,140 undirected edges, 47 classes, "
                       "sales-rank split"),
        OgbNodeDataset("ogbn-papers100M", "papers100M-bin.zip", "papers100M-bin", "time", False, True,
                       111_059_956, 1_615_685_872, 128, 172,
                       "OGB MAG citation graph, 111M nodes, 1.6B directed edges, 172 classes, time split "
                       "(conversion needs ~40 GB RAM)"),
    )
}


def _pyarrow_csv():
    try:
        import pyarrow as pa
        import pyarrow.csv as pa_csv
    except ImportError:
        raise DatasetError("reading OGB CSV files needs pyarrow: pip install 'pyarrow>=14'") from None
    return pa, pa_csv


def _csv_blocks(path: Path, columns: int, dtype: str) -> Iterator[np.ndarray]:
    """``(rows, columns)`` numpy blocks of a header-less (gzip) CSV, parsed by pyarrow.

    Raises:
        DatasetError: the file is missing, truncated or holds something else than
            ``columns`` columns of ``dtype`` (the message names the file).
    """
    pa, pa_csv = _pyarrow_csv()
    if not path.is_file():
        raise DatasetError(f"missing dataset file {path}")
    names = [f"c{i}" for i in range(columns)]
    try:
        reader = pa_csv.open_csv(
            str(path),
            read_options=pa_csv.ReadOptions(column_names=names, block_size=CSV_BLOCK_BYTES),
            convert_options=pa_csv.ConvertOptions(column_types={name: getattr(pa, dtype)() for name in names}),
        )
        for batch in reader:
            yield np.stack([column.to_numpy(zero_copy_only=False) for column in batch.columns], axis=1)
    except (pa.ArrowException, OSError, EOFError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DatasetError(f"{path} is truncated or corrupt ({message}); re-extract or re-download it") from None


def _csv_width(path: Path) -> int:
    """Columns of a header-less (gzip) CSV, from the schema pyarrow infers on its first block.

    Raises:
        DatasetError: the file is missing, empty or unreadable (named).
    """
    pa, pa_csv = _pyarrow_csv()
    if not path.is_file():
        raise DatasetError(f"missing dataset file {path}")
    try:
        reader = pa_csv.open_csv(str(path), read_options=pa_csv.ReadOptions(autogenerate_column_names=True,
                                                                           block_size=1 << 16))
        width = len(reader.schema)
        reader.close()
    except (pa.ArrowException, OSError, EOFError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DatasetError(f"{path} is truncated, empty or corrupt ({message}); re-extract or re-download it") from None
    return width


def _read_csv(path: Path, columns: int, dtype: str, rows: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """A whole CSV as ``(rows, columns)``; written into ``out`` block by block if given.

    Raises:
        DatasetError: as :func:`_csv_blocks`, or the row count differs from ``rows``.
    """
    blocks, filled = [], 0
    for block in _csv_blocks(path, columns, dtype):
        if out is not None:
            if filled + len(block) > len(out):
                raise DatasetError(f"{path} has more than the {len(out)} rows its num-*-list file announces")
            out[filled: filled + len(block)] = block
        else:
            blocks.append(block)
        filled += len(block)
    expected = rows if rows is not None else (len(out) if out is not None else None)
    if expected is not None and filled != expected:
        raise DatasetError(f"{path} has {filled} rows, expected {expected}: truncated or corrupt; re-extract it")
    if out is not None:
        return out
    return np.concatenate(blocks) if blocks else np.empty((0, columns), dtype=dtype)


def read_split_ids(path: Path, num_nodes: int) -> np.ndarray:
    """The node ids of one OGB split file (``train.csv``, ``valid.csv`` or ``test.csv``, gzipped when its name
    ends in ``.gz``): one integer per line, no header.

    Returns:
        ``(n,)`` int64 ids, in file order.

    Raises:
        DatasetError: the file is missing or unreadable, holds something else than one integer per line, or
            names a node outside ``[0, num_nodes)`` (the message names the file).
    """
    ids = _read_csv(path, 1, "int64").reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_nodes):
        raise DatasetError(f"{path} names nodes outside [0, {num_nodes})")
    return ids


def split_folder_files(folder: Path) -> list[Path]:
    """The three files of an OGB-style split folder, in :data:`SPLITS` order: ``<part>.csv.gz`` where it
    exists, else ``<part>.csv``.

    Raises:
        DatasetError: a part has neither file (named).
    """
    files = []
    for _, part in SPLITS:
        found = [folder / f"{part}.csv.gz", folder / f"{part}.csv"]
        path = next((path for path in found if path.is_file()), None)
        if path is None:
            raise DatasetError(f"split folder {folder} has no {part}.csv (nor {part}.csv.gz); an OGB-style split "
                               "folder holds train.csv, valid.csv and test.csv, one node id per line")
        files.append(path)
    return files


def _npz_member(path: Path, member: str, out_factory=None) -> np.ndarray:
    """One array of an (uncompressed or deflated) ``.npz`` file, streamed from the zip without
    a second copy; ``out_factory(shape, dtype)`` may provide the target (e.g. a cache memmap).
    Only plain arrays are read (``allow_pickle`` is never set).

    Raises:
        DatasetError: missing file or member, object array, truncated data.
    """
    source = f"{path}:{member}.npy"
    with open_archive(path) as archive:
        try:
            handle = archive.open(member + ".npy")
        except KeyError:
            raise DatasetError(f"{path} lacks the array {member!r}") from None
        try:
            with handle:
                version = npy_format.read_magic(handle)
                header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
                shape, fortran, dtype = header(handle)
                if dtype.hasobject:
                    raise DatasetError(f"{source} is an object array; refusing to unpickle it")
                out = out_factory(shape, dtype) if out_factory else np.empty(shape, dtype=dtype)
                flat = out.reshape(-1, order="F" if fortran else "C").view(np.uint8)
                view, done = memoryview(flat), 0
                while done < flat.size:
                    count = handle.readinto(view[done: done + (64 << 20)])
                    if not count:
                        raise DatasetError(f"{source} is truncated ({done} of {flat.size} bytes)")
                    done += count
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
            raise DatasetError(f"{source} is truncated or corrupt ({error}); re-download it") from None
    return out


def _raw_files(directory: Path, spec_split: str, binary: bool) -> list[Path]:
    raw = directory / "raw"
    names = ["data.npz", "node-label.npz"] if binary else [
        "num-node-list.csv.gz", "num-edge-list.csv.gz", "edge.csv.gz", "node-feat.csv.gz", "node-label.csv.gz"]
    return [raw / name for name in names] + [directory / "split" / spec_split / f"{part}.csv.gz" for _, part in SPLITS]


def convert_ogb_directory(directory: Path, target: Path, *, name: str, split: str, symmetric: bool,
                          binary: bool = False, source: object = None) -> Path:
    """Convert an OGB node-property directory into a cache folder (see the module docstring).

    Args:
        directory: the dataset directory (holding ``raw/`` and ``split/``).
        target: the cache folder to write (replaced when complete).
        name: graph name.
        split: split scheme under ``split/``.
        symmetric: add every reverse edge.
        binary: read ``raw/data.npz`` and ``raw/node-label.npz`` instead of the CSVs.
        source: the description recorded in ``meta.json`` (default: the files' fingerprint).

    Returns:
        ``target``.

    Raises:
        DatasetError: a file is missing, truncated or corrupt (the message names it), or the
            files disagree on the number of nodes or edges.
    """
    raw = directory / "raw"
    if source is None:
        source = {"files": file_fingerprint(_raw_files(directory, split, binary)), "symmetric": symmetric}
    with CacheWriter(target) as writer:
        if binary:
            num_nodes = int(_npz_member(raw / "data.npz", "num_nodes_list").sum())
            edge_index = _npz_member(raw / "data.npz", "edge_index")
            if edge_index.ndim != 2 or edge_index.shape[0] != 2:
                raise DatasetError(f"{raw / 'data.npz'}: edge_index has shape {edge_index.shape}, expected (2, E)")
            src, dst = edge_index[0], edge_index[1]
            x = _npz_member(raw / "data.npz", "node_feat", lambda shape, dtype: (
                writer.open("x", shape, dtype) if dtype in (np.float16, np.float32) else np.empty(shape, dtype)))
            if not isinstance(x, np.memmap):
                writer.save("x", x.astype(np.float32))
            labels = _npz_member(raw / "node-label.npz", "node_label").reshape(-1)
        else:
            num_nodes = int(_read_csv(raw / "num-node-list.csv.gz", 1, "int64").sum())
            num_edges = int(_read_csv(raw / "num-edge-list.csv.gz", 1, "int64").sum())
            edges = _read_csv(raw / "edge.csv.gz", 2, "int64", out=np.empty((num_edges, 2), np.int64))
            src, dst = edges[:, 0], edges[:, 1]
            width = _csv_width(raw / "node-feat.csv.gz")
            x = _read_csv(raw / "node-feat.csv.gz", width, "float32", out=writer.open("x", (num_nodes, width), np.float32))
            labels = _read_csv(raw / "node-label.csv.gz", 1, "float64", rows=num_nodes).reshape(-1)
        if x.shape[0] != num_nodes or labels.shape[0] != num_nodes:
            raise DatasetError(f"{directory}: {num_nodes} nodes but {x.shape[0]} feature rows and {labels.shape[0]} labels")
        if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
            raise DatasetError(f"{raw}: edges name nodes outside [0, {num_nodes}); the edge file is corrupt")
        indptr, indices = csc_from_edges(src, dst, num_nodes, symmetric=symmetric, drop_self_loops=True)
        del src, dst
        writer.save("indptr", indptr)
        writer.save("indices", indices)
        del indices
        y = np.where(np.isnan(labels), -1, labels).astype(np.int64) if labels.dtype.kind == "f" else labels.astype(np.int64)
        writer.save("y", y)
        for field, part in SPLITS:
            path = directory / "split" / split / f"{part}.csv.gz"
            ids = read_split_ids(path, num_nodes)
            unlabelled = int((y[ids] < 0).sum())
            if unlabelled:
                raise DatasetError(f"{path} lists {unlabelled} node(s) without a label in node-label; the files disagree")
            writer.save(field, np.sort(ids))
        num_classes = int(y.max()) + 1 if (y >= 0).any() else 0
        return writer.commit({"name": name, "num_classes": num_classes, "source": source})


WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
"""``OSError`` numbers that say the cache could not be written (the disk or quota is full, a file too large for
the filesystem, the folder read-only or not ours): an extraction that fails so while writing into the cache (the
error names a path there, or none) is the cache's problem, not the archive's."""


def _safe_extract(archive_path: Path, into: Path) -> None:
    """Unzip ``archive_path`` into ``into`` (members must stay inside it), via a temporary folder.

    Raises:
        DatasetError: an unsafe member path; an archive that is not a complete zip (delete it to re-download); or
            a cache that cannot be written (:data:`WRITE_FAILURES`: the archive is kept, the fix is the cache's).
    """
    tmp = into.with_name(into.name + ".extracting")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive_path) as archive:
            for member in archive.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise DatasetError(f"{archive_path} holds an unsafe path {member!r}; refusing to extract it")
            archive.extractall(tmp)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError) and error.errno in WRITE_FAILURES and (
                error.filename is None or str(tmp) in str(error.filename)):  # writing into the cache, not reading
            with writing_cache(into.parent):  # the cache's one line: the archive is fine, keep it
                raise
        raise DatasetError(f"{archive_path} is not a complete zip archive ({error}); delete it to re-download") from None
    tmp.rename(into)


def find_ogb_directory(spec: OgbNodeDataset, data_dir: Path | None, fetch: bool = True) -> Path:
    """The extracted dataset directory of ``spec`` (holding ``raw/``), looked for in order:
    ``data_dir`` itself, ``data_dir/<folder>``, ``data_dir/<archive>`` (extracted into the cache),
    the same in ``$BETTY_DATA_DIR`` when ``data_dir`` is ``None`` (skipped if it holds none of
    them), the cache's extracted folder, the cache's archive, a download of
    :attr:`OgbNodeDataset.url`.

    Raises:
        DatasetError: ``data_dir`` holds none of these, or the download fails (offline).
    """
    home = cache_dir() / spec.name
    if data_dir is None and os.environ.get("BETTY_DATA_DIR"):  # the environment's folder, if it holds this dataset
        shared = Path(os.environ["BETTY_DATA_DIR"])
        if any((place / "raw").is_dir() for place in (shared, shared / spec.folder)) or (shared / spec.archive).is_file():
            data_dir = shared
    if data_dir is not None:
        for candidate in (data_dir, data_dir / spec.folder):
            if (candidate / "raw").is_dir():
                return candidate
        if not (data_dir / spec.archive).is_file():
            raise DatasetError(f"{spec.name}: {data_dir} holds neither raw/ nor {spec.folder}/raw/ nor {spec.archive}; "
                               f"point --data-dir at the unzipped {spec.archive}")
        archive = data_dir / spec.archive
    else:
        if (home / spec.folder / "raw").is_dir():
            return home / spec.folder
        archive = home / spec.archive
        if not archive.is_file():
            if not fetch:
                raise DatasetError(f"{spec.name} is not downloaded; run without fetch or pass --data-dir")
            download(spec.url, archive)
    extracted = home / "extracted"
    if not (extracted / spec.folder / "raw").is_dir():
        with writing_cache(home):
            home.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(extracted, ignore_errors=True)
        _safe_extract(archive, extracted)
    if not (extracted / spec.folder / "raw").is_dir():
        raise DatasetError(f"{archive} does not unpack to {spec.folder}/raw/; is it the OGB {spec.archive}?")
    return extracted / spec.folder


def load_ogb(name: str, data_dir: Path | None = None, *, to_undirected: bool | None = None, mmap: bool = True) -> Graph:
    """Load an OGB node-property dataset through the on-disk cache, converting it on first use.

    Args:
        name: a key of :data:`OGB_DATASETS`.
        data_dir: the unzipped dataset directory, or a folder holding it or its zip; ``None``
            = the cache, downloading when online.
        to_undirected: add reverse edges; ``None`` = OGB's default (only ogbn-products);
            ogbn-products is always undirected.
        mmap: map the cached arrays instead of reading them into memory.

    Returns:
        A :class:`Graph`: float32 ``x``, int64 ``y`` (``-1`` for unlabelled nodes), OGB's split.

    Raises:
        DatasetError: unknown name, missing/truncated/corrupt files (named), failed download.
    """
    spec = OGB_DATASETS.get(name)
    if spec is None:
        raise DatasetError(f"unknown OGB dataset {name!r}; known: {', '.join(OGB_DATASETS)}")
    symmetric = spec.add_inverse_edge or bool(to_undirected)
    directory = find_ogb_directory(spec, data_dir)
    source = {"files": file_fingerprint(_raw_files(directory, spec.split, spec.binary)), "symmetric": symmetric}
    folder = processed_dir(name, "undirected" if symmetric else "directed")
    graph = load_cached(folder, source, mmap=mmap)
    if graph is None:
        log.info("converting %s from %s into %s (once)", name, directory, folder)
        convert_ogb_directory(directory, folder, name=name, split=spec.split, symmetric=symmetric,
                              binary=spec.binary, source=source)
        graph = read_back(folder, source, mmap=mmap)
    return graph
