"""Planning sampled mini-batches: per-batch REG against the run's graph partition (issue 23, item 3).

Every sampled mini-batch is a new batch, so a per-batch plan (``micro_batch.assignment=batch``: the batch's
REG, METIS, the micro-batches' sizes and estimates; Betty §4.3–4.4) is paid at every step. With
``micro_batch.assignment=graph`` METIS cuts the whole graph once per K for the run and each batch's outputs
take their nodes' parts, so a batch's plan is a look-up; its micro-batches' sizes are not counted
(``partition.slicing.count_layers``): their redundancy comes from the micro-batches the step builds. Under a budget
(``--budget``) they are counted and estimated, and the run's first batch, or one whose graph split misses the
budget, gets the per-batch REG search (``fallbacks``).

For each graph and batch size, the same sampled mini-batches (fanouts ``--fanouts``, input layer first; seeds: every
node, shuffled) are planned and trained by both arms in turn (per-batch, graph, per-batch, …), each arm with its own
2-layer GraphSAGE-mean (hidden 64, dropout 0.5, Adam, the same initial weights), K = ``--k`` micro-batches. Per arm:
CPU seconds (``time.process_time``; one thread: ``torch.set_num_threads(1)`` and ``NUMBA_NUM_THREADS=1``, so other
processes on the machine do not enter the figure) of ``Planner.plan`` (with reading the plan's redundancy after the
step, as training does) and of the K-micro-batch step (forward and backward of every micro-batch, one Adam step),
medians over the measured batches, planning's share of the step (the medians' ratio) and, in brackets, Σ plan / Σ step
over the measured batches (which holds what happens once: a fallback, METIS of the graph at a new K). The warm-up
batch of each arm (two under a budget) is not measured; the graph arm's warm-up plans hold the run's graph partition
(graph build + METIS; under a budget also the first batch's REG search), reported apart as "once per run".
Redundancy is Σ_k input nodes of micro-batch k / input nodes of the batch (Betty Fig. 16's measure, the mean
over batches); the peak is the largest micro-batch's estimated peak (the closed form, exact for the micro-batches
the plan makes; the mean over batches of each batch's largest). "K" is the mean number of micro-batches.

``sbm-100k`` is ``make_sbm(num_nodes=100_000, num_features=64, avg_degree=10)`` (5 classes, 70% of edges inside a
class: little locality); other names load through the dataset registry (``benchmarks/common.py``).

Run (the figures in ``benchmarks/README.md``):
    python benchmarks/sampled_planning.py --graphs sbm-100k,amazon-computers --batch-sizes 1024,8192 --batches 10
    python benchmarks/sampled_planning.py --graphs sbm-100k,amazon-computers --batch-sizes 1024,8192 --batches 10 \
        --budget 0.25
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

from common import int_list, load_graph, markdown_table, name_list  # noqa: E402 (this folder)

import torch  # noqa: E402

from betty_trainer.config import load_config  # noqa: E402
from betty_trainer.data.feature_store import HostFeatureStore  # noqa: E402
from betty_trainer.memory.planner import Planner  # noqa: E402
from betty_trainer.memory.spec import model_spec  # noqa: E402
from betty_trainer.models import build_model  # noqa: E402
from betty_trainer.sampling import sample_batch  # noqa: E402
from estimator.peaks import PeakEstimator  # noqa: E402
from partition import GraphPartition  # noqa: E402

ARMS = ("batch", "graph")


def arms(graph: Any, k: int, seed: int, budget_fraction: float | None, first: Any) -> dict[str, dict[str, Any]]:
    """Per ``micro_batch.assignment``, a planner and a model with its optimizer (the same initial weights); with
    ``budget_fraction``, both plan under a budget of that fraction of the ``first`` batch's unsplit estimate."""
    overrides = ["model.arch=sage", "model.aggregator=mean", "model.hidden=64", "model.num_layers=2",
                 f"micro_batch.num_micro_batches={k}", "micro_batch.partitioner=reg"]
    config = load_config(None, overrides)
    estimator = PeakEstimator(model_spec(config, graph))
    if budget_fraction is not None:
        config = load_config(None, overrides + [f"micro_batch.budget={int(budget_fraction * estimator.peak(first.blocks))}"])
    everyone = torch.ones(graph.num_nodes, dtype=torch.bool)  # every node is a seed here
    made = {}
    for assignment in ARMS:
        torch.manual_seed(seed)
        model = build_model(config.model, graph)
        partition = GraphPartition(graph.indptr, graph.indices, everyone) if assignment == "graph" else None
        made[assignment] = {"planner": Planner(config.micro_batch, estimator, torch.device("cpu"), seed=seed,
                                               graph_partition=partition),
                            "model": model, "optimizer": torch.optim.Adam(model.parameters()), "warmup": [],
                            "rows": []}
    return made


