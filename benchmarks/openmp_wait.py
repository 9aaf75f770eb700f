"""The OpenMP wait policy ``import betty_trainer`` sets (``betty_trainer.process.passive_openmp``): full-batch training
steps in fresh processes under ``OMP_WAIT_POLICY=ACTIVE`` (the runtimes' spinning, what a process gets when torch
loads first) and ``PASSIVE`` (what ``import betty_trainer`` sets), interleaved, one process after another.

A process runs two OpenMP runtimes (torch's bundled ``libgomp`` and the system's, which numba's kernels use), each
with one thread per core; torch and numba run their default threads (one per core). Each process is given the
policy in its environment (every runtime reads it when it loads), builds the model and the full batch, runs
``--steps`` training steps (forward, cross entropy, backward; the model's node-keyed dropout included) and prints
each step's process CPU time; the table gives, per policy, the median over processes of their median step, the
slowest process's median, and the slowest step.

Run:
    python benchmarks/openmp_wait.py
    python benchmarks/openmp_wait.py --cases cora:gat,amazon-computers:sage --processes 6 --steps 20
"""

from __future__ import annotations

import common  # this folder
from common import markdown_table

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

POLICIES = ("ACTIVE", "PASSIVE")
MODELS = {"gat": ["model.arch=gat", "model.hidden=64", "model.heads=4"], "sage": ["model.arch=sage", "model.hidden=64"]}


def child(graph_name: str, model_name: str, steps: int) -> None:
    """One process's steps (run as ``--child``): prints a JSON list of CPU seconds per step."""
    import time

    import torch  # its OpenMP runtime reads OMP_WAIT_POLICY from the environment the parent gave
    from torch.nn import functional as F

    from betty_trainer import sample_batch
    from betty_trainer.config import load_config
    from betty_trainer.models import build_model, set_dropout_key

    graph = common.load_graph(graph_name)
    config = load_config(None, MODELS[model_name])
    torch.manual_seed(0)
    model = build_model(config.model, graph)
    set_dropout_key(model, 0, 0)
    batch = sample_batch(graph, graph.train_idx, [None] * config.model.num_layers)
    x, y = graph.x[batch.input_nodes], graph.y[batch.output_nodes]
    times = []
    for _ in range(steps + 1):  # the first compiles and warms up
        start = time.process_time()
        F.cross_entropy(model(batch.blocks, x.clone()), y).backward()
        times.append(time.process_time() - start)
    print(json.dumps(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="cora:gat,amazon-computers:sage", help="graph:model pairs")
    parser.add_argument("--processes", type=int, default=4, help="fresh processes per policy and case")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", nargs=2, metavar=("GRAPH", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.steps)
        return
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}; {os.cpu_count()} cores")
    rows = []
    for case in args.cases.split(","):
        graph_name, model_name = case.split(":")
        medians: dict[str, list[float]] = {policy: [] for policy in POLICIES}
        slowest = dict.fromkeys(POLICIES, 0.0)
        for _ in range(args.processes):
            for policy in POLICIES:
                env = {**os.environ, "OMP_WAIT_POLICY": policy}
                out = subprocess.run([sys.executable, __file__, "--child", graph_name, model_name, "--steps",
                                      str(args.steps)], env=env, capture_output=True, text=True, check=True).stdout
                times = json.loads(out.strip().splitlines()[-1])
                medians[policy].append(statistics.median(times))
                slowest[policy] = max(slowest[policy], max(times))
        for policy in POLICIES:
            rows.append([graph_name, model_name, policy, f"{statistics.median(medians[policy]) * 1e3:.1f}",
                         f"{max(medians[policy]) * 1e3:.1f}", f"{slowest[policy] * 1e3:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(markdown_table(["graph", "model", "OMP_WAIT_POLICY", "median step ms (median process)",
                          "slowest process's median ms", "slowest step ms"], rows))


if __name__ == "__main__":
    main()
