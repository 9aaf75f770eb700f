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

The other sampling studies import this file's batch sequence (:func:`batch_arguments`, :func:`epoch_batches`),
its LRU simulation (:func:`lru_miss_rate`) and its DGL side (:class:`DGLSide`):
``feature_cache_bytes.py`` (bytes moved per epoch through the feature store's caches), ``labor_lru_miss.py``
(LRU miss rate at κ = 1 and 64 under several counting rules), ``gns_vs_ns.py`` (GNS against NS in the GNS
paper's setting) and ``gns_bias.py`` (how far GNS's importance weights are from unbiased).

The same file is DGL's side: ``~/.cache/betty-trainer/dgl-venv/bin/python benchmarks/sampling.py --dgl-side`` serves
JSON-line commands and imports nothing from betty-trainer (DGL's environment pins its own torch).
"""

from __future__ import annotations

from common import int_list, load_graph, markdown_table  # this folder; both sides load it

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
        seconds, cpu_seconds, nodes, edges, inputs = [], [], [], [], []
        for rep in range(reps + 1):
            self.dgl.seed(seed)
            sampler = self._sampler(kind, fanouts, importance, kappa)
            started, cpu_started = time.perf_counter(), time.process_time()
            samples = [sampler.sample_blocks(self.graph, batch) for batch in batches]
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.process_time() - cpu_started)
            if rep == 0:
                for input_nodes, _, blocks in samples:
                    nodes.append([b.num_src_nodes() for b in blocks] + [blocks[-1].num_dst_nodes()])
                    edges.append(sum(b.num_edges() for b in blocks))
                    inputs.append(input_nodes.numpy())
        return {"seconds": seconds[1:], "cpu_seconds": cpu_seconds[1:], **summarize(nodes, edges),
                "lru_miss": lru_miss_rate(inputs, self.graph.num_nodes(), lru)}


# --- our side --------------------------------------------------------------------------------------------------

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


# --- the measured batch sequence, shared by the sampling studies ------------------------------------------------

def batch_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the flags of the studies that sample one sequence of batches on one graph."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--graph", default="ego-twitter", help="ego-twitter, or a dataset name betty-train knows")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="raw files of the dataset (default: its folder in ../shared/datasets)")
    parser.add_argument("--fanouts", type=int_list, default=[10, 10, 10], help="input layer first")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=48, help="batches of the measured sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lru", type=float, default=0.1, help="LRU capacity as a fraction of the nodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seed-order", choices=("shuffled", "id"), default="shuffled",
                        help="batches of shuffled seeds, or of seeds in node-id order (an unshuffled loader)")
    return parser


def epoch_batches(args: argparse.Namespace):
    """``(graph, pool, batches)``: ``--graph``; the seeds' pool (its training nodes, or every node when they are
    fewer than the measured seeds); the first ``--batches`` batches of ``--batch-size`` seeds of the pool, shuffled
    by ``--seed`` or in node-id order (``--seed-order``)."""
    graph = load_graph(args.graph, args.data_dir)
    n = graph.num_nodes
    pool = graph.train_idx if graph.train_idx.numel() >= args.batch_size * args.batches else torch.arange(n)
    order = pool if args.seed_order == "id" else \
        pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(args.seed))]
    return graph, pool, list(order[: args.batch_size * args.batches].split(args.batch_size))


def features(graph, width: int, seed: int) -> torch.Tensor:
    """``graph.x``; for a graph without features (one column: a SNAP graph's ``log(1 + in-degree)``), random float32
    rows of ``width`` values drawn from ``seed``."""
    return graph.x if graph.x.shape[1] > 1 else torch.randn(graph.num_nodes, width,
                                                            generator=torch.Generator().manual_seed(seed))


# --- the sampler table ------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = batch_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--dgl-side", action="store_true", help="serve DGL's side (run with DGL's Python)")
    parser.add_argument("--reps", type=int, default=3, help="timed passes (after one warm-up)")
    parser.add_argument("--gns-cache", type=float, default=0.01, help="GNS cache as a fraction of the nodes")
    parser.add_argument("--device", default="cpu", help="where our samplers run (cuda: the tensor paths on the GPU)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    parser.add_argument("--samplers", default="", help="comma list of row-name prefixes to run (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dgl_side:
        serve(DGLSide())
        return
    torch.set_num_threads(args.threads)
    fanouts = args.fanouts
    graph, pool, batches = epoch_batches(args)
    n = graph.num_nodes
    lru = int(args.lru * n)
    device = torch.device(args.device)
    ours_graph = graph if device.type == "cpu" else dataclasses.replace(
        graph, indptr=graph.indptr.to(device), indices=graph.indices.to(device), train_idx=graph.train_idx.to(device))
    our_batches = [batch.to(device) for batch in batches]
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
    print_table(rows, total)
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


def print_table(rows, total: int) -> None:
    header = ["sampler", "nodes per layer (input → seeds)", "edges/batch", "seeds/s", "LRU miss", "GNS uncached inputs",
              "DGL nodes per layer", "DGL seeds/s", "DGL LRU miss", "ours/DGL seeds/s", "ours/DGL input nodes"]
    lines = []
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
        lines.append(cells)
    print("\n" + markdown_table(header, lines))


if __name__ == "__main__":
    main()