def step(arm: dict[str, Any], batch: Any, graph: Any, store: HostFeatureStore) -> dict[str, Any]:
    """Plan and train one batch with ``arm``: CPU seconds of each, redundancy and largest estimated peak. The plan's
    seconds include reading its redundancy after the step, as the training loop does after every step (a split not
    counted while planning takes it from the micro-batches the step built)."""
    started = time.process_time()
    plan = arm["planner"].plan(batch)
    planned = time.process_time()
    arm["optimizer"].zero_grad(set_to_none=True)
    plan.run(arm["model"], store, graph.y, torch.device("cpu"))
    arm["optimizer"].step()
    done = time.process_time()
    redundancy = plan.redundancy()[0]
    read = time.process_time()
    return {"plan_s": planned - started + read - done, "step_s": done - planned, "k": plan.pieces,
            "partitioner": plan.partitioner, "redundancy": redundancy, "peak_bytes": plan.estimate,
            "input_nodes": batch.blocks[0].num_src}


def measure(graph: Any, batch_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both arms on the same sampled batches, interleaved: ``args.batches`` measured after the warm-up (one batch;
    two under a budget, where the graph arm's first batch is planned per batch and the second partitions the
    graph)."""
    warmups = 1 if args.budget is None else 2  # under a budget the graph is partitioned at the second batch
    order = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(args.seed))
    window = torch.arange(min(batch_size, graph.num_nodes))  # batch i: the shuffled nodes from i · batch_size on, cyclically
    batches = (sample_batch(graph, order[(window + index * batch_size) % graph.num_nodes].sort().values,
                            args.fanouts, torch.Generator().manual_seed(args.seed + index))
               for index in range(warmups + args.batches))
    first = next(batches)
    store, made = HostFeatureStore(graph.x, pin=False), arms(graph, args.k, args.seed, args.budget, first)
    for index, batch in enumerate(itertools.chain([first], batches)):
        for arm in made.values():
            arm["warmup" if index < warmups else "rows"].append(step(arm, batch, graph, store))
    result = {"batch_size": batch_size, "once_per_run_s": sum(r["plan_s"] for r in made["graph"]["warmup"]), "arms": {}}
    for name, arm in made.items():
        rows = arm["rows"]
        result["arms"][name] = {
            "plan_ms": 1e3 * statistics.median(r["plan_s"] for r in rows),
            "step_ms": 1e3 * statistics.median(r["step_s"] for r in rows),
            "plan_share": sum(r["plan_s"] for r in rows) / sum(r["step_s"] for r in rows),
            "redundancy": statistics.mean(r["redundancy"] for r in rows),
            "peak_mib": statistics.mean(r["peak_bytes"] for r in rows) / 2**20,
            "input_nodes": statistics.mean(r["input_nodes"] for r in rows),
            "k": statistics.mean(r["k"] for r in rows),
            "fallbacks": arm["planner"].fallbacks, "refined": arm["planner"].refined, "rows": rows,
            "warmup": arm["warmup"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=name_list, default=["sbm-100k", "amazon-computers"])
    parser.add_argument("--batch-sizes", type=int_list, default=[1024, 8192], help="seed nodes per mini-batch")
    parser.add_argument("--fanouts", type=int_list, default=[10, 25], help="input layer first")
    parser.add_argument("--k", type=int, default=8, help="micro-batches per batch")
    parser.add_argument("--batches", type=int, default=8, help="measured batches per arm (after one warm-up)")
    parser.add_argument("--budget", type=float, default=None,
                        help="plan under a budget: this fraction of the first batch's unsplit estimate (default: K)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write all raw numbers to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results, lines = {"config": {**vars(args), "json": None}, "graphs": {}}, []
    for name in args.graphs:
        graph = load_graph(name)
        results["graphs"][name] = rows = [measure(graph, size, args) for size in args.batch_sizes]
        for row in rows:
            per = row["arms"]
            lines.append(
                [name, str(row["batch_size"]), f"{per['batch']['input_nodes']:,.0f}"]
                + [f"{per[a]['plan_ms']:.1f} / {per[a]['step_ms']:.0f} ms: {100 * per[a]['plan_ms'] / per[a]['step_ms']:.1f}% "
                   f"(Σ {100 * per[a]['plan_share']:.1f}%)" for a in ARMS]
                + [" / ".join(f"{per[a]['k']:g}" for a in ARMS)]
                + [f"{per[a]['redundancy']:.3f}" for a in ARMS] + [f"{per[a]['peak_mib']:.2f}" for a in ARMS]
                + [f"{row['once_per_run_s']:.2f} s", str(per["graph"]["fallbacks"]), str(per["graph"]["refined"])])
    print(markdown_table(["graph", "batch", "input nodes", "per-batch REG: plan / K step", "graph: plan / K step",
                          "K REG / graph", "redundancy REG", "redundancy graph", "peak MiB REG", "peak MiB graph",
                          "graph partition once per run", "fallbacks", "refined"], lines))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
