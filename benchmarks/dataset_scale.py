"""Time and memory of every stage from a generated graph to one trained epoch, from 10⁵ to 5·10⁷ edges.

Issue 9 ("Real scale"): a synthetic graph with ≥ 50M directed edges and 2M nodes is
generated, cached, sampled (fanouts 10,25, full batch = the training nodes) and trained
for one epoch of 2-layer SAGE with 8 REG micro-batches on this machine, peak RSS under
20 GiB; this script prints each stage's time and memory.

The graph is :func:`betty_trainer.datasets.make_powerlaw` (Chung-Lu power-law planted
partition, average degree 26, 100 float32 features, 47 classes, 10% training nodes),
written once into the on-disk cache (``$BETTY_CACHE_DIR``, here a temporary folder unless
``--cache`` is given) and memory-mapped from it. By default the 47 classes are the planted
blocks (an edge stays in its class with probability 0.8, else lands anywhere); with
``--communities 2000 --class-homophily 0.8`` the blocks are 2000 communities of ~1000 nodes
nested in the classes (an edge stays in its community with probability 0.8; of the others 80%
stay in the class), the locality of a co-purchase graph that Betty's REG exploits
(``benchmarks/table6.py`` shows why Table 6 needs it). Each size runs in its own process, so
one size's freed memory does not hide the next one's. Stages:

- ``generate``: :func:`~betty_trainer.datasets.powerlaw.write_powerlaw` into the cache;
- ``open``: :func:`~betty_trainer.datasets.cache.load_cached` (maps the ``.npy`` files);
- ``sample``: one full batch, seeds = all training nodes, fanouts 10,25 (input layer first);
- ``plan``: what :func:`~betty_trainer.memory.planner.plan_micro_batches` does with REG, K = 8, by
  stage: REG construction (:class:`~partition.partitioners.OutputSplitter`'s graph), METIS vertex
  weights, METIS, counting the 8 micro-batches' sizes (:attr:`partition.Split.stage_seconds`), and
  ``Batch.restrict``. "REG+METIS / epoch" is REG construction plus METIS over the epoch's
  sample + plan + train;
- ``train``: the 8 micro-batches through 2-layer GraphSAGE (mean, hidden 64), features
  gathered from the memory-mapped matrix by :class:`~betty_trainer.data.feature_store.HostFeatureStore`,
  gradients accumulated, one Adam step.

Per stage: wall seconds and *extra peak RSS* (``VmHWM`` from ``/proc/self/status`` after
resetting it through ``/proc/self/clear_refs``, minus the RSS before the stage; Linux only),
plus the process's overall peak RSS (``ru_maxrss``). RSS counts the pages of mapped files
the stage touched (they are reclaimable page cache, not copies).

Run (the largest size takes minutes; run it once at most on a shared machine):
    python benchmarks/dataset_scale.py --edges 1e5,1e6,1e7
    python benchmarks/dataset_scale.py --edges 5.3e7 --cache /tmp/scale-cache --json dataset_scale.json
    python benchmarks/dataset_scale.py --edges 6e7 --communities 2000 --class-homophily 0.8 --cache /tmp/scale-cache

Measured here before the REG and METIS changes of 2026-11-22 (2 shared cores, load average 5-7;
seconds / extra peak GiB per stage):

| edges | nodes | generate | open | sample | plan K=8 | train | plan/train | inputs full / Σ micro | RSS GiB |
|---|---|---|---|---|---|---|---|---|---|
| 68.9k | 3.8k | 0.05 / 0.01 | 0.03 / 0.00 | 0.01 / 0.00 | 0.01 / 0.00 | 0.54 / 0.00 | 2.5% | 3.8k / 13.7k | 0.47 |
| 868k | 38.5k | 1.11 / 0.05 | 0.00 / 0.01 | 0.06 / 0.00 | 0.50 / 0.02 | 4.26 / 0.02 | 11.8% | 37.6k / 127k | 0.48 |
| 9.61M | 385k | 15.24 / 0.33 | 0.16 / 0.04 | 0.71 / 0.05 | 3.80 / 0.26 | 10.11 / 0.14 | 37.6% | 374k / 1.21M | 0.92 |
| 52.31M | 2.04M | 191.73 / 1.48 | 0.10 / 0.20 | 3.56 / 0.39 | 11.48 / 0.54 | 44.76 / 0.63 | 25.7% | 1.98M / 6.43M | 2.61 |

(the first three rows from ``--edges 1e5,1e6,1e7``, the last from ``--edges 5.3e7``; the cache of the
largest graph is 1.06 GB on disk, features 0.82 GB of it.)

After them (METIS k-way above 10⁶ entries, REG pair bound 2·10⁶, d = 1 src nodes out of the product;
caches already built; load average ~8; commit 9763bba), the class-block graph (``--edges 5.3e7``) and the nested one
(``--edges 6e7 --communities 2000 --class-homophily 0.8``), one run each:

| edges | nodes | sample | plan | train | REG / wts / METIS / slice / restrict | REG+METIS / epoch | plan/train | inputs | RSS GiB |
|---|---|---|---|---|---|---|---|---|---|
| 52.31M | 2.04M | 2.06/0.39 | 4.36/0.50 | 28.60/0.98 | 0.54 / 0.10 / 2.36 / 1.16 / 0.19 | 8.3% | 15.3% | 1.98M / 6.95M | 2.71 |
| 53.16M | 2.31M | 4.02/0.43 | 4.21/0.44 | 30.75/0.97 | 0.92 / 0.24 / 1.22 / 1.55 / 0.27 | 5.5% | 13.7% | 2.25M / 4.05M | 2.64 |

(inputs: full batch / Σ micro-batches. Wall times move with the load, and training (two threads) more
than REG and METIS (one): compare shares within a row. METIS takes twice as long on the class-block
graph's REG, which has no cluster structure to coarsen; the nested graph generates in ~190 s, 1.18 GB
of cache.)
"""

