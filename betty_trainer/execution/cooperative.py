"""The forward and backward of one rank's share of a cooperative global batch (cooperative paper §3.1, Alg. 1:
"Feature Loading", "Forward Pass", "Backward Pass").

Each rank loads the features of the input nodes it owns through its own feature store (so a node cache there
holds owned rows only, and the ranks' caches add up), and the rows go to the ranks whose blocks read them by
all-to-all. Before every later layer the embeddings move the same way; the exchanges are autograd functions,
so the backward sends each row's gradient back to its owner. The loss of the rank's seeds is divided by the
global batch's seed count, and :func:`all_reduce_gradients` sums the parameters' gradients over the ranks: the
result is the gradient of the global batch's mean loss, as one process computing the whole batch would get it
(up to floating-point reassociation; ``tests/test_cooperative.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.profiler import record_function

from betty_trainer.data.feature_store import FeatureStore
from betty_trainer.distributed.exchange import collective, exchange_rows
from betty_trainer.distributed.share import CooperativeBatch
from betty_trainer.errors import NonFiniteLossError
from betty_trainer.execution.micro_batches import measured_step_resident
from betty_trainer.execution.plan import StepResult, estimated_row, held_bytes, layer_sizes, piece_row, plan_report
from betty_trainer.models.stack import runs_layer_by_layer
from betty_trainer.phases import GATHER
from estimator.estimate import MemoryEstimate
from estimator.measure import MeasuredPeak, measure_peak


def cooperative_backward(model: nn.Module, share: CooperativeBatch, features: FeatureStore, labels: Tensor,
                         device: torch.device, num_outputs: int) -> StepResult:
    """Forward and backward of this rank's share, adding its part of ``∇ mean_{i∈V} CE_i`` to ``.grad`` (a
    collective: every rank of the share's group calls it for the same global batch).

    Args:
        model: a :class:`~betty_trainer.models.stack.LayerStack` (every built-in model), run one layer at a time
            with an exchange before each layer.
        share: this rank's :class:`~betty_trainer.distributed.share.CooperativeBatch`.
        features: this rank's feature store; it is asked for the rows of the input nodes this rank owns.
        labels: ``(N,)`` int64 labels.
        device: where the model runs.
        num_outputs: ``|V|``, the seed count of the global batch.

    Returns:
        The global batch's :class:`StepResult` (its mean loss and correct count, summed over the ranks).

    Raises:
        TypeError: ``model`` cannot run layer by layer.
        NonFiniteLossError: the global loss is NaN or infinite, raised on every rank alike (no gradient is added).
        TrainingError: a collective failed because another rank died or left (naming this rank and the collective).
    """
    if not runs_layer_by_layer(model):
        raise TypeError(f"cooperative training runs the model layer by layer between exchanges: {type(model).__name__} "
                        "must be a LayerStack whose forward is the stack's own")
    group = share.exchanges[0].group
    with record_function(GATHER):
        h = features.gather(share.input_nodes, device)
    for index, block in enumerate(share.blocks):
        # the exchanged input rows are this step's own: input dropout may overwrite them (consume_input)
        h = model.layer_forward(index, block.to(device), exchange_rows(h, share.exchanges[index]), index == 0)
    y = labels[share.output_nodes].to(device, non_blocking=True)
    loss = F.cross_entropy(h, y, reduction="sum") / num_outputs
    totals = torch.stack([loss.detach().double().cpu(), (h.argmax(1) == y).sum().double().cpu()])
    with collective("the all-reduce of the loss", group):
        dist.all_reduce(totals, group=group)
    if not torch.isfinite(totals[0]):  # every rank sees the same sum, so every rank stops here
        raise NonFiniteLossError(f"loss is {totals[0].item()}")
    loss.backward()
    return StepResult(totals[0].item(), int(totals[1].item()))


def cooperative_step(model: nn.Module, shares: Iterable[CooperativeBatch], features: FeatureStore, labels: Tensor,
                     device: torch.device, num_outputs: int) -> StepResult:
    """One cooperative training step's forward and backward: every round's share
    (:meth:`~betty_trainer.sampling.cooperative.CooperativeSampler.rounds`; one round without micro-batching) run by
    :func:`cooperative_backward`, gradients accumulated, then all-reduced (:func:`all_reduce_gradients`), so
    ``.grad`` on every rank is the gradient of the global batch's mean loss. No optimizer step.

    Args:
        model, features, labels, device: as :func:`cooperative_backward`.
        shares: this rank's share of each round, in order; the same number on every rank.
        num_outputs: ``|V|``, the seed count of the global batch (of all rounds together).

    Returns:
        The global batch's :class:`StepResult`.

    Raises:
        TypeError, TrainingError: see :func:`cooperative_backward`.
    """
    loss, correct, group = 0.0, 0, None
    for share in shares:
        result = cooperative_backward(model, share, features, labels, device, num_outputs)
        loss, correct, group = loss + result.loss, correct + result.correct, share.exchanges[0].rows_group
    all_reduce_gradients(model, group)
    return StepResult(loss, correct)


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's ``.grad`` over the ranks of ``group`` (a parameter without one on a rank counts as
    zeros there), so every rank takes the same optimizer step (Alg. 1 ends with the gradients all-reduced).

    Raises:
        TrainingError: the all-reduce failed because a rank died or left.
    """
    for parameter in model.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        with collective("the all-reduce of gradients", group):
            dist.all_reduce(parameter.grad, group=group)


