"""Layer-wise evaluation with and without projecting a projected layer once per node, side by side in one run.

``betty_trainer.training.evaluation.layerwise_logits`` projects a layer that projects first (SAGE where
``F_in > F_out``, GAT) once for every node when its dst nodes take several chunks, and each chunk propagates its rows
of the projection. The control is the same function with no layer treated as projected (every chunk runs
``layer_forward`` on its block's src rows, the code before the change), made by replacing ``projected_layers`` in the
evaluation module for those calls. Per graph and model (hidden 64, 2 layers), the two are timed in interleaved
rounds (CPU time of one call of all nodes' logits, one torch thread by default; set ``NUMBA_NUM_THREADS=1`` too),
and the largest difference of their logits is printed beside the ratio.

Run:
    NUMBA_NUM_THREADS=1 python benchmarks/evaluation_projection.py
    NUMBA_NUM_THREADS=1 python benchmarks/evaluation_projection.py --graphs amazon-computers --rounds 5
"""

from __future__ import annotations

from common import load_graph, markdown_table, name_list  # this folder; first: betty_trainer's process settings

import argparse
import statistics
import time

import torch

from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.models import build_model
from betty_trainer.training import evaluation

CPU = torch.device("cpu")


def timed(model, graph, store, projected: bool) -> tuple[float, torch.Tensor]:
    """CPU seconds of one ``layerwise_logits`` call of every node, and its logits; ``projected=False`` is the
    control (no layer projected once per node)."""
    original = evaluation.projected_layers
    if not projected:
        evaluation.projected_layers = lambda model: [False] * len(model.layers)
    try:
        started = time.process_time()
        logits = evaluation.layerwise_logits(model, graph, store, CPU)
        return time.process_time() - started, logits
    finally:
        evaluation.projected_layers = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=name_list, default=["amazon-computers", "sbm-100k"])
    parser.add_argument("--models", type=name_list, default=["sage", "gat"], help="model.arch values")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (control, projected) per case")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.graphs:
        graph = load_graph(name)
        store = HostFeatureStore(graph.x, pin=False)
        for arch in args.models:
            torch.manual_seed(0)
            model = build_model(load_config(None, [f"model.arch={arch}", "model.hidden=64"]).model, graph)
            timed(model, graph, store, True)  # warm-up: compiled kernels, allocator
            control, projected = [], []
            for _ in range(args.rounds):
                seconds, before = timed(model, graph, store, False)
                control.append(seconds)
                seconds, after = timed(model, graph, store, True)
                projected.append(seconds)
            difference = float((after - before).abs().max() / before.abs().max())
            c, p = statistics.median(control), statistics.median(projected)
            rows.append([name, arch, f"{-(-graph.num_nodes // evaluation.EVAL_CHUNK)}", f"{c:.3f}", f"{p:.3f}",
                         f"{p / c:.2f}×", f"{difference:.1e}"])
            print(rows[-1], flush=True)
    print(markdown_table(["graph", "model", "chunks", "control (s)", "projected (s)", "projected / control",
                          "max |Δ logits| / max |logits|"], rows))


if __name__ == "__main__":
    main()
