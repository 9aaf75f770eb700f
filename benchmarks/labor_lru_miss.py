"""Which counting gives which LRU miss rate (issue 8, Dependency done-when): LABOR's batch dependency κ = 1 against
κ = 64, under several rules for what a batch reads (its input nodes, or every layer's src nodes in either order),
on ego-Twitter undirected and directed as stored, LABOR-0 and LABOR-*, with and without layer dependency.

Ours reads through a real LRU :class:`~betty_trainer.data.cache.CachedFeatureStore` of ``--lru`` of the nodes;
where DGL's environment exists, DGL's ``LaborSampler`` is beside, its reads counted by
:func:`sampling.lru_miss_rate` (the same LRU, simulated). The seed batches are :mod:`sampling`'s measured
sequence on ``--graph``. Run from the repository root::

    python benchmarks/labor_lru_miss.py --batches 79 --seed-order id

The same file is DGL's side (``--dgl-side``, run with DGL's Python; it imports nothing from betty-trainer).
"""

from __future__ import annotations

from common import load_graph, markdown_table, shared_folder  # this folder

import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess, serve  # this folder: both sides load it
from sampling import DGLSide, batch_arguments, epoch_batches, lru_miss_rate  # this folder


def reads_of(count: str, input_nodes, layer_nodes: list) -> list:
    """The gathers one batch makes under a counting rule: ``inputs`` one gather of the input nodes;
    ``layers-in`` one gather per layer of its src nodes, input layer first, then the seeds; ``layers-out``
    the same, seeds first (the order sampling visits them)."""
    if count == "inputs":
        return [input_nodes]
    return list(layer_nodes) if count == "layers-in" else list(reversed(layer_nodes))


class DGLStudy(DGLSide):
    """DGL's side: DGL's LaborSampler batches, counted by :func:`lru_miss_rate`."""

    def lru(self, seeds: str, batch_size: int, fanouts: list[int], importance: int, kappa: float,
            layer_dependency: bool, count: str, seed: int, capacity: int | list[int]) -> dict:
        """The miss rate of an LRU of ``capacity`` nodes (a list: one rate per capacity, over the same batches)."""
        from dgl.dataloading import LaborSampler

        self.dgl.seed(seed)
        sampler = LaborSampler(fanouts, importance_sampling=importance, layer_dependency=layer_dependency,
                               batch_dependency=10**9 if kappa == math.inf else int(kappa))
        reads = []
        for batch in torch.from_numpy(np.load(seeds)).split(batch_size):
            input_nodes, output_nodes, blocks = sampler.sample_blocks(self.graph, batch)
            layers = [b.srcdata[self.dgl.NID] for b in blocks] + [output_nodes]
            reads += [r.numpy() for r in reads_of(count, input_nodes, layers)]
        n = self.graph.num_nodes()
        miss = [lru_miss_rate(reads, n, c) for c in capacity] if isinstance(capacity, list) else \
            lru_miss_rate(reads, n, capacity)
        return {"miss": miss, "reads_per_batch": sum(r.size for r in reads) / (len(reads) or 1)}



def load_directed_jlg(data_dir: Path | None):
    """ego-Twitter's .jlg (in ``data_dir``, else its folder in ../shared/datasets) with its edges as stored
    (``src → dst``, one direction; the file lists each undirected edge once), as a naive
    ``dgl.graph((src, dst))`` would read it."""
    from betty_trainer.data.graph import Graph
    from betty_trainer.datasets import DATASETS, read_jlg

    file = next(iter(DATASETS["snap-ego-twitter"].files))
    num_nodes, _, src, dst = read_jlg((data_dir or shared_folder("ego-twitter")) / file)
    empty = torch.zeros(0, dtype=torch.int64)
    return Graph.from_edges(torch.from_numpy(src), torch.from_numpy(dst), num_nodes, symmetric=False,
                            x=torch.zeros(num_nodes, 1), y=torch.zeros(num_nodes, dtype=torch.int64),
                            train_idx=empty, val_idx=empty, test_idx=empty, num_classes=1, name="ego-twitter-directed")


def our_lru(graph, batches, fanouts, importance, kappa, layer_dependency, count, seed, capacity) -> dict:
    """Our LaborSampler's batches read through a real LRU :class:`CachedFeatureStore` (one gather per read
    of :func:`reads_of`); the miss rate is checked against :func:`lru_miss_rate` of the same reads.
    ``capacity`` a list: the same batches through one cache per capacity, ``miss`` a list of their rates."""
    from betty_trainer.data.cache import CachedFeatureStore
    from betty_trainer.data.feature_store import HostFeatureStore
    from betty_trainer.sampling import LaborSampler, SampleKey

    sampler = LaborSampler(graph, fanouts, importance_iterations=importance, layer_dependency=layer_dependency,
                           batch_dependency=kappa, batches_per_epoch=len(batches))
    capacities = capacity if isinstance(capacity, list) else [capacity]
    host = HostFeatureStore(torch.zeros(graph.num_nodes, 1), pin=False)
    stores = [CachedFeatureStore(host, "cpu", "lru", c) for c in capacities]
    reads = []
    for step, seeds in enumerate(batches):
        batch = sampler.sample(seeds, SampleKey(seed, 0, step))
        layers = [block.src_nodes for block in batch.blocks] + [batch.output_nodes]
        for nodes in reads_of(count, batch.input_nodes, layers):
            for store in stores:
                store.gather(nodes, "cpu")
            reads.append(nodes.numpy())
    misses = []
    for store, c in zip(stores, capacities):
        miss = store.stats.misses / (store.stats.hits + store.stats.misses)
        simulated = lru_miss_rate(reads, graph.num_nodes, c)
        assert abs(miss - simulated) < 1e-12, (miss, simulated)
        misses.append(miss)
    return {"miss": misses if isinstance(capacity, list) else misses[0],
            "reads_per_batch": sum(r.size for r in reads) / len(batches)}


