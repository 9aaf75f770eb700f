"""Input-node redundancy of micro-batch partitioners on real datasets, with partitioning time.

Source: Betty (ASPLOS '23) §4.3, Fig. 16 and Table 6. The full training batch is split
into K micro-batches by each partitioner (REG, unweighted REG, METIS on the induced
output graph, range, random); redundancy of layer l is Σ_k |src nodes of layer l in
micro-batch k| / |src nodes of layer l in the full batch|, so 1.0 means no node is
gathered twice. Layer 0 (input nodes) is what the paper plots. Times are wall-clock
milliseconds on the CPU: partitioning (``partition_outputs`` only: the REG or induced
graph is built and cut by METIS; median of ``--repeats`` runs) and slicing
(``Batch.split``, median as well). ``reg_unclipped`` (with ``--methods``) is the paper's
REG without hub clipping, for comparison.

``--step-epochs E`` also trains 2-layer SAGE-mean (hidden 64) on the full batch for E
epochs with ``Planner`` (K = ``--step-k``, REG, one partitioner seed as a run
would use) and prints, per epoch, sampling, planning (REG + METIS + slicing, or the
reuse check when the batch equals the last one) and the training step, and planning's
share of the whole step averaged over the epochs.

Run:
    python benchmarks/redundancy.py
    python benchmarks/redundancy.py --fanouts 10,25 --ks 2,4,8 --json redundancy.json
    python benchmarks/redundancy.py --datasets amazon-computers --outputs all --ks 4,8,16 \
        --methods reg,metis,reg_unclipped --step-epochs 5
"""

from __future__ import annotations

from common import int_list, load_graph, name_list  # this folder

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from betty_trainer.config import load_config
from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.errors import BettyError
from betty_trainer.memory.planner import Planner
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import build_model
from betty_trainer.sampling import sample_batch
from estimator.peaks import PeakEstimator
from partition import PARTITIONERS, OutputSplitter, partition_outputs, redundancy
from partition.reg import build_reg

METHODS = list(PARTITIONERS)  # reg, reg_unweighted, metis, range, random


def measure(batch: Batch, k: int, method: str, seed: int, repeats: int) -> dict[str, Any]:
    """Partition ``batch`` into ``k`` micro-batches with ``method``; times in milliseconds."""
    partition_ms, slice_ms = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        if method == "reg_unclipped":
            block = batch.blocks[-1]
            groups = OutputSplitter(block, "reg", graph=build_reg(block, clip_hubs=False)).split(k, seed)
        else:
            groups = partition_outputs(batch.blocks[-1], k, method, seed)
        partition_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        micro_batches = batch.split(groups)
        slice_ms.append((time.perf_counter() - start) * 1e3)
    layers = redundancy(batch.blocks, [mb.blocks for mb in micro_batches])
    return {
        "k": k,
        "method": method,
        "num_micro_batches": len(groups),
        "partition_ms": statistics.median(partition_ms),
        "partition_ms_runs": partition_ms,
        "slice_ms": statistics.median(slice_ms),
        "input_redundancy": layers[0],
        "layer_redundancy": layers,
    }


def step_share(graph: Graph, outputs: torch.Tensor, fanouts: list, k: int, epochs: int, seed: int) -> dict[str, Any]:
    """Per epoch: seconds to sample the batch, plan it (``Planner.plan``) and train on it (forward
    and backward of every micro-batch, one Adam step); 2-layer SAGE-mean, hidden 64, K = ``k``, REG."""
    config = load_config(None, ["model.arch=sage", "model.aggregator=mean", "model.hidden=64", "model.num_layers=2",
                                f"micro_batch.num_micro_batches={k}", "micro_batch.partitioner=reg"])
    torch.manual_seed(seed)
    model = build_model(config.model, graph)
    optimizer = torch.optim.Adam(model.parameters())
    features = HostFeatureStore(graph.x, pin=False)
    planner = Planner(config.micro_batch, PeakEstimator(model_spec(config, graph)), torch.device("cpu"), seed=seed)
    rows = []
    for epoch in range(epochs):
        start = time.perf_counter()
        batch = sample_batch(graph, outputs, fanouts, torch.Generator().manual_seed(seed))
        sampled = time.perf_counter()
        plan = planner.plan(batch)
        planned = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        plan.run(model, features, graph.y, torch.device("cpu"))
        optimizer.step()
        done = time.perf_counter()
        rows.append({"epoch": epoch, "k": plan.pieces, "sample_s": sampled - start, "plan_s": planned - sampled,
                     "train_s": done - planned, "step_s": done - start})
    return {"epochs": rows, "plans_made": planner.plans_made, "plans_reused": planner.plans_reused,
            "plan_share": sum(r["plan_s"] for r in rows) / sum(r["step_s"] for r in rows)}


