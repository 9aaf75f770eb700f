"""Cooperative against independent minibatching: work per rank, vertices communicated, and node-cache traffic.

Source: the cooperative-minibatching paper, §3.1 (Alg. 1) and Table 7. ``P`` gloo processes on this machine
(``torch.multiprocessing``, loopback) run the library's own code: each batch is one global batch of ``B`` seeds.

* **independent**: rank ``p`` samples its own mini-batch of the ``B/P`` seeds of chunk ``p`` (the baseline: the
  same global batch size, no communication);
* **cooperative**: the ranks sample the global batch together
  (:class:`~betty_trainer.sampling.cooperative.CooperativeSampler`), each computing the seeds and vertices it
  owns (``random`` or ``metis`` ownership) and exchanging the rest by all-to-all.

Per layer ``j`` (``j = 0`` the seeds, ``j = L`` the input nodes, as in the paper), the table gives what one rank
processes, averaged over the batches and then **the maximum over the ranks** (the paper's reduction):
``S^j`` vertices it owns and computes, ``c·S̃^j`` vertices it receives from other ranks (0 when independent),
``S̃^j`` the src vertices its layer ``j−1`` reads (owned and received), and ``E^{j−1}`` the sampled edges.

The cache section gives every rank a node cache of the same size (``--cache`` rows; ``static``: highest
out-degree, ``lru``); a cooperative rank caches vertices it owns only (it loads no others), so the ranks' caches
add up. It prints the miss rate over all ranks' gathers and the bytes a GPU run would move host→device
(misses × row bytes + cache fills, summed over the ranks).

Run:
    python benchmarks/cooperative.py --graph snap-ego-twitter
    python benchmarks/cooperative.py --graph powerlaw --powerlaw-nodes 1000000 --powerlaw-edges 20000000
    python benchmarks/cooperative.py --graph cora --batch 1024
"""

from __future__ import annotations

from common import load_graph  # this folder

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from betty_trainer.config import DatasetConfig
from betty_trainer.data.cache import CachedFeatureStore
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.datasets import load_dataset
from betty_trainer.distributed.ownership import load_owners
from betty_trainer.sampling import LaborSampler, NeighborSampler, SampleKey
from betty_trainer.sampling.cooperative import CooperativeSampler

CPU = torch.device("cpu")


def load(args: argparse.Namespace):
    """The graph ``--graph`` names, through the library's dataset registry (:func:`common.load_graph`; ``powerlaw``:
    generated once into the cache)."""
    if args.graph == "powerlaw":
        return load_dataset(DatasetConfig(name="powerlaw", powerlaw={"num_nodes": args.powerlaw_nodes,
                                                                     "num_edges": args.powerlaw_edges,
                                                                     "num_features": 16}))
    return load_graph(args.graph, args.data_dir)


def global_batches(num_nodes: int, args: argparse.Namespace) -> list[torch.Tensor]:
    """``--batches`` global batches of ``--batch`` distinct seeds drawn from every node (structure-only graphs have
    no training split), the same in every process."""
    generator = torch.Generator().manual_seed(args.seed)
    return [torch.randperm(num_nodes, generator=generator)[:args.batch] for _ in range(args.batches)]


