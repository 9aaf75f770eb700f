"""The LABOR paper's measurements in its own regime (issue 25 item 3; ``../shared/papers/cooperative-minibatching-labor.txt``).

* ``--fig3`` (§4.1, Fig. 3 top row): E[|S³|]/|S⁰|, the sampled vertices of the 3rd hop per seed, against the batch
  size |S⁰| for NS, LABOR-0 and LABOR-*, 3 layers of fanout ``--fanout``, averaged over ``--reps`` random seed
  batches per size (our samplers). Theorem 3.1: it decreases with the batch size; the paper's order: NS > LABOR-0 >
  LABOR-*. |S³| is the input layer's src set, which (as in DGL's blocks) contains the seeds and every earlier hop.
* ``--kappa`` (§4.2, Fig. 5a): the LRU miss rate of LABOR-0 at batch size 1,024 against the batch dependency
  κ ∈ {1, 4, 16, 64, 256, ∞}, with LRU caches of 0.5×, 1× and 1.5× one batch's input-node set (the mean over the
  κ = 1 batches; the paper's regime: reddit's cache of 60k vertices, a batch's input set of that order), and
  10% of the nodes (the setting of ``labor_lru_miss.py``, a lower bound on what κ can do: the cache is far smaller
  than one batch's reads). Each batch reads its input nodes once. Ours reads through real LRU
  ``CachedFeatureStore``\\ s (asserted equal to the simulation :func:`sampling.lru_miss_rate`); DGL's
  ``LaborSampler``, in DGL's environment in the same run, is counted by ``lru_miss_rate``
  (:func:`labor_lru_miss.our_lru` and :class:`labor_lru_miss.DGLStudy`). The batches are ``--epochs`` shuffled
  epochs of every node as a seed, one sequence, so κ-groups run across epochs on both sides.
* ``--kappa-accuracy`` (Table 3): test accuracy at κ ∈ {1, 16, 64, 256, ∞} on ``--accuracy-graphs``, ``--runs``
  seeds each, through ``betty_trainer.train`` with ``sampling.sampler=labor``, ``--accuracy-epochs`` epochs.

Run from the repository root::

    python benchmarks/labor_paper.py --fig3
    python benchmarks/labor_paper.py --kappa --epochs 2
    python benchmarks/labor_paper.py --kappa-accuracy

The same file is DGL's side (``--dgl-side``, run with DGL's Python; it imports nothing from betty-trainer).
"""

from __future__ import annotations

from common import int_list, load_graph, markdown_table, name_list  # this folder

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess, serve  # this folder: both sides load it
from labor_lru_miss import DGLStudy, our_lru  # this folder

KAPPAS = (1, 4, 16, 64, 256, math.inf)
ACCURACY_KAPPAS = (1, 16, 64, 256, math.inf)


def kappa_name(kappa: float) -> str:
    return "∞" if kappa == math.inf else str(int(kappa))


# --- Fig. 3 ------------------------------------------------------------------------------------------------------

def fig3(args) -> None:
    """E[|S³|]/|S⁰| per graph, batch size and sampler (mean ± std over ``--reps`` seed batches)."""
    from betty_trainer.sampling import LaborSampler, NeighborSampler, SampleKey

    fanouts = [args.fanout] * 3
    for name in args.graphs:
        graph = load_graph(name, args.data_dir)
        pool = graph.train_idx if graph.train_idx.numel() >= max(args.batch_sizes) else torch.arange(graph.num_nodes)
        samplers = {"NS": NeighborSampler(graph, fanouts),
                    "LABOR-0": LaborSampler(graph, fanouts, importance_iterations=0),
                    "LABOR-*": LaborSampler(graph, fanouts, importance_iterations=-1)}
        print(f"{name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges (CSC, in-edges), seeds from "
              f"{pool.numel():,} nodes; fanouts {fanouts}; {args.reps} seed batches per size", flush=True)
        rows = []
        for size in args.batch_sizes:
            cells = [f"{size:,}"]
            means = []
            for label, sampler in samplers.items():
                ratios = []
                started = time.perf_counter()
                for rep in range(args.reps):
                    order = torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(args.seed + rep))
                    batch = sampler.sample(pool[order[:size]], SampleKey(args.seed, 0, rep))
                    ratios.append(batch.input_nodes.numel() / size)
                mean = statistics.fmean(ratios)
                means.append(mean)
                spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
                cells.append(f"{mean:.2f} ± {spread:.2f}")
                print(f"  {size:>6,} {label}: E[|S³|]/|S⁰| {mean:.3f} ± {spread:.3f} "
                      f"({time.perf_counter() - started:.1f} s)", flush=True)
            cells.append("yes" if means[0] > means[1] > means[2] else "**no**")
            rows.append((means, cells))
        for column, label in enumerate(samplers):
            series = [means[column] for means, _ in rows]
            decreasing = all(a > b for a, b in zip(series, series[1:]))
            print(f"  {label}: {'monotone decrease' if decreasing else 'NOT monotone'} over the batch sizes")
        print(f"\n{name} ({graph.num_nodes:,} nodes), E[|S³|]/|S⁰|, mean ± std over {args.reps} seed batches:\n")
        print(markdown_table(["batch size (seeds)", *samplers, "NS > LABOR-0 > LABOR-*"], [c for _, c in rows]) + "\n",
              flush=True)


