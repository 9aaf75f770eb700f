"""REG at scale: the K-way plan of a large power-law batch, REG (hubs clipped) against METIS on the induced graph.

REG here is the ``reg`` partitioner: ``C = Aᵀ diag(w) A`` over the output block, src nodes
read by more outputs than :func:`partition.reg.hub_threshold` allows (``MAX_PAIRS``
output pairs) left out, each kept one weighing ``w ≈ 64 / (d − 1)`` (``d``: its readers).

Source: Betty (ASPLOS '23) §4.3 (REG, Algorithm 1); issue 7 "REG at scale": on a
2M-node power-law graph with in-degrees up to 2·10⁵, 200k outputs and fanouts 10,25,
the K = 16 plan must finish within 30 s and 4 GiB of extra memory, with redundancy no
worse than METIS on the outputs' induced graph. (At commit 90a2506 the unclipped REG
took 98.8 s and 17.7 GB and METIS then ran out of memory.)

The graph is a seeded Chung–Lu graph: node ``i`` (in a random order) has expected
degree ∝ ``(i + 1)^-α`` with ``α`` chosen so the largest expected degree is
``--max-degree``; ``--edges`` endpoint pairs are drawn independently ∝ those weights,
symmetrised, deduplicated and self loops dropped (``Graph.from_edges``). The batch is
``--outputs`` random distinct seeds sampled with ``betty_trainer.sampling.neighbor.sample_batch``.

For each partitioner it runs ``partition.make_split(blocks, k=K, partitioner=...)``
(graph over the outputs, METIS, slicing of the K micro-batches) and prints wall time,
extra peak resident memory (``VmHWM`` from ``/proc/self/status``, reset through
``/proc/self/clear_refs`` before each plan, minus the resident memory before it; Linux
only) and the per-layer redundancy (Σ_k |src nodes of micro-batch k| / |src nodes|).
It then times make_split's stages apart (vertex weights, METIS, slicing), each beside its
former form, measured side by side in the same run: METIS with its default 10 refinement
passes (``partition.metis.REFINEMENT_ITERATIONS`` applies above 10⁶ entries) and slicing
by tensor ops (the GPU path) instead of the compiled CPU kernel. The machine's load
average is printed with each row: wall times on a shared machine move with it.

Run:
    python benchmarks/reg_scale.py                          # the issue's 2M-node case, K = 16
    python benchmarks/reg_scale.py --nodes 200000 --edges 1450000 --max-degree 20000 --outputs 20000
    python benchmarks/reg_scale.py --methods reg,metis,reg_unclipped   # unclipped REG: minutes and ~18 GB at 2M nodes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from betty_trainer.data.block import Batch
from betty_trainer.data.graph import Graph
from betty_trainer.sampling import sample_batch
from partition import Split, make_split, redundancy
from partition.metis import metis_kway
from partition.partitioners import OutputSplitter
from partition.reg import MAX_PAIRS, build_reg, hub_threshold, reader_counts
from partition.search import integer_weights, output_costs
from partition.slicing import slice_block_tensors, slice_layers


def power_law_graph(num_nodes: int, num_edges: int, max_degree: float, seed: int = 0) -> Graph:
    """A seeded undirected Chung–Lu graph with a power-law degree sequence.

    Args:
        num_nodes: ``N``.
        num_edges: endpoint pairs drawn (before symmetrising and deduplication; the
            graph holds up to ``2 · num_edges`` directed edges).
        max_degree: expected degree of the most connected node (its realised degree is
            lower: repeated pairs are merged).
        seed: numpy seed; the same arguments give the same graph.

    Returns:
        A :class:`Graph` with ``x`` ``(N, 1)`` zeros, ``y`` zeros, empty splits.
    """
    log_rank = np.log(np.arange(1, num_nodes + 1, dtype=np.float64))

    def top_share(alpha: float) -> float:  # expected degree of the first node for exponent alpha
        weights = np.exp(-alpha * log_rank)
        return 2 * num_edges / weights.sum()

    low, high = 0.0, 2.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if top_share(middle) < max_degree else (low, middle)
    cdf = np.cumsum(np.exp(-low * log_rank))
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_nodes)  # hubs spread over the id space
    ends = order[np.minimum(np.searchsorted(cdf, rng.random(2 * num_edges), side="right"), num_nodes - 1)]
    empty = torch.zeros(0, dtype=torch.int64)
    return Graph.from_edges(torch.from_numpy(ends[:num_edges]), torch.from_numpy(ends[num_edges:]), num_nodes,
                            x=torch.zeros(num_nodes, 1), y=torch.zeros(num_nodes, dtype=torch.int64),
                            train_idx=empty, val_idx=empty, test_idx=empty, num_classes=1, name="chung-lu")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(fn) -> tuple[Any, float, int, float]:
    """Run ``fn()``; return its result, wall seconds, extra peak resident bytes over the RSS before, and
    CPU seconds of this process (less sensitive than wall time to other processes on the machine)."""
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started, cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return result, seconds, (_status_kib("VmHWM") - before) * 1024, cpu


def plan_row(batch: Batch, method: str, k: int, seed: int) -> dict[str, Any]:
    """Plan ``batch`` into ``k`` micro-batches with ``method``: time (graph over the outputs, then
    ``make_split``: vertex weights, METIS and slicing), extra peak memory, redundancy; then the plan's
    stages timed apart, each beside its former form (METIS with its default 10 refinement passes, slicing
    by tensor ops, as before the compiled CPU kernel)."""
    block = batch.blocks[-1]
    name = "reg" if method == "reg_unclipped" else method
    splitter, graph_s, graph_peak, graph_cpu = measured(
        lambda: OutputSplitter(block, "reg", graph=build_reg(block, clip_hubs=False)) if method == "reg_unclipped"
        else _built(OutputSplitter(block, method)))
    plan, plan_s, plan_peak, plan_cpu = measured(
        lambda: _counted(make_split(batch.blocks, k=k, partitioner=name, seed=seed, splitter=splitter)))
    # the stages of make_split, timed apart (with the same vertex weights)
    weights, weights_s, _, _ = measured(lambda: integer_weights(output_costs(batch.blocks)))
    groups, metis_s, _, _ = measured(lambda: splitter.split(k, seed, weights))
    _, slicing_s, _, _ = measured(lambda: [slice_layers(batch.blocks, group) for group in groups])
    graph = splitter.graph
    _, metis10_s, _, _ = measured(lambda: metis_kway(graph, k, seed, weights, niter=10) if graph is not None else None)
    _, tensor_slicing_s, _, _ = measured(lambda: [_slice_by_tensor_ops(batch.blocks, group) for group in groups])
    layers = redundancy(batch.blocks, plan.sizes)
    return {"method": method, "k": plan.k, "seconds": graph_s + plan_s, "cpu_seconds": graph_cpu + plan_cpu,
            "graph_seconds": graph_s, "plan_seconds": plan_s, "weights_seconds": weights_s,
            "metis_seconds": metis_s, "slicing_seconds": slicing_s,
            "metis_10_passes_seconds": metis10_s, "tensor_slicing_seconds": tensor_slicing_s,
            "graph_entries": 0 if graph is None else int(graph.nnz),
            "extra_peak_bytes": max(graph_peak, plan_peak),
            "input_redundancy": layers[0], "layer_redundancy": layers, "load_average": os.getloadavg()}


def _counted(split: Split) -> Split:
    """``split`` with its micro-batches' sizes counted (a split of a given K without an estimate counts them when first
    read; a plan that estimates them counts them while planning, and this benchmark times that)."""
    split.sizes  # noqa: B018 (counted when first read)
    return split


def _slice_by_tensor_ops(blocks, outputs):
    """``slice_layers`` through the tensor path (the one GPUs take) instead of the compiled CPU kernel."""
    dst = outputs
    for block in reversed(blocks):
        dst = slice_block_tensors(block, dst).src_index


def _built(splitter: OutputSplitter) -> OutputSplitter:
    splitter.graph  # noqa: B018 (builds the REG or induced graph now, to time it apart)
    return splitter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2_000_000)
    parser.add_argument("--edges", type=int, default=14_500_000, help="endpoint pairs drawn (≈ half the directed edges)")
    parser.add_argument("--max-degree", type=float, default=330_000, help="expected degree of the largest hub")
    parser.add_argument("--outputs", type=int, default=200_000, help="seed/output nodes of the batch")
    parser.add_argument("--fanouts", default="10,25", help="input layer first")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--methods", default="reg,metis", help="comma-separated; reg_unclipped = the paper's AᵀA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    started = time.perf_counter()
    graph = power_law_graph(args.nodes, args.edges, args.max_degree, args.seed)
    degrees = graph.in_degrees()
    print(f"graph: {graph.num_nodes} nodes, {graph.num_edges} directed edges, in-degree max {int(degrees.max())}, "
          f"mean {graph.num_edges / graph.num_nodes:.1f} ({time.perf_counter() - started:.1f} s)")
    seeds = torch.from_numpy(np.random.default_rng(args.seed + 1).choice(args.nodes, args.outputs, replace=False))
    fanouts = [int(f) for f in args.fanouts.split(",")]
    batch, seconds, _, _ = measured(partial(sample_batch, graph, seeds, fanouts, torch.Generator().manual_seed(args.seed)))
    del graph, degrees
    readers = reader_counts(batch.blocks[-1])
    threshold = hub_threshold(readers, MAX_PAIRS)
    print(f"batch: {batch} sampled in {seconds:.1f} s; output block: {batch.blocks[-1].num_edges} edges, "
          f"a src node read by up to {int(readers.max())} outputs, Σd² = {float((readers.astype(float) ** 2).sum()):.3g}; "
          f"REG keeps src nodes read by ≤ {threshold} outputs ({int((readers > threshold).sum())} hubs clipped)")
    # a one-time cost per process, not per plan: numba compiles the slicing kernel (or loads it from its cache)
    _, seconds, _, _ = measured(lambda: slice_layers(batch.blocks, torch.zeros(1, dtype=torch.int64)))
    print(f"compiled slicing kernel ready in {seconds:.2f} s (untimed below)")

    rows = []
    for method in args.methods.split(","):
        row = plan_row(batch, method, args.k, args.seed)
        rows.append(row)
        print(f"{method:>14}: K={row['k']}  plan {row['seconds']:6.2f} s wall ({row['cpu_seconds']:.2f} s CPU; graph "
              f"{row['graph_seconds']:.2f} s, {row['graph_entries']} entries; make_split {row['plan_seconds']:.2f} s)  "
              f"extra peak {row['extra_peak_bytes'] / 2**30:5.2f} GiB  "
              f"redundancy per layer {', '.join(f'{r:.3f}' for r in row['layer_redundancy'])}\n"
              f"{'':>16}make_split's stages apart: vertex weights {row['weights_seconds']:.2f} s, METIS "
              f"{row['metis_seconds']:.2f} s (10 refinement passes: {row['metis_10_passes_seconds']:.2f} s), slicing "
              f"{row['slicing_seconds']:.2f} s (by tensor ops: {row['tensor_slicing_seconds']:.2f} s); "
              f"load average {', '.join(f'{x:.1f}' for x in row['load_average'])}", flush=True)
    by_method = {row["method"]: row for row in rows}
    if {"reg", "metis"} <= by_method.keys():
        reg, metis = by_method["reg"], by_method["metis"]
        print(f"REG / METIS: time {reg['seconds'] / metis['seconds']:.2f}× "
              f"(CPU {reg['cpu_seconds'] / metis['cpu_seconds']:.2f}×), input redundancy "
              f"{reg['input_redundancy'] / metis['input_redundancy']:.3f}×; "
              f"REG within 30 s: {reg['seconds'] <= 30}, within 4 GiB: {reg['extra_peak_bytes'] <= 4 * 2**30}")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {**vars(args), "json": None}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
