"""The on-disk cache of converted graphs: one ``.npy`` file per array, memory-mapped when loaded.

A dataset whose raw form is slow to parse (OGB's gzip CSVs, a generated power-law graph)
is converted **once** into a folder of ``.npy`` files — ``indptr`` (int64), ``indices``
(int32 when ``N < 2³¹``), ``x`` (float32), ``y`` (int64, ``-1`` = unlabelled),
``train_idx``/``val_idx``/``test_idx`` (int64) — plus ``meta.json``. Later runs map the
files (``np.load(mmap_mode="c")``: copy-on-write, pages are read on demand from the page
cache, nothing is copied into the process until written), so a products-scale graph opens
in well under a second and its features need not fit in RAM.

``meta.json`` records the format version, each array's dtype and shape, and a *source*
description (the raw files' paths, sizes and modification times, or a generator's
parameters). A folder is used only if its meta matches the source asked for and every
array file has the size its header promises; otherwise it is rebuilt. A folder is
written under a temporary name and renamed into place when complete, so an interrupted
conversion never leaves a folder that looks usable.

Where: ``$BETTY_CACHE_DIR`` (default ``~/.cache/betty-trainer``) ``/<dataset>/processed/<variant>``.

Every cache under ``$BETTY_CACHE_DIR`` (converted datasets, aggregation tables, ownerships, downloads) is written
inside :func:`writing_cache`, so a cache folder that cannot be written (``BETTY_CACHE_DIR`` a file, read-only, a
full disk) is one :class:`DatasetError` naming the folder and the fix, and a cached file that cannot be read
(empty, truncated, corrupt) is rebuilt where it is found. Not yet the extraction of a downloaded OGB archive: a
write that fails there is reported as an incomplete archive.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npy_format

from betty_trainer.data.graph import Graph
from betty_trainer.errors import DatasetError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
ARRAYS = ("indptr", "indices", "x", "y", "train_idx", "val_idx", "test_idx")


def cache_dir() -> Path:
    """The download and conversion cache: ``$BETTY_CACHE_DIR`` or ``~/.cache/betty-trainer``."""
    return Path(os.environ.get("BETTY_CACHE_DIR", Path.home() / ".cache" / "betty-trainer"))


@contextlib.contextmanager
def writing_cache(folder: Path) -> Iterator[None]:
    """Write under the cache folder ``folder`` inside this block: an ``OSError`` (the cache is a file, read-only,
    the disk is full) becomes one line.

    Raises:
        DatasetError: naming ``folder``, the cause and the fix (a writable ``BETTY_CACHE_DIR``).
    """
    try:
        yield
    except OSError as error:
        code = errno.errorcode.get(error.errno, "?") if error.errno else "?"
        raise DatasetError(f"cannot write the cache folder {folder}: {error.strerror or error} ({code}); "
                           f"BETTY_CACHE_DIR ({cache_dir()}) must be a writable folder with free space: point it at "
                           "one, or free space there") from None


def cache_corrupt(folder: Path, what: str) -> str:
    """The message of a cache folder that cannot be used even after rebuilding it: ``what`` happened, deleting
    ``folder`` rebuilds it."""
    return f"the cache {folder} {what}; delete {folder} and run again to rebuild it (check the disk's free space)"


def processed_dir(name: str, variant: str = "default") -> Path:
    """The folder of dataset ``name``'s converted arrays for one preprocessing ``variant``."""
    return cache_dir() / name / "processed" / variant


def file_fingerprint(paths: list[Path]) -> list[list[Any]]:
    """``[[resolved path, size in bytes, mtime in ns], ...]`` of ``paths``: what a cached conversion of
    those files depends on (cheap: no file is read).

    Raises:
        DatasetError: a file is missing.
    """
    out = []
    for path in paths:
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise DatasetError(f"missing dataset file {path}") from None
        out.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return out