def summary(name: str, rows: list[dict[str, Any]], k: int = 8) -> str:
    """One line comparing REG's input redundancy at ``k`` with the baselines."""
    at_k = {row["method"]: row["input_redundancy"] for row in rows if row["k"] == k}
    if not {"reg", "reg_unweighted", "range", "random"} <= at_k.keys():
        return f"{name}: no K={k} row with reg, reg_unweighted, range and random; no summary"
    reg = at_k["reg"]
    return (
        f"{name}, K={k}: REG input redundancy {reg:.3f} = {reg / at_k['range']:.2f}× range's, "
        f"{reg / at_k['random']:.2f}× random's; weighted / unweighted REG = {reg / at_k['reg_unweighted']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder of the datasets' raw files (default: each one's folder in ../shared/datasets)")
    parser.add_argument("--datasets", type=name_list, default=["cora", "citeseer"], help="e.g. cora,citeseer")
    parser.add_argument("--ks", type=int_list, default=[2, 4, 8, 16], help="numbers of micro-batches, e.g. 2,4,8,16")
    parser.add_argument("--fanouts", type=int_list, default=[-1, -1], help="input layer first; -1 = full neighbourhood")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and partitioners")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="write all raw numbers to this file")
    parser.add_argument("--methods", type=name_list, default=METHODS,
                        help=f"partitioners, of {METHODS} and reg_unclipped")
    parser.add_argument("--outputs", choices=["train", "all"], default="train",
                        help="output nodes of the batch: the training split, or every node (full-graph training)")
    parser.add_argument("--step-epochs", type=int, default=0, help="also time E training epochs with plan reuse")
    parser.add_argument("--step-k", type=int, default=8, help="micro-batches of the --step-epochs run")
    args = parser.parse_args()

    console = Console()
    fanouts = [None if f == -1 else f for f in args.fanouts]
    data_dir = None if args.data_dir is None else str(args.data_dir)
    results: dict[str, Any] = {"config": {**vars(args), "data_dir": data_dir, "json": None}, "datasets": {}}
    for name in args.datasets:
        try:
            graph = load_graph(name, args.data_dir)
        except BettyError as error:
            parser.error(str(error))
        outputs = graph.train_idx if args.outputs == "train" else torch.arange(graph.num_nodes)
        batch = sample_batch(graph, outputs, fanouts, torch.Generator().manual_seed(args.seed))
        methods = args.methods
        rows = [measure(batch, k, method, args.seed, args.repeats) for k in args.ks for method in methods]
        results["datasets"][name] = {"batch_layer_sizes": [b.num_src for b in batch.blocks] + [batch.blocks[-1].num_dst],
                                     "rows": rows}

        sizes = " → ".join(map(str, results["datasets"][name]["batch_layer_sizes"]))
        table = Table(title=f"{name}: input-node redundancy (partitioning time, ms)",
                      caption=f"full batch, nodes per layer {sizes}; fanouts {args.fanouts}")
        table.add_column("K", justify="right")
        for method in methods:
            table.add_column(method, justify="right", no_wrap=True)
        for k in args.ks:
            cells = {r["method"]: f"{r['input_redundancy']:.3f} ({r['partition_ms']:.1f})" for r in rows if r["k"] == k}
            table.add_row(str(k), *(cells[m] for m in methods))
        console.print(table)
        console.print(summary(name, rows), soft_wrap=True)
        for k in args.ks:
            at_k = {r["method"]: r for r in rows if r["k"] == k}
            if {"reg", "metis"} <= at_k.keys():
                reg, metis = at_k["reg"], at_k["metis"]
                console.print(f"{name}, K={k}: REG / METIS partitioning time {reg['partition_ms'] / metis['partition_ms']:.2f}×, "
                              f"input redundancy {reg['input_redundancy'] / metis['input_redundancy']:.3f}×", soft_wrap=True)
        if args.step_epochs:
            share = step_share(graph, outputs, fanouts, args.step_k, args.step_epochs, args.seed)
            results["datasets"][name]["step_share"] = share
            for row in share["epochs"]:
                console.print(f"epoch {row['epoch']}: K={row['k']} sample {row['sample_s']:.3f} s, plan {row['plan_s']:.3f} s, "
                              f"train {row['train_s']:.3f} s")
            console.print(f"{name}: planning is {100 * share['plan_share']:.1f}% of the K={args.step_k} step over "
                          f"{args.step_epochs} epochs ({share['plans_made']} plans made, {share['plans_reused']} reused)")

    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        console.print(f"raw numbers written to {args.json}")


if __name__ == "__main__":
    main()
