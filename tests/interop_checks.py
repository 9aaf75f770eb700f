"""The checks the DGL and PyG interop tests share (tests/test_interop_dgl.py runs in the DGL environment,
tests/test_interop_pyg.py in the project's; both import these)."""

from __future__ import annotations

import torch
from torch import nn

from betty_trainer import Batch, Graph, plan_micro_batches, train
from betty_trainer.config import load_config
from betty_trainer.models import set_dropout_key
from tests.test_exactness import assert_same_gradients, gradients
from tests.test_runs import QUICKSTART, SMALL


def assert_computes_logits(ours: nn.Module, models: list[nn.Module], batch: Batch, graph: Graph) -> None:
    """Each of ``models`` gives ``ours``' ``(outputs, classes)`` logits on ``batch``, equal up to float32
    rounding: the libraries sum each neighbourhood in a different order (eps 1.2e-7 per add)."""
    x = graph.x[batch.input_nodes]
    expected = ours(batch.blocks, x)
    assert expected.shape == (batch.output_nodes.numel(), graph.num_classes)
    for model in models:
        got = model(batch.blocks, x)
        assert got.shape == expected.shape
        # the exactness bound of tests/test_exactness.py: another library's float32 sums in another order
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def assert_micro_batches_equal_full_batch(model: nn.Module, batch: Batch, graph: Graph,
                                          dropout: nn.Module | None = None) -> None:
    """K = 4 REG micro-batches of ``batch`` give ``model`` the full batch's gradient (Betty §4.2.3), under a
    fixed dropout key; with ``dropout`` (the model's node-keyed dropout), setting its ``p`` to 0 then changes
    the gradient, so the equality was not the trivial one."""
    set_dropout_key(model, seed=3, step=11)
    reference = gradients(model, [batch], graph)
    micro_batches = plan_micro_batches(batch, 4, "reg", seed=1)
    assert len(micro_batches) == 4
    assert_same_gradients(reference, gradients(model, micro_batches, graph))
    if dropout is not None:
        dropout.p = 0.0
        # guard: 100x the exactness bound, so the check above can fail
        assert (gradients(model, [batch], graph)[0] - reference[0]).abs().max() > 1e-3 * reference[0].abs().max()


def assert_trains_with_the_trainer(model: nn.Module, tmp_path, epochs: int) -> None:
    """``train`` on the small synthetic quickstart graph changes every parameter of ``model`` and reaches a
    validation accuracy of 0.5: 5 classes, chance is 0.2 ± 0.04 on 100 validation nodes (binomial), so 0.5 is
    7 standard deviations above it."""
    config = load_config(QUICKSTART, SMALL + [f"optim.epochs={epochs}", "optim.lr=0.05"])
    before = [p.detach().clone() for p in model.parameters()]
    result = train(config, model=model, run_dir=tmp_path)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert result.best_val_acc >= 0.5
