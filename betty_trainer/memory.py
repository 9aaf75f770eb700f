"""The measured memory peak of one real training step of one micro-batch (the estimator's ground truth).

The step is the one training runs for a micro-batch
(:func:`~betty_trainer.step.micro_batch_backward`), followed by the optimizer step; :func:`estimator.measure.measure_peak`
measures it (``torch.cuda.max_memory_allocated`` on a GPU, the profiler's allocation
records on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from betty_trainer.block import Batch
from betty_trainer.feature_store import FeatureStore, as_feature_store
from betty_trainer.step import micro_batch_backward
from estimator.measure import MeasuredPeak, measure_peak


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors live between training steps: ``model``'s parameters and buffers and every
    tensor in ``optimizer.state`` (Adam: two moments and a step counter per parameter)."""
    state = [value for values in optimizer.state.values() for value in values.values() if isinstance(value, Tensor)]
    return [*model.parameters(), *model.buffers(), *state]


def measure_training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batch: Batch,
    features: Tensor | FeatureStore,
    labels: Tensor,
    device: torch.device | str,
    num_outputs: int | None = None,
    accumulate: bool = False,
) -> MeasuredPeak:
    """Run one training step on ``micro_batch`` and return its measured memory peak (bytes).

    The measured step: :func:`~betty_trainer.step.micro_batch_backward` (gather and
    move the inputs, forward, loss ``Σ CE / num_outputs``, backward; the micro-batch's
    tensors are released when it returns, as in training), then ``optimizer.step()``.
    It runs in the model's current mode (``model.train()`` for dropout).

    This is a real step: it **updates the model and the optimizer state**. Callers who
    want no update pass deep copies (``copy.deepcopy`` of the model and an optimizer
    built on the copy). Before the step the gradients of ``model`` and ``optimizer`` are
    set to ``None`` (``zero_grad(set_to_none=True)``), so the gradients are allocated
    inside the step and count in the peak, as in a batch's first micro-batch. With
    ``accumulate=True`` every parameter gets a zero gradient instead, as in the later
    micro-batches of a batch, whose gradients are added into those the earlier ones
    left: they are resident, and each new gradient is a temporary. Nothing else is
    changed or restored.

    ``resident`` (CPU; see :func:`~estimator.measure.measure_peak`) is the model's
    parameters, their gradients (``accumulate``), buffers, every tensor in ``optimizer.state`` and the micro-batch's
    block structure (on a GPU the blocks are copied inside the step and counted there). A fresh Adam creates
    its state (2 × parameter bytes) inside its first ``step()``, after backward has freed
    the activations; for the steady-state peak of later steps, measure a step after the
    optimizer has stepped once.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs, C)`` logits, on ``device``.
        optimizer: an optimizer over ``model``'s parameters.
        micro_batch: the micro-batch (blocks on the CPU or on ``device``).
        features: the :class:`~betty_trainer.feature_store.FeatureStore` the step gathers
            from (its gather counts in the step; its stored features and a host staging
            buffer do not), or an ``(N, F)`` tensor on the CPU or on ``device`` (wrapped,
            unpinned).
        labels: ``(N,)`` int64 labels.
        device: where the model runs: ``cpu``, ``cuda`` or ``cuda:N``.
        num_outputs: the loss divisor ``|V|`` (the whole batch's output count when the
            micro-batch is one of several); default: ``micro_batch``'s own output count.
        accumulate: measure a micro-batch after the first of its batch (see above).

    Returns:
        The :class:`~estimator.measure.MeasuredPeak` of the step.

    Raises:
        ValueError: for a device other than CPU or CUDA, or, on CPU, a parameter, buffer
            or optimizer state tensor not on the CPU.
        RuntimeError: if a torch profiler is already running (CPU), or from the model.
        TrainingError: if the loss is NaN or infinite.
    """
    device = torch.device(device)
    features = as_feature_store(features)
    divisor = micro_batch.output_nodes.numel() if num_outputs is None else num_outputs
    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    if accumulate:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    resident = training_state(model, optimizer)
    if accumulate:
        resident += [parameter.grad for parameter in model.parameters()]
    if device.type == "cpu":  # on CPU the blocks are not copied inside the step but are live during it
        resident += [t for block in micro_batch.blocks
                     for t in (block.src_nodes, block.indptr, block.indices, block.edge_weight) if t is not None]

    def step() -> None:
        micro_batch_backward(model, micro_batch, features, labels, device, divisor)
        optimizer.step()

    return measure_peak(step, device, resident)
