"""Samplers side by side (issue 8): NS, LABOR-0, LABOR-1, LABOR-*, LABOR-0 with batch dependency
κ ∈ {1, 16, 64, 256, ∞}, GNS; and, where DGL's environment exists, DGL's ``NeighborSampler`` and
``LaborSampler`` on the same graph, seeds and threads, in the same run.

For each sampler, over one sequence of mini-batches (a shuffled epoch's first ``--batches``
batches of ``--batch-size`` seeds):

* input nodes per layer (mean over batches; the input layer first, the seeds last);
* sampled edges per batch;
* throughput, seeds per second (median of ``--reps`` timed passes after one warm-up pass);
* the miss rate of an LRU cache holding ``--lru`` of the nodes, simulated at batch granularity
  (the cache holds the most recently read nodes, a batch's reads counted before it updates the
  cache; ties within a batch broken by node id): the feature reads that would cross PCIe;
* for GNS, the input nodes outside its node cache (the reads when the cache is the device cache).

Run from the repository root (takes a few minutes on 2 loaded cores)::

    python benchmarks/sampling.py --graph ego-twitter --fanouts 10,10,10 --batch-size 1024 --batches 48

``--gns-study`` prints GNS against NS at equal fanouts in the GNS paper's setting, graph by graph and
cache size by cache size (see :func:`gns_study`)::

    python benchmarks/sampling.py --gns-study --graphs amazon-computers,ego-twitter --gns-caches 0.01,0.05

``--gns-bias`` measures how far GNS's importance-weighted sum (GCN), mean (SAGE) and GCN layer are from
the full neighbourhood's across caches (see :func:`gns_bias`)::

    python benchmarks/sampling.py --gns-bias --graph amazon-computers --fanouts 10 --threads 1

The same file is DGL's side: ``~/.cache/betty-trainer/dgl-venv/bin/python benchmarks/sampling.py --dgl-side`` serves
JSON-line commands and imports nothing from betty-trainer (DGL's environment pins its own torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess, serve  # this folder: both sides load it

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = REPO_ROOT.parent / "shared" / "datasets"


# --- shared by both sides ----------------------------------------------------------------------------------

def lru_miss_rate(inputs: list[np.ndarray], num_nodes: int, capacity: int) -> float:
    """Misses / reads of an LRU cache of ``capacity`` nodes over batches reading ``inputs`` (in order).

    Batch granularity: before batch ``i`` the cache holds the ``capacity`` nodes read most recently
    (by last batch, ties by node id); the batch's reads hit iff cached; then every read node is
    stamped with ``i``. O(N) per batch.
    """
    last = np.full(num_nodes, -1, dtype=np.int64)
    reads = misses = 0
    for index, nodes in enumerate(inputs):
        seen = np.flatnonzero(last >= 0)
        if seen.size > capacity:
            key = last[seen] * num_nodes + seen
            threshold = np.partition(key, seen.size - capacity)[seen.size - capacity]
            cached_key = np.where(last[nodes] >= 0, last[nodes] * num_nodes + nodes, -1)
            hits = int((cached_key >= threshold).sum())
        else:
            hits = int((last[nodes] >= 0).sum())
        reads += nodes.size
        misses += nodes.size - hits
        last[nodes] = index
    return misses / max(reads, 1)


def summarize(batches_nodes: list[list[int]], edges: list[int]) -> dict:
    counts = np.asarray(batches_nodes, dtype=np.float64)
    return {"nodes_per_layer": counts.mean(0).tolist(), "edges": float(np.mean(edges))}


# --- DGL's side (runs in DGL's environment) -----------------------------------------------------------------

class DGLSide:
    """DGL samplers on one graph; answers ``load`` and ``run`` commands."""

    def __init__(self) -> None:
        import dgl

        self.dgl = dgl
        self.graph = None

    def load(self, folder: str) -> dict:
        indptr = torch.from_numpy(np.load(Path(folder) / "indptr.npy")).long()
        indices = torch.from_numpy(np.load(Path(folder) / "indices.npy")).long()
        n = indptr.numel() - 1
        dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
        self.graph = self.dgl.graph((indices, dst), num_nodes=n)
        self.graph.create_formats_()
        return {"nodes": n, "edges": self.graph.num_edges()}

    def _sampler(self, kind: str, fanouts: list[int], importance: int, kappa: float):
        from dgl.dataloading import LaborSampler, NeighborSampler

        if kind == "ns":
            return NeighborSampler(fanouts)
        # DGL takes batch_dependency as an int; a κ larger than the batches of the run is κ = ∞ for them
        return LaborSampler(fanouts, importance_sampling=importance,
                            batch_dependency=10**9 if kappa == math.inf else int(kappa))

    def run(self, kind: str, seeds: str, batch_size: int, fanouts: list[int], importance: int, kappa: float,
            seed: int, reps: int, lru: int) -> dict:
        batches = torch.from_numpy(np.load(seeds)).split(batch_size)
        seconds, nodes, edges, inputs = [], [], [], []
        for rep in range(reps + 1):
            self.dgl.seed(seed)
            sampler = self._sampler(kind, fanouts, importance, kappa)
            started = time.perf_counter()
            samples = [sampler.sample_blocks(self.graph, batch) for batch in batches]
            seconds.append(time.perf_counter() - started)
            if rep == 0:
                for input_nodes, _, blocks in samples:
                    nodes.append([b.num_src_nodes() for b in blocks] + [blocks[-1].num_dst_nodes()])
                    edges.append(sum(b.num_edges() for b in blocks))
                    inputs.append(input_nodes.numpy())
        return {"seconds": seconds[1:], **summarize(nodes, edges),
                "lru_miss": lru_miss_rate(inputs, self.graph.num_nodes(), lru)}


def reads_of(count: str, input_nodes, layer_nodes: list) -> list:
    """The gathers one batch makes under a counting rule: ``inputs`` one gather of the input nodes;
    ``layers-in`` one gather per layer of its src nodes, input layer first, then the seeds; ``layers-out``
    the same, seeds first (the order sampling visits them)."""
    if count == "inputs":
        return [input_nodes]
    return list(layer_nodes) if count == "layers-in" else list(reversed(layer_nodes))


class DGLStudy(DGLSide):
    """DGL's side of ``--lru-study``: DGL's LaborSampler batches, counted by :func:`lru_miss_rate`."""

    def lru(self, seeds: str, batch_size: int, fanouts: list[int], importance: int, kappa: float,
            layer_dependency: bool, count: str, seed: int, capacity: int) -> dict:
        from dgl.dataloading import LaborSampler

        self.dgl.seed(seed)
        sampler = LaborSampler(fanouts, importance_sampling=importance, layer_dependency=layer_dependency,
                               batch_dependency=10**9 if kappa == math.inf else int(kappa))
        reads = []
        for batch in torch.from_numpy(np.load(seeds)).split(batch_size):
            input_nodes, output_nodes, blocks = sampler.sample_blocks(self.graph, batch)
            layers = [b.srcdata[self.dgl.NID] for b in blocks] + [output_nodes]
            reads += [r.numpy() for r in reads_of(count, input_nodes, layers)]
        return {"miss": lru_miss_rate(reads, self.graph.num_nodes(), capacity),
                "reads_per_batch": sum(r.size for r in reads) / (len(reads) or 1)}


# --- our side --------------------------------------------------------------------------------------------------

SHARED_FOLDERS = {"amazon-computers": "graphdata-npz", "amazon-photo": "graphdata-npz", "coauthor-cs": "graphdata-npz",
                  "coauthor-physics": "graphdata-npz", "musae-facebook": "musae-facebook", "cora": "planetoid",
                  "citeseer": "planetoid"}  # else snap-* in snap-jlg, fb100-* in facebook100


def load_graph(name: str, data_dir: Path | None):
    """``ego-twitter`` (``data_dir`` or ../shared/datasets/snap-jlg holds its .jlg) or a dataset betty-train knows
    (raw files in ``data_dir``, else in its ../shared/datasets folder)."""
    if data_dir is None and name != "ego-twitter":
        folder = SHARED_FOLDERS.get(name) or ("snap-jlg" if name.startswith("snap-") else
                                               "facebook100" if name.startswith("fb100-") else None)
        data_dir = SHARED / folder if folder else None
    if name == "ego-twitter":
        import importlib.util

        spec = importlib.util.spec_from_file_location("_versus_dgl", REPO_ROOT / "benchmarks" / "versus_dgl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.load_jlg((data_dir or SHARED / "snap-jlg") / "ego-twitter-undirected.jlg")
    from betty_trainer.config import DatasetConfig
    from betty_trainer.datasets import load_dataset

    return load_dataset(DatasetConfig(name=name, data_dir=data_dir))


def our_samplers(graph, fanouts: list[int], batches: int, gns_fraction: float, pool: torch.Tensor) -> dict:
    from betty_trainer.sampling import GNSSampler, LaborSampler, NeighborSampler

    def labor(importance: int = 0, kappa: float = 1):
        return LaborSampler(graph, fanouts, importance_iterations=importance, batch_dependency=kappa,
                            batches_per_epoch=batches)

    samplers = {
        "NS": (NeighborSampler(graph, fanouts), ("ns", 0, 1)),
        "LABOR-0": (labor(), ("labor", 0, 1)),
        "LABOR-1": (labor(1), ("labor", 1, 1)),
        "LABOR-*": (labor(-1), ("labor", -1, 1)),
    }
    for kappa in (16, 64, 256, math.inf):
        samplers[f"LABOR-0 κ={'∞' if kappa == math.inf else kappa}"] = (labor(0, kappa), ("labor", 0, kappa))
    for only in (False, True):
        gns = GNSSampler(graph, fanouts, cache_fraction=gns_fraction, refresh_every=batches, cache_only_input_layer=only,
                         batches_per_epoch=batches, training_nodes=pool)
        samplers[f"GNS {gns_fraction:.0%}" + (" cache-only input" if only else "")] = (gns, None)
    return samplers


def run_ours(sampler, batches: list[torch.Tensor], seed: int, reps: int, lru: int, num_nodes: int) -> dict:
    from betty_trainer.sampling import GNSSampler, SampleKey

    seconds, nodes, edges, inputs, uncached = [], [], [], [], []
    cuda = batches[0].is_cuda
    for rep in range(reps + 1):
        started = time.perf_counter()
        samples = [sampler.sample(seeds, SampleKey(seed, 0, step)) for step, seeds in enumerate(batches)]
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if rep == 0:
            for step, batch in enumerate(samples):
                nodes.append([b.num_src for b in batch.blocks] + [batch.blocks[-1].num_dst])
                edges.append(sum(b.num_edges for b in batch.blocks))
                inputs.append(batch.input_nodes.cpu().numpy())
                if isinstance(sampler, GNSSampler):
                    mask = sampler.cache(SampleKey(seed, 0, step)).mask
                    uncached.append(int((~mask[batch.input_nodes]).sum()))
    result = {"seconds": seconds[1:], **summarize(nodes, edges), "lru_miss": lru_miss_rate(inputs, num_nodes, lru)}
    if uncached:
        result["uncached_inputs"] = float(np.mean(uncached))
    return result


# --- bytes moved per epoch through the feature store's caches (issue 8, "Bytes") ---------------------------

def epoch_inputs(sampler, batches: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Each batch's input nodes (int64, on the CPU), keyed ``SampleKey(seed, 0, step)``; the blocks are dropped."""
    from betty_trainer.sampling import SampleKey

    return [sampler.sample(seeds, SampleKey(seed, 0, step)).input_nodes.cpu() for step, seeds in enumerate(batches)]


