"""How far GNS's importance weights are from unbiased across caches (``sampling/gns.py``'s module docstring): per
cache size of ``--gns-caches``, one-layer GNS samples of 300 high-degree dst rows of ``--graph``, their weighted
sum, weighted mean and GCN output against the full neighbourhood's (see :func:`gns_bias`). Run from the
repository root::

    python benchmarks/gns_bias.py --graph amazon-computers --fanouts 10 --threads 1
"""

from __future__ import annotations

from common import int_list, load_graph  # this folder

import argparse
import math
from pathlib import Path

import torch


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
    k = args.fanouts[0]
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="amazon-computers", help="a dataset name betty-train knows, with features")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="raw files of the dataset (default: its folder in ../shared/datasets)")
    parser.add_argument("--fanouts", type=int_list, default=[10], help="k: the first value")
    parser.add_argument("--gns-caches", default="0.01,0.05", help="cache sizes, fractions of the nodes")
    parser.add_argument("--bias-batches", type=int, default=600, help="samples per cache size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="draws the dst rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gns_bias(args)


if __name__ == "__main__":
    main()
