"""One micro-batch's forward and backward: what training runs, and what memory is measured on."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.block import Batch
from betty_trainer.errors import TrainingError


def micro_batch_backward(
    model: nn.Module,
    micro_batch: Batch,
    features: Tensor,
    labels: Tensor,
    device: torch.device,
    num_outputs: int,
) -> tuple[float, int]:
    """Forward and backward one micro-batch, adding ``∇ Σ_{i∈V_k} CE_i / |V|`` to ``.grad``.

    Gathers ``features[micro_batch.input_nodes]`` and the output nodes' labels, moves
    them and the blocks to ``device``, runs ``model(blocks, x)`` and backpropagates
    ``Σ CE / num_outputs`` (Betty §4.2.3: with ``num_outputs = |V|`` of the whole batch
    the micro-batches' gradients sum to the full batch's). Everything the micro-batch
    allocated is released when this returns, before the next micro-batch starts: the
    memory estimate (``estimator``) models exactly this step.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs_k, C)`` logits.
        micro_batch: the micro-batch.
        features: ``(N, F)`` node features (any device).
        labels: ``(N,)`` int64 labels.
        device: where the model runs.
        num_outputs: the loss divisor ``|V|``.

    Returns:
        The micro-batch's loss term (float) and its number of correctly classified outputs.

    Raises:
        TrainingError: if the loss is NaN or infinite (then no gradient is added).
    """
    x = features[micro_batch.input_nodes].to(device, non_blocking=True)
    y = labels[micro_batch.output_nodes].to(device, non_blocking=True)
    logits = model(micro_batch.to(device).blocks, x)
    loss = F.cross_entropy(logits, y, reduction="sum") / num_outputs
    if not torch.isfinite(loss):
        raise TrainingError(f"loss is {loss.item()}")
    loss.backward()
    return loss.item(), int((logits.argmax(1) == y).sum())