class CacheWriter:
    """Writes one cached graph folder: arrays into a temporary folder, renamed into place by :meth:`commit`.

    Use as a context manager; leaving the block without :meth:`commit` (an exception)
    deletes the temporary folder.

    Args:
        folder: the final folder (replaced if it exists when committing).
        required: the arrays :meth:`commit` insists on (default: a graph's, :data:`ARRAYS`).
    """

    def __init__(self, folder: Path, required: Sequence[str] = ARRAYS):
        self.folder, self.required = folder, tuple(required)
        self.tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with writing_cache(folder):
            self.tmp.mkdir(parents=True)
        self.arrays: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def open(self, name: str, shape: tuple[int, ...], dtype) -> np.memmap:
        """A writable ``np.memmap`` backed by ``<name>.npy`` (filled by the caller, e.g. chunk by chunk)."""
        self.arrays[name] = {"dtype": np.dtype(dtype).str, "shape": list(shape)}
        with writing_cache(self.folder):
            return npy_format.open_memmap(self.tmp / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)

    def save(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` as ``<name>.npy``."""
        array = np.ascontiguousarray(array)
        self.arrays[name] = {"dtype": array.dtype.str, "shape": list(array.shape)}
        with writing_cache(self.folder):
            np.save(self.tmp / f"{name}.npy", array, allow_pickle=False)

    def commit(self, meta: dict[str, Any]) -> Path:
        """Write ``meta.json`` (with the arrays' dtypes and shapes) and move the folder into place.

        Raises:
            DatasetError: a required array (:data:`ARRAYS` by default) was not written, or the folder cannot be
                written (:func:`writing_cache`).
        """
        missing = [name for name in self.required if name not in self.arrays]
        if missing:
            raise DatasetError(f"cache of {self.folder} lacks {', '.join(missing)} (a bug in its builder)")
        meta = {**meta, "format": CACHE_FORMAT, "arrays": self.arrays}
        with writing_cache(self.folder):
            (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if self.folder.exists():
                shutil.rmtree(self.folder)
            os.replace(self.tmp, self.folder)
        return self.folder


def save_graph(graph: Graph, folder: Path, source: Any) -> Path:
    """Cache an in-memory :class:`Graph` in ``folder`` (see the module docstring).

    Args:
        graph: the graph.
        folder: target folder (replaced).
        source: JSON-serialisable description of what the graph was built from.

    Returns:
        ``folder``.
    """
    with CacheWriter(folder) as writer:
        for name in ARRAYS:
            writer.save(name, getattr(graph, name).numpy())
        return writer.commit({"name": graph.name, "num_classes": graph.num_classes, "source": source})


def read_meta(folder: Path) -> dict[str, Any] | None:
    """``folder/meta.json`` if it exists and parses, else ``None``."""
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _complete(folder: Path, meta: dict[str, Any]) -> bool:
    """Whether every array file exists with the size its recorded dtype and shape need."""
    for name in ARRAYS:
        spec = meta.get("arrays", {}).get(name)
        if spec is None:
            return False
        path = folder / f"{name}.npy"
        try:
            with open(path, "rb") as handle:
                version = npy_format.read_magic(handle)
                header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
                shape, _, dtype = header(handle)
                offset = handle.tell()
            size = path.stat().st_size
        except (OSError, ValueError, EOFError):
            return False
        if list(shape) != spec["shape"] or dtype.str != spec["dtype"]:
            return False
        if size != offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            return False
    return True


def load_cached(folder: Path, source: Any, mmap: bool = True, *, invalid_rebuilds: bool = True) -> Graph | None:
    """The graph cached in ``folder`` if it was built from ``source`` and is complete, else ``None``.

    A cache whose arrays make no valid :class:`Graph` (one left inconsistent) is rebuilt (``None``, with a warning)
    unless ``invalid_rebuilds`` is false (:func:`read_back`): right after a conversion the graph's own error is the
    dataset's, and rebuilding would meet it again.

    Args:
        folder: a folder written by :class:`CacheWriter` / :func:`save_graph`.
        source: the source description the cache must have been built from (compared with
            the one in ``meta.json`` after a JSON round trip).
        mmap: map the arrays copy-on-write (``np.load(mmap_mode="c")``) instead of reading them.

    Returns:
        A :class:`Graph` whose tensors share memory with the mapped files, or ``None``
        (no cache, another source, another format version, or a truncated file: the caller
        rebuilds it).
    """
    meta = read_meta(folder)
    if meta is None:
        return None
    if meta.get("format") != CACHE_FORMAT or meta.get("source") != json.loads(json.dumps(source)):
        log.info("cache %s is stale (format or source changed); rebuilding", folder)
        return None
    if not _complete(folder, meta):
        log.warning("cache %s is incomplete or truncated; rebuilding", folder)
        return None
    try:
        arrays = {}
        for name in ARRAYS:
            empty = 0 in meta["arrays"][name]["shape"]  # an empty file cannot be mapped
            arrays[name] = np.load(folder / f"{name}.npy", mmap_mode="c" if mmap and not empty else None,
                                   allow_pickle=False)
        return Graph(**{name: torch.from_numpy(array) for name, array in arrays.items()},
                     num_classes=int(meta["num_classes"]), name=str(meta["name"]), check_features=False)
    except (OSError, ValueError, EOFError, KeyError, TypeError, DatasetError) as error:
        if isinstance(error, DatasetError) and not invalid_rebuilds:
            raise
        log.warning("cache %s is corrupt (%s); rebuilding", folder, str(error).splitlines()[0] if str(error) else
                    type(error).__name__)
        return None


def read_back(folder: Path, source: Any, mmap: bool = True) -> Graph:
    """The graph a conversion has just written to ``folder`` (:func:`load_cached`; the dataset's own errors raised).

    Raises:
        DatasetError: the written cache cannot be read (naming the folder to delete), or its graph is invalid (the
            graph's message: the raw data's fault).
    """
    graph = load_cached(folder, source, mmap=mmap, invalid_rebuilds=False)
    if graph is None:
        raise DatasetError(cache_corrupt(folder, "could not be read back after writing it"))
    return graph
