"""Bytes moved per epoch through the feature store (issue 8, "Bytes"): for no cache, a static cache, an LRU cache
(``--lru`` of the nodes), GNS's node cache (``--gns-cache``) and macro-batch gathering, one epoch of gathers of
each batch's input nodes, next to the lower bound (distinct input nodes × row bytes).

The batches are :mod:`sampling`'s measured sequence (``--graph``, ``--batches`` of ``--batch-size`` seeds);
ego-Twitter has no features, so its rows are random ones of ``--feature-width`` float32 values. Run from the
repository root::

    python benchmarks/feature_cache_bytes.py --graph ego-twitter --batches 79
"""

from __future__ import annotations

from common import markdown_table  # this folder

import json
import time
from pathlib import Path

import torch

from sampling import batch_arguments, epoch_batches, features  # this folder


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


def bytes_rows(graph, x: torch.Tensor, batches: list[torch.Tensor], args,
               pool: torch.Tensor) -> list[dict]:
    """Bytes moved per epoch for each cache kind and macro-batch gathering (see the module docstring)."""
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
        return GNSSampler(graph, args.fanouts, cache_fraction=args.gns_cache, refresh_every=args.gns_refresh,
                          cache_only_input_layer=only_input, batches_per_epoch=len(batches), training_nodes=pool)

    samplers = {"NS": NeighborSampler(graph, args.fanouts),
                "LABOR-0 κ=64": LaborSampler(graph, args.fanouts, batch_dependency=64, batches_per_epoch=len(batches)),
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
    cells = []
    for r in rows:
        bound = r["distinct"] * r["row_bytes"]
        cells.append([r["name"], f"{r['requested']:,}", f"{r['hits'] / max(r['hits'] + r['misses'], 1):.3f}",
                      f"{r['host_read'] / mb:,.1f}", f"{r['fill'] / mb:,.1f}", f"{r['host_to_device'] / mb:,.1f}",
                      f"{bound / mb:,.1f}", f"{r['host_read'] / bound:.2f}×", f"{r['seconds']:.2f}"])
    print("\n" + markdown_table(header, cells))


def main(argv=None) -> None:
    parser = batch_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--gns-cache", type=float, default=0.01, help="GNS cache as a fraction of the nodes")
    parser.add_argument("--gns-refresh", type=int, default=16, help="GNS refreshes its cache every this many batches")
    parser.add_argument("--feature-width", type=int, default=128,
                        help="float32 features per node of a graph without features (ego-twitter: random ones)")
    parser.add_argument("--device", default="cpu", help="where the gathers go (cuda: host→device copies)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    graph, pool, batches = epoch_batches(args)
    x = features(graph, args.feature_width, args.seed)
    print(f"{args.graph}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; fanouts {args.fanouts} (input layer first), "
          f"one epoch = {len(batches)} batches of {args.batch_size} seeds; features {tuple(x.shape)} "
          f"{x.dtype} ({x.shape[1] * x.element_size()} bytes a row); gathers to {args.device}", flush=True)
    rows = bytes_rows(graph, x, batches, args, pool)
    print_bytes_table(rows, args.device)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
