"""Downloads into the cache: streamed, checksummed, resumable where the server honours ``Range``.

A file is fetched to ``<target>.part`` in chunks while its sha256 is computed; only a
complete file whose checksum matches is renamed to ``<target>``. An interrupted download
keeps its ``.part``; the next attempt asks for the rest (``Range: bytes=<have>-``) and
appends if the server answers ``206 Partial Content``, or starts over on a plain ``200``
(``file://`` URLs and servers without range support). Where the registry pins no sha256
(OGB publishes none), the digest of the first complete download is written beside the
file as ``<target>.sha256`` and later downloads must match it.

Uses only :mod:`urllib.request` (``urllib.request.urlopen`` is looked up at call time, so
tests replace it).
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path

from betty_trainer.datasets.cache import writing_cache
from betty_trainer.errors import DatasetError

CHUNK_BYTES = 1 << 20


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, target: Path, sha256: str = "", timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``target`` (see the module docstring); a ``target`` that exists is kept.

    Args:
        url: ``http(s)://`` or ``file://`` URL.
        target: where the complete file goes; its folder is created.
        sha256: expected hex digest; ``""`` = not pinned (trust the first download, record it).
        timeout: socket timeout in seconds.

    Returns:
        ``target``.

    Raises:
        DatasetError: the download fails (offline: the message says to pass ``--data-dir``),
            is shorter than the server announced, or its checksum does not match (the
            partial file is deleted so the next attempt starts clean), or the cache folder cannot be
            written (:func:`~betty_trainer.datasets.cache.writing_cache`).
    """
    if target.is_file():
        return target
    partial = target.with_name(target.name + ".part")
    with writing_cache(target.parent):  # a cache that cannot be written is named before anything is downloaded
        target.parent.mkdir(parents=True, exist_ok=True)
        open(partial, "ab").close()
    have = partial.stat().st_size if partial.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status = getattr(response, "status", None) or response.getcode() or 200
            if have and status == 206:
                with open(partial, "rb") as handle:  # resume: hash what we already have
                    for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
                        digest.update(block)
                mode = "ab"
            else:
                have, mode = 0, "wb"
            length = response.headers.get("Content-Length") if response.headers else None
            received = 0
            with open(partial, mode) as out:
                for block in iter(lambda: response.read(CHUNK_BYTES), b""):
                    out.write(block)
                    digest.update(block)
                    received += len(block)
    except (urllib.error.URLError, OSError) as error:
        if partial.is_file() and partial.stat().st_size == 0:
            partial.unlink()
        raise DatasetError(
            f"cannot download {url} ({getattr(error, 'reason', error)}); offline, pass --data-dir or set "
            f"BETTY_DATA_DIR to a folder holding the files (a partial download resumes next time)"
        ) from None
    if length is not None and received != int(length):
        raise DatasetError(f"download of {url} stopped after {received} of {length} bytes; run again to resume")
    actual = digest.hexdigest()
    recorded = target.with_name(target.name + ".sha256")
    expected = sha256 or (recorded.read_text().split()[0] if recorded.is_file() else "")
    if expected and actual != expected:
        partial.unlink()
        raise DatasetError(f"downloaded {url} but its sha256 {actual[:16]}… does not match {expected[:16]}…; "
                           "deleted, not saved")
    with writing_cache(target.parent):
        if not sha256:
            recorded.write_text(f"{actual}  {target.name}\n")
        os.replace(partial, target)
    return target
