"""One epoch of products-scale training on a GPU under a memory budget below the full batch's need.

Issue 9, "On a GPU": the synthetic power-law graph at ogbn-products scale
(:func:`betty_trainer.datasets.make_powerlaw`: 2M nodes, ≥ 50M directed edges, 100
float32 features memory-mapped from the on-disk cache, 47 classes, 10% training nodes)
is trained for one epoch by :func:`betty_trainer.training.trainer.train` with 2-layer
GraphSAGE, fanouts 10,25 and the full batch (all training nodes). First the full batch is
run once as one micro-batch (K = 1) on copies of the model and optimizer and its peak
``torch.cuda.max_memory_allocated`` is measured; the budget is then set to ``--fraction``
of that need, and the run plans the smallest K whose micro-batches the estimator says
fit (Betty §4.4.3). Every micro-batch's forward+backward peak
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) is recorded by
wrapping the trainer's ``micro_batch_backward`` and compared with the budget; the
optimizer step's peak is recorded too.

Run (on a CUDA machine; a few minutes, most of it generating the graph once):
    python benchmarks/gpu_budget_epoch.py --json gpu_budget_epoch.json

Measured on one H100 80GB (torch 2.11.0+cu130, 16 cores), 2026-11-22: 2,000,000 nodes,
52,293,850 edges (generated into the cache in 27.3 s), 200,000 training nodes; the full
batch reads 1,947,692 input nodes and its K = 1 step peaks at 7,341,352,448 bytes
(6.84 GiB; estimate 7,273,784,364). Budget 0.4 × that = 2,936,540,979 bytes (2.73 GiB):
the planner tried K = 3 (largest estimate 3.26 GB, over) and took K = 4 (estimates
2.487-2.537 GB); measured micro-batch peaks 2,556,496,896 / 2,603,400,704 / 2,557,086,720 /
2,554,596,864 bytes, all under the budget; epoch 27.6 s (planning 5.7 s), 1.92 GB moved
host→device from the memory-mapped features; host peak RSS 8.2 GiB. At a tiny size
(``--edges 2e6 --nodes 80000 --hidden 64``) the measured peaks exceeded the estimates by a
constant ~67 MB (CUDA workspaces the estimate leaves out), so a 66 MiB budget was missed there.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from betty_trainer.config import load_config
from betty_trainer.datasets import load_dataset
from betty_trainer.execution.micro_batches import measure_training_step
from betty_trainer.sampling.schedule import first_batch
from betty_trainer.training import trainer as trainer_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=float, default=5.3e7, help="directed edges drawn (≥ 50M kept after dedup)")
    parser.add_argument("--nodes", type=int, default=2_000_000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--fraction", type=float, default=0.4, help="budget as a share of the full batch's measured peak")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    overrides = ["dataset.name=powerlaw", f"dataset.powerlaw.num_edges={int(args.edges)}",
                 f"dataset.powerlaw.num_nodes={args.nodes}", "sampling.fanouts=10,25", "optim.epochs=1",
                 "train.device=cuda", "train.progress=false", f"model.hidden={args.hidden}", "micro_batch.partitioner=reg"]
    config = load_config(None, overrides)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    started = time.perf_counter()
    graph = load_dataset(config.dataset)
    result.update(load_s=time.perf_counter() - started, nodes=graph.num_nodes, edges=graph.num_edges,
                  train_nodes=graph.train_idx.numel(), features_bytes=graph.x.nbytes)
    print(f"graph {graph} in {result['load_s']:.1f} s", flush=True)

    # the full batch's need: the K = 1 step measured on copies (no update of the run's model)
    batch = first_batch(config, graph)
    model = trainer_module.init_model(config, graph).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr)
    store = trainer_module.HostFeatureStore(graph.x, pin=True)
    result["features_memory_mapped"] = store.memory_mapped
    probe = copy.deepcopy(model)
    need = measure_training_step(probe, torch.optim.Adam(probe.parameters(), lr=config.optim.lr),
                                 batch, store, graph.y, device).peak_bytes
    del probe
    del model, optimizer
    torch.cuda.empty_cache()
    budget = int(args.fraction * need)
    result.update(full_batch_input_nodes=batch.blocks[0].num_src, full_batch_peak_bytes=need, budget_bytes=budget)
    print(f"full batch: {batch.blocks[0].num_src:,} input nodes, measured peak {need / 2**30:.2f} GiB; "
          f"budget {budget / 2**30:.2f} GiB", flush=True)

    peaks: list[int] = []
    inner = trainer_module.micro_batch_backward

    def measured_backward(*a, **k):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = inner(*a, **k)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        return out

    trainer_module.micro_batch_backward = measured_backward
    config = load_config(None, overrides + [f"micro_batch.budget={budget}"])
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        outcome = trainer_module.train(config, graph=graph, run_dir=Path(run_dir) / "run")
        result["train_and_eval_s"] = time.perf_counter() - started
        plan_file = Path(run_dir) / "run" / "plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
        metrics = (Path(run_dir) / "run" / "metrics.jsonl").read_text().splitlines()
    trainer_module.micro_batch_backward = inner
    result.update(micro_batch_peaks_bytes=peaks, num_micro_batches=len(peaks), max_micro_batch_peak_bytes=max(peaks),
                  all_under_budget=all(p <= budget for p in peaks), val_acc=outcome.best_val_acc,
                  metrics=[json.loads(line) for line in metrics])
    if plan is not None:
        result["plan"] = {key: plan.get(key) for key in ("num_micro_batches", "budget_bytes", "full_batch",
                                                          "redundancy_per_layer", "tried", "planning_seconds")}
        result["plan_estimates_bytes"] = [row.get("estimate", {}).get("peak_bytes") for row in plan["pieces"]]
    print(f"K = {len(peaks)} micro-batches; measured peaks (GiB): {[round(p / 2**30, 2) for p in peaks]}; "
          f"budget {budget / 2**30:.2f} GiB; all under: {result['all_under_budget']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
