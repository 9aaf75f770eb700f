"""One micro-batch's forward and backward: what training runs, and what memory is measured on;
and the micro-batches of a batch, built one at a time."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.block import Batch
from betty_trainer.errors import TrainingError
from betty_trainer.feature_store import FeatureStore, as_feature_store
from betty_trainer.models.stack import LayerStack
from partition import LayerSlice


class MicroBatches(Sequence[Batch]):
    """The ``K`` micro-batches of one batch, each built (``Batch.restrict``) when it is read.

    A plan holds only :class:`~partition.LayerSlice` positions; the micro-batch's blocks
    (global src ids, CSC structure, edge weights) are made when training reaches it, so a
    loop over this sequence keeps one micro-batch alive at a time, not ``K``.

    Args:
        batch: the full batch (or mini-batch) the slices index into.
        layers: per micro-batch, one :class:`~partition.LayerSlice` per block, input layer
            first (``Plan.layers``).
    """

    def __init__(self, batch: Batch, layers: Sequence[Sequence[LayerSlice]]):
        self.batch, self.layers = batch, layers

    @property
    def num_outputs(self) -> int:
        """``|V|``: the output nodes of all micro-batches together (the loss divisor)."""
        return sum(slices[-1].num_dst for slices in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @overload
    def __getitem__(self, index: int) -> Batch: ...

    @overload
    def __getitem__(self, index: slice) -> list[Batch]: ...

    def __getitem__(self, index: int | slice) -> Batch | list[Batch]:
        if isinstance(index, slice):
            return [self.batch.restrict(slices) for slices in self.layers[index]]
        return self.batch.restrict(self.layers[index])

    def __iter__(self) -> Iterator[Batch]:
        for slices in self.layers:
            yield self.batch.restrict(slices)

    def __repr__(self) -> str:
        return f"MicroBatches(k={len(self)}, outputs={self.num_outputs})"


def micro_batch_backward(
    model: nn.Module,
    micro_batch: Batch,
    features: Tensor | FeatureStore,
    labels: Tensor,
    device: torch.device,
    num_outputs: int,
) -> tuple[float, int]:
    """Forward and backward one micro-batch, adding ``∇ Σ_{i∈V_k} CE_i / |V|`` to ``.grad``.

    Gathers the input nodes' features on ``device`` from the feature store, moves the
    output nodes' labels and the blocks there, runs ``model(blocks, x)`` and backpropagates
    ``Σ CE / num_outputs`` (Betty §4.2.3: with ``num_outputs = |V|`` of the whole batch
    the micro-batches' gradients sum to the full batch's). Everything the micro-batch
    allocated is released when this returns, before the next micro-batch starts: the
    memory estimate (``estimator``) models exactly this step.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs_k, C)`` logits.
        micro_batch: the micro-batch.
        features: the :class:`~betty_trainer.feature_store.FeatureStore`, or an ``(N, F)``
            tensor (wrapped by :func:`~betty_trainer.feature_store.as_feature_store`).
        labels: ``(N,)`` int64 labels.
        device: where the model runs.
        num_outputs: the loss divisor ``|V|``.

    Returns:
        The micro-batch's loss term (float) and its number of correctly classified outputs.

    Raises:
        TrainingError: if the loss is NaN or infinite (then no gradient is added).
    """
    x = as_feature_store(features).gather(micro_batch.input_nodes, device)
    y = labels[micro_batch.output_nodes].to(device, non_blocking=True)
    blocks = micro_batch.to(device).blocks
    # x is this step's own gather: a built-in model may overwrite it with its dropped-out copy
    logits = model(blocks, x, consume_input=True) if isinstance(model, LayerStack) else model(blocks, x)
    loss = F.cross_entropy(logits, y, reduction="sum") / num_outputs
    if not torch.isfinite(loss):
        raise TrainingError(f"loss is {loss.item()}")
    loss.backward()
    return loss.item(), int((logits.argmax(1) == y).sum())
