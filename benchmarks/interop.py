"""Step time of one 2-layer GraphSAGE-mean through our model, a DGL model and a PyG model on the same micro-batches.

The interop adaptors (``betty_trainer.models.interop``) convert every block at every step (``Block.to_dgl``,
``Block.to_pyg``) and hand it to the library's own ``SAGEConv``; this script measures what that costs against our
own :class:`~betty_trainer.GraphSAGE` doing the same arithmetic (the three models hold the same weights, so
they compute the same logits up to float rounding, as tests/test_interop_*.py assert).

Setup: Amazon Computers (``../shared/datasets/graphdata-npz``), every node as the full batch (``--outputs``), fanouts
``--fanouts`` (10,25), hidden width ``--hidden`` (256), no dropout, Adam; a step is ``accumulate_gradients`` over
the batch's K REG micro-batches (the same micro-batches for every model, planned once) and ``optimizer.step()``,
for each K of ``--ks`` (1,4). Repetitions interleave the models (the order rotating every repetition) after
one warm-up step each; the figures are medians. Also printed: converting one batch's blocks alone.

PyG runs in the project's venv; DGL 2.1 needs torch 2.2.1 and runs in the DGL environment that ``.ci/dgl``
builds. Each interpreter measures our model beside the libraries it has, so every ours/library ratio comes
from one process; run from the project's venv, the script also runs itself under ``--dgl-python`` (default:
``.ci/dgl``'s environment, when it exists) for the DGL ratio.

Run:
    python benchmarks/interop.py                       # PyG here, DGL in the DGL environment
    python benchmarks/interop.py --reps 3 --ks 1 --json /tmp/interop.json
"""

from __future__ import annotations

from common import REPO_ROOT, int_list, load_graph, markdown_table, name_list  # this folder

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from operator import attrgetter
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from betty_trainer import GraphSAGE, HostFeatureStore, accumulate_gradients, plan_micro_batches, sample_batch
from betty_trainer.models.interop import DGLModel, PyGModel
from dgl_channel import DEFAULT_DGL_PYTHON  # this folder

CPU = torch.device("cpu")


class _Stack(nn.Module):
    """A library's example-style GraphSAGE: its conv ``layers`` in turn, ReLU between them; ``call(layer, part, h)``
    runs one layer on its part of the batch (a DGL block, a PyG ``(edge_index, e_id, size)``)."""

    def __init__(self, layers: list[nn.Module], call):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.call = call

    def run(self, parts, h):
        for i, (layer, part) in enumerate(zip(self.layers, parts)):
            h = self.call(layer, part, h)
            if i != len(self.layers) - 1:
                h = F.relu(h)
        return h


class _PyGStack(_Stack):
    def forward(self, x, adjs):  # PyG's NeighborSampler examples
        return self.run(adjs, x)


class _DGLStack(_Stack):
    def forward(self, blocks, x):  # DGL's examples
        return self.run(blocks, x)


def _copy_weights(ours: GraphSAGE, module: _Stack, theirs_from_ours: dict[str, str]) -> _Stack:
    """``module`` with ``ours``' weights: each of its layers' parameter ``theirs`` takes our layer's ``ours``."""
    with torch.no_grad():
        for layer, conv in zip(ours.layers, module.layers):
            for theirs, mine in theirs_from_ours.items():
                attrgetter(theirs)(conv).copy_(attrgetter(mine)(layer))
    return module


def pyg_model(ours: GraphSAGE) -> nn.Module | None:
    """PyG's ``NeighborSampler``-style GraphSAGE with ``ours``' weights, wrapped; ``None`` without PyG."""
    try:
        from torch_geometric.nn import SAGEConv
    except ImportError:
        return None
    module = _PyGStack([SAGEConv(layer.in_feats, layer.out_feats) for layer in ours.layers],
                       lambda conv, adj, x: conv((x, x[: adj[2][1]]), adj[0]))
    return PyGModel(_copy_weights(ours, module, {"lin_l.weight": "fc_neigh.weight", "lin_l.bias": "bias",
                                                 "lin_r.weight": "fc_self.weight"}))


