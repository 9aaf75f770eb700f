"""The recorder's peak against the hand-written memory terms and the measured peak, for built-in models (issue 24,
item 3's evidence; CPU).

Each built-in model is recorded by :func:`betty_trainer.memory.recorded.record_model` (its numba kernels are
operators, ``betty_trainer.models.operators``, which fill tensors allocated in torch code); a model the recorder
refuses is printed with why (the LSTM aggregator's in-degree groups are data-dependent).
On Cora's full training batch split into K REG micro-batches (Adam warmed by one step, later micro-batches
accumulating; node dropout ``--dropout``, default 0), every micro-batch is estimated by the recorder
(``recorded``), by the hand-written terms (``estimate_micro_batch``: ``terms``) and measured
(``measure_training_step``: ``measured``); the table gives bytes and the differences.

Run:
    python benchmarks/recorder_vs_terms.py
    python benchmarks/recorder_vs_terms.py --models sage-mean,gcn --ks 1,4 --hidden 64
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silences the profiler's per-step start/stop lines

import torch  # noqa: E402

from betty_trainer import plan_micro_batches, sample_batch  # noqa: E402
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


def peaks(graph: Graph, name: str, hidden: int, dropout: float, k: int, seed: int = 0) -> Iterator[tuple[int, int, int]]:
    """Per micro-batch of ``graph``'s full training batch (full neighbourhood, 2 layers) in ``k`` REG micro-batches:
    the recorded, hand-written (terms) and measured peak bytes of built-in model ``name`` (of :data:`MODELS`, width
    ``hidden``, node dropout ``dropout``, Adam with weight decay warmed by one step; micro-batches after the first
    accumulate). Importable from the tests (``from benchmarks.recorder_vs_terms import peaks``).

    Raises:
        RecordingRefused: the recorder refuses the model (the message names why in one line).
    """
    config = load_config(None, [*MODELS[name], "model.num_layers=2", f"model.hidden={hidden}", f"model.dropout={dropout}",
                                "optim.weight_decay=0.0005"])
    torch.manual_seed(seed)
    model = build_model(config.model, graph)
    set_dropout_key(model, seed, 0)
    spec = spec_of(model, config, "cpu")
    recorded = record_model(model, graph, 2, config.optim.make_optimizer)
    optimizer = config.optim.make_optimizer(model.parameters())
    features = HostFeatureStore(graph.x, pin=False)
    batch = sample_batch(graph, graph.train_idx, [None, None])
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
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    graph = common.load_graph("cora", args.data_dir)
    rows = []
    for name in args.models:
        try:
            for k in args.ks:
                for index, (mine, terms, measured) in enumerate(peaks(graph, name, args.hidden, args.dropout, k,
                                                                       args.seed)):
                    rows.append([name, str(k), str(index), str(mine), str(terms), str(measured), f"{mine - terms:+d}",
                                 f"{mine - measured:+d}", f"{terms - measured:+d}"])
        except RecordingRefused as refusal:
            print(f"{name}: refused: {refusal}")
    print(markdown_table(["model", "K", "micro-batch", "recorded", "terms", "measured", "recorded − terms",
                          "recorded − measured", "terms − measured"], rows))


if __name__ == "__main__":
    main()