@dataclass
class CooperativePlan:
    """A :class:`~betty_trainer.execution.plan.StepPlan` for this rank's share of a cooperative global batch, in
    ``len(shares)`` micro-batch rounds (:meth:`~betty_trainer.sampling.cooperative.CooperativeSampler.rounds`), run
    by :func:`cooperative_step`. Its ``run`` holds collectives, so every rank runs a plan of the same number of
    rounds for the same global batch.

    Attributes:
        batch: the share of the whole global batch (one round; what the loop sampled).
        shares: the share of each round (``[batch]`` for one round).
        rank: this rank; ``world_size``: ``P``.
        itemise: ``(share, accumulate) -> MemoryEstimate``, a round's itemised estimate
            (:func:`estimator.cooperative.estimate_cooperative_share` of a built-in model), or ``None`` without one
            (a custom model).
        budget: the budget the rounds were planned against (bytes; ``None``: a fixed number of rounds).
        tried: ``(rounds, largest estimate on this rank)`` of each count the planner tried, in order.
        seconds: the planning time (sampling the rounds included).
        feature_store_bytes: device bytes the feature store holds beside the step (taken off the budget).
    """

    batch: CooperativeBatch
    shares: Sequence[CooperativeBatch]
    rank: int
    world_size: int
    itemise: Callable[[CooperativeBatch, bool], MemoryEstimate] | None = None
    budget: int | None = None
    tried: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    feature_store_bytes: int = 0
    method: ClassVar[str] = "cooperative"

    @cached_property
    def estimates(self) -> list[MemoryEstimate] | None:
        """Each round's estimate (made when first read), or ``None`` without an ``itemise``."""
        if self.itemise is None:
            return None
        return [self.itemise(share, index > 0) for index, share in enumerate(self.shares)]

    @property
    def pieces(self) -> int:
        return len(self.shares)

    @property
    def estimate(self) -> int | None:
        return max((estimate.peak_bytes for estimate in self.estimates), default=None) if self.estimates else None

    @property
    def work(self) -> float:
        return float(sum(block.num_src + block.num_edges for share in self.shares for block in share.blocks))

    @property
    def host_bytes(self) -> int:
        """The rounds' shares (their blocks and exchange indices) less the batch's own: 0 for one round."""
        return held_bytes((t for share in self.shares for t in share_tensors(share)), share_tensors(self.batch))

    @property
    def summary(self) -> str:
        rounds = f"{self.pieces} micro-batch round{'s' if self.pieces > 1 else ''}"
        return f"a share of the global batch in {rounds}"

    def redundancy(self) -> list[float]:
        whole = [max(block.num_src, 1) for block in self.batch.blocks]
        computed = [sum(share.blocks[layer].num_src for share in self.shares) for layer in range(len(whole))]
        return [max(1.0, rows / total) for rows, total in zip(computed, whole)]

    def run(self, model: nn.Module, features: FeatureStore, labels: Tensor, device: torch.device) -> StepResult:
        return cooperative_step(model, self.shares, features, labels, device, self.batch.seeds.numel())

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer, features: FeatureStore, labels: Tensor,
                device: torch.device) -> list[int]:
        """One real cooperative step per round (:func:`measure_cooperative_step`; a collective), after one that
        creates the optimizer's state; those after the first with the earlier rounds' gradients resident."""
        num_outputs = self.batch.seeds.numel()
        measure_cooperative_step(model, optimizer, self.shares[0], features, labels, device, num_outputs)
        return [measure_cooperative_step(model, optimizer, share, features, labels, device, num_outputs,
                                         accumulate=index > 0).peak_bytes
                for index, share in enumerate(self.shares)]

    def report(self, measured: list[int] | None = None) -> dict:
        """The report every plan writes (:func:`~betty_trainer.execution.plan.plan_report`): a row per round, with
        each layer's exchange (``rows_received`` from other ranks, ``rows_served``: the distinct rows this rank
        provides), and this rank's place (``rank``, ``world_size``, ``global_batch_outputs``)."""
        rows = []
        for index, share in enumerate(self.shares):
            layers = layer_sizes(share.blocks)
            for sizes, exchange in zip(layers, share.exchanges):
                sizes.update(rows_received=exchange.rows_received, rows_served=exchange.owned.numel())
            rows.append(estimated_row(piece_row(index, layers), self.estimates[index] if self.estimates else None,
                                      measured[index] if measured is not None else None))
        return plan_report(self, rows, budget=self.budget, partitioner="owned seeds in consecutive parts",
                           tried=self.tried, seconds=self.seconds, feature_store_bytes=self.feature_store_bytes,
                           measured_step=max(measured) if measured else None, rank=self.rank,
                           world_size=self.world_size, global_batch_outputs=self.batch.seeds.numel())