from __future__ import annotations

from common import markdown_table  # this folder

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

AVERAGE_DEGREE = 26  # directed edges per node (ogbn-products: 50.5; this keeps 52M edges at 2M nodes)
FANOUTS = [10, 25]
K = 8


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(stage: str, row: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run ``fn``; store its wall seconds and extra peak RSS (bytes) in ``row`` under ``stage``."""
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    result = fn()
    row[f"{stage}_s"] = time.perf_counter() - start
    row[f"{stage}_peak_bytes"] = (_status_kib("VmHWM") - before) * 1024
    return result


def _warm_up(graph, seed: int) -> None:
    from betty_trainer import HostFeatureStore, accumulate_gradients
    from betty_trainer.memory.planner import plan_micro_batches
    from betty_trainer.models.sage import GraphSAGE
    from betty_trainer.sampling import sample_batch

    batch = sample_batch(graph, graph.train_idx[:64], FANOUTS, torch.Generator().manual_seed(seed))
    model = GraphSAGE(graph.num_features, 64, graph.num_classes, 2, "mean", 0.5)
    accumulate_gradients(model, plan_micro_batches(batch, 2, "reg", seed), HostFeatureStore(graph.x, pin=False),
                         graph.y, torch.device("cpu"))


def powerlaw_params(num_edges: int, seed: int, communities: int = 0, class_homophily: float = 0.0) -> dict[str, Any]:
    """The :func:`~betty_trainer.datasets.powerlaw.write_powerlaw` keywords of the benchmark graph with
    ``num_edges`` directed edges drawn: ``N = num_edges / 26`` nodes, 47 classes, 100 features, 10% training
    nodes; ``communities`` > 0 plants that many blocks nested in the classes (``class_homophily``)."""
    params = dict(num_nodes=max(1000, num_edges // AVERAGE_DEGREE), num_edges=num_edges, num_classes=47,
                  num_features=100, exponent=2.5, homophily=0.8, feature_signal=0.3, train_fraction=0.1,
                  val_fraction=0.02, test_fraction=0.1, seed=seed)
    if communities:  # absent otherwise, so the cache of the class-block graph keeps its source
        params.update(num_communities=communities, class_homophily=class_homophily)
    return params


def cached_graph(params: dict[str, Any], row: dict[str, Any] | None = None):
    """The graph of ``params`` from the cache (``$BETTY_CACHE_DIR``/powerlaw-bench), generated into it first
    if absent (timed into ``row['generate_*']`` when ``row`` is given); memory-mapped."""
    from betty_trainer.datasets.cache import load_cached, processed_dir
    from betty_trainer.datasets.powerlaw import GENERATOR_VERSION, write_powerlaw

    source = {"generator": "powerlaw", "version": GENERATOR_VERSION, **params}
    suffix = f"-c{params['num_communities']}-h{params['class_homophily']}" if "num_communities" in params else ""
    folder = processed_dir("powerlaw-bench", f"e{params['num_edges']}-s{params['seed']}{suffix}")
    if load_cached(folder, source) is None:
        measured("generate", row if row is not None else {}, lambda: write_powerlaw(folder, source=source, **params))
    if row is not None:
        row["cache_bytes"] = sum(path.stat().st_size for path in folder.iterdir())
    return folder, source


def one_size(num_edges: int, seed: int, communities: int = 0, class_homophily: float = 0.0) -> dict[str, Any]:
    """Every stage on one graph size, in this process; returns the row."""
    from betty_trainer import accumulate_gradients
    from betty_trainer.data.feature_store import HostFeatureStore
    from betty_trainer.datasets.cache import load_cached
    from betty_trainer.execution.micro_batches import MicroBatches
    from betty_trainer.models.sage import GraphSAGE
    from betty_trainer.sampling import sample_batch
    from partition import OutputSplitter, make_split

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    params = powerlaw_params(num_edges, seed, communities, class_homophily)
    row: dict[str, Any] = {"edges_drawn": num_edges, "nodes": params["num_nodes"]}
    folder, source = cached_graph(params, row)
    graph = measured("open", row, lambda: load_cached(folder, source))
    _warm_up(graph, seed)  # JIT-compiled kernels and first-call costs stay out of the measured stages
    row["edges"] = graph.num_edges
    row["train_nodes"] = graph.train_idx.numel()
    batch = measured("sample", row, lambda: sample_batch(graph, graph.train_idx, FANOUTS,
                                                         torch.Generator().manual_seed(seed)))
    row["input_nodes"] = batch.blocks[0].num_src
    splitter = OutputSplitter(batch.blocks[-1], "reg")

    def plan():  # plan_micro_batches(batch, K, "reg", seed), with the REG built apart to time it
        started, cpu = time.perf_counter(), time.process_time()
        splitter.graph  # noqa: B018 (builds the REG)
        row["reg_s"], row["reg_cpu_s"] = time.perf_counter() - started, time.process_time() - cpu
        cpu = time.process_time()
        made = make_split(batch.blocks, k=K, partitioner="reg", seed=seed, splitter=splitter)
        made.sizes  # noqa: B018 (counts the micro-batches, as a plan made with an estimate does while planning)
        row["make_plan_cpu_s"] = time.process_time() - cpu
        row.update({f"plan_{stage}_s": seconds for stage, seconds in made.stage_seconds.items()})
        started = time.perf_counter()
        built = list(MicroBatches(batch, made.groups))  # sliced again, as a plan's micro-batches are when they run
        row["plan_build_s"] = time.perf_counter() - started
        return built

    micro = measured("plan", row, plan)
    row["micro_input_nodes"] = sum(mb.blocks[0].num_src for mb in micro)
    torch.manual_seed(seed)
    model = GraphSAGE(graph.num_features, 64, graph.num_classes, 2, "mean", 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    store = HostFeatureStore(graph.x, pin=False)

    def epoch():
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, micro, store, graph.y, torch.device("cpu"))
        optimizer.step()
        return loss

    measured("train", row, epoch)
    row["features_memory_mapped"] = store.memory_mapped
    row["plan_share_of_train"] = row["plan_s"] / row["train_s"]
    row["epoch_s"] = row["sample_s"] + row["plan_s"] + row["train_s"]
    row["reg_metis_s"] = row["reg_s"] + row["plan_partition_s"]
    row["reg_metis_share_of_epoch"] = row["reg_metis_s"] / row["epoch_s"]
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    stages = [s for s in ("generate", "open", "sample", "plan", "train") if any(f"{s}_s" in r for r in rows)]
    head = ["edges", "nodes"] + [f"{s} s / GiB" for s in stages] + [
        "plan: REG / weights / METIS / counting / build s", "REG+METIS / epoch", "plan/train",
        "inputs full / Σ micro", "peak RSS GiB"]
    lines = []
    for r in rows:
        cells = [f"{r['edges']:,}", f"{r['nodes']:,}"]
        cells += [f"{r[f'{s}_s']:.2f} / {_gib(r[f'{s}_peak_bytes'])}" if f"{s}_s" in r else "cached" for s in stages]
        cells.append(" / ".join(f"{r[key]:.2f}" for key in ("reg_s", "plan_weights_s", "plan_partition_s",
                                                             "plan_counting_s", "plan_build_s")))
        cells += [f"{r['reg_metis_share_of_epoch']:.1%}", f"{r['plan_share_of_train']:.1%}",
                  f"{r['input_nodes']:,} / {r['micro_input_nodes']:,}", _gib(r["peak_rss_bytes"])]
        lines.append(cells)
    return markdown_table(head, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", default="1e5,1e6,1e7", help="comma-separated directed edges to draw per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, help="cache folder to keep the graphs in (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--communities", type=int, default=0,
                        help="plant this many blocks nested in the classes (0: the classes are the blocks)")
    parser.add_argument("--class-homophily", type=float, default=0.0,
                        help="with --communities: share of the pairs leaving their block that stay in its class")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one size in this process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_size(args.one, args.seed, args.communities, args.class_homophily)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "BETTY_CACHE_DIR": str(args.cache or scratch)}
        for edges in (int(float(value)) for value in args.edges.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(edges), "--seed", str(args.seed),
                                  "--communities", str(args.communities), "--class-homophily", str(args.class_homophily)],
                                 env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"size {edges} failed:\n{out.stderr}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"done {edges:,} edges: {rows[-1]}", file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
