"""The recorder's peak against the hand-written memory terms and the measured peak, for built-in models (issue 24,
item 3's evidence; CPU).

For each built-in model the script first tries :func:`betty_trainer.memory.recorded.record_model` as it is and
prints why the recorder refuses it. Then it records the model again with its CPU kernels seen by the recorder:
the numba kernels of ``betty_trainer.models.aggregate`` (the CSR product and the transposed product; not the
segment max) are wrapped, for this script only, as ``torch.library`` custom ops whose fake implementation
allocates what the kernel's Python wrapper allocates (the kernels write into those tensors and allocate nothing
through torch). On Cora's full training batch split into K REG micro-batches (Adam warmed by one step, later
micro-batches accumulating), every micro-batch is estimated by the recorder (``recorded``), by the hand-written
terms (``estimate_micro_batch``: ``terms``) and measured (``measure_training_step``: ``measured``); the table
gives bytes and the differences.

Run:
    python benchmarks/recorder_vs_terms.py
    python benchmarks/recorder_vs_terms.py --models sage-mean,gcn --ks 1,4 --hidden 64
"""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # silences the profiler's per-step start/stop lines

import common  # noqa: E402  (this folder)
import torch  # noqa: E402
from common import int_list, markdown_table, name_list  # noqa: E402
from torch import Tensor  # noqa: E402

from betty_trainer import plan_micro_batches, sample_batch  # noqa: E402
from betty_trainer.config import load_config  # noqa: E402
from betty_trainer.data.feature_store import HostFeatureStore  # noqa: E402
from betty_trainer.execution.micro_batches import measure_training_step  # noqa: E402
from betty_trainer.memory.recorded import record_model  # noqa: E402
from betty_trainer.memory.spec import spec_of  # noqa: E402
from betty_trainer.models import aggregate, build_model  # noqa: E402
from estimator.counts import counts_of  # noqa: E402
from estimator.estimate import estimate_micro_batch  # noqa: E402
from estimator.recorder import RecordingRefused  # noqa: E402

MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"], "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "gcn": ["model.arch=gcn"], "gin": ["model.arch=gin"], "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
          "gat": ["model.arch=gat"]}
KERNELS = (aggregate._csr_matmul, aggregate._transposed_matmul)  # the wrappers of the numba kernels


@torch.library.custom_op("betty_recorder_probe::csr_matmul", mutates_args=())
def _csr_matmul(indptr: Tensor, indices: Tensor, dense: Tensor, values: Tensor | None = None,
                row_scale: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
    return KERNELS[0](indptr, indices, dense, values, row_scale, col_scale)


@_csr_matmul.register_fake
def _(indptr, indices, dense, values=None, row_scale=None, col_scale=None):
    return dense.new_empty(indptr.shape[0] - 1, dense.shape[1])


@torch.library.custom_op("betty_recorder_probe::transposed_matmul", mutates_args=())
def _transposed_matmul(indptr: Tensor, indices: Tensor, num_src: int, grad: Tensor, values: Tensor | None,
                       row_scale: Tensor | None, col_scale: Tensor | None) -> Tensor:
    block = types.SimpleNamespace(indptr=indptr, indices=indices, num_src=num_src, num_edges=indices.numel())
    return KERNELS[1](block, grad, values, row_scale, col_scale)


@_transposed_matmul.register_fake
def _(indptr, indices, num_src, grad, values, row_scale, col_scale):
    return grad.new_empty(num_src, grad.shape[1])  # the scatter's output (widths up to SCATTER_MAX_WIDTH)


def kernels_as_operators() -> None:
    """Route the kernel wrappers through the custom ops above, where the models call them (for the rest of the
    process). The segment max (``sage-pool``) calls its kernels on ``.numpy()`` arrays directly: not routed. Above
    ``aggregate.SCATTER_MAX_WIDTH`` columns the backward builds ``Aᵀ`` inside the operator, which the recorder does
    not see: keep ``--hidden`` at most that."""
    aggregate._csr_matmul = _csr_matmul
    aggregate._transposed_matmul = lambda block, grad, values, row_scale, col_scale: _transposed_matmul(
        block.indptr, block.indices, block.num_src, grad, values, row_scale, col_scale)


def compare(graph, name: str, hidden: int, ks: list[int], seed: int) -> list[list[str]]:
    """One row per micro-batch: recorded, hand-written and measured peaks (bytes) and their differences."""
    config = load_config(None, [*MODELS[name], "dataset.name=cora", "model.num_layers=2", f"model.hidden={hidden}",
                                "model.dropout=0", "optim.weight_decay=0.0005"])
    torch.manual_seed(seed)
    model = build_model(config.model, graph)
    spec = spec_of(model, config, "cpu")
    recorded = record_model(model, graph, 2, config.optim.make_optimizer)
    optimizer = config.optim.make_optimizer(model.parameters())
    features = HostFeatureStore(graph.x, pin=False)
    batch = sample_batch(graph, graph.train_idx, [None, None])
    rows = []
    for k in ks:
        micro_batches = plan_micro_batches(batch, k, "reg", seed)
        measure_training_step(model, optimizer, micro_batches[0], features, graph.y, "cpu")  # Adam state exists
        for index, micro_batch in enumerate(micro_batches):
            layers = counts_of(micro_batch.blocks)
            mine = recorded.estimate(layers, accumulate=index > 0)
            terms = estimate_micro_batch(layers, spec, accumulate=index > 0).peak_bytes
            measured = measure_training_step(model, optimizer, micro_batch, features, graph.y, "cpu",
                                             num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
            rows.append([name, str(k), str(index), str(mine), str(terms), str(measured), f"{mine - terms:+d}",
                         f"{mine - measured:+d}", f"{terms - measured:+d}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=name_list, default=list(MODELS))
    parser.add_argument("--ks", type=int_list, default=[1, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    graph = common.load_graph("cora", args.data_dir)
    for name in args.models:  # as the models are
        config = load_config(None, [*MODELS[name], "dataset.name=cora", "model.dropout=0"])
        try:
            record_model(build_model(config.model, graph), graph, config.model.num_layers)
            print(f"{name}: recorded as it is")
        except RecordingRefused as refusal:
            print(f"{name}: refused as it is: {refusal}")
    kernels_as_operators()
    rows = []
    for name in args.models:
        try:
            rows += compare(graph, name, args.hidden, args.ks, args.seed)
        except RecordingRefused as refusal:
            print(f"{name}: refused with its kernels as operators: {refusal}")
    print(markdown_table(["model", "K", "micro-batch", "recorded", "terms", "measured", "recorded − terms",
                          "recorded − measured", "terms − measured"], rows))


if __name__ == "__main__":
    main()
