"""OGB node-property format: a tiny directory in OGB's layout and compression, loaded through the on-disk
cache; errors that name the file; resumable, checksummed downloads (no network: file:// and a fake server)."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import sys
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from betty_trainer.config import DatasetConfig
from betty_trainer.data.feature_store import is_file_backed
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import download, load_dataset, load_ogb
from betty_trainer.datasets import ogb as ogb_module
from betty_trainer.datasets.cache import processed_dir
from betty_trainer.errors import DatasetError

N, E, F, C = 60, 300, 5, 4
download_module = sys.modules["betty_trainer.datasets.download"]  # the package exports the function of that name


def _gz_csv(path: Path, rows: np.ndarray, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:
        np.savetxt(handle, rows, fmt=fmt, delimiter=",")


def make_ogb_arrays(seed: int = 0, nan_labels: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(N, size=E), rng.integers(N, size=E)
    labels = rng.integers(C, size=N).astype(np.float64)
    labels[-1] = C - 1  # every class present
    order = rng.permutation(N)
    if nan_labels:
        labels[order[55:]] = np.nan  # the nodes in no split, as in papers100M
    return {"src": src, "dst": dst, "x": rng.standard_normal((N, F)).astype(np.float32), "y": labels,
            "train": order[:30], "valid": order[30:40], "test": order[40:55]}


def write_ogb_dir(root: Path, arrays: dict[str, np.ndarray], split: str = "time") -> Path:
    """The layout of OGB's unzipped ``arxiv.zip``: ``raw/*.csv.gz`` and ``split/<scheme>/*.csv.gz``."""
    raw = root / "raw"
    _gz_csv(raw / "edge.csv.gz", np.stack([arrays["src"], arrays["dst"]], 1), "%d")
    _gz_csv(raw / "node-feat.csv.gz", arrays["x"], "%.9g")  # 9 digits: float32 round-trips exactly
    _gz_csv(raw / "node-label.csv.gz", arrays["y"][:, None], "%.1f")
    _gz_csv(raw / "num-node-list.csv.gz", np.array([[N]]), "%d")
    _gz_csv(raw / "num-edge-list.csv.gz", np.array([[E]]), "%d")
    for part in ("train", "valid", "test"):
        _gz_csv(root / "split" / split / f"{part}.csv.gz", arrays[part][:, None], "%d")
    return root


def reference_graph(arrays, symmetric: bool) -> Graph:
    y = np.where(np.isnan(arrays["y"]), -1, arrays["y"]).astype(np.int64)
    return Graph.from_edges(torch.from_numpy(arrays["src"]), torch.from_numpy(arrays["dst"]), N,
                            symmetric=symmetric, x=torch.from_numpy(arrays["x"]), y=torch.from_numpy(y),
                            train_idx=torch.from_numpy(np.sort(arrays["train"])),
                            val_idx=torch.from_numpy(np.sort(arrays["valid"])),
                            test_idx=torch.from_numpy(np.sort(arrays["test"])), num_classes=C)


