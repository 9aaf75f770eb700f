"""The input-feature aggregation cache (issue 25, item 2; BatchGNN §3, App. C): step peak and time with and without
``features.aggregation_cache``.

For each graph and case, SAGE-mean hidden ``--hidden``, dropout 0, full neighbourhood, Adam, on the CPU: one
training step of the case's batch at K = 1 and K = 8 (REG micro-batches), without and with the cache. Cases:

- ``train-2``: 2 layers, the training split's seeds: layer 0's dst nodes (1 hop) are far fewer than its src nodes
  (2 hops), so the cache should cut the peak;
- ``train-3``: 3 layers, the training split's seeds: layer 0's dst nodes (2 hops) against its src nodes (3 hops),
  which on these small graphs cover most of the graph;
- ``all-2``: 2 layers, every node a seed (the full graph): layer 0's dst nodes are the whole graph, as many as its
  src nodes, and the cache reads ``2F`` columns a node instead of ``F`` (BatchGNN Table 5's case): it reads more.
  The seeds are shuffled (a fixed permutation): in node order a batch's input rows are the store's own rows
  ``0 … N − 1`` and a built-in model's step reads them in place, with or without the cache, gathering nothing.

Peak: the largest micro-batch's measured peak (``measure_training_step``: the profiler's allocation records on the
CPU, after a warm-up step so Adam's state is resident; later micro-batches accumulate). Time: the median of
``--repeats`` whole steps (every micro-batch and the optimizer step), the batch planned beforehand. Budget: the
smallest K the planner (``micro_batch.budget``, the closed-form estimate) finds for 0.5 × the uncached K = 1
measured peak, with and without the cache, and that plan's estimated peak. The cache's one-off cost (computing
and writing the table, and reading it back) is printed apart.

Run:
    python benchmarks/aggregation_cache.py                                     # Physics and Computers, both cases
    python benchmarks/aggregation_cache.py --graphs amazon-computers --cases train-3 --repeats 1
"""

from __future__ import annotations

from common import load_graph, markdown_table  # this folder

import argparse
import os
import statistics
import tempfile
import time

import torch

from betty_trainer import HostFeatureStore, load_config
from betty_trainer.errors import PlanningError
from betty_trainer.execution.micro_batches import accumulate_gradients, measure_training_step
from betty_trainer.memory.planner import make_planner, plan_micro_batches
from betty_trainer.sampling.base import SampleKey
from betty_trainer.sampling.schedule import make_sampler
from betty_trainer.training.aggregation import input_features
from betty_trainer.training.trainer import init_model

CPU = torch.device("cpu")
CASES = {"train-2": (2, "train"), "train-3": (3, "train"), "all-2": (2, "all")}


def config_of(layers: int, hidden: int, cached: bool, budget: int | None = None):
    overrides = ["model.arch=sage", "model.aggregator=mean", f"model.hidden={hidden}", f"model.num_layers={layers}",
                 "model.dropout=0", "sampling.sampler=full", f"features.aggregation_cache={str(cached).lower()}",
                 "micro_batch.partitioner=reg"]
    return load_config(None, overrides + ([f"micro_batch.budget={budget}"] if budget else []))


def measure(graph, config, seeds, ks, repeats):
    """Per K: (largest measured micro-batch peak, median step seconds); and the input rows of the K = 1 batch."""
    features = HostFeatureStore(input_features(config, graph), pin=False)
    batch = make_sampler(config, graph).sample(seeds, SampleKey(0))
    model = init_model(config, graph)
    optimizer = config.optim.make_optimizer(model.parameters())
    out = {}
    for k in ks:
        micro_batches = plan_micro_batches(batch, k, "reg", 0)
        measure_training_step(model, optimizer, micro_batches[0], features, graph.y, CPU)  # Adam's state exists
        peak = max(measure_training_step(model, optimizer, micro_batch, features, graph.y, CPU,
                                         num_outputs=seeds.numel(), accumulate=index > 0).peak_bytes
                   for index, micro_batch in enumerate(micro_batches))
        seconds = []
        for _ in range(repeats):
            optimizer.zero_grad(set_to_none=True)
            began = time.perf_counter()
            accumulate_gradients(model, micro_batches, features, graph.y, CPU)
            optimizer.step()
            seconds.append(time.perf_counter() - began)
        out[k] = (peak, statistics.median(seconds))
    return out, batch


def table_seconds(graph, hidden):
    """Seconds to make the cache's table the first time (computed and written) and the next (read back)."""
    config = config_of(2, hidden, True)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        input_features(config, graph)
        seconds.append(time.perf_counter() - started)
    return seconds


def smallest_k(graph, layers, hidden, cached, budget, batch):
    config = config_of(layers, hidden, cached, budget)
    features = HostFeatureStore(input_features(config, graph), pin=False)
    try:
        plan = make_planner(config, graph, None, CPU, features).plan(batch)
    except PlanningError:
        return "none fits", "-"
    return str(plan.pieces), f"{plan.estimate / 2**20:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default="coauthor-physics,amazon-computers")
    parser.add_argument("--cases", default="train-2,train-3,all-2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("BETTY_CACHE_DIR", tempfile.mkdtemp(prefix="aggcache-bench-"))
    rows, tables = [], []
    for name in args.graphs.split(","):
        graph = load_graph(name)
        first, again = table_seconds(graph, args.hidden)
        tables.append(f"{name}: the cache's table ({graph.num_nodes} x {2 * graph.num_features} float32, "
                      f"{graph.num_nodes * 2 * graph.num_features * 4 / 2**20:.0f} MiB) took {first:.2f} s to compute "
                      f"and write, {again:.2f} s to read back (the features hashed for its key, the file mapped)")
        for case in args.cases.split(","):
            layers, which = CASES[case]
            seeds = graph.train_idx if which == "train" else \
                torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(0))  # gathered, not in place
            results, batches = {}, {}
            for cached in (False, True):
                results[cached], batches[cached] = measure(graph, config_of(layers, args.hidden, cached), seeds,
                                                           (1, 8), args.repeats)
            budget = results[False][1][0] // 2
            fits = {cached: smallest_k(graph, layers, args.hidden, cached, budget, batches[cached])
                    for cached in (False, True)}
            for cached in (False, True):
                (p1, t1), (p8, t8) = results[cached][1], results[cached][8]
                rows.append([name, case, "cache" if cached else "-", str(batches[cached].input_nodes.numel()),
                             f"{p1 / 2**20:.0f}", f"{t1:.2f}", f"{p8 / 2**20:.0f}", f"{t8:.2f}",
                             f"{budget / 2**20:.0f}", *fits[cached]])
            print(markdown_table(HEADER, rows[-2:]), flush=True)
    print()
    print(markdown_table(HEADER, rows))
    print("\n".join(tables))


HEADER = ["graph", "case", "cache", "input rows (K=1)", "K=1 peak MiB", "K=1 s", "K=8 peak MiB", "K=8 s",
          "budget MiB (0.5 x uncached K=1)", "smallest K", "its est. peak MiB"]

if __name__ == "__main__":
    main()