def exchange_indices(share: CooperativeBatch) -> list[Tensor]:
    """The int64 indices of a share's exchanges: each one's ``order``, ``serve_index`` and ``owned``."""
    return [t for exchange in share.exchanges for t in (exchange.order, exchange.serve_index, exchange.owned)]


def share_tensors(share: CooperativeBatch) -> list[Tensor]:
    """The tensors a share holds: its blocks' (:meth:`~betty_trainer.data.block.Block.tensors`) and its exchanges'
    indices."""
    return [*(t for block in share.blocks for t in block.tensors()), *exchange_indices(share)]


def measure_cooperative_step(model: nn.Module, optimizer: torch.optim.Optimizer, share: CooperativeBatch,
                             features: FeatureStore, labels: Tensor, device: torch.device, num_outputs: int,
                             accumulate: bool = False) -> MeasuredPeak:
    """Run one cooperative training step on ``share`` (one round: :func:`cooperative_step`, then
    ``optimizer.step()``; a collective) and return its measured memory peak, as
    :func:`~betty_trainer.execution.micro_batches.measure_training_step` does for a micro-batch (same resident
    set, plus the share's exchange indices on the CPU). **Updates the model and the optimizer.**

    Raises:
        TrainingError: see :func:`cooperative_backward`. ValueError, RuntimeError: see
            :func:`estimator.measure.measure_peak`.
    """
    resident = measured_step_resident(model, optimizer, share.blocks, device, accumulate)
    if device.type == "cpu":  # the exchanges' indices are live during the step, as the blocks are
        resident += exchange_indices(share)

    def step() -> None:
        cooperative_step(model, [share], features, labels, device, num_outputs)
        optimizer.step()

    return measure_peak(step, device, resident)
