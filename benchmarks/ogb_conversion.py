"""Converting an OGB directory once versus opening its cache: the two loads of one dataset, side by side.

Issue 9, Build 1: an OGB node-property directory is converted once into memory-mappable
``.npy`` files, so later runs start in seconds. No OGB file can be downloaded here, so the
script writes a directory in OGB's exact layout and compression with ogbn-arxiv's sizes
(169,343 nodes, 1,166,243 edges, 128 float features, 40 classes, ``split/time``; random
values), then times :func:`betty_trainer.datasets.load_ogb` twice in one process: the
first call parses the gzip CSVs (pyarrow) and writes the cache, the second maps it. It
prints both times, their ratio, and the extra peak RSS of each (``VmHWM`` reset through
``/proc/self/clear_refs``; Linux).

Run:
    python benchmarks/ogb_conversion.py                 # arxiv-sized
    python benchmarks/ogb_conversion.py --scale 0.1     # a tenth of it

Measured here (2 shared cores, loaded, 2026-11-22), arxiv-sized (90.5 MiB of gzip CSV):
first load 12.72 s and 0.30 GiB extra peak RSS, second load 0.124 s and 0.01 GiB: 103x.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path

import numpy as np

ARXIV = (169_343, 1_166_243, 128, 40)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", compresslevel=6) as handle:
        handle.write(text)


def write_arxiv_like(root: Path, scale: float, seed: int = 0) -> None:
    """An OGB-layout directory with arxiv's sizes times ``scale`` (random graph, features, labels, split)."""
    nodes, edges, width, classes = (int(ARXIV[0] * scale), int(ARXIV[1] * scale), ARXIV[2], ARXIV[3])
    rng = np.random.default_rng(seed)
    raw = root / "raw"
    pairs = rng.integers(nodes, size=(edges, 2))
    _gz(raw / "edge.csv.gz", "\n".join(f"{a},{b}" for a, b in pairs.tolist()) + "\n")
    features = rng.standard_normal((nodes, width)).astype(np.float32)
    with gzip.open(raw / "node-feat.csv.gz", "wt", compresslevel=6) as handle:
        np.savetxt(handle, features, fmt="%.6f", delimiter=",")  # arxiv's own files carry 6 decimals
    _gz(raw / "node-label.csv.gz", "\n".join(map(str, rng.integers(classes, size=nodes).tolist())) + "\n")
    _gz(raw / "num-node-list.csv.gz", f"{nodes}\n")
    _gz(raw / "num-edge-list.csv.gz", f"{edges}\n")
    order = rng.permutation(nodes)
    cuts = (int(0.54 * nodes), int(0.71 * nodes))
    for name, part in (("train", order[: cuts[0]]), ("valid", order[cuts[0]: cuts[1]]), ("test", order[cuts[1]:])):
        _gz(root / "split" / "time" / f"{name}.csv.gz", "\n".join(map(str, part.tolist())) + "\n")


def timed(fn):
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start, (_status_kib("VmHWM") - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of ogbn-arxiv's size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        import os

        os.environ["BETTY_CACHE_DIR"] = str(Path(scratch) / "cache")
        from betty_trainer.datasets import load_ogb

        directory = Path(scratch) / "arxiv"
        start = time.perf_counter()
        write_arxiv_like(directory, args.scale)
        raw_bytes = sum(path.stat().st_size for path in directory.rglob("*.gz"))
        print(f"wrote an OGB-layout directory ({raw_bytes / 2**20:.1f} MiB of gzip CSV) in "
              f"{time.perf_counter() - start:.1f} s")
        first, convert_s, convert_gib = timed(lambda: load_ogb("ogbn-arxiv", directory))
        second, open_s, open_gib = timed(lambda: load_ogb("ogbn-arxiv", directory))
        print(f"{first}")
        print("| load | seconds | extra peak RSS GiB |\n|---|---|---|")
        print(f"| first (parse + convert + map) | {convert_s:.2f} | {convert_gib:.2f} |")
        print(f"| second (map the cache) | {open_s:.3f} | {open_gib:.2f} |")
        print(f"first / second: {convert_s / open_s:.0f}x")


if __name__ == "__main__":
    main()
