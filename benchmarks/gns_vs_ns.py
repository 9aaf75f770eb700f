"""GNS against NS in the GNS paper's setting (issue 8, GNS done-when: ≥ 3× fewer input nodes and bytes than NS).

For each graph of ``--graphs`` (:func:`gns_study`): the seeds' pool, the paper's batch of 1,000 and a batch as large,
relative to the graph, as the paper's ogbn-products batch (``--study-batch-sizes``), each cache size of
``--gns-caches``; NS and GNS with its input layer from the cache only, at equal ``--fanouts``, on ``--batches``
batches; per batch the input nodes, and the bytes read from the host per epoch through the feature store (NS
without a cache, NS with a static cache of GNS's size, GNS through its node cache). Run from the repository root::

    python benchmarks/gns_vs_ns.py --graphs amazon-computers,ego-twitter --gns-caches 0.01,0.05 --fanouts 5,10,15
"""

from __future__ import annotations

from common import int_list, load_graph, markdown_table  # this folder

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from sampling import features  # this folder

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


def gns_study_rows(name: str, graph, x: torch.Tensor, fanouts: list[int], batch_size: int, pool: torch.Tensor,
                   fractions: list[float], measured: int, seed: int) -> list[dict]:
    """NS and GNS (input layer from the cache only) on graph ``name``'s first ``measured`` batches of one shuffled epoch
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
        rows.append({"graph": name, "nodes": graph.num_nodes, "fanouts": fanouts, "batch": batch_size,
                     "batches_per_epoch": per_epoch, "measured": len(batches), "cache": fraction,
                     "cache_rows": int(gns.cache(SampleKey(seed, 0, 0)).nodes.numel()),
                     "probability": gns.cache_probability, "row_bytes": row, "ns": ns_row, "ns_static": static,
                     "gns": ours})
    return rows


def gns_study(args) -> None:
    """For each graph of ``--graphs``: the seeds' pool (:func:`study_pool`), the paper's batch of 1,000 and the
    products-like batch (:func:`products_like_batch`), each cache size of ``--gns-caches``; prints one table."""
    fanouts = args.fanouts
    rows = []
    for name in args.graphs.split(","):
        graph = load_graph(name)
        pool, pool_name = study_pool(graph, args.seed)
        x = features(graph, args.feature_width, args.seed)
        sizes = [int(b) if b != "products" else products_like_batch(graph, fanouts, pool, args.seed)
                 for b in args.study_batch_sizes.split(",")]
        print(f"{name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; seeds: {pool_name} "
              f"({pool.numel():,}); batch sizes {sizes}; rows {x.shape[1] * x.element_size()} bytes", flush=True)
        for size in dict.fromkeys(sizes):
            for r in gns_study_rows(name, graph, x, fanouts, size, pool, [float(c) for c in args.gns_caches.split(",")],
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
    cells = []
    for r in rows:
        ns, static, gns = r["ns"], r["ns_static"], r["gns"]
        cells.append([f"{r['graph']} ({r['nodes']:,})", ",".join(map(str, r["fanouts"])),
                      f"{r['batch']:,} ({ns['inputs'] / r['nodes']:.1%})",
                      f"{r['cache']:.0%} ({r['cache_rows']:,}, {r['probability']})", f"{ns['inputs']:,.0f}",
                      f"{gns['inputs']:,.0f} ({gns['layer1']:,.0f}; {gns['cached_inputs']:,.0f})",
                      f"{ns['inputs'] / gns['inputs']:.2f}×", f"{ns['epoch_bytes'] / mb:,.1f}",
                      f"{static['epoch_bytes'] / mb:,.1f}", f"{gns['epoch_bytes'] / mb:,.1f} ({gns['fill_bytes'] / mb:,.1f})",
                      f"{ns['epoch_bytes'] / gns['epoch_bytes']:.2f}×", f"{static['epoch_bytes'] / gns['epoch_bytes']:.2f}×",
                      f"{gns['hit_rate']:.3f}"])
    print("\n" + markdown_table(header, cells))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default="amazon-computers,coauthor-physics,fb100-cornell5,snap-slashdot,ego-twitter",
                        help="comma list of graphs (files from their folders in ../shared/datasets)")
    parser.add_argument("--gns-caches", default="0.01,0.05", help="cache sizes, fractions of the nodes")
    parser.add_argument("--study-batch-sizes", default="1000,products",
                        help="batch sizes; 'products' is the size whose NS input nodes are the fraction "
                             "of the graph they are in the paper's ogbn-products run (17.7%%)")
    parser.add_argument("--fanouts", type=int_list, default=[10, 10, 10], help="input layer first (the paper's: 5,10,15)")
    parser.add_argument("--batches", type=int, default=48, help="measured batches per setting")
    parser.add_argument("--feature-width", type=int, default=128,
                        help="float32 features per node of a graph without features (SNAP graphs: random ones)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gns_study(args)


if __name__ == "__main__":
    main()