def gather_epoch(store, inputs: list[torch.Tensor], device: torch.device, macro: int, seed: int) -> dict:
    """One epoch of gathers (one per batch, the batch's input nodes) through ``store``; with ``macro = M``
    every ``M`` consecutive batches are staged in one gather first. Returns the counters' change and
    the wall time (synchronised on CUDA, so the asynchronous copies are included)."""
    from betty_trainer.data.cache import CachedFeatureStore
    from betty_trainer.sampling import SampleKey

    before = store.stats.snapshot()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    group = max(macro, 1)
    for start in range(0, len(inputs), group):
        if macro:
            store.prefetch(torch.cat(inputs[start:start + group]))
        for step in range(start, min(start + group, len(inputs))):
            if isinstance(store, CachedFeatureStore):
                store.begin_batch(SampleKey(seed, 0, step))
            store.gather(inputs[step], device)
        if macro:
            store.release()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return {"stats": store.stats - before, "seconds": seconds}


def bytes_rows(graph, x: torch.Tensor, batches: list[torch.Tensor], fanouts: list[int], args,
               pool: torch.Tensor) -> list[dict]:
    """Bytes moved per epoch for each cache kind and macro-batch gathering (see ``--bytes``)."""
    from betty_trainer.data.cache import CachedFeatureStore, cache_capacity
    from betty_trainer.data.feature_store import HostFeatureStore
    from betty_trainer.sampling import GNSSampler, LaborSampler, NeighborSampler

    device = torch.device(args.device)
    host = HostFeatureStore(x, pin=device.type == "cuda")
    row = host.row_bytes
    n = graph.num_nodes
    capacity = cache_capacity(args.lru, n, row)
    degrees = graph.out_degrees()  # as make_feature_store: how many neighbour lists hold a node
    def gns(only_input: bool):
        return GNSSampler(graph, fanouts, cache_fraction=args.gns_cache, refresh_every=args.gns_refresh,
                          cache_only_input_layer=only_input, batches_per_epoch=len(batches), training_nodes=pool)

    samplers = {"NS": NeighborSampler(graph, fanouts),
                "LABOR-0 κ=64": LaborSampler(graph, fanouts, batch_dependency=64, batches_per_epoch=len(batches)),
                "GNS": gns(False), "GNS cache-only input layer": gns(True)}
    everything = len(batches)
    specs = [("NS", "none", 0), ("NS", "static", 0), ("NS", "lru", 0), ("NS", "none", 8), ("NS", "none", everything),
             ("NS", "lru", 8), ("LABOR-0 κ=64", "none", 0), ("LABOR-0 κ=64", "lru", 0), ("GNS", "none", 0),
             ("GNS", "gns", 0), ("GNS cache-only input layer", "gns", 0)]
    inputs = {}
    rows = []
    for sampler, kind, macro in specs:
        if sampler not in inputs:
            inputs[sampler] = epoch_inputs(samplers[sampler], batches, args.seed)
        gns_sampler = samplers[sampler] if kind == "gns" else None
        if kind == "none" and not macro:
            store = HostFeatureStore(host.x, pin=False) if device.type == "cpu" else host
        else:
            store = CachedFeatureStore(host, device, kind, capacity, degrees=degrees,
                                       node_source=gns_sampler.cache_nodes if gns_sampler else None)
        result = gather_epoch(store, inputs[sampler], device, macro, args.seed)
        stats = result["stats"]
        distinct = torch.unique(torch.cat(inputs[sampler])).numel()
        requested = sum(batch.numel() for batch in inputs[sampler])
        size = (f"{args.gns_cache:.0%} of nodes, refresh every {args.gns_refresh}" if kind == "gns" else
                f"{capacity:,} rows ({args.lru:.0%})" if kind in ("static", "lru") else "")
        name = f"{sampler}, {kind if kind != 'none' else 'no cache'}" + (f" {size}" if size else "")
        if macro:
            name += f", macro-batch {'all' if macro == everything else macro}"
        rows.append({"name": name, "requested": requested, "distinct": distinct, "row_bytes": row,
                     "hits": stats.hits, "misses": stats.misses, "fill": stats.cache_fill_bytes,
                     "host_read": stats.misses * row + stats.cache_fill_bytes,
                     "host_to_device": stats.host_to_device_bytes, "seconds": result["seconds"],
                     "gather_seconds": stats.gather_seconds})
        del store
    return rows


