"""Layer-wise chunked execution against Betty's micro-batches (issue 10): peak and step time, side by side.

For each graph and model: one full-batch training step (every node an output, full neighbourhood,
dropout 0.5, Adam) at K = 1, with Betty's micro-batches at K ∈ ``--ks`` (REG), and layer by layer
at ``--chunks`` chunks per layer (METIS chunks, recomputation in backward). Peak: the measured peak of
the step (``estimator.measure.measure_peak``: profiler allocation records on CPU, after one warm-up
step so Adam's state is resident). Time: the median CPU time of ``--repeats`` steps (one thread by default;
set ``NUMBA_NUM_THREADS=1`` too), planning excluded
(a full batch's plan is reused every epoch). Each row is measured in the same run, its columns' timed
steps interleaved (round robin).

Printed: peak (MiB) and time (s) per column, then ratios to K = 1; the issue's targets are the
layer-wise peak at most Betty's K = 16 peak at ≤ 2× the K = 1 time, and on Coauthor Physics
a K = 8 peak ≤ 0.6× the K = 1 peak (issue 7).

``--planner``: the planner's choice under a budget instead (issue 10's planner done-when). Per model on the
first of ``--graphs``, budgets ``--fractions`` × the K = 1 step's measured peak; at each budget the plan of
``micro_batch.mode=micro_batches`` (the smallest K whose largest micro-batch is estimated to fit), of ``layerwise``
(the fewest chunks per layer estimated to fit) and what ``auto`` picks. Both modes' plans are measured in
the same run, their timed steps interleaved: peak as the tests measure it (Betty: the largest micro-batch's
``measure_training_step``, later ones accumulating; layer-wise: ``measure_layerwise_step``; after a warm-up
step, so Adam's state is resident) and the median CPU time of a step over the K = 1 step's, interleaved with
them. Printed per budget: each mode's K (or chunks per layer), estimated and measured peak and time ratio; auto's
choice, whether it fits (measured ≤ budget) and its time over the faster plan's (the target: ≤ 1.2).

Run:
    python benchmarks/layerwise.py                                   # Amazon Computers and Coauthor Physics
    python benchmarks/layerwise.py --graphs amazon-computers --models sage-64 --ks 4,8 --repeats 2
    python benchmarks/layerwise.py --planner --graphs amazon-computers --models sage-64,sage-256
    python benchmarks/layerwise.py --graphs sbm-30k-d40 --models sage-64 --ks 16 --chunks 2,16  # little locality
"""

from __future__ import annotations

from common import load_graph, markdown_table  # this folder

import argparse
import statistics
import time
from pathlib import Path

import torch

from betty_trainer import HostFeatureStore, StepPlan, load_config
from betty_trainer.errors import PlanningError
from betty_trainer.execution.layerwise import layerwise_backward
from betty_trainer.execution.micro_batches import (
    MicroBatches,
    accumulate_gradients,
    measure_training_step,
    training_state,
)
from betty_trainer.memory.planner import Planner
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import set_dropout_key
from betty_trainer.sampling import sample_batch
from betty_trainer.training.trainer import init_model
from estimator.measure import measure_peak
from estimator.peaks import PeakEstimator
from partition import make_split
from partition.chunks import chunk_layers

CPU = torch.device("cpu")
MIB = 2**20
MODELS = {"sage-64": ("sage", 64), "sage-256": ("sage", 256), "gat-64": ("gat", 64)}


def config_for(arch: str, hidden: int):
    overrides = [f"model.arch={arch}", f"model.hidden={hidden}", "model.num_layers=2", "model.dropout=0.5",
                 "train.device=cpu"]
    if arch == "sage":
        overrides.append("model.aggregator=mean")
    return load_config(None, overrides)