def cache_store(graph, kind: str, rows: int, owned: torch.Tensor | None) -> CachedFeatureStore:
    """A node cache of ``rows`` rows over the host features; ``owned`` (a mask) limits a static cache to the
    vertices this rank owns."""
    degrees = graph.out_degrees().long()
    if owned is not None:
        degrees = torch.where(owned, degrees, torch.full_like(degrees, -1))
    return CachedFeatureStore(HostFeatureStore(graph.x, pin=False), CPU, kind, rows,
                              degrees=degrees if kind == "static" else None)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        graph = load(args)
        fanouts = [args.fanout] * args.layers
        sampler = LaborSampler(graph, fanouts) if args.sampler == "labor" else NeighborSampler(graph, fanouts)
        batches = global_batches(graph.num_nodes, args)
        rows = {}
        for ownership in args.ownership:
            owners = load_owners(graph, world, ownership, seed=args.seed)
            cooperative = CooperativeSampler(sampler, owners)
            counts, stores = [], {kind: cache_store(graph, kind, args.cache, owners == rank) for kind in args.caches}
            for step, seeds in enumerate(batches):
                share = cooperative.sample(seeds, SampleKey(args.seed, 0, step))
                counts.append([(ex.owned.numel(), ex.rows_received, block.num_src, block.num_edges)
                               for block, ex in zip(share.blocks, share.exchanges)])
                for store in stores.values():
                    store.gather(share.input_nodes, CPU)
            rows[("cooperative", ownership)] = (counts, {k: s.stats for k, s in stores.items()})
        counts, stores = [], {kind: cache_store(graph, kind, args.cache, None) for kind in args.caches}
        for step, seeds in enumerate(batches):
            batch = sampler.sample(seeds.chunk(world)[rank], SampleKey(args.seed, 0, step))
            counts.append([(block.num_src, 0, block.num_src, block.num_edges) for block in batch.blocks])
            for store in stores.values():
                store.gather(batch.input_nodes, CPU)
        rows[("independent", "-")] = (counts, {k: s.stats for k, s in stores.items()})
        torch.save({"rows": rows, "row_bytes": graph.x.shape[1] * graph.x.element_size(),
                    "graph": f"{graph.name}: {graph.num_nodes:,} nodes, {graph.indices.numel():,} edges"},
                   out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def work_table(results: list[dict], layers: int, title: str) -> Table:
    """Per mode and ownership, per layer ``j = L … 1``: ``S^j``, ``c·S̃^j``, ``S̃^j``, ``E^{j−1}`` (thousands),
    averaged over the batches, maximum over the ranks."""
    table = Table(title=title)
    table.add_column("mode")
    table.add_column("ownership")
    for j in range(layers, 0, -1):
        for name in (f"S^{j}", f"c·S̃^{j}", f"S̃^{j}", f"E^{j - 1}"):
            table.add_column(name, justify="right")
    for key in results[0]["rows"]:
        per_rank = [torch.tensor(r["rows"][key][0], dtype=torch.float64).mean(0) for r in results]  # (L, 4)
        worst = torch.stack(per_rank).amax(0)  # block 0 (input) first
        cells = [f"{float(v) / 1000:.2f}" for block in range(layers) for v in worst[block]]
        table.add_row(key[0], key[1], *cells)
    return table


def cache_table(results: list[dict], title: str) -> Table:
    table = Table(title=title)
    for name in ("mode", "ownership", "cache", "miss rate", "host→device MiB (all ranks)"):
        table.add_column(name, justify="right" if name[0] in "mh" else "left")
    row_bytes = results[0]["row_bytes"]
    for key in results[0]["rows"]:
        for kind in results[0]["rows"][key][1]:
            stats = [r["rows"][key][1][kind] for r in results]
            hits, misses = sum(s.hits for s in stats), sum(s.misses for s in stats)
            moved = sum(s.misses * row_bytes + s.cache_fill_bytes for s in stats)
            table.add_row(key[0], key[1], kind, f"{misses / max(hits + misses, 1):.3f}", f"{moved / 2**20:.1f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="snap-ego-twitter", help="a dataset name (betty-train datasets)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="the folder of its files (default: its folder in ../shared/datasets)")
    parser.add_argument("--powerlaw-nodes", type=int, default=1_000_000)
    parser.add_argument("--powerlaw-edges", type=int, default=20_000_000, help="directed edges drawn")
    parser.add_argument("--world", type=int, default=4, help="P, the processes")
    parser.add_argument("--batch", type=int, default=4096, help="global batch size B")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--fanout", type=int, default=10)
    parser.add_argument("--sampler", choices=["labor", "ns"], default="labor", help="labor is LABOR-0")
    parser.add_argument("--ownership", default="random,metis")
    parser.add_argument("--cache", type=int, default=4096, help="node cache rows per rank")
    parser.add_argument("--caches", default="static,lru")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.ownership, args.caches = args.ownership.split(","), args.caches.split(",")
    load(args)  # converted once, before the processes map it
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(args.world, free_port(), args, Path(folder)), nprocs=args.world)
        results = [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(args.world)]
    console = Console(width=200)
    setting = (f"{results[0]['graph']}; P = {args.world}, B = {args.batch}, {args.layers} layers, "
               f"{'LABOR-0' if args.sampler == 'labor' else 'NS'} fanout {args.fanout}, {args.batches} batches")
    console.print(work_table(results, args.layers, f"Per-rank work (thousands; mean over batches, max over ranks)\n"
                                                   f"{setting}"))
    console.print(cache_table(results, f"Node cache of {args.cache} rows per rank\n{setting}"))


if __name__ == "__main__":
    main()