def lru_study(args, batches: list[torch.Tensor]) -> None:
    """LRU miss rate at κ = 1 and 64 under several counting rules, ours (a real LRU cache) and DGL's
    LaborSampler (the same LRU, simulated) side by side."""
    graphs = {"undirected": load_graph("ego-twitter", args.data_dir),
              "directed as stored": load_directed_jlg(args.data_dir)}
    variants = [("undirected", 0, False, "inputs"), ("undirected", 0, False, "layers-in"),
                ("undirected", 0, False, "layers-out"), ("undirected", 0, True, "inputs"),
                ("undirected", -1, False, "inputs"), ("directed as stored", 0, False, "inputs"),
                ("directed as stored", 0, False, "layers-out"), ("undirected", 0, True, "layers-out")]
    if args.variants:
        variants = [variants[int(i)] for i in args.variants.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        np.save(scratch / "seeds.npy", torch.cat(batches).numpy())
        dgl = None
        if args.dgl_python and Path(args.dgl_python).exists():
            dgl = DGLProcess(args.dgl_python, Path(__file__).resolve(), ["--dgl-side"], args.threads,
                             scratch / "dgl.log")
            print(f"DGL {dgl('hello')['dgl']} side by side", flush=True)
        loaded = None
        for name, importance, layer_dependency, count in variants:
            graph = graphs[name]
            capacity = int(args.lru * graph.num_nodes)
            if dgl is not None and loaded != name:
                folder = scratch / name.replace(" ", "-")
                folder.mkdir()
                np.save(folder / "indptr.npy", graph.indptr.numpy())
                np.save(folder / "indices.npy", graph.indices.numpy())
                dgl("load", folder=str(folder))
                loaded = name
            cells = []
            for kappa in (1, 64):
                ours = our_lru(graph, batches, args.fanouts, importance, kappa, layer_dependency, count, args.seed,
                               capacity)
                theirs = dgl("lru", seeds=str(scratch / "seeds.npy"), batch_size=args.batch_size, fanouts=args.fanouts,
                             importance=importance, kappa=kappa, layer_dependency=layer_dependency, count=count,
                             seed=args.seed, capacity=capacity) if dgl is not None else None
                cells.append((ours, theirs))
            label = (f"{name}, {'LABOR-*' if importance else 'LABOR-0'}"
                     f"{', layer dependency' if layer_dependency else ''}, reads: {count}")
            rows.append((label, cells))
            print(f"  {label}: " + "; ".join(
                f"κ={k} ours {o['miss']:.3f} ({o['reads_per_batch']:,.0f} reads/batch)"
                + (f", DGL {t['miss']:.3f}" if t else "") for k, (o, t) in zip((1, 64), cells)), flush=True)
        if dgl is not None:
            dgl.close()
    print_lru_table(rows)


def print_lru_table(rows: list[tuple[str, list[tuple[dict, dict | None]]]]) -> None:
    header = ["graph, sampler, what a batch reads", "reads/batch κ=1", "ours κ=1", "ours κ=64", "ours κ64/κ1",
              "DGL κ=1", "DGL κ=64", "DGL κ64/κ1"]
    cells = []
    for label, ((o1, t1), (o64, t64)) in rows:
        dgl_cells = [f"{t1['miss']:.3f}", f"{t64['miss']:.3f}", f"{t64['miss'] / t1['miss']:.2f}"] if t1 else [""] * 3
        cells.append([label, f"{o1['reads_per_batch']:,.0f}", f"{o1['miss']:.3f}", f"{o64['miss']:.3f}",
                      f"{o64['miss'] / o1['miss']:.2f}", *dgl_cells])
    print("\n" + markdown_table(header, cells))


def main(argv=None) -> None:
    parser = batch_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--dgl-side", action="store_true", help="serve DGL's side (run with DGL's Python)")
    parser.add_argument("--variants", default="", help="comma list of variant numbers (default: all)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    args = parser.parse_args(argv)
    if args.dgl_side:
        serve(DGLStudy())
        return
    torch.set_num_threads(args.threads)
    _, _, batches = epoch_batches(args)
    print(f"{args.graph}: LRU of {args.lru:.0%} of the nodes; fanouts {args.fanouts}, {len(batches)} batches of "
          f"{args.batch_size} seeds ({args.seed_order})", flush=True)
    lru_study(args, batches)


if __name__ == "__main__":
    main()