def print_bytes_table(rows: list[dict], device: str) -> None:
    mb = 1e6
    header = ["data path (per epoch)", "rows requested", "hit rate", "bytes read from host (MB)",
              "of which cache fill (MB)", f"host→device bytes measured on {device} (MB)", "lower bound (MB)",
              "read / lower bound", "gather time (s)"]
    print(f"\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for r in rows:
        bound = r["distinct"] * r["row_bytes"]
        print(f"| {r['name']} | {r['requested']:,} | {r['hits'] / max(r['hits'] + r['misses'], 1):.3f} | "
              f"{r['host_read'] / mb:,.1f} | {r['fill'] / mb:,.1f} | {r['host_to_device'] / mb:,.1f} | "
              f"{bound / mb:,.1f} | {r['host_read'] / bound:.2f}× | {r['seconds']:.2f} |")


# --- GNS against NS in the GNS paper's setting (issue 8, GNS done-when) ------------------------------------

PRODUCTS_NS_INPUT_FRACTION = 433_928 / 2_449_029  # GNS Table 4: NS input nodes per batch / ogbn-products' nodes


def study_pool(graph, seed: int) -> tuple[torch.Tensor, str]:
    """The seeds' pool, the training nodes V_S: the graph's train split when it holds at least 5% of the nodes
    (ogbn-products: 8%), else a random 10% of the nodes (the Shchur and SNAP graphs have 20 per class or none)."""
    n = graph.num_nodes
    if graph.train_idx.numel() >= 0.05 * n:
        return graph.train_idx.long(), "train split"
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: max(1, n // 10)]
    return torch.sort(chosen).values, "random 10% of the nodes"


def products_like_batch(graph, fanouts: list[int], pool: torch.Tensor, seed: int, probes: int = 4) -> int:
    """The batch size whose NS input nodes per batch are the same fraction of the graph as in the GNS paper's
    ogbn-products run (Table 4: 433,928 of 2,449,029 nodes, 17.7%), by bisection over ``probes`` batches."""
    from betty_trainer.sampling import NeighborSampler, SampleKey

    sampler = NeighborSampler(graph, fanouts)
    order = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed + 1))]

    def fraction(size: int) -> float:
        batches = order[: size * probes].split(size)
        return float(np.mean([sampler.sample(b, SampleKey(seed, 1, i)).input_nodes.numel() for i, b in
                              enumerate(batches)])) / graph.num_nodes

    low, high = 1, min(1000, pool.numel() // probes)
    if fraction(high) <= PRODUCTS_NS_INPUT_FRACTION:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fraction(middle) <= PRODUCTS_NS_INPUT_FRACTION else (low, middle)
    return low


def gns_study_rows(graph, x: torch.Tensor, fanouts: list[int], batch_size: int, pool: torch.Tensor,
                   fractions: list[float], measured: int, seed: int) -> list[dict]:
    """NS and GNS (input layer from the cache only) on the first ``measured`` batches of one shuffled epoch
    over ``pool``; per batch the input nodes, and the rows read from the host through the feature store:
    NS without a cache and NS with a static cache of the GNS cache's size (its highest-degree nodes), GNS
    through its own node cache, refreshed once per epoch (Alg. 1, line 2)."""
    from betty_trainer.data.cache import CachedFeatureStore
    from betty_trainer.data.feature_store import HostFeatureStore
    from betty_trainer.sampling import GNSSampler, NeighborSampler, SampleKey

    order = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed))]
    per_epoch = -(-pool.numel() // batch_size)
    batches = list(order[: batch_size * measured].split(batch_size))[:measured]
    host = HostFeatureStore(x, pin=False)
    row = host.row_bytes
    degrees = graph.out_degrees()  # as make_feature_store: how many neighbour lists hold a node

    def read(sampler, kind: str, capacity: int) -> dict:
        store = host if kind == "none" else CachedFeatureStore(
            host, "cpu", kind, capacity, degrees=degrees,
            node_source=sampler.cache_nodes if kind == "gns" else None)
        inputs, layer1, cached = [], [], []
        for step, seeds in enumerate(batches):
            key = SampleKey(seed, 0, step)
            batch = sampler.sample(seeds, key)
            if kind != "none":
                store.begin_batch(key)
            store.gather(batch.input_nodes, "cpu")
            inputs.append(batch.input_nodes.numel())
            layer1.append(batch.blocks[0].num_dst)
            if isinstance(sampler, GNSSampler):
                cached.append(int(sampler.cache(key).mask[batch.input_nodes].sum()))
        stats = store.stats
        per_batch = stats.misses * row / len(batches)
        return {"inputs": float(np.mean(inputs)), "layer1": float(np.mean(layer1)),
                "cached_inputs": float(np.mean(cached)) if cached else 0.0,
                "hit_rate": stats.hits / max(stats.hits + stats.misses, 1),
                "epoch_bytes": per_batch * per_epoch + stats.cache_fill_bytes, "fill_bytes": stats.cache_fill_bytes}

    ns = NeighborSampler(graph, fanouts)
    ns_row = read(ns, "none", 0)
    rows = []
    for fraction in fractions:
        gns = GNSSampler(graph, fanouts, cache_fraction=fraction, refresh_every=per_epoch, cache_only_input_layer=True,
                         batches_per_epoch=per_epoch, training_nodes=pool)
        ours = read(gns, "gns", gns.cache_size)
        static = read(ns, "static", gns.cache_size)
        rows.append({"graph": graph.name, "nodes": graph.num_nodes, "fanouts": fanouts, "batch": batch_size,
                     "batches_per_epoch": per_epoch, "measured": len(batches), "cache": fraction,
                     "cache_rows": int(gns.cache(SampleKey(seed, 0, 0)).nodes.numel()),
                     "probability": gns.cache_probability, "row_bytes": row, "ns": ns_row, "ns_static": static,
                     "gns": ours})
    return rows


def gns_study(args) -> None:
    """For each graph of ``--graphs``: the seeds' pool (:func:`study_pool`), the paper's batch of 1,000 and the
    products-like batch (:func:`products_like_batch`), each cache size of ``--gns-caches``; prints one table."""
    fanouts = [int(f) for f in args.fanouts.split(",")]
    rows = []
    for name in args.graphs.split(","):
        graph = load_graph(name, None)
        pool, pool_name = study_pool(graph, args.seed)
        x = graph.x if graph.x.shape[1] > 1 else torch.randn(graph.num_nodes, args.feature_width,
                                                             generator=torch.Generator().manual_seed(args.seed))
        sizes = [int(b) if b != "products" else products_like_batch(graph, fanouts, pool, args.seed)
                 for b in args.study_batch_sizes.split(",")]
        print(f"{name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; seeds: {pool_name} "
              f"({pool.numel():,}); batch sizes {sizes}; rows {x.shape[1] * x.element_size()} bytes", flush=True)
        for size in dict.fromkeys(sizes):
            for r in gns_study_rows(graph, x, fanouts, size, pool, [float(c) for c in args.gns_caches.split(",")],
                                    args.batches, args.seed):
                rows.append(r)
                print(f"  batch {size}, cache {r['cache']:.0%}: NS {r['ns']['inputs']:,.0f} inputs/batch, "
                      f"GNS {r['gns']['inputs']:,.0f} ({r['ns']['inputs'] / r['gns']['inputs']:.2f}×), bytes "
                      f"{r['ns']['epoch_bytes'] / r['gns']['epoch_bytes']:.2f}×", flush=True)
    print_gns_study(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def print_gns_study(rows: list[dict]) -> None:
    mb = 1e6
    header = ["graph (nodes)", "fanouts", "batch (NS inputs / N)", "cache % (rows, P)", "NS inputs/batch",
              "GNS inputs/batch (layer-1 nodes; cached)", "inputs NS/GNS", "NS MB/epoch", "NS + static cache MB/epoch",
              "GNS MB/epoch (fill)", "bytes NS/GNS", "bytes NS+static/GNS", "GNS hit rate"]
    print(f"\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for r in rows:
        ns, static, gns = r["ns"], r["ns_static"], r["gns"]
        print(f"| {r['graph']} ({r['nodes']:,}) | {','.join(map(str, r['fanouts']))} | {r['batch']:,} "
              f"({ns['inputs'] / r['nodes']:.1%}) | {r['cache']:.0%} ({r['cache_rows']:,}, {r['probability']}) | "
              f"{ns['inputs']:,.0f} | {gns['inputs']:,.0f} ({gns['layer1']:,.0f}; {gns['cached_inputs']:,.0f}) | "
              f"{ns['inputs'] / gns['inputs']:.2f}× | {ns['epoch_bytes'] / mb:,.1f} | {static['epoch_bytes'] / mb:,.1f} | "
              f"{gns['epoch_bytes'] / mb:,.1f} ({gns['fill_bytes'] / mb:,.1f}) | "
              f"{ns['epoch_bytes'] / gns['epoch_bytes']:.2f}× | {static['epoch_bytes'] / gns['epoch_bytes']:.2f}× | "
              f"{gns['hit_rate']:.3f} |")


# --- which counting gives which LRU miss rate (issue 8, Dependency done-when) ------------------------------

def gns_bias(args) -> None:
    """How far GNS's importance weights are from unbiased across caches (``sampling/gns.py``'s module docstring).

    On ``--graph``, 300 dst rows of in-degree above ``3k`` (``k`` the first of ``--fanouts``; rows drawn by
    ``--seed``), a scalar feature ``h`` (the first 8 features against weights 1..2) and, for each cache of
    ``--gns-caches`` (a degree cache drawn for every batch), ``--bias-batches`` one-layer GNS samples of the rows.
    Per row it compares the mean over the batches of three estimates with their full-neighbourhood values:
    the weighted sum ``Σ w h`` (Horvitz–Thompson), the weighted mean ``Σ w h / Σ w`` (SAGE's mean) and
    ``GCNConv``'s output (unit weight, no bias). A row is off when its mean is more than the Bonferroni bound
    (two-sided 10⁻³ over the rows: 4.65 for 300) of standard errors away. Rows "mixing regimes" have at least
    ``k`` cached neighbours in 20–80% of the caches.
    """
    from betty_trainer.models.gcn import GCNConv
    from betty_trainer.sampling import GNSSampler, NeighborSampler, SampleKey

    graph = load_graph(args.graph, args.data_dir)
    k = int(args.fanouts.split(",")[0])
    degree = graph.in_degrees()
    dst = torch.nonzero(degree > 3 * k).flatten()
    dst = dst[torch.randperm(dst.numel(), generator=torch.Generator().manual_seed(args.seed))[:300]]
    rows = dst.numel()
    h = graph.x[:, :8].double() @ torch.linspace(1, 2, 8, dtype=torch.float64) * 10
    neighbours = torch.cat([graph.indices[graph.indptr[s]:graph.indptr[s + 1]].long() for s in dst.tolist()])
    row_of_edge = torch.repeat_interleave(torch.arange(rows), degree[dst])
    full_sum = torch.zeros(rows, dtype=torch.float64).index_add_(0, row_of_edge, h[neighbours])
    full_mean = full_sum / degree[dst].double()
    conv = GCNConv(1, 1).double()
    with torch.no_grad():
        conv.linear.weight.fill_(1.0)
        conv.bias.zero_()
    inv_sqrt = (degree.double() + 1).rsqrt()

    def gcn(block):
        with torch.no_grad():
            return conv(block, h[block.src_nodes].unsqueeze(1), inv_sqrt[block.src_nodes]).squeeze(1)

    full_gcn = gcn(NeighborSampler(graph, [None]).sample(dst, SampleKey(0)).blocks[0])
    bound = -float(torch.special.ndtri(torch.tensor(1e-3 / (2 * rows), dtype=torch.float64)))
    reps = args.bias_batches
    print(f"{args.graph}: {rows} dst rows with in-degree > {3 * k}, k = {k}, {reps} batches per cache; a row is off "
          f"beyond {bound:.2f} standard errors", flush=True)
    for fraction in (float(c) for c in args.gns_caches.split(",")):
        sampler = GNSSampler(graph, [k], cache_fraction=fraction, refresh_every=1, cache_probability="degree")
        sums = torch.empty(reps, rows, dtype=torch.float64)
        means, convs, totals = torch.empty_like(sums), torch.empty_like(sums), torch.empty_like(sums)
        at_least_k = torch.zeros(rows)
        for rep in range(reps):
            key = SampleKey(7, 0, rep)
            block = sampler.sample(dst, key).blocks[0]
            weight = block.edge_weight.double()
            edge_dst = block.edge_dst()
            sums[rep] = torch.zeros(rows, dtype=torch.float64).index_add_(0, edge_dst,
                                                                          weight * h[block.src_nodes[block.indices]])
            totals[rep] = torch.zeros(rows, dtype=torch.float64).index_add_(0, edge_dst, weight)
            means[rep] = sums[rep] / totals[rep]
            convs[rep] = gcn(block)
            cached = torch.zeros(rows).index_add_(0, row_of_edge, sampler.cache(key).mask[neighbours].float())
            at_least_k += (cached >= k).float()
        mixing = (at_least_k / reps > 0.2) & (at_least_k / reps < 0.8)
        for name, estimates, full in (("weighted sum (HT)", sums, full_sum), ("weighted mean (SAGE)", means, full_mean),
                                      ("GCNConv output", convs, full_gcn)):
            z = (estimates.mean(0) - full) / (estimates.std(0) / math.sqrt(reps))
            relative = estimates.mean(0) / full - 1  # noisy on heavy-tailed rows: the rows off are the resolved biases
            off = z.abs() > bound
            print(f"  cache {fraction:.0%} {name:21s}: {int(off.sum()):3d}/{rows} rows off "
                  f"(median relative bias {float(relative[off].median()) if off.any() else math.nan:+.2%}); all rows: "
                  f"median {float(relative.median()):+.2%}, median |.| {float(relative.abs().median()):.2%}; "
                  f"{int(mixing.sum())} rows mixing regimes: median {float(relative[mixing].median()):+.2%}", flush=True)
        print(f"  cache {fraction:.0%} median E[Σ w] / d_s: {float((totals.mean(0) / degree[dst]).median()):.3f}")


def load_directed_jlg(path: Path):
    """ego-Twitter's .jlg with its edges as stored (``src → dst``, one direction; the file lists each
    undirected edge once), as a naive ``dgl.graph((src, dst))`` would read it."""
    import gzip

    from betty_trainer.data.graph import Graph

    with gzip.open(path, "rt") as handle:
        num_nodes = int(handle.readline().split(",")[0])
        edges = np.array(handle.read().replace("\n", ",").strip(",").split(","), dtype=np.int64).reshape(-1, 2) - 1
    empty = torch.zeros(0, dtype=torch.int64)
    return Graph.from_edges(torch.from_numpy(edges[:, 0]), torch.from_numpy(edges[:, 1]), num_nodes, symmetric=False,
                            x=torch.zeros(num_nodes, 1), y=torch.zeros(num_nodes, dtype=torch.int64),
                            train_idx=empty, val_idx=empty, test_idx=empty, num_classes=1, name="ego-twitter-directed")


def our_lru(graph, batches, fanouts, importance, kappa, layer_dependency, count, seed, capacity) -> dict:
    """Our LaborSampler's batches read through a real LRU :class:`CachedFeatureStore` (one gather per read
    of :func:`reads_of`); the miss rate is checked against :func:`lru_miss_rate` of the same reads."""
    from betty_trainer.data.cache import CachedFeatureStore
    from betty_trainer.data.feature_store import HostFeatureStore
    from betty_trainer.sampling import LaborSampler, SampleKey

    sampler = LaborSampler(graph, fanouts, importance_iterations=importance, layer_dependency=layer_dependency,
                           batch_dependency=kappa, batches_per_epoch=len(batches))
    store = CachedFeatureStore(HostFeatureStore(torch.zeros(graph.num_nodes, 1), pin=False), "cpu", "lru", capacity)
    reads = []
    for step, seeds in enumerate(batches):
        batch = sampler.sample(seeds, SampleKey(seed, 0, step))
        layers = [block.src_nodes for block in batch.blocks] + [batch.output_nodes]
        for nodes in reads_of(count, batch.input_nodes, layers):
            store.gather(nodes, "cpu")
            reads.append(nodes.numpy())
    miss = store.stats.misses / (store.stats.hits + store.stats.misses)
    simulated = lru_miss_rate(reads, graph.num_nodes, capacity)
    assert abs(miss - simulated) < 1e-12, (miss, simulated)
    return {"miss": miss, "reads_per_batch": sum(r.size for r in reads) / len(batches)}


def lru_study(args, batches: list[torch.Tensor], fanouts: list[int]) -> None:
    """LRU miss rate at κ = 1 and 64 under several counting rules, ours (a real LRU cache) and DGL's
    LaborSampler (the same LRU, simulated) side by side."""
    path = (args.data_dir or SHARED / "snap-jlg") / "ego-twitter-undirected.jlg"
    graphs = {"undirected": load_graph("ego-twitter", args.data_dir), "directed as stored": load_directed_jlg(path)}
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
            dgl = DGLProcess(args.dgl_python, Path(__file__).resolve(), ["--dgl-study"], args.threads,
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
                ours = our_lru(graph, batches, fanouts, importance, kappa, layer_dependency, count, args.seed,
                               capacity)
                theirs = dgl("lru", seeds=str(scratch / "seeds.npy"), batch_size=args.batch_size, fanouts=fanouts,
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
    header = ["graph, sampler, what a batch reads", "reads/batch κ=1", "ours κ=1", "ours κ=64", "ours κ64/κ1",
              "DGL κ=1", "DGL κ=64", "DGL κ64/κ1"]
    print(f"\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for label, ((o1, t1), (o64, t64)) in rows:
        dgl_cells = [f"{t1['miss']:.3f}", f"{t64['miss']:.3f}", f"{t64['miss'] / t1['miss']:.2f}"] if t1 else [""] * 3
        print(f"| {label} | {o1['reads_per_batch']:,.0f} | {o1['miss']:.3f} | {o64['miss']:.3f} | "
              f"{o64['miss'] / o1['miss']:.2f} | {' | '.join(dgl_cells)} |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dgl-side", action="store_true", help="serve DGL's side (run with DGL's Python)")
    parser.add_argument("--dgl-study", action="store_true", help="serve DGL's side of --lru-study")
    parser.add_argument("--lru-study", action="store_true",
                        help="instead of the sampler table: LRU miss rate at κ=1 and 64 under several counting rules "
                             "(ours with a real LRU cache, DGL's LaborSampler beside)")
    parser.add_argument("--graph", default="ego-twitter", help="ego-twitter, or a dataset name betty-train knows")
    parser.add_argument("--data-dir", type=Path, default=None, help="raw files of a named dataset")
    parser.add_argument("--fanouts", default="10,10,10", help="input layer first")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=48, help="batches of the measured sequence")
    parser.add_argument("--reps", type=int, default=3, help="timed passes (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lru", type=float, default=0.1, help="LRU capacity as a fraction of the nodes")
    parser.add_argument("--gns-cache", type=float, default=0.01, help="GNS cache as a fraction of the nodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where our samplers run (cuda: the tensor paths on the GPU)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    parser.add_argument("--samplers", default="", help="comma list of row-name prefixes to run (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--bytes", action="store_true",
                        help="instead of the sampler table: bytes moved per epoch through the feature store for no "
                             "cache, static, LRU (--lru of the nodes), GNS (--gns-cache) and macro-batch gathering, "
                             "next to the lower bound (distinct input nodes × row bytes)")
    parser.add_argument("--variants", default="", help="--lru-study: comma list of variant numbers (default: all)")
    parser.add_argument("--seed-order", choices=("shuffled", "id"), default="shuffled",
                        help="batches of shuffled seeds, or of seeds in node-id order (an unshuffled loader)")
    parser.add_argument("--feature-width", type=int, default=128,
                        help="--bytes: float32 features per node (ego-twitter has none: random ones of this width)")
    parser.add_argument("--gns-study", action="store_true",
                        help="instead of the sampler table: NS against GNS (input layer from the cache only) in the GNS "
                             "paper's setting on each of --graphs, for each cache size of --gns-caches (use --fanouts "
                             "5,10,15 and --batches for the measured batches per setting)")
    parser.add_argument("--graphs", default="amazon-computers,coauthor-physics,fb100-cornell5,snap-slashdot,ego-twitter",
                        help="--gns-study: comma list of graphs")
    parser.add_argument("--gns-caches", default="0.01,0.05", help="--gns-study: cache sizes, fractions of the nodes")
    parser.add_argument("--study-batch-sizes", default="1000,products",
                        help="--gns-study: batch sizes; 'products' is the size whose NS input nodes are the fraction "
                             "of the graph they are in the paper's ogbn-products run (17.7%%)")
    parser.add_argument("--gns-bias", action="store_true",
                        help="instead of the sampler table: how far GNS's weighted sum, weighted mean and GCN output are "
                             "from the full neighbourhood's across caches, per cache size of --gns-caches (on --graph; "
                             "k: the first of --fanouts)")
    parser.add_argument("--bias-batches", type=int, default=600, help="--gns-bias: samples per cache size")
    parser.add_argument("--gns-refresh", type=int, default=16, help="--bytes: GNS refreshes its cache every this "
                                                                    "many batches")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dgl_side:
        serve(DGLSide())
        return
    if args.dgl_study:
        serve(DGLStudy())
        return
    torch.set_num_threads(args.threads)
    if args.gns_study:
        gns_study(args)
        return
    if args.gns_bias:
        gns_bias(args)
        return
    fanouts = [int(f) for f in args.fanouts.split(",")]
    graph = load_graph(args.graph, args.data_dir)
    n = graph.num_nodes
    pool = graph.train_idx if graph.train_idx.numel() >= args.batch_size * args.batches else torch.arange(n)
    order = pool if args.seed_order == "id" else \
        pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(args.seed))]
    batches = list(order[: args.batch_size * args.batches].split(args.batch_size))
    lru = int(args.lru * n)
    device = torch.device(args.device)
    ours_graph = graph if device.type == "cpu" else dataclasses.replace(
        graph, indptr=graph.indptr.to(device), indices=graph.indices.to(device), train_idx=graph.train_idx.to(device))
    our_batches = [batch.to(device) for batch in batches]
    if args.lru_study:
        print(f"{args.graph}: LRU of {args.lru:.0%} of the nodes; fanouts {fanouts}, {len(batches)} batches of "
              f"{args.batch_size} seeds ({args.seed_order})", flush=True)
        lru_study(args, batches, fanouts)
        return
    if args.bytes:
        x = graph.x if graph.x.shape[1] > 1 else torch.randn(n, args.feature_width,
                                                             generator=torch.Generator().manual_seed(args.seed))
        print(f"{args.graph}: {n:,} nodes, {graph.num_edges:,} edges; fanouts {fanouts} (input layer first), "
              f"one epoch = {len(batches)} batches of {args.batch_size} seeds; features {tuple(x.shape)} "
              f"{x.dtype} ({x.shape[1] * x.element_size()} bytes a row); gathers to {args.device}", flush=True)
        rows = bytes_rows(graph, x, batches, fanouts, args, pool)
        print_bytes_table(rows, args.device)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    print(f"{args.graph}: {n:,} nodes, {graph.num_edges:,} edges; fanouts {fanouts} (input layer first), "
          f"{len(batches)} batches of {args.batch_size}, LRU {lru:,} nodes ({args.lru:.0%}), threads {args.threads}, "
          f"ours on {args.device}", flush=True)
    dgl = None
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.dgl_python and Path(args.dgl_python).exists():
            np.save(scratch / "indptr.npy", graph.indptr.numpy())
            np.save(scratch / "indices.npy", graph.indices.numpy())
            np.save(scratch / "seeds.npy", torch.cat(batches).numpy())
            dgl = DGLProcess(args.dgl_python, Path(__file__).resolve(), ["--dgl-side"], args.threads, scratch / "dgl.log")
            hello = dgl("hello")
            dgl("load", folder=str(scratch))
            print(f"DGL {hello['dgl']} (torch {hello['torch']}, {hello['threads']} threads) side by side", flush=True)
        rows = []
        wanted = [prefix for prefix in args.samplers.split(",") if prefix]
        for name, (sampler, dgl_spec) in our_samplers(ours_graph, fanouts, len(batches), args.gns_cache,
                                                               pool.to(device)).items():
            if wanted and not any(name.startswith(prefix) for prefix in wanted):
                continue
            ours = run_ours(sampler, our_batches, args.seed, args.reps, lru, n)
            theirs = None
            if dgl is not None and dgl_spec is not None:
                kind, importance, kappa = dgl_spec
                theirs = dgl("run", kind=kind, seeds=str(scratch / "seeds.npy"), batch_size=args.batch_size,
                             fanouts=fanouts, importance=importance, kappa=kappa, seed=args.seed, reps=args.reps,
                             lru=lru)
            rows.append((name, ours, theirs))
            print(f"  {name}: {format_row(name, ours, theirs, len(batches) * args.batch_size)}", flush=True)
        if dgl is not None:
            dgl.close()
    total = len(batches) * args.batch_size
    print_table(rows, total, fanouts)
    if args.json:
        args.json.write_text(json.dumps([{"sampler": name, "ours": ours, "dgl": theirs} for name, ours, theirs in rows],
                                        indent=1))


def rate(result: dict, total: int) -> float:
    return total / statistics.median(result["seconds"])


def format_row(name: str, ours: dict, theirs: dict | None, total: int) -> str:
    text = (f"inputs/layer {'/'.join(f'{v:,.0f}' for v in ours['nodes_per_layer'])}, {rate(ours, total):,.0f} seeds/s, "
            f"LRU miss {ours['lru_miss']:.3f}")
    if theirs:
        text += (f" | DGL inputs {'/'.join(f'{v:,.0f}' for v in theirs['nodes_per_layer'])}, "
                 f"{rate(theirs, total):,.0f} seeds/s, LRU miss {theirs['lru_miss']:.3f}")
    return text


def print_table(rows, total: int, fanouts: list[int]) -> None:
    header = ["sampler", "nodes per layer (input → seeds)", "edges/batch", "seeds/s", "LRU miss", "GNS uncached inputs",
              "DGL nodes per layer", "DGL seeds/s", "DGL LRU miss", "ours/DGL seeds/s", "ours/DGL input nodes"]
    print(f"\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for name, ours, theirs in rows:
        cells = [name, " / ".join(f"{v:,.0f}" for v in ours["nodes_per_layer"]), f"{ours['edges']:,.0f}",
                 f"{rate(ours, total):,.0f}", f"{ours['lru_miss']:.3f}",
                 f"{ours['uncached_inputs']:,.0f}" if "uncached_inputs" in ours else ""]
        if theirs:
            cells += [" / ".join(f"{v:,.0f}" for v in theirs["nodes_per_layer"]), f"{rate(theirs, total):,.0f}",
                      f"{theirs['lru_miss']:.3f}", f"{rate(ours, total) / rate(theirs, total):.2f}×",
                      f"{ours['nodes_per_layer'][0] / theirs['nodes_per_layer'][0]:.3f}×"]
        else:
            cells += [""] * 5
        print(f"| {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
