"""The step plan: the one interface to every way of running one batch's forward and backward.

The planner (:mod:`betty_trainer.memory.planner`) searches and returns a :class:`StepPlan`; the training loop, the
dry run (``betty-train plan``) and ``plan.json`` use only what this protocol declares, never the kind of plan
they hold. Two kinds implement it, each beside its executor:

- :class:`~betty_trainer.execution.micro_batches.MicroBatchPlan`: the batch's outputs split into ``K``
  micro-batches, each run through all layers, gradients accumulated (Betty §4.2);
- :class:`~betty_trainer.execution.layerwise.LayerwisePlan`: the batch run one layer at a time in ``K`` chunks
  per layer, recomputed in backward.

A rank's share of a cooperative global batch is meant to be a third: its ``run`` holds the collectives
(all-to-all of sampled ids, features and embeddings; all-reduce of gradients), which every rank must enter in
the same order, so a plan's ``pieces`` must be the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore
from estimator.estimate import MemoryEstimate


class StepResult(NamedTuple):
    """What one batch's forward and backward gave (unpacks as ``loss, correct``).

    Attributes:
        loss: the batch's mean cross-entropy over its output nodes (float).
        correct: output nodes whose logits' argmax is their label.
    """

    loss: float
    correct: int


@runtime_checkable
class StepPlan(Protocol):
    """How one batch runs: its pieces, what was estimated, and ``run`` (docs/design.md › Seams › StepPlan; the
    accumulation that makes every kind give the full batch's gradient: Betty §4.2.3).

    Attributes:
        batch: the batch the plan runs (blocks input layer first).
        method: what runs it, as ``plan.json``'s ``mode`` names it: ``micro_batches`` or ``layerwise``.
        pieces: micro-batches, or chunks per layer (``≥ 1``); re-planning after an out-of-memory error asks
            for more.
        estimate: the estimated peak of the step in bytes (its largest piece's; ``None`` without an
            estimate, e.g. an uncalibrated custom model at a fixed ``K``).
        work: the estimated cost the planner compares plans by (multiply-adds of a built-in model, rows and
            edges processed otherwise); only ratios between plans of one batch are meaningful. A plan may make it when
            first read (a micro-batch plan counting its micro-batches' sizes), and the planner reads it only where it
            compares two plans.
        host_bytes: bytes of the tensors the plan itself holds beside its batch, between steps as during them
            (``plan.json``'s ``plan_host_bytes``): what keeping the plan costs in host memory, outside every step's
            estimated peak.
    """

    batch: Batch
    method: str

    @property
    def pieces(self) -> int: ...

    @property
    def estimate(self) -> int | None: ...

    @property
    def work(self) -> float: ...

    @property
    def host_bytes(self) -> int: ...

    @property
    def summary(self) -> str:
        """How the batch runs, in words (``"8 micro-batches"``, ``"layer by layer in 4 chunks per layer"``)."""
        ...

    def redundancy(self) -> list[float]:
        """Per layer, the src rows the plan computes over the batch's src rows (``≥ 1``; Betty Table 6)."""
        ...

    def run(self, model: nn.Module, features: FeatureStore, labels: Tensor, device: torch.device) -> StepResult:
        """Forward and backward the whole batch, adding ``∇ mean_{i∈V} CE_i`` to the parameters' ``.grad``
        (no optimizer step).

        Raises:
            NonFiniteLossError: a loss is NaN or infinite (the message names the piece).
            torch.OutOfMemoryError: a piece did not fit on the device (the caller re-plans).
        """
        ...

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer, features: FeatureStore, labels: Tensor,
                device: torch.device) -> list[int]:
        """Run real training steps of the plan (after one that creates the optimizer's state) and return the
        measured peak bytes (:func:`estimator.measure.measure_peak`) of each measured unit: each micro-batch,
        or the one layer-wise step. Updates ``model`` and ``optimizer``.

        Raises:
            NonFiniteLossError: a loss is NaN or infinite.
            RuntimeError: a torch profiler is already running (CPU).
            ValueError: a device other than CPU or CUDA.
        """
        ...

    def report(self, measured: list[int] | None = None) -> dict:
        """``plan.json``'s content (JSON-ready): sizes, estimates by component, redundancy per layer, what the
        search tried; with ``measured`` (from :meth:`measure`), each measured peak and the estimate's error
        ``(estimate − measured) / measured``."""
        ...


def held_bytes(held: Iterable[Tensor], beside: Iterable[Tensor] = ()) -> int:
    """Bytes of the distinct storages of the ``held`` tensors (views of one storage count it once), less those
    ``beside`` holds too (a plan's batch): a plan's :attr:`StepPlan.host_bytes`."""
    batch_storages = {t.untyped_storage().data_ptr() for t in beside}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in batch_storages)


def layer_sizes(layers: Sequence[Any]) -> list[dict[str, int]]:
    """Per layer (input layer first), its src nodes, dst nodes and edges (a report's sizes), from anything with
    ``num_src``, ``num_dst`` and ``num_edges``: a batch's blocks, or a micro-batch's layers counted without slicing
    (:attr:`partition.Split.sizes`)."""
    return [{"src_nodes": b.num_src, "dst_nodes": b.num_dst, "edges": b.num_edges} for b in layers]


def relative_error(estimate: int, measured: int) -> float:
    """An estimate's error against the measured peak, ``(estimate − measured) / measured`` (bytes in, a signed
    fraction out: +0.05 is 5% over)."""
    return (estimate - measured) / measured


def plan_report(plan: StepPlan, rows: list[dict], *, budget: int | None, partitioner: str,
                tried: list[tuple[int, int]], seconds: float, feature_store_bytes: int,
                full_batch_estimate: int | None = None, measured_step: int | None = None, **extra) -> dict:
    """The report every kind of plan writes (``plan.json``; ``betty-train plan`` draws it as one table).

    Args:
        plan: the plan.
        rows: one row per piece (:func:`piece_row`), each with, where the plan estimates or measures a piece on
            its own, ``estimate`` (``peak_bytes`` and the components ``at_peak``), ``measured_peak_bytes`` and
            ``error``.
        budget, partitioner, tried, seconds, feature_store_bytes: what the search was given and did (``tried``:
            each K and its largest estimate, 0 where the search estimated nothing, written ``null``: a fixed K).
        full_batch_estimate: the estimated peak of the unsplit batch, bytes, where the search made one.
        measured_step: the measured peak of the whole step, bytes (the largest piece's, or the one layer-wise
            step's).
        extra: the kind's own keys (a layer-wise plan's ``layer_outputs_on``, ``chunks_per_layer`` and
            ``partitioner_per_layer``).
    """
    report = {
        "mode": plan.method,
        "summary": plan.summary,
        "num_pieces": plan.pieces,
        "budget_bytes": budget,
        "feature_store_bytes": feature_store_bytes,
        "partitioner": partitioner,
        "full_batch": {"outputs": plan.batch.output_nodes.numel(), "estimate_peak_bytes": full_batch_estimate,
                       "layers": layer_sizes(plan.batch.blocks)},
        "estimate_peak_bytes": plan.estimate,
        "work": plan.work,
        "plan_host_bytes": plan.host_bytes,
        "redundancy_per_layer": plan.redundancy(),
        "tried": [{"k": k, "largest_estimate_bytes": peak or None} for k, peak in tried],  # 0: not estimated
        "planning_seconds": seconds,
        **extra,
        "pieces": rows,
    }
    if measured_step is not None:
        report["measured_peak_bytes"] = measured_step
        if plan.estimate:
            report["error"] = relative_error(plan.estimate, measured_step)
    return report


def piece_row(index: int, layers: list[dict[str, int]]) -> dict:
    """A report's row of piece ``index``: its outputs (dst nodes of its last layer) and its sizes per layer
    (``src_nodes``, ``dst_nodes``, ``edges``, as :func:`layer_sizes` gives them)."""
    return {"piece": index, "outputs": layers[-1]["dst_nodes"], "layers": layers}


def estimated_row(row: dict, estimate: MemoryEstimate | int | None, measured: int | None) -> dict:
    """``row`` (:func:`piece_row`) with the piece's own ``estimate`` (``peak_bytes`` and the components ``at_peak``;
    a custom model's recorded or calibrated estimate is a number of bytes, its ``at_peak`` empty) and
    ``measured_peak_bytes``, and the estimate's ``error`` where both are there; ``None`` adds nothing."""
    if estimate is not None:
        peak, at_peak = (estimate, {}) if isinstance(estimate, int) else (estimate.peak_bytes, estimate.at_peak)
        row["estimate"] = {"peak_bytes": peak, "at_peak": at_peak}
    if measured is not None:
        row["measured_peak_bytes"] = measured
        if estimate is not None:
            row["error"] = relative_error(row["estimate"]["peak_bytes"], measured)
    return row
