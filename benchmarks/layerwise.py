"""Layer-wise chunked execution against Betty's micro-batches (issue 10): peak and step time, side by side.

For each graph and model: one full-batch training step (every node an output, full neighbourhood,
dropout 0.5, Adam) at K = 1, with Betty's micro-batches at K ∈ ``--ks`` (REG), and layer by layer
at ``--chunks`` chunks per layer (METIS chunks, recomputation in backward). Peak: the measured peak of
the step (``estimator.measure.measure_peak``: profiler allocation records on CPU, after one warm-up
step so Adam's state is resident). Time: the median of ``--repeats`` steps, planning excluded
(a full batch's plan is reused every epoch). Each row is measured in the same run, interleaved.

Printed: peak (MiB) and time (s) per column, then ratios to K = 1; the issue's targets are the
layer-wise peak at most Betty's K = 16 peak at ≤ 2× the K = 1 time, and on Coauthor Physics
a K = 8 peak ≤ 0.6× the K = 1 peak (issue 7).

Run:
    python benchmarks/layerwise.py                                   # Amazon Computers and Coauthor Physics
    python benchmarks/layerwise.py --graphs amazon-computers --models sage-64 --ks 4,8 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from betty_trainer import load_config, load_dataset  # noqa: E402
from betty_trainer.config import DatasetConfig  # noqa: E402
from betty_trainer.models import set_dropout_key  # noqa: E402
from betty_trainer.sampling import sample_batch  # noqa: E402
from betty_trainer.training.layerwise import layerwise_backward  # noqa: E402
from betty_trainer.training.step import MicroBatches, training_state  # noqa: E402
from betty_trainer.training.trainer import accumulate_gradients, init_model  # noqa: E402
from estimator.measure import measure_peak  # noqa: E402
from partition import make_plan  # noqa: E402
from partition.chunks import chunk_layers  # noqa: E402

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
    """``{column: (peak MiB, median seconds)}`` for K = 1, Betty K and layer-wise K."""
    config = config_for(arch, hidden)
    model = init_model(config, graph)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    batch = sample_batch(graph, torch.arange(graph.num_nodes), [None, None])
    runners = {"K=1": lambda: accumulate_gradients(model, [batch], graph.x, graph.y, CPU)}
    for k in ks:
        plan = make_plan(batch.blocks, k=k, partitioner="reg", seed=0)
        micro_batches = MicroBatches(batch, plan.layers)
        runners[f"betty K={k}"] = (lambda mb=micro_batches: accumulate_gradients(model, mb, graph.x, graph.y, CPU))
    for k in chunk_counts:
        chunks = chunk_layers(batch.blocks, k, "metis", seed=0)
        runners[f"layerwise {k}"] = (lambda c=chunks: layerwise_backward(model, batch, c, graph.x, graph.y, CPU))

    def step(run):
        set_dropout_key(model, 0, 0)
        optimizer.zero_grad(set_to_none=True)
        run()
        optimizer.step()

    step(runners["K=1"])  # Adam's moments exist from here on
    results = {}
    for name, run in runners.items():
        optimizer.zero_grad(set_to_none=True)
        resident = training_state(model, optimizer)
        peak = measure_peak(lambda: step(run), CPU, resident).peak_bytes
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step(run)
            times.append(time.perf_counter() - started)
        results[name] = (peak / MIB, statistics.median(times))
        print(f"  {graph.name} {arch}-{hidden} {name}: peak {peak / MIB:.1f} MiB, step {statistics.median(times):.3f} s",
              flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default="amazon-computers,coauthor-physics")
    parser.add_argument("--models", default="sage-64,sage-256,gat-64", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--ks", default="4,8,16", help="Betty's micro-batches")
    parser.add_argument("--chunks", default=None, help="layer-wise chunks per layer (default: --ks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "datasets" / "graphdata-npz"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    chunk_counts = [int(k) for k in (args.chunks or args.ks).split(",")]
    rows = []
    for name in args.graphs.split(","):
        graph = load_dataset(DatasetConfig(name=name, data_dir=args.data_dir))
        for model in args.models.split(","):
            arch, hidden = MODELS[model]
            rows.append((name, model, run_case(graph, arch, hidden, ks, chunk_counts, args.repeats)))
    columns = list(rows[0][2])
    print("\npeak MiB / step s (ratio to K=1)")
    print("| graph | model | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for name, model, results in rows:
        base_peak, base_time = results["K=1"]
        cells = [f"{peak:.0f} MiB ({peak / base_peak:.2f}×) / {secs:.2f} s ({secs / base_time:.1f}×)"
                 for peak, secs in results.values()]
        print(f"| {name} | {model} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
