"""Betty's micro-batches (Betty §4.2): the :class:`MicroBatchPlan` of a batch and its executor.

One micro-batch's forward and backward (:func:`micro_batch_backward`) is what training runs and what memory is
measured on (:func:`measure_training_step`, the estimator's ground truth: ``torch.cuda.max_memory_allocated`` on a
GPU, the profiler's allocation records on CPU, via :func:`estimator.measure.measure_peak`);
:func:`accumulate_gradients` runs a batch's micro-batches, each built when it is read (:class:`MicroBatches`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, overload

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.profiler import record_function

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.feature_store import FeatureStore, hands_out_rows, require_store
from betty_trainer.errors import NonFiniteLossError
from betty_trainer.execution.plan import StepResult, estimated_row, held_bytes, layer_sizes, piece_row, plan_report
from betty_trainer.models.registry import as_built
from betty_trainer.models.stack import LayerStack
from betty_trainer.phases import GATHER
from estimator.estimate import MemoryEstimate
from estimator.measure import MeasuredPeak, measure_peak
from partition import SliceSize, Split, redundancy


class MicroBatches(Sequence[Batch]):
    """The ``K`` micro-batches of one batch, each sliced and built (``Batch.restrict``) when it is read.

    Holds only each micro-batch's output positions: reading micro-batch ``k`` slices the batch for it
    (:func:`partition.slice_layers`; ``O(its edges)``, a few per cent of its step on the CPU) and builds its
    blocks (global src ids, CSC structure, edge weights); the slices' src positions and edge ids are dropped
    once the blocks are built. A loop over this sequence keeps one micro-batch alive at a time, not ``K``, and
    nothing of the micro-batches lives between steps but their sizes (:attr:`built_sizes`). A group of every output
    is the batch itself (``K = 1``: no slicing, no copy).

    Args:
        batch: the full batch (or mini-batch) the micro-batches slice.
        groups: per micro-batch, ``(m_k,)`` int64 sorted positions among the batch's output nodes
            (:attr:`partition.Split.groups`).

    Attributes:
        built_sizes: per micro-batch, the :class:`~partition.SliceSize` of each of its blocks (input layer first, no
            degree histogram) once it has been read, else ``None``: what a plan whose split was not counted takes
            its redundancy from (:meth:`MicroBatchPlan.redundancy`).
    """

    def __init__(self, batch: Batch, groups: Sequence[Tensor]):
        self.batch, self.groups = batch, groups
        self.built_sizes: list[list[SliceSize] | None] = [None] * len(groups)

    @property
    def num_outputs(self) -> int:
        """``|V|``: the output nodes of all micro-batches together (the loss divisor)."""
        return sum(group.numel() for group in self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def _build(self, index: int) -> Batch:
        group = self.groups[index]
        built = self.batch if group.numel() == self.batch.output_nodes.numel() else self.batch.micro_batch(group)
        self.built_sizes[index] = [SliceSize.of(block) for block in built.blocks]
        return built

    @overload
    def __getitem__(self, index: int) -> Batch: ...

    @overload
    def __getitem__(self, index: slice) -> list[Batch]: ...

    def __getitem__(self, index: int | slice) -> Batch | list[Batch]:
        if isinstance(index, slice):
            return [self._build(position) for position in range(len(self))[index]]
        return self._build(range(len(self))[index])  # a negative index counts from the end, as a list's

    def __iter__(self) -> Iterator[Batch]:
        for index in range(len(self)):
            yield self._build(index)

    def __repr__(self) -> str:
        return f"MicroBatches(k={len(self)}, outputs={self.num_outputs})"


def micro_batch_backward(
    model: nn.Module,
    micro_batch: Batch,
    features: FeatureStore,
    labels: Tensor,
    device: torch.device,
    num_outputs: int,
) -> tuple[float, int]:
    """Forward and backward one micro-batch, adding ``∇ Σ_{i∈V_k} CE_i / |V|`` to ``.grad``.

    Gathers the input nodes' features on ``device`` from the feature store (a built-in model as built, whose layers
    never write their input, :func:`~betty_trainer.models.registry.as_built`, reads a plain host store's own rows
    instead where the input nodes are ``0 … n − 1`` on the CPU: :func:`~betty_trainer.data.feature_store.
    hands_out_rows`), moves the output nodes' labels and the
    blocks there, runs ``model(blocks, x)`` and backpropagates
    ``Σ CE / num_outputs`` (Betty §4.2.3: with ``num_outputs = |V|`` of the whole batch
    the micro-batches' gradients sum to the full batch's). Everything the micro-batch
    allocated is released when this returns, before the next micro-batch starts: the
    memory estimate (``estimator``) models exactly this step.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs_k, C)`` logits.
        micro_batch: the micro-batch.
        features: the :class:`~betty_trainer.data.feature_store.FeatureStore` the input rows are
            gathered from.
        labels: ``(N,)`` int64 labels.
        device: where the model runs.
        num_outputs: the loss divisor ``|V|``.

    Returns:
        The micro-batch's loss term (float) and its number of correctly classified outputs.

    Raises:
        NonFiniteLossError: if the loss is NaN or infinite (then no gradient is added).
    """
    with record_function(GATHER):  # only a built-in model, which never writes its input, reads the store's rows
        x = features.view(micro_batch.input_nodes, device) \
            if as_built(model) and hands_out_rows(features, device) else None
        owned = x is None
        x = features.gather(micro_batch.input_nodes, device) if owned else x
    y = labels[micro_batch.output_nodes].to(device, non_blocking=True)
    blocks = micro_batch.to(device).blocks
    # this step's own gather: a built-in model may overwrite it with its dropped-out copy
    logits = model(blocks, x, consume_input=owned) if isinstance(model, LayerStack) else model(blocks, x)
    loss = F.cross_entropy(logits, y, reduction="sum") / num_outputs
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"loss is {loss.item()}")
    loss.backward()
    return loss.item(), int((logits.argmax(1) == y).sum())


def accumulate_gradients(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    features: FeatureStore,
    labels: Tensor,
    device: torch.device,
) -> StepResult:
    """Forward and backward every micro-batch, accumulating ``∇ mean_{i∈V} loss_i`` in ``.grad``.

    Micro-batch ``k`` contributes ``Σ_{i∈V_k} CE_i / |V|`` with ``|V|`` the batch's
    output count (Betty §4.2.3), so the sum equals the full-batch gradient. Each
    micro-batch is released before the next is read, so with :class:`MicroBatches`
    (which builds a micro-batch when it is read) one micro-batch is alive at a time.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs, C)`` logits.
        micro_batches: disjoint micro-batches of one batch.
        features: the :class:`~betty_trainer.data.feature_store.FeatureStore` the input rows are
            gathered from.
        labels: ``(N,)`` int64 labels.
        device: where the model runs.

    Returns:
        The batch's mean loss and its number of correctly classified outputs.

    Raises:
        NonFiniteLossError: if a loss is NaN or infinite (naming the micro-batch; no gradient of that batch
            should be applied).
        TypeError: ``features`` is not a :class:`~betty_trainer.data.feature_store.FeatureStore`.
    """
    require_store(features)
    if isinstance(micro_batches, MicroBatches):
        total = micro_batches.num_outputs  # without building the micro-batches
    else:
        total = sum(mb.output_nodes.numel() for mb in micro_batches)
    loss_sum, correct, index = 0.0, 0, 0
    for micro_batch in micro_batches:  # not enumerate(), whose cached result tuple keeps the previous item alive
        try:
            loss, right = micro_batch_backward(model, micro_batch, features, labels, device, total)
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error} in micro-batch {index}") from None
        del micro_batch  # gone before the next one is built
        loss_sum, correct, index = loss_sum + loss, correct + right, index + 1
    return StepResult(loss_sum, correct)


Itemise = Callable[[Sequence[Any], bool], MemoryEstimate]
"""``(a micro-batch's layers, accumulating) → its estimate by component``: the layers are its blocks, or its sizes
counted without slicing (:attr:`partition.Split.sizes`), input layer first."""


@dataclass
class MicroBatchPlan:
    """A :class:`~betty_trainer.execution.plan.StepPlan` that runs a batch as ``K`` micro-batches, each through all
    layers, their gradients accumulated (Betty §4.2), in the order of ``split``.

    Attributes:
        batch: the batch the micro-batches slice.
        split: the micro-batches' output groups, their layers' sizes, estimates and search (:func:`partition.make_split`);
            each micro-batch is sliced when it runs (:class:`MicroBatches`).
        work_of: the estimated cost of the micro-batches from their layers' sizes (a built-in model's multiply-adds:
            :meth:`PeakEstimator.micro_batch_work <estimator.peaks.PeakEstimator.micro_batch_work>`), or ``None`` for
            :attr:`partition.Split.work` (rows and edges): :attr:`work` is made of it when first read.
        partitioner: what split the outputs (``micro_batch.partitioner``).
        feature_store_bytes: device bytes the feature store holds beside the step (taken off the budget).
        itemise: the estimate by component of a micro-batch (the closed form of a built-in model) from its layers
            (:meth:`counted_layers`; the batch's edge weights, which counted sizes do not carry, bound in), or
            ``None``.
        kept_transpose_bytes: bytes of the transposes the batch's blocks keep for the run (``K = 1`` only:
            ``betty_trainer.memory.planner.Planner``'s kept transposes; counted in the estimate's block structure).
        ran_sizes: each micro-batch's layers' sizes as the last :meth:`run` built them (``None`` before one ends).

    Its estimate and report count each micro-batch's layers from the split (:meth:`counted_layers`), slicing none;
    a micro-batch is sliced only when it runs or is measured. A split made without estimates (a fixed ``K``: each
    batch assigned by the graph, or split by the partitioner for a closed-form estimator) is counted only when
    something reads its sizes: the estimate, the report, the work; the redundancy the training loop reads after
    every step comes from the micro-batches the step built.
    """

    batch: Batch
    split: Split
    work_of: Callable[[list[list[SliceSize]]], float] | None
    partitioner: str
    feature_store_bytes: int = 0
    itemise: Itemise | None = None
    kept_transpose_bytes: int = 0
    ran_sizes: list[list[SliceSize]] | None = field(default=None, init=False, repr=False)
    method: ClassVar[str] = "micro_batches"

    @property
    def pieces(self) -> int:
        return self.split.k

    @cached_property
    def estimate(self) -> int | None:
        """The largest micro-batch's estimated peak, bytes: the search's (:attr:`partition.Split.estimates`), or,
        for a split made without estimates (a fixed ``K``: :class:`~betty_trainer.memory.planner.Planner`), the
        closed form of each micro-batch's counted layers (:meth:`counted_layers`, none sliced) when asked (``None``
        without a closed form)."""
        if self.split.estimates or self.itemise is None:
            return max(self.split.estimates, default=0) or None
        return max(self.itemise(self.counted_layers(index), index > 0).peak_bytes for index in range(self.pieces))

    def counted_layers(self, index: int) -> Sequence[Any]:
        """Micro-batch ``index``'s layers as its estimate reads them, without slicing it: the split's counted sizes
        (:func:`partition.slicing.count_layers`, degree histograms included), or at ``K = 1`` the batch's own
        blocks (the whole batch, whose sizes the split keeps without a histogram)."""
        return self.batch.blocks if self.split.k == 1 else self.split.sizes[index]

    @cached_property
    def work(self) -> float:
        """The estimated cost the planner compares (see the protocol): :attr:`work_of` the split's sizes, or
        :attr:`partition.Split.work`; made when first read (counting the split's sizes where it was not)."""
        return self.work_of(self.split.sizes) if self.work_of is not None else float(self.split.work)

    @property
    def summary(self) -> str:
        return f"{self.pieces} micro-batch{'es' if self.pieces > 1 else ''}"

    @property
    def host_bytes(self) -> int:
        """The split's groups, ``8 · outputs`` bytes at any K (each micro-batch is sliced when it runs)."""
        return held_bytes(self.split.groups)

    @property
    def micro_batches(self) -> MicroBatches:
        """The micro-batches, each sliced and built when it is read."""
        return MicroBatches(self.batch, self.split.groups)

    def redundancy(self) -> list[float]:
        """Per layer, ``Σ_k src rows of micro-batch k / the batch's src rows`` (:func:`partition.redundancy`): from
        :attr:`ran_sizes` where a run has ended, else from the split's sizes (counted now where they were not;
        slicing and counting give the same sizes: ``count_layers``' contract)."""
        return redundancy(self.batch.blocks, self.ran_sizes if self.ran_sizes is not None else self.split.sizes)

    def run(self, model: nn.Module, features: FeatureStore, labels: Tensor, device: torch.device) -> StepResult:
        """The micro-batches' forward and backward (:func:`accumulate_gradients`), each built when it runs; their
        sizes are kept (:attr:`ran_sizes`)."""
        micro_batches = self.micro_batches
        result = accumulate_gradients(model, micro_batches, features, labels, device)
        self.ran_sizes = micro_batches.built_sizes
        return result

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer, features: FeatureStore, labels: Tensor,
                device: torch.device) -> list[int]:
        """One real step per micro-batch (:func:`measure_training_step`), after one that creates the optimizer's
        state; those after the first with the earlier ones' gradients resident, as in training."""
        micro_batches = self.micro_batches
        measure_training_step(model, optimizer, micro_batches[0], features, labels, device)  # Adam's state exists
        num_outputs = self.batch.output_nodes.numel()
        return [measure_training_step(model, optimizer, micro_batch, features, labels, device, num_outputs=num_outputs,
                                      accumulate=index > 0).peak_bytes
                for index, micro_batch in enumerate(micro_batches)]

    def report(self, measured: list[int] | None = None) -> dict:
        """Rows: micro-batch ``i`` is piece ``i``, its sizes and estimate from the split (:meth:`counted_layers`;
        none sliced)."""
        split = self.split  # its estimates: each micro-batch's peak as the search had it (a custom model's too)

        def estimate(index: int) -> MemoryEstimate | int | None:
            if self.itemise is not None:
                return self.itemise(self.counted_layers(index), index > 0)
            return split.estimates[index] if split.estimates else None

        rows = [estimated_row(piece_row(index, layer_sizes(split.sizes[index])), estimate(index),
                              measured[index] if measured is not None else None)
                for index in range(self.pieces)]
        return plan_report(self, rows, budget=split.budget, partitioner=self.partitioner, tried=split.tried,
                           seconds=split.seconds, feature_store_bytes=self.feature_store_bytes,
                           full_batch_estimate=split.full_batch_estimate or (
                               self.itemise(self.batch.blocks, False).peak_bytes if self.itemise is not None else None),
                           measured_step=max(measured) if measured else None,
                           kept_transpose_bytes=self.kept_transpose_bytes)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The tensors live between training steps: ``model``'s parameters and buffers and every
    tensor in ``optimizer.state`` (Adam: two moments and a step counter per parameter)."""
    state = [value for values in optimizer.state.values() for value in values.values() if isinstance(value, Tensor)]
    return [*model.parameters(), *model.buffers(), *state]


def measured_step_resident(model: nn.Module, optimizer: torch.optim.Optimizer, blocks: Sequence[Block],
                           device: torch.device, accumulate: bool) -> list[Tensor]:
    """Set the gradients as a measured step starts (``None``, or zeros with ``accumulate``: an earlier micro-batch
    left them) and return what is live before it and belongs in its peak: :func:`training_state`, the gradients
    when accumulating, and on the CPU the blocks' structure (not copied inside the step, but live during it)."""
    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    if accumulate:
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
    resident = training_state(model, optimizer)
    if accumulate:
        resident += [parameter.grad for parameter in model.parameters()]
    if device.type == "cpu":
        resident += [t for block in blocks for t in block.tensors()]
    return resident


def measure_training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batch: Batch,
    features: FeatureStore,
    labels: Tensor,
    device: torch.device | str,
    num_outputs: int | None = None,
    accumulate: bool = False,
) -> MeasuredPeak:
    """Run one training step on ``micro_batch`` and return its measured memory peak (bytes).

    The measured step: :func:`~betty_trainer.execution.micro_batches.micro_batch_backward` (gather and
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
        features: the :class:`~betty_trainer.data.feature_store.FeatureStore` the step gathers
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
        NonFiniteLossError: if the loss is NaN or infinite.
    """
    device = torch.device(device)
    divisor = micro_batch.output_nodes.numel() if num_outputs is None else num_outputs
    resident = measured_step_resident(model, optimizer, micro_batch.blocks, device, accumulate)

    def step() -> None:
        micro_batch_backward(model, micro_batch, features, labels, device, divisor)
        optimizer.step()

    return measure_peak(step, device, resident)