def dgl_model(ours: GraphSAGE) -> nn.Module | None:
    """DGL's example-style GraphSAGE (``forward(blocks, x)``) with ``ours``' weights, wrapped; ``None`` without DGL."""
    try:
        from dgl.nn import SAGEConv
    except ImportError:
        return None
    module = _DGLStack([SAGEConv(layer.in_feats, layer.out_feats, "mean") for layer in ours.layers],
                       lambda conv, block, h: conv(block, h))
    return DGLModel(_copy_weights(ours, module, {"fc_neigh.weight": "fc_neigh.weight",
                                                 "fc_self.weight": "fc_self.weight", "fc_self.bias": "bias"}))


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    graph = load_graph("amazon-computers")
    outputs = graph.train_idx if args.outputs == "train" else torch.arange(graph.num_nodes)
    batch = sample_batch(graph, outputs, args.fanouts, torch.Generator().manual_seed(0))
    features = HostFeatureStore(graph.x, pin=False)
    torch.manual_seed(0)
    ours = GraphSAGE(graph.num_features, args.hidden, graph.num_classes, 2, "mean", dropout=0.0)
    models = {"ours": ours}
    for name, make in (("dgl", dgl_model), ("pyg", pyg_model)):
        if name in args.libraries and (model := make(ours)) is not None:
            models[name] = model
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=0.01) for name, model in models.items()}
    for model in models.values():
        model.train()
    result = {"torch": torch.__version__, "threads": args.threads, "hidden": args.hidden, "fanouts": args.fanouts,
              "outputs": batch.output_nodes.numel(), "edges": [b.num_edges for b in batch.blocks], "steps": {},
              "convert_ms": {}}
    converters = {"dgl": lambda b: b.to_dgl(), "pyg": lambda b: b.to_pyg()}
    for name in models.keys() - {"ours"}:
        times = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            for block in batch.blocks:
                converters[name](block)
            times.append(time.perf_counter() - t0)
        result["convert_ms"][name] = 1e3 * statistics.median(times[1:])
    for k in args.ks:
        micro_batches = plan_micro_batches(batch, k, "reg", seed=1)
        times = {name: [] for name in models}
        names = list(models)
        for rep in range(args.reps + 1):  # repetition 0 warms up
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                model, optimizer = models[name], optimizers[name]
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                accumulate_gradients(model, micro_batches, features, graph.y, CPU)
                optimizer.step()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        result["steps"][k] = {name: statistics.median(values) for name, values in times.items()}
    return result


def print_result(result: dict) -> None:
    print(f"\ntorch {result['torch']}, {result['threads']} threads; Amazon Computers, {result['outputs']} outputs, "
          f"fanouts {result['fanouts']} ({' + '.join(map(str, result['edges']))} edges), hidden {result['hidden']}")
    libraries = [name for name in ("dgl", "pyg") if name in next(iter(result["steps"].values()))]
    header = ["K", "ours (s)"] + [f"{name} (s)" for name in libraries] + [f"ours/{name}" for name in libraries]
    rows = []
    for k, steps in result["steps"].items():
        cells = [str(k), f"{steps['ours']:.3f}"] + [f"{steps[name]:.3f}" for name in libraries]
        rows.append(cells + [f"{steps['ours'] / steps[name]:.2f}" for name in libraries])
    print(markdown_table(header, rows))
    for name, ms in result["convert_ms"].items():
        print(f"converting the batch's {len(result['edges'])} blocks for {name}: {ms:.1f} ms")
    sys.stdout.flush()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--fanouts", type=int_list, default=[10, 25])
    parser.add_argument("--outputs", choices=["all", "train"], default="all",
                        help="the full batch's output nodes: every node (default) or the training split")
    parser.add_argument("--ks", type=int_list, default=[1, 4])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per model and K (after one warm-up)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--libraries", type=name_list, default=["dgl", "pyg"])
    parser.add_argument("--dgl-python", type=Path, default=DEFAULT_DGL_PYTHON,
                        help="interpreter of the DGL environment, run for the DGL ratio when DGL is not here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = [measure(args)]
    print_result(results[0])
    have_dgl = "dgl" in next(iter(results[0]["steps"].values()))
    if "dgl" in args.libraries and not have_dgl and args.dgl_python.is_file():
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "dgl.json"
            command = [str(args.dgl_python), __file__, "--libraries", "dgl", "--dgl-python", "", "--json", str(out),
                       "--hidden", str(args.hidden), "--fanouts", ",".join(map(str, args.fanouts)),
                       "--ks", ",".join(map(str, args.ks)), "--outputs", args.outputs, "--reps", str(args.reps),
                       "--threads", str(args.threads)]
            subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            results += json.loads(out.read_text())
    elif "dgl" in args.libraries and not have_dgl:
        print(f"\nno DGL here and no DGL environment at {args.dgl_python}: `bash .ci/dgl` builds one")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