def run_case(graph, arch: str, hidden: int, ks: list[int], chunk_counts: list[int],
             repeats: int) -> dict[str, tuple[float, float]]:
    """``{column: (peak MiB, median CPU seconds)}`` for K = 1, Betty K and layer-wise K."""
    config = config_for(arch, hidden)
    model = init_model(config, graph)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    features = HostFeatureStore(graph.x, pin=False)
    runners = {"K=1": lambda: accumulate_gradients(model, [batch], features, graph.y, CPU)}
    for k in ks:
        split = make_split(batch.blocks, k=k, partitioner="reg", seed=0)
        micro_batches = MicroBatches(batch, split.groups)
        runners[f"betty K={k}"] = (lambda mb=micro_batches: accumulate_gradients(model, mb, features, graph.y, CPU))
    for k in chunk_counts:
        chunks = chunk_layers(batch.blocks, k, "metis", seed=0)
        runners[f"layerwise {k}"] = (lambda c=chunks: layerwise_backward(model, batch, c, features, graph.y, CPU))

    def step(run):
        set_dropout_key(model, 0, 0)
        optimizer.zero_grad(set_to_none=True)
        run()
        optimizer.step()

    step(runners["K=1"])  # Adam's moments exist from here on
    peaks, times = {}, {name: [] for name in runners}
    for name, run in runners.items():
        optimizer.zero_grad(set_to_none=True)
        resident = training_state(model, optimizer)
        peaks[name] = measure_peak(lambda run=run: step(run), CPU, resident).peak_bytes
    for _ in range(repeats):  # round robin over the columns: a change in the machine's load hits them all
        for name, run in runners.items():
            started = time.process_time()
            step(run)
            times[name].append(time.process_time() - started)
    results = {}
    for name in runners:
        results[name] = (peaks[name] / MIB, statistics.median(times[name]))
        print(f"  {graph.name} {arch}-{hidden} {name}: peak {peaks[name] / MIB:.1f} MiB, "
              f"step {statistics.median(times[name]):.3f} s", flush=True)
    return results


def run_planner(graph, arch: str, hidden: int, fractions: list[float], repeats: int) -> tuple[int, list[dict]]:
    """The K = 1 measured peak and, per budget fraction, the betty, layer-wise and auto plans, measured (see the
    module docstring)."""
    config = config_for(arch, hidden)
    model = init_model(config, graph)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=config.optim.weight_decay)
    model.train()
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    spec = model_spec(config, graph, CPU)
    set_dropout_key(model, 0, 0)
    features = HostFeatureStore(graph.x, pin=False)
    measure_training_step(model, optimizer, batch, features, graph.y, CPU)  # Adam's moments exist from here on
    full_peak = measure_training_step(model, optimizer, batch, features, graph.y, CPU).peak_bytes

    def planner(mode: str, budget: int) -> Planner:
        section = config.micro_batch.model_copy(update={"mode": mode, "budget": budget})
        return Planner(section, PeakEstimator(spec), CPU)

    def measure(plan: StepPlan) -> int:
        set_dropout_key(model, 0, 0)
        return max(plan.measure(model, optimizer, features, graph.y, CPU))

    measured: dict[tuple[str, int], tuple[int, float]] = {}  # (mode, K) -> (peak bytes, median CPU time over K = 1's)
    rows = []
    for fraction in fractions:
        budget = int(full_peak * fraction)
        row = {"fraction": fraction, "budget": budget}
        works = {}
        for mode in ("micro_batches", "layerwise"):
            try:
                plan = planner(mode, budget).plan(batch)
            except PlanningError:
                row[mode] = None
                continue
            row[mode] = {"k": plan.pieces, "summary": f"K={plan.pieces}" if mode == "micro_batches" else
                         ", ".join(str(len(layer)) for layer in plan.chunks.layers) + " chunks",
                         "estimate": plan.estimate, "work": plan.work}
            works[mode] = plan
        fresh = [mode for mode in works if (mode, row[mode]["k"]) not in measured]
        times = {mode: [] for mode in ["K=1", *fresh]}
        peaks = {mode: measure(works[mode]) for mode in fresh}
        runs = {"K=1": lambda: accumulate_gradients(model, [batch], features, graph.y, CPU)}
        runs.update({mode: (lambda plan=works[mode]: plan.run(model, features, graph.y, CPU)) for mode in fresh})
        for _ in range(repeats):  # interleaved: K = 1, betty, layer-wise, K = 1, …
            for mode, run in runs.items():
                set_dropout_key(model, 0, 0)
                optimizer.zero_grad(set_to_none=True)
                started = time.process_time()
                run()
                optimizer.step()
                times[mode].append(time.process_time() - started)
        reference = statistics.median(times["K=1"])
        for mode in fresh:
            measured[mode, row[mode]["k"]] = (peaks[mode], statistics.median(times[mode]) / reference)
        for mode in works:
            row[mode]["peak"], row[mode]["ratio"] = measured[mode, row[mode]["k"]]
        try:
            chosen = planner("auto", budget).plan(batch)
            row["auto"] = (chosen.method, chosen.pieces)
        except PlanningError:
            row["auto"] = None
        print(f"  {graph.name} {arch}-{hidden} {fraction}×: " + ", ".join(
            f"{mode} {row[mode]}" for mode in ("micro_batches", "layerwise", "auto")), flush=True)
        rows.append(row)
    return full_peak, rows


