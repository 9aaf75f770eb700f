"""Where an epoch's time goes, phase by phase, with its host→device bytes and cache hit rate (issue 22, item 8).

For each configuration (K = 1, 4, 16 micro-batches, layer-wise chunks, the node caches none/static/LRU/GNS and
macro-batching), ``train`` runs ``--epochs`` epochs of 2-layer GraphSAGE with sampled mini-batches on a generated
power-law graph under ``torch.profiler``, after one unprofiled warm-up epoch of the same configuration (compiled
kernels, CUDA context). The training loop marks its phases as profiler ranges (``betty_trainer/phases.py``):
sampling, staging a macro-batch, planning, the step (forward and backward over the micro-batches or chunks),
the feature gathers inside it, the optimizer update and evaluation, and the run's preparation before its first
epoch (printed once: the model, feature store, sampler, the planner's graph partition for sampled batches).
Printed per epoch (the mean over the profiled epochs): each phase's host wall time (ranges of one name summed;
``gather`` lies inside ``step``), the rest of the epoch (``other``: the loop's own work, checkpoints, metrics), and
on a GPU the time the GPU ran kernels or copies (the union of their intervals) and its idle time beside it (the
run's wall time per epoch, preparation included, less the busy time); then the epoch's host→device bytes and the
training gathers' hit rate (``metrics.jsonl``: ``host_to_device_bytes``, ``feature_hits``, ``feature_misses``).

On the CPU the figures are CPU wall times (one thread by default; ``--threads``) and there is no GPU column.

Run:
    python benchmarks/epoch_phases.py                                    # CPU, a 50k-node graph
    python benchmarks/epoch_phases.py --device cuda --nodes 500000 --edges 1e7 --json epoch_phases.json
"""

from __future__ import annotations

from common import markdown_table, name_list  # this folder; first: betty_trainer's process settings

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from betty_trainer.config import load_config
from betty_trainer.datasets import load_dataset
from betty_trainer.phases import GATHER, PHASES, PREPARE
from betty_trainer.training.trainer import train

CONFIGS = {
    "K=1": ["micro_batch.num_micro_batches=1"],
    "K=4": ["micro_batch.num_micro_batches=4"],
    "K=16": ["micro_batch.num_micro_batches=16"],
    "layer-wise 4": ["micro_batch.mode=layerwise", "micro_batch.num_micro_batches=4", "model.dropout=0"],
    "static cache": ["features.cache.kind=static", "features.cache.size=0.1"],
    "lru cache": ["features.cache.kind=lru", "features.cache.size=0.1"],
    "gns cache": ["sampling.sampler=gns", "features.cache.kind=gns", "sampling.gns.cache_fraction=0.01"],
    "macro-batch 4": ["features.macro_batch=4"],
}
"""Each configuration's overrides on the base run (K = 1 unless it says otherwise)."""


def base_overrides(args: argparse.Namespace) -> list[str]:
    return ["dataset.name=powerlaw", f"dataset.powerlaw.num_nodes={args.nodes}",
            f"dataset.powerlaw.num_edges={int(args.edges)}", "model.arch=sage", f"model.hidden={args.hidden}",
            "sampling.fanouts=[10,25]", f"sampling.batch_size={args.batch_size}", f"train.device={args.device}",
            "micro_batch.num_micro_batches=1",
            "train.progress=false"]


def busy_seconds(prof: profile) -> float:
    """Seconds the GPU ran kernels or copies: the union of the device events' intervals (the profiler also puts each
    ``record_function`` range on the GPU's timeline as a user annotation, which spans the gaps: left out)."""
    intervals = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                       if event.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(event, "is_user_annotation", False) and event.name not in PHASES)
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6


def phase_seconds(prof: profile) -> dict[str, float]:
    """Host wall seconds in each phase's ranges (the ranges of one name summed; the GPU timeline's copies of the
    ranges left out)."""
    totals = dict.fromkeys(PHASES, 0.0)
    for event in prof.events():
        if event.name in totals and event.device_type == torch.autograd.DeviceType.CPU:
            totals[event.name] += (event.time_range.end - event.time_range.start) / 1e6
    return totals


def profiled_run(name: str, overrides: list[str], graph, args: argparse.Namespace) -> dict:
    """Warm up one epoch, then profile ``args.epochs`` epochs of the configuration; per-epoch figures."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with tempfile.TemporaryDirectory() as directory:
        train(load_config(None, overrides + ["optim.epochs=1"]), graph=graph, run_dir=Path(directory) / "warm-up")
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            train(load_config(None, overrides + [f"optim.epochs={args.epochs}"]), graph=graph,
                  run_dir=Path(directory) / "run")
            if args.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        metrics = [json.loads(line) for line in (Path(directory) / "run" / "metrics.jsonl").read_text().splitlines()]
    totals = phase_seconds(prof)
    prepare = totals.pop(PREPARE)  # once per run, not per epoch
    phases = {key: value / args.epochs for key, value in totals.items()}
    epoch = (wall - prepare) / args.epochs
    top_level = sum(value for key, value in phases.items() if key != GATHER)
    hits = sum(m["feature_hits"] for m in metrics)
    misses = sum(m["feature_misses"] for m in metrics)
    row = {"config": name, "prepare_s": prepare, "epoch_s": epoch, "phases_s": phases, "other_s": epoch - top_level,
           "host_to_device_bytes": sum(m["host_to_device_bytes"] for m in metrics) / args.epochs,
           "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
           "micro_batches": metrics[-1]["micro_batches"]}
    if args.device == "cuda":  # over the whole run, preparation included, per epoch
        row["gpu_busy_s"] = busy_seconds(prof) / args.epochs
        row["gpu_idle_s"] = wall / args.epochs - row["gpu_busy_s"]
    print(f"{name}: prepare {prepare:.3f} s, epoch {epoch:.3f} s, " + ", ".join(f"{key.split('::')[1]} {value:.3f}"
                                                        for key, value in phases.items()), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--configs", type=name_list, default=list(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--nodes", type=int, default=50_000)
    parser.add_argument("--edges", type=float, default=1e6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2, help="profiled epochs, after one warm-up epoch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    torch.set_num_threads(args.threads)
    overrides = base_overrides(args)
    graph = load_dataset(load_config(None, overrides).dataset)
    print(f"graph {graph}; device {args.device}", flush=True)
    rows = [profiled_run(name, overrides + CONFIGS[name], graph, args) for name in args.configs]
    per_epoch = [key for key in PHASES if key != PREPARE]
    header = ["config", "K", "prepare (s, once)", "epoch (s)"] + [key.split("::")[1] for key in per_epoch] + ["other"]
    header += ["GPU busy", "GPU idle"] if args.device == "cuda" else []
    header += ["host→device MiB", "hit rate"]
    table = []
    for row in rows:
        cells = [row["config"], str(row["micro_batches"]), f"{row['prepare_s']:.3f}", f"{row['epoch_s']:.3f}"]
        cells += [f"{row['phases_s'][key]:.3f}" for key in per_epoch] + [f"{row['other_s']:.3f}"]
        cells += [f"{row['gpu_busy_s']:.3f}", f"{row['gpu_idle_s']:.3f}"] if args.device == "cuda" else []
        cells += [f"{row['host_to_device_bytes'] / 2**20:.1f}", f"{row['hit_rate']:.3f}"]
        table.append(cells)
    print(markdown_table(header, table))
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "graph": str(graph), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
