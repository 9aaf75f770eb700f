"""The whole-step recorder's peak against the estimator's memory terms (each layer's recorded on its own, the LSTM's
written by hand) and the measured peak, for built-in models (issue 24; CPU).

Each built-in model is recorded by :func:`betty_trainer.memory.recorded.record_model` (its numba kernels are
operators, ``betty_trainer.models.operators``, which fill tensors allocated in torch code); a model the recorder
refuses is printed with why (the LSTM aggregator's in-degree groups are data-dependent).
On Cora's full training batch split into K REG micro-batches (Adam warmed by one step, later micro-batches
accumulating; node dropout ``--dropout``, default 0), every micro-batch is estimated by the recorder
(``recorded``), by the estimator's terms (``estimate_micro_batch``: ``terms``) and measured
(``measure_training_step``: ``measured``); the table gives bytes and the differences.

Run:
    python benchmarks/recorder_vs_terms.py
    python benchmarks/recorder_vs_terms.py --models sage-mean,gcn --ks 1,4 --hidden 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silences the profiler's per-step start/stop lines

import torch  # noqa: E402

from betty_trainer import Batch, plan_micro_batches, sample_batch  # noqa: E402
from betty_trainer.config import load_config  # noqa: E402
from betty_trainer.data.feature_store import HostFeatureStore  # noqa: E402
from betty_trainer.data.graph import Graph  # noqa: E402
from betty_trainer.execution.micro_batches import measure_training_step  # noqa: E402
from betty_trainer.memory.recorded import record_model  # noqa: E402
from betty_trainer.memory.spec import spec_of  # noqa: E402
from betty_trainer.models import build_model, set_dropout_key  # noqa: E402
from estimator.counts import counts_of  # noqa: E402
from estimator.estimate import estimate_micro_batch  # noqa: E402
from estimator.recorder import RecordingRefused  # noqa: E402

MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"], "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "gcn": ["model.arch=gcn"], "gin": ["model.arch=gin"], "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
          "gat": ["model.arch=gat"], "sage-lstm": ["model.arch=sage", "model.aggregator=lstm"]}


def peaks(graph: Graph, name: str, hidden: int, dropout: float, k: int, seed: int = 0,
          weighted: bool = False) -> Iterator[tuple[int, int, int]]:
    """Per micro-batch of ``graph``'s full training batch (full neighbourhood, 2 layers) in ``k`` REG micro-batches:
    the recorded, estimated (terms) and measured peak bytes of built-in model ``name`` (of :data:`MODELS`, width
    ``hidden``, node dropout ``dropout``, Adam with weight decay warmed by one step; micro-batches after the first
    accumulate); with ``weighted``, every block carries float32 edge weights in ``[0.5, 1.5)`` (as LABOR's and GNS's
    blocks carry importance weights) and the model is recorded with them. Importable from the tests (``from
    benchmarks.recorder_vs_terms import peaks``).

    Raises:
        RecordingRefused: the recorder refuses the model (the message names why in one line).
    """
    config = load_config(None, [*MODELS[name], "model.num_layers=2", f"model.hidden={hidden}", f"model.dropout={dropout}",
                                "optim.weight_decay=0.0005"])
    torch.manual_seed(seed)
    model = build_model(config.model, graph)
    set_dropout_key(model, seed, 0)
    spec = spec_of(model, config, "cpu")
    recorded = record_model(model, graph, 2, config.optim.make_optimizer, weighted=(weighted, weighted))
    optimizer = config.optim.make_optimizer(model.parameters())
    features = HostFeatureStore(graph.x, pin=False)
    batch = sample_batch(graph, graph.train_idx, [None, None])
    if weighted:
        generator = torch.Generator().manual_seed(seed)
        batch = Batch([dataclasses.replace(block, edge_weight=torch.rand(block.num_edges, generator=generator) + 0.5)
                       for block in batch.blocks])
    micro_batches = plan_micro_batches(batch, k, "reg", seed)
    measure_training_step(model, optimizer, micro_batches[0], features, graph.y, "cpu")  # Adam state exists
    for index, micro_batch in enumerate(micro_batches):
        layers = counts_of(micro_batch.blocks)
        measured = measure_training_step(model, optimizer, micro_batch, features, graph.y, "cpu",
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
        yield (recorded.estimate(layers, accumulate=index > 0),
               estimate_micro_batch(layers, spec, accumulate=index > 0).peak_bytes, measured)


def main() -> None:
    import common  # this folder; imported here, so that the tests can import the module
    from common import int_list, markdown_table, name_list

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=name_list, default=list(MODELS))
    parser.add_argument("--ks", type=int_list, default=[1, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weighted", action="store_true", help="blocks with edge weights (LABOR's, GNS's)")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    graph = common.load_graph("cora", args.data_dir)
    rows = []
    for name in args.models:
        try:
            for k in args.ks:
                for index, (mine, terms, measured) in enumerate(peaks(graph, name, args.hidden, args.dropout, k,
                                                                       args.seed, args.weighted)):
                    rows.append([name, str(k), str(index), str(mine), str(terms), str(measured), f"{mine - terms:+d}",
                                 f"{mine - measured:+d}", f"{terms - measured:+d}"])
        except RecordingRefused as refusal:
            print(f"{name}: refused: {refusal}")
    print(markdown_table(["model", "K", "micro-batch", "recorded", "terms", "measured", "recorded − terms",
                          "recorded − measured", "terms − measured"], rows))


if __name__ == "__main__":
    main()