def print_planner(name: str, model: str, full_peak: int, rows: list[dict]) -> None:
    def cell(entry) -> str:
        if entry is None:
            return "— (none fits)"
        return (f"{entry['summary']}: {entry['estimate'] / MIB:.1f} / {entry['peak'] / MIB:.1f} MiB, "
                f"{entry['ratio']:.2f}× K = 1")

    print(f"\n{name}, {model}: K = 1 measured peak {full_peak / MIB:.1f} MiB; per plan: estimated / measured peak, "
          "median CPU time of a step over K = 1's, interleaved")
    lines = []
    for row in rows:
        budget = row["budget"]
        auto = row["auto"]
        if auto is None:
            choice = fits = ratio = "—"
        else:
            entry = row[auto[0]]
            assert entry is not None and entry["k"] == auto[1], "auto chose a plan neither mode made"
            faster = min(row[m]["ratio"] for m in ("micro_batches", "layerwise") if row[m] is not None)
            choice = f"{auto[0]} K={auto[1]}"
            fits = "yes" if entry["peak"] <= budget else f"NO (+{100 * (entry['peak'] / budget - 1):.1f}%)"
            ratio = f"{entry['ratio'] / faster:.2f}"
        lines.append([f"{row['fraction']}× ({budget / MIB:.1f} MiB)", cell(row["micro_batches"]), cell(row["layerwise"]),
                      choice, fits, ratio])
    print(markdown_table(["budget", "betty", "layer-wise", "auto", "fits", "auto time / faster"], lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default="amazon-computers,coauthor-physics")
    parser.add_argument("--models", default="sage-64,sage-256,gat-64", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--ks", default="4,8,16", help="Betty's micro-batches")
    parser.add_argument("--chunks", default=None, help="layer-wise chunks per layer (default: --ks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--planner", action="store_true", help="the planner's choice under budgets (see above)")
    parser.add_argument("--fractions", default="1,0.75,0.5,0.375,0.25", help="--planner: budgets × the K = 1 peak")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (numba's: NUMBA_NUM_THREADS)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder of the graphs' raw files (default: each one's folder in ../shared/datasets)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    chunk_counts = [int(k) for k in (args.chunks or args.ks).split(",")]
    if args.planner:
        name = args.graphs.split(",")[0]
        graph = load_graph(name, args.data_dir)
        results = []
        for model in args.models.split(","):
            arch, hidden = MODELS[model]
            results.append((model, *run_planner(graph, arch, hidden, [float(f) for f in args.fractions.split(",")],
                                                args.repeats)))
        for model, full_peak, rows in results:
            print_planner(name, model, full_peak, rows)
        return
    rows = []
    for name in args.graphs.split(","):
        graph = load_graph(name, args.data_dir)
        for model in args.models.split(","):
            arch, hidden = MODELS[model]
            rows.append((name, model, run_case(graph, arch, hidden, ks, chunk_counts, args.repeats)))
    columns = list(rows[0][2])
    print("\npeak MiB / step s (ratio to K=1)")
    lines = []
    for name, model, results in rows:
        base_peak, base_time = results["K=1"]
        lines.append([name, model] + [f"{peak:.0f} MiB ({peak / base_peak:.2f}×) / {secs:.2f} s ({secs / base_time:.1f}×)"
                                      for peak, secs in results.values()])
    print(markdown_table(["graph", "model", *columns], lines))


if __name__ == "__main__":
    main()