# --- Fig. 5a: LRU miss rate against κ ------------------------------------------------------------------------------

def epochs_of_batches(pool: torch.Tensor, batch_size: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """``epochs`` shuffles of ``pool`` (epoch ``e`` shuffled by ``seed + e``), each cut into batches of ``batch_size``
    (a short last batch dropped), as one sequence."""
    batches = []
    for epoch in range(epochs):
        order = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed + epoch))]
        batches += list(order[: order.numel() // batch_size * batch_size].split(batch_size))
    return batches


def kappa_study(args) -> None:
    """LRU miss rate of LABOR-0 against κ at four cache sizes, ours and DGL's in the same run."""
    graph = load_graph(args.graph, args.data_dir)
    n = graph.num_nodes
    pool = graph.train_idx if graph.train_idx.numel() >= args.batch_size * 8 else torch.arange(n)
    batches = epochs_of_batches(pool, args.batch_size, args.epochs, args.seed)
    fanouts = [args.fanout] * 3
    spec = {"fanouts": fanouts, "importance": 0, "layer_dependency": False, "count": "inputs", "seed": args.seed}
    # one batch's input set: the mean over the κ = 1 batches (ours; the cache sizes depend only on it)
    first = our_lru(graph, batches, kappa=1, capacity=[1], **spec)
    per_batch = first["reads_per_batch"]
    sizes = [(f"{f}× batch", int(f * per_batch)) for f in args.cache_factors] + [("10% of nodes", int(0.1 * n))]
    capacities = [c for _, c in sizes]
    print(f"{args.graph}: {n:,} nodes, {graph.num_edges:,} edges; LABOR-0, fanouts {fanouts}, {len(batches)} batches of "
          f"{args.batch_size} ({args.epochs} shuffled epochs); one batch reads {per_batch:,.0f} input nodes at κ = 1 "
          f"({per_batch / n:.0%} of the graph); LRU caches: "
          + ", ".join(f"{label} = {c:,} ({c / n:.0%} of nodes)" for label, c in sizes), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        dgl = None
        if args.dgl_python and Path(args.dgl_python).exists():
            np.save(scratch / "seeds.npy", torch.cat(batches).numpy())
            np.save(scratch / "indptr.npy", graph.indptr.numpy())
            np.save(scratch / "indices.npy", graph.indices.numpy())
            dgl = DGLProcess(args.dgl_python, Path(__file__).resolve(), ["--dgl-side"], args.threads,
                             scratch / "dgl.log")
            print(f"DGL {dgl('hello')['dgl']} side by side", flush=True)
            dgl("load", folder=str(scratch))
        for kappa in KAPPAS:
            started = time.perf_counter()
            ours = our_lru(graph, batches, kappa=kappa, capacity=capacities, **spec)
            theirs = dgl("lru", seeds=str(scratch / "seeds.npy"), batch_size=args.batch_size, kappa=kappa,
                         capacity=capacities, **spec) if dgl is not None else None
            results.append((kappa, ours, theirs))
            print(f"  κ={kappa_name(kappa)}: ours " + " ".join(f"{m:.3f}" for m in ours["miss"])
                  + (" | DGL " + " ".join(f"{m:.3f}" for m in theirs["miss"]) if theirs else "")
                  + f" ({time.perf_counter() - started:.0f} s)", flush=True)
        if dgl is not None:
            dgl.close()
    print_kappa_tables(sizes, results)


def print_kappa_tables(sizes: list[tuple[str, int]], results: list[tuple[float, dict, dict | None]]) -> None:
    """One table of miss rates (ours, DGL, the gap) per κ and cache size, and one of κ's reduction against κ = 1."""
    header = ["κ", *(f"{label} ({capacity:,})" for label, capacity in sizes), "largest abs(ours − DGL)"]
    rows, gaps = [], []
    for kappa, ours, theirs in results:
        cells = [kappa_name(kappa)]
        row_gaps = [abs(m - t) for m, t in zip(ours["miss"], theirs["miss"])] if theirs else []
        for column in range(len(sizes)):
            cells.append(f"{ours['miss'][column]:.3f}" + (f" / {theirs['miss'][column]:.3f}" if theirs else ""))
        rows.append(cells + [f"{max(row_gaps):.3f}" if row_gaps else ""])
        gaps += row_gaps
    print("\nLRU miss rate (misses / reads), LABOR-0, ours / DGL:\n")
    print(markdown_table(header, rows))
    base_ours, base_dgl = results[0][1]["miss"], results[0][2]["miss"] if results[0][2] else None
    rows = []
    for kappa, ours, theirs in results[1:]:
        cells = [kappa_name(kappa)]
        for column in range(len(sizes)):
            cells.append(f"{1 - ours['miss'][column] / base_ours[column]:.0%}"
                         + (f" / {1 - theirs['miss'][column] / base_dgl[column]:.0%}" if theirs else ""))
        rows.append(cells)
    print("\nMiss-rate reduction against κ = 1 (1 − miss(κ)/miss(1)), ours / DGL:\n")
    print(markdown_table(["κ", *(f"{label}" for label, _ in sizes)], rows))
    if gaps:
        print(f"\nlargest |ours − DGL| over every cell: {max(gaps):.4f}")


# --- Table 3: accuracy against κ ---------------------------------------------------------------------------------

def kappa_accuracy(args) -> None:
    """Test accuracy (of the model chosen on validation) per graph and κ, mean ± std over ``--runs`` seeds:
    ``configs/cora-labor.yaml`` on ``--accuracy-graphs`` with LABOR-0, ``--accuracy-layers`` layers of fanout
    ``--fanout``, batches of ``--accuracy-batch-size``, one micro-batch, ``--accuracy-epochs`` epochs, on the CPU."""
    from rich.console import Console

    from betty_trainer import load_config, train

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.accuracy_graphs:
            graph = load_graph(name, args.data_dir)
            batches = math.ceil(graph.train_idx.numel() / args.accuracy_batch_size)
            print(f"{name}: {graph.num_nodes:,} nodes, {graph.train_idx.numel():,} training nodes, {batches} batches "
                  f"per epoch, {args.accuracy_epochs} epochs = {batches * args.accuracy_epochs} batches", flush=True)
            for kappa in ACCURACY_KAPPAS:
                accuracies = []
                started = time.perf_counter()
                for run in range(args.runs):
                    overrides = [f"name=labor-paper-{name}", f"dataset.name={name}", f"seed={run}",
                                 f"model.num_layers={args.accuracy_layers}",
                                 f"sampling.fanouts=[{','.join([str(args.fanout)] * args.accuracy_layers)}]",
                                 f"sampling.batch_size={args.accuracy_batch_size}",
                                 "sampling.labor.importance_iterations=0",
                                 f"sampling.labor.batch_dependency={'inf' if kappa == math.inf else kappa}",
                                 "micro_batch.num_micro_batches=1", f"optim.epochs={args.accuracy_epochs}",
                                 "train.device=cpu"]
                    result = train(load_config(args.accuracy_config, overrides), graph=graph,
                                   run_dir=Path(scratch) / f"{name}-{kappa_name(kappa)}-{run}",
                                   console=Console(quiet=True))
                    accuracies.append(result.test_acc)
                mean = statistics.fmean(accuracies)
                spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
                rows.append([name, kappa_name(kappa), f"{mean:.4f} ± {spread:.4f}",
                             ", ".join(f"{a:.4f}" for a in accuracies)])
                print(f"  {name} κ={kappa_name(kappa)}: {mean:.4f} ± {spread:.4f} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    print("\n" + markdown_table(["graph", "κ", "test accuracy (mean ± std)", "runs"], rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fig3", action="store_true", help="E[|S³|]/|S⁰| against the batch size")
    parser.add_argument("--kappa", action="store_true", help="LRU miss rate against κ, ours beside DGL's")
    parser.add_argument("--kappa-accuracy", action="store_true", help="test accuracy against κ")
    parser.add_argument("--dgl-side", action="store_true", help="serve DGL's side (run with DGL's Python)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="raw files of the dataset (default: its folder in ../shared/datasets)")
    parser.add_argument("--fanout", type=int, default=10, help="every layer's fanout (3 layers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--graphs", type=name_list, default=["ego-twitter", "snap-slashdot"], help="--fig3's graphs")
    parser.add_argument("--batch-sizes", type=int_list, default=[256, 1024, 4096, 16384], help="--fig3's |S⁰|")
    parser.add_argument("--reps", type=int, default=4, help="--fig3's seed batches per size")
    parser.add_argument("--graph", default="ego-twitter", help="--kappa's graph")
    parser.add_argument("--batch-size", type=int, default=1024, help="--kappa's batch size")
    parser.add_argument("--epochs", type=int, default=2, help="--kappa's shuffled epochs of batches")
    parser.add_argument("--cache-factors", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 1.0, 1.5],
                        help="--kappa's LRU sizes in units of one batch's input-node set")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    parser.add_argument("--accuracy-graphs", type=name_list, default=["musae-facebook", "fb100-cornell5"])
    parser.add_argument("--accuracy-config", default="configs/cora-labor.yaml")
    parser.add_argument("--accuracy-epochs", type=int, default=8)
    parser.add_argument("--accuracy-batch-size", type=int, default=512)
    parser.add_argument("--accuracy-layers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="--kappa-accuracy's seeds per κ")
    args = parser.parse_args(argv)
    if args.dgl_side:
        serve(DGLStudy())
        return
    torch.set_num_threads(args.threads)
    if not (args.fig3 or args.kappa or args.kappa_accuracy):
        parser.error("name at least one of --fig3, --kappa, --kappa-accuracy")
    if args.fig3:
        fig3(args)
    if args.kappa:
        kappa_study(args)
    if args.kappa_accuracy:
        kappa_accuracy(args)


if __name__ == "__main__":
    main()