def assert_same_graph(got: Graph, want: Graph) -> None:
    for field in ("indptr", "indices", "x", "y", "train_idx", "val_idx", "test_idx"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.num_classes == want.num_classes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BETTY_DATA_DIR", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def arxiv(tmp_path):
    arrays = make_ogb_arrays()
    return write_ogb_dir(tmp_path / "arxiv", arrays), arrays


def test_ogb_directory_loads_identically_through_the_cache(arxiv, cache):
    directory, arrays = arxiv
    graph = load_ogb("ogbn-arxiv", directory)
    assert_same_graph(graph, reference_graph(arrays, symmetric=False))
    assert graph.indices.dtype == torch.int32 and graph.x.dtype == torch.float32
    assert (processed_dir("ogbn-arxiv", "directed") / "x.npy").is_file()
    assert is_file_backed(graph.x) and is_file_backed(graph.indices), "mapped from the cache, not read"
    in_memory = load_dataset(DatasetConfig(name="ogbn-arxiv", data_dir=directory, mmap=False))
    assert_same_graph(in_memory, graph)
    assert not is_file_backed(in_memory.x)
    undirected = load_dataset(DatasetConfig(name="ogbn-arxiv", data_dir=directory, to_undirected=True))
    assert_same_graph(undirected, reference_graph(arrays, symmetric=True))
    assert graph.num_edges < undirected.num_edges


def test_second_load_is_served_from_the_cache_without_parsing(arxiv, cache, monkeypatch):
    directory, arrays = arxiv
    first = load_ogb("ogbn-arxiv", directory)
    calls = []
    real_blocks = ogb_module._csv_blocks
    monkeypatch.setattr(ogb_module, "_csv_blocks", lambda *a: calls.append(a[0]) or real_blocks(*a))
    second = load_ogb("ogbn-arxiv", directory)
    assert calls == [], "a cached dataset is not parsed again"
    assert_same_graph(second, first)
    # the cache follows its source: a rewritten raw file is converted again
    changed = dict(arrays, dst=(arrays["dst"] + 1) % N)
    write_ogb_dir(directory, changed)
    third = load_ogb("ogbn-arxiv", directory)
    assert any(path.name == "edge.csv.gz" for path in calls)
    assert_same_graph(third, reference_graph(changed, symmetric=False))


def test_a_truncated_cache_file_is_rebuilt(arxiv, cache):
    directory, arrays = arxiv
    load_ogb("ogbn-arxiv", directory)
    x_file = processed_dir("ogbn-arxiv", "directed") / "x.npy"
    x_file.write_bytes(x_file.read_bytes()[:-7])
    assert_same_graph(load_ogb("ogbn-arxiv", directory), reference_graph(arrays, symmetric=False))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    with gzip.open(path, "wt") as handle:
        handle.write("0.5,0.25,not-a-number,1,2\n")


def _drop_last_row(path: Path) -> None:
    lines = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    path.write_bytes(gzip.compress(b"".join(lines[:-1])))


@pytest.mark.parametrize("file, damage, message", [
    ("raw/edge.csv.gz", _truncate, r"raw/edge.csv.gz is truncated or corrupt"),
    ("raw/node-feat.csv.gz", _garble, r"raw/node-feat.csv.gz is truncated or corrupt"),
    ("raw/node-label.csv.gz", _drop_last_row, r"raw/node-label.csv.gz has 59 rows, expected 60"),
    ("raw/edge.csv.gz", _drop_last_row, r"raw/edge.csv.gz has 299 rows, expected 300"),
    ("raw/node-label.csv.gz", Path.unlink, r"missing dataset file .*raw/node-label.csv.gz"),
    ("split/time/valid.csv.gz", Path.unlink, r"missing dataset file .*split/time/valid.csv.gz"),
])
def test_a_damaged_or_missing_file_is_named_in_one_line(arxiv, cache, file, damage, message):
    directory, _ = arxiv
    damage(directory / file)
    with pytest.raises(DatasetError, match=message) as error:
        load_ogb("ogbn-arxiv", directory)
    assert "\n" not in str(error.value)
    assert not processed_dir("ogbn-arxiv", "directed").exists(), "no half-written cache"
    assert not list(processed_dir("ogbn-arxiv", "directed").parent.glob(".*tmp*")), "temporary folder removed"


def test_betty_data_dir_is_searched_and_skipped_when_it_lacks_the_dataset(arxiv, cache, monkeypatch, tmp_path):
    directory, arrays = arxiv
    monkeypatch.setenv("BETTY_DATA_DIR", str(directory.parent))  # holds arxiv/raw
    assert_same_graph(load_ogb("ogbn-arxiv"), reference_graph(arrays, symmetric=False))
    monkeypatch.setenv("BETTY_DATA_DIR", str(tmp_path / "elsewhere"))  # holds nothing: the cache is next, offline
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(DatasetError, match="cannot download http://snap.stanford.edu/ogb/data/nodeproppred/arxiv.zip"):
        load_ogb("ogbn-arxiv")


def test_a_split_naming_an_unlabelled_node_is_refused(tmp_path, cache):
    arrays = make_ogb_arrays(nan_labels=True)
    arrays["y"][arrays["valid"][0]] = np.nan
    directory = write_ogb_dir(tmp_path / "arxiv", arrays)
    with pytest.raises(DatasetError, match=r"split/time/valid.csv.gz lists 1 node\(s\) without a label"):
        load_ogb("ogbn-arxiv", directory)


def test_raw_splits_that_overlap_are_the_datasets_fault_not_the_caches(tmp_path, cache):
    """The graph's own check (a node in two splits) is raised as it is on reading the converted cache back, not taken
    for a corrupt cache to delete and rebuild (a review finding)."""
    arrays = make_ogb_arrays()
    arrays["valid"][0] = arrays["train"][0]
    directory = write_ogb_dir(tmp_path / "arxiv", arrays)
    for _ in range(2):  # the same message again: nothing was left to "rebuild"
        with pytest.raises(DatasetError, match=r"invalid graph 'ogbn-arxiv': node \d+ is in both train_idx and val_idx"):
            load_ogb("ogbn-arxiv", directory)


def test_products_adds_the_reverse_edges_it_stores_once(tmp_path, cache):
    arrays = make_ogb_arrays(seed=1)
    directory = write_ogb_dir(tmp_path / "products", arrays, split="sales_ranking")
    assert_same_graph(load_ogb("ogbn-products", directory, to_undirected=False), reference_graph(arrays, symmetric=True))


def test_papers100m_binary_layout_with_unlabelled_nodes(tmp_path, cache):
    arrays = make_ogb_arrays(seed=2, nan_labels=True)
    root = tmp_path / "papers100M-bin"
    (root / "raw").mkdir(parents=True)
    np.savez_compressed(root / "raw" / "data.npz", edge_index=np.stack([arrays["src"], arrays["dst"]]),
                        node_feat=arrays["x"], num_nodes_list=np.array([N]), num_edges_list=np.array([E]))
    np.savez(root / "raw" / "node-label.npz", node_label=arrays["y"][:, None].astype(np.float32))
    for part in ("train", "valid", "test"):
        _gz_csv(root / "split" / "time" / f"{part}.csv.gz", arrays[part][:, None], "%d")
    graph = load_ogb("ogbn-papers100M", tmp_path)  # data_dir may also be the folder holding the dataset directory
    assert_same_graph(graph, reference_graph(arrays, symmetric=False))
    assert (graph.y == -1).sum() == 5


def _zip_dir(directory: Path, top: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                archive.write(path, f"{top}/{path.relative_to(directory)}")
    return buffer.getvalue()


class FakeServer:
    """Serves one body over a fake ``urlopen``; honours ``Range`` and can cut the first response short."""

    def __init__(self, body: bytes, cut_first_at: int | None = None):
        self.body, self.cut, self.requests = body, cut_first_at, []

    def urlopen(self, request, timeout=None):
        headers = dict(request.header_items()) if isinstance(request, urllib.request.Request) else {}
        self.requests.append(headers.get("Range"))
        start = int(headers["Range"].split("=")[1].rstrip("-")) if "Range" in headers else 0
        payload = self.body[start:]
        server = self

        class Response(io.BytesIO):
            status = 206 if start else 200
            headers = {"Content-Length": str(len(payload))}

            def read(self, size=-1):
                if server.cut is not None and self.tell() + (size if size > 0 else len(payload)) > server.cut:
                    server.cut = None
                    raise OSError("connection reset")
                return super().read(size)

            def getcode(self):
                return self.status

        return Response(payload)


def test_download_resumes_verifies_and_converts_once(arxiv, cache, monkeypatch):
    directory, arrays = arxiv
    body = _zip_dir(directory, "arxiv")
    server = FakeServer(body, cut_first_at=len(body) // 2)
    monkeypatch.setattr(download_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr("urllib.request.urlopen", server.urlopen)
    with pytest.raises(DatasetError, match="resumes next time"):
        load_ogb("ogbn-arxiv")
    partial = cache / "ogbn-arxiv" / "arxiv.zip.part"
    assert 0 < partial.stat().st_size < len(body)
    graph = load_ogb("ogbn-arxiv")
    assert server.requests == [None, f"bytes={partial_size(server, body)}-"]
    assert_same_graph(graph, reference_graph(arrays, symmetric=False))
    assert (cache / "ogbn-arxiv" / "arxiv.zip").read_bytes() == body
    assert (cache / "ogbn-arxiv" / "arxiv.zip.sha256").read_text().split()[0] == hashlib.sha256(body).hexdigest()
    load_ogb("ogbn-arxiv")
    assert len(server.requests) == 2, "the archive is not fetched again"


def partial_size(server: FakeServer, body: bytes) -> int:
    """Bytes written before the cut: whole 1 KiB chunks up to the cut point."""
    return (len(body) // 2) // 1024 * 1024


def test_download_from_a_file_url_checks_the_pinned_sha256(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 5000)
    good = "0" * 64
    with pytest.raises(DatasetError, match="does not match"):
        download(source.as_uri(), tmp_path / "got.bin", sha256=good)
    assert not (tmp_path / "got.bin").exists() and not (tmp_path / "got.bin.part").exists()
    pinned = hashlib.sha256(b"x" * 5000).hexdigest()
    assert download(source.as_uri(), tmp_path / "got.bin", sha256=pinned).read_bytes() == b"x" * 5000


def test_a_zip_member_outside_the_folder_is_refused(tmp_path, cache):
    archive = tmp_path / "arxiv.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("../evil.txt", "x")
    with pytest.raises(DatasetError, match="unsafe path"):
        load_ogb("ogbn-arxiv", tmp_path)
    assert not (cache / "evil.txt").exists() and not (tmp_path.parent / "evil.txt").exists()


def test_a_full_disk_while_extracting_blames_the_cache_and_keeps_the_archive(arxiv, cache, monkeypatch, tmp_path):
    directory, _ = arxiv
    archive = tmp_path / "zipped" / "arxiv.zip"
    archive.parent.mkdir()
    archive.write_bytes(_zip_dir(directory, "arxiv"))

    def full(self, path=None, members=None, pwd=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", full)
    with pytest.raises(DatasetError, match=r"cannot write the cache folder .*No space left on device \(ENOSPC\)"):
        load_ogb("ogbn-arxiv", archive.parent)
    assert archive.is_file(), "the archive is fine: nothing tells the user to delete it"
    assert not any(cache.rglob("*.extracting")), "the partial extraction is removed"


def test_an_unreadable_archive_is_the_archives_problem_not_the_caches(tmp_path, cache, monkeypatch):
    archive = tmp_path / "arxiv.zip"
    archive.write_bytes(b"PK")

    def unreadable(self, file, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(file))

    monkeypatch.setattr(zipfile.ZipFile, "__init__", unreadable)
    with pytest.raises(DatasetError, match=r"arxiv.zip is not a complete zip archive \(.*Permission denied"):
        load_ogb("ogbn-arxiv", tmp_path)
