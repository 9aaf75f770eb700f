"""What is live at a CUDA step's memory peak, allocation by allocation, beside the estimate's own terms (issue 22,
item 5: find the CUDA kernels' temporaries the estimator does not model).

For each model: one training step of the full batch (K = 1, or ``--k``) on the generated ``synthetic-100k`` graph
(``common.SBM``) runs on CUDA under ``torch.cuda.memory._record_memory_history`` (the allocator's own trace, with
Python stacks). The trace is replayed: the moment the step's own bytes peak, and every block live then that the
step allocated, grouped by size and by the innermost Python frame of betty_trainer, estimator or torch (blocks
allocated by autograd's device thread have no Python frame: "(autograd engine)"). Printed beside it: the
estimate's peak and its ``at_peak`` terms, the measured peak (``max_memory_allocated``), the block's sizes
(src nodes, dst nodes, edges per layer) so that each unexplained block can be matched to a shape.

``torch.cuda.memory._record_memory_history`` and ``_snapshot`` are private PyTorch API (documented in "Understanding
CUDA Memory Usage"); this is a diagnostic, not part of the package.

Run (CUDA only):
    python benchmarks/cuda_peak_anatomy.py --models gat,sage-pool,sage-mean --hidden 64 --json anatomy.json
"""

from __future__ import annotations

from common import SBM  # this folder; first: betty_trainer's process settings before torch loads

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.datasets import load_dataset
from betty_trainer.memory.planner import make_planner
from betty_trainer.models import set_dropout_key
from betty_trainer.sampling.schedule import first_batch
from betty_trainer.training.trainer import init_model

MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"],
          "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "sage-pool": ["model.arch=sage", "model.aggregator=pool"], "gcn": ["model.arch=gcn"],
          "gat": ["model.arch=gat"], "sage-lstm": ["model.arch=sage", "model.aggregator=lstm"]}
OURS = ("betty_trainer", "estimator", "torch/")


def _frame(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS) and "torch/cuda/memory" not in name:
            short = name.split("site-packages/")[-1].split("betty-trainer/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(autograd engine)" if not frames else f"{frames[0].get('filename')}:{frames[0].get('line')}"


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, list[dict]]]]:
    """Replay one device's trace: the largest sum of bytes the traced region allocated and had not freed, and the
    blocks (size, stack frames) live then."""
    completed = any(event["action"] == "free_completed" for event in trace)
    release = "free_completed" if completed else "free_requested"
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = 0
    at_peak: list[tuple[int, list[dict]]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == release and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, at_peak


def anatomy(name: str, hidden: int, k: int, graph, fanouts: str, cpp: bool) -> dict:
    device = torch.device("cuda")
    config = load_config(None, [f"dataset.synthetic.{key}={value}" for key, value in SBM["synthetic-100k"].items()]
                         + MODELS[name] + ["train.device=cuda", "train.progress=false", f"model.hidden={hidden}",
                                           f"sampling.fanouts={fanouts}", f"micro_batch.num_micro_batches={k}"])
    store = HostFeatureStore(graph.x, pin=True)
    planner = make_planner(config, graph, None, device, store)
    plan = planner.plan(first_batch(config, graph))
    model = init_model(config, graph).to(device)
    set_dropout_key(model, config.seed, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    plan.measure(model, optimizer, store, graph.y, device)  # warm-up: Adam's state and the workspaces exist
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all" if cpp else "python")
    try:
        measured = plan.measure(model, optimizer, store, graph.y, device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report = planner.report(plan, measured)
    index = torch.cuda.current_device()
    peak, blocks = live_at_peak(snapshot["device_traces"][index])
    groups: dict[tuple[str, int], int] = defaultdict(int)
    stacks: dict[tuple[str, int], list[str]] = {}
    for size, frames in blocks:
        groups[(_frame(frames), size)] += 1
        stacks[(_frame(frames), size)] = [f"{frame.get('name')} ({frame.get('filename', '').split('/')[-1]}:"
                                          f"{frame.get('line')})" for frame in frames[:25]]
    rows = sorted(((size * count, count, size, frame) for (frame, size), count in groups.items()), reverse=True)
    piece = max(report["pieces"], key=lambda row: row["estimate"]["peak_bytes"])
    result = {"model": name, "hidden": hidden, "k": k, "measured_peak_bytes": max(measured),
              "allocated_before_bytes": before, "traced_peak_bytes": peak, "estimate": piece["estimate"],
              "layers": piece["layers"], "memory_terms": report["memory_terms"],
              "live_at_peak": [dict(bytes=b, count=c, size=s, frame=f) for b, c, s, f in rows[:40]]}
    print(f"\n== {name}, hidden {hidden}, K = {k}: measured peak {max(measured):,} B, estimate "
          f"{piece['estimate']['peak_bytes']:,} B ({(piece['estimate']['peak_bytes'] - max(measured)) / max(measured):+.2%});"
          f" resident before the step {before:,} B, the step's own traced peak {peak:,} B", flush=True)
    print("layers (src, dst, edges):", [(layer["src_nodes"], layer["dst_nodes"], layer["edges"])
                                        for layer in piece["layers"]])
    print("estimate at its peak:", {key: value for key, value in piece["estimate"]["at_peak"].items() if value})
    for total, count, size, frame in rows[:40]:
        print(f"  {total:>13,} = {count:>3} × {size:>12,}  {frame}")
    if cpp:  # the stacks of the largest blocks, C++ frames innermost first
        for _, _, size, frame in rows[:6]:
            print(f"\n  stack of the {size:,}-byte block(s) at {frame}:\n    " + "\n    ".join(stacks[(frame, size)]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gat,sage-pool,sage-mean")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--fanouts", default="[10,25]")
    parser.add_argument("--cpp", action="store_true", help="record C++ stacks too and print the largest blocks'")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    graph = load_dataset(load_config(None, [f"dataset.synthetic.{key}={value}"
                                            for key, value in SBM["synthetic-100k"].items()]).dataset)
    results = []
    for name in args.models.split(","):
        try:
            results.append(anatomy(name, args.hidden, args.k, graph, args.fanouts, args.cpp))
        except Exception as error:  # a diagnostic: report and go on with the next model
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
