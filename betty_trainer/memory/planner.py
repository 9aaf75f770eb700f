"""The planner: the estimator and the partitioner composed into the :class:`~betty_trainer.execution.plan.StepPlan`
of each batch (Betty §4.4.3).

``Planner.plan(batch)`` returns what to run: ``K`` micro-batches or ``K`` chunks per layer from the config, or,
with ``micro_batch.budget``, the fewest whose estimated peak fits the budget. The estimate is the closed form for a
built-in model and a recorded closed form, or a calibrated fit, for a custom one (:func:`make_planner`). This
module is the one home of plan composition: :func:`plan_micro_batches` (a fixed K, no estimate) and the planner both call
:func:`partition.make_split`, and only here does its ``BudgetError`` become the user-facing
:class:`~betty_trainer.errors.PlanningError`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from betty_trainer.config import Config, MicroBatchConfig
from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore, hands_out_rows
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError, PlanningError
from betty_trainer.execution.layerwise import LayerwisePlan
from betty_trainer.execution.micro_batches import MicroBatches, MicroBatchPlan
from betty_trainer.execution.plan import StepPlan, held_bytes
from betty_trainer.memory.budget import resolve_budget
from betty_trainer.memory.recorded import WeightedEstimates
from betty_trainer.memory.spec import model_spec
from betty_trainer.models import build_model
from betty_trainer.models.aggregate import keep_transposes
from betty_trainer.models.stack import runs_layer_by_layer
from betty_trainer.sampling.bulk import BulkDraw
from estimator.peaks import PeakEstimator
from estimator.recorder import RecordingRefused
from partition import BudgetError, GraphPartition, OutputSplitter, Split, make_split
from partition.chunks import search_chunks
from partition.partitioners import GRAPHS
from partition.search import Estimate, k_to_fit, refine_split

logger = logging.getLogger(__name__)


class Planner:
    """Plans each batch: its micro-batches or its layer-wise chunks (``micro_batch.mode``).

    Args:
        config: the ``micro_batch`` section.
        estimator: the :class:`~estimator.peaks.PeakEstimator` of the built-in model's closed form or of a custom
            model's recorded or calibrated estimate (see :func:`make_planner`), which the searches the planner calls
            are handed; or
            ``None`` for an uncalibrated custom model, and without an estimate only a fixed ``K`` is possible.
        device: where training runs (for ``budget: auto``).
        feature_store_bytes: device bytes the feature store holds between steps (its node cache and a
            staged macro-batch: the store's ``max_device_bytes``); the budget a step may use is
            ``micro_batch.budget`` minus these and the allocator's margin (``budget_terms``:
            :class:`~betty_trainer.memory.budget.BudgetTerms`).
        seed: the partitioner's seed (:func:`~betty_trainer.sampling.schedule.plan_seed`).
        layerwise_allowed: layer-wise plans may be made (``False`` for a custom model that cannot run layer by
            layer, or whose calibrated fit models micro-batches only); else ``mode`` is ``micro_batches``.
        graph_partition: the run's :class:`~partition.GraphPartition` (``micro_batch.assignment`` resolved to
            ``graph``: :func:`make_planner`), or ``None`` to partition each batch's outputs.
        bulk_draw: the run's sampler's :class:`~betty_trainer.sampling.bulk.BulkDraw` (``None``: one batch at a
            time on the graph's device): reported, and where the step trains on CUDA its ``device_bytes`` (sampling
            on the GPU) are taken off the budget as the feature store's are (sampling and training share the
            current CUDA device).
        recurring: the run trains on one batch every step (a full batch of full neighbourhoods:
            :func:`samples_batches` is false), so a plan of it in one micro-batch may keep its blocks' transposes.

    Assignment by the graph: with a ``graph_partition``, a batch's micro-batches are its outputs grouped by their
    nodes' parts in the graph's K-way partition (made once per K for the run); no REG and no METIS per batch. Without
    a budget K is ``num_micro_batches`` and nothing is counted or estimated per batch (the plan counts and estimates
    its micro-batches when asked: :attr:`MicroBatchPlan.estimate
    <betty_trainer.execution.micro_batches.MicroBatchPlan.estimate>`; the redundancy read after each step comes from
    the micro-batches the step built; ``micro_batch.mode=auto``, comparing two plans' work, counts them). Under a
    budget the micro-batches are counted and estimated: the first batch is planned per batch (the K search on its REG)
    and its K is the graph's; each later batch tries the graph's K, and where its largest estimate misses the budget,
    each micro-batch that missed is cut in two by a METIS bisection of its part of the graph
    (:meth:`GraphSplitter.halves <partition.partitioners.GraphSplitter.halves>`: made once per part and K, on the
    part's own edges; :func:`~partition.search.refine_split`), and the batch takes that split where it fits in no more
    micro-batches than the graph's K would grow to, ``⌈K · (largest − resident) / (budget − resident)⌉`` (a
    micro-batch's own bytes shrink about as 1/K), at least K + 1 (``refined`` counts those batches; the graph's K
    stays, as one K for every batch would need headroom for the worst); else the graph's K grows to that K and the
    batch tries it; where it misses again the batch is planned per batch instead (``fallbacks`` counts those batches)
    and the graph's K becomes the larger of that K and the per-batch search's. After :data:`GRAPH_K_SHRINK_AFTER`
    batches that fit at the graph's K, it drops to the largest K the same 1/K rule says they needed, where that is
    lower, never to a K that missed, nor to one whose batch was refined (each new K is one METIS of the whole graph,
    made once; every move is logged at INFO level). Where the peak falls much slower than 1/K (Amazon Computers' dense
    neighbourhoods: the micro-batches share most input rows) the rule asks for too few in both directions
    (``benchmarks/README.md`` › sampled_planning.py › Under a budget). ``graph_k`` is the K the next batch tries
    (``None`` before the first batch, and without a budget). Any assignment of the outputs gives the full batch's
    gradient (Betty §4.2.3); the estimate counts the micro-batches the assignment makes. Without a graph partition
    and without a budget, a batch split by its own partitioner is likewise not counted or estimated where the
    estimator has a closed form (the plan does that when asked); a calibrated custom model's estimates are made
    with the split, which is all that reports them.

    Layer-wise chunks by the graph: with a ``graph_partition`` and no budget (K chunks per layer, fixed), a layer's
    chunks are its dst nodes grouped by their nodes' parts in a K-way partition of the same graph that balances every
    node (most of a layer's dst nodes are no training nodes: :meth:`GraphPartition.of_all_nodes
    <partition.GraphPartition.of_all_nodes>`), made once for the run. Under a budget, and in a re-plan after an
    out-of-memory error, the chunk search tries counts the run has not partitioned (doubling, then bisecting per
    layer): each would be a METIS of the whole graph, so those chunks are cut per batch as before.

    Plan reuse: a batch whose structure equals the last planned batch's (same blocks:
    ``src_nodes``, ``indptr``, ``indices`` and ``edge_weight`` compared with
    ``torch.equal``), planned with the same ``min_pieces``, gets the last plan back without
    partitioning again (a plan keeps each micro-batch's outputs and slices it when it runs); a
    full-neighbourhood full batch is such a batch every epoch.
    With another ``min_pieces`` (re-planning after an out-of-memory error) the batch's REG is
    reused. ``plans_made`` and ``plans_reused`` count the two cases.

    Kept transposes (``micro_batch.keep_transposes``): a ``recurring`` batch planned in one micro-batch, with the
    built-in model's closed form on the CPU kernels, keeps the transpose of each block whose aggregation's backward
    multiplies by ``Aᵀ`` (:meth:`PeakEstimator.transposed_layers <estimator.peaks.PeakEstimator.transposed_layers>`;
    :func:`~betty_trainer.models.aggregate.keep_transposes`), made once for the run, when the estimate with them
    (:func:`~estimator.counts.kept_transpose_bytes`, counted in ``block_structure``) fits the budget: under
    ``auto`` only a budget's room pays for them, under ``true`` a run without a budget keeps them too. That backward
    then gathers instead of scattering (issue 23: ``benchmarks/README.md`` › aggregation.py › Kept transposes:
    0.67–1.15× DGL's aggregation time at width 64 on Amazon Computers over five runs, against 0.75–1.15× scattering; +2.0 MiB, +12%,
    on its K = 1 dropout-0 peak, for 3–12% of the K = 1 step). Any other plan of the batch takes them away.

    Raises:
        ConfigError: a budget with an uncalibrated custom model, ``auto`` on CPU, or an allocator margin and a
            feature store that take the whole budget.
    """

    def __init__(self, config: MicroBatchConfig, estimator: PeakEstimator | None, device: torch.device,
                 feature_store_bytes: int = 0, seed: int = 0, layerwise_allowed: bool = True,
                 graph_partition: GraphPartition | None = None, bulk_draw: BulkDraw | None = None,
                 recurring: bool = False):
        self.config = config
        self.recurring = recurring
        self.seed = seed
        self.feature_store_bytes = feature_store_bytes
        self.device = torch.device(device)
        self.layerwise_allowed = layerwise_allowed
        self.bulk_draw = bulk_draw
        on_this_device = bulk_draw is not None and self.device.type == "cuda"  # a CPU step's budget is host memory
        self.budget_terms = resolve_budget(config, device, feature_store_bytes,
                                           bulk_draw.device_bytes if on_this_device else 0)
        self.budget = self.budget_terms.step_bytes
        if self.budget is not None and estimator is None:
            raise ConfigError("micro_batch.budget needs a memory estimate of the custom model: calibrate it with "
                              "betty_trainer.memory.custom.calibrate_model (train() does), or set "
                              "micro_batch.num_micro_batches instead")
        self.estimator = estimator
        self.resident = estimator.resident_bytes if estimator is not None else 0
        self.plans_made = 0
        self.plans_reused = 0
        self.graph_partition = graph_partition
        self.fallbacks = 0
        self.refined = 0  # batches whose graph split's missed micro-batches were cut in two (GraphSplitter.halves)
        self.graph_k: int | None = None
        self._missed_k = 0  # the largest K whose graph split missed the budget: the graph's K stays above it
        self._needed_k, self._fitted = 0, 0  # since the graph's K last moved: the K its batches needed, how many
        self._last: _LastPlan | None = None
        self._splitter: OutputSplitter | None = None
        self._warned_fewer = self._warned_above = False  # said once: fewer pieces than asked; chunks above K = 1

    def report(self, plan: StepPlan, measured: list[int] | None = None) -> dict:
        """``plan.json``'s content: ``plan``'s report (:meth:`~betty_trainer.execution.plan.StepPlan.report`) and
        ``memory_terms``, every term of the budget (:meth:`BudgetTerms.report
        <betty_trainer.memory.budget.BudgetTerms.report>`) and what every estimate holds resident: ``parameters``,
        ``optimizer_state`` and ``device_workspace`` (bytes; 0 for a custom model, whose calibrated fit measured them);
        with a bulk sampler, ``sampling``: its draw (:meth:`BulkDraw.report
        <betty_trainer.sampling.bulk.BulkDraw.report>`: ``bulk``, ``bulk_memory``, ``batch_size``, ``draw_bytes``,
        ``structure_bytes``, ``device``, and ``device_bytes``, the budget's ``sampler_bytes``)."""
        return {**plan.report(measured), **self.memory_report()}

    def memory_report(self) -> dict:
        """:meth:`report`'s ``memory_terms`` and, with a bulk sampler, ``sampling``."""
        sampling = {} if self.bulk_draw is None else {"sampling": self.bulk_draw.report()}
        return {"memory_terms": self.memory_terms(), **sampling}

    def memory_terms(self) -> dict:
        """``plan.json``'s ``memory_terms`` (see :meth:`report`), bytes by term."""
        resident = self.estimator.state_bytes() if self.estimator is not None else {}
        terms = {name: resident.get(name, 0) for name in ("parameters", "optimizer_state", "device_workspace")}
        return {**self.budget_terms.report(), **terms}

    def plan(self, batch: Batch, min_pieces: int = 1) -> StepPlan:
        """What to run for ``batch``: its micro-batches, or its layer-wise chunks (``micro_batch.mode``); at least
        ``min_pieces`` micro-batches or chunks per layer (after an out-of-memory error).

        Each kind is one call down: :func:`partition.make_split` (the K search) or
        :func:`partition.chunks.search_chunks` (the chunk search), handed the estimator. ``auto`` plans both and
        keeps, among those that fit the budget, the one with less estimated work (multiply-adds from the model's
        widths, :func:`estimator.work.step_work`); without a budget it compares them at the configured K. Returns
        the last plan (the same object) when ``batch`` is structurally the last planned batch and ``min_pieces`` is
        the same (see the class docstring).

        Raises:
            PlanningError: no split fits the budget (with the numbers).
        """
        last = self._last
        same_batch = last is not None and same_structure(last.plan.batch, batch)
        if same_batch and last.min_pieces == min_pieces:
            self.plans_reused += 1
            return last.plan
        keep_transposes(batch.blocks, [False] * batch.num_layers)  # planned afresh: estimated without them
        mode = self.config.mode if self.layerwise_allowed else "micro_batches"
        candidates, errors, self._splitter = [], [], last.splitter if same_batch else None
        whole = self._whole_batch_estimate(batch)
        for kind in (("micro_batches", "layerwise") if mode == "auto" else (mode,)):
            try:
                candidates.append(self._search(kind, batch, min_pieces, whole))
            except BudgetError as error:
                errors.append(f"{kind}: {error}")
        if not candidates:
            raise PlanningError("; ".join(errors))
        asked = max(self.config.num_micro_batches, min_pieces)
        short = next((c for c in candidates if self.budget is None and c.pieces < asked), None)
        if short is not None and not self._warned_fewer:  # said once per planner, with the request and what runs
            self._warned_fewer = True
            limit, what, nodes = ((batch.output_nodes.numel(), "micro-batches", "output nodes")
                                  if short.method == "micro_batches" else
                                  (max(b.num_dst for b in batch.blocks), "chunks per layer", "dst nodes in its largest layer"))
            logger.warning("micro_batch.num_micro_batches asks for %d %s; %s%s made %d%s, so %d run", asked, what,
                           f"the batch has {limit} {nodes}, at most one per piece; " if asked > limit else "",
                           short.partitioner, short.pieces,
                           ("" if short.pieces >= min(asked, limit) else
                            f" (no {'output' if short.method == 'micro_batches' else 'dst node'} of the batch is in"
                            " some of the graph's parts)" if "graph" in short.partitioner else
                            f" (it left parts empty; micro_batch.partitioner=range or random give exactly min(K, {limit}))"),
                           short.pieces)
        # one candidate's work is not read (a micro-batch plan's is its split's sizes, counted when first read)
        chosen = min(candidates, key=lambda candidate: candidate.work) if len(candidates) > 1 else candidates[0]
        plan = self._keep_transposes(chosen)
        self.plans_made += 1
        self._last = _LastPlan(min_pieces, self._splitter, plan)
        if len(candidates) > 1:
            logger.info("micro_batch.mode=auto chose %s (estimated work %.3g vs %.3g)", plan.method,
                        plan.work, max(candidate.work for candidate in candidates))
        return plan

    def _keep_transposes(self, plan: StepPlan) -> StepPlan:
        """``plan``, whose batch's blocks keep their transposes where that pays (see the class docstring), its
        estimate then counting them; else ``plan`` as it is."""
        estimator, wanted = self.estimator, self.config.keep_transposes
        if not (self.recurring and plan.method == "micro_batches" and plan.pieces == 1 and estimator is not None
                and (wanted is True or (wanted == "auto" and self.budget is not None))):
            return plan
        blocks, weighted = plan.batch.blocks, edge_weighted(plan.batch)
        keep = estimator.transposed_layers(blocks, weighted)  # none without the closed form on the CPU kernels
        if not any(keep):
            return plan
        keep_transposes(blocks, keep)
        peak = estimator.peak(blocks, weighted=weighted)
        if self.budget is not None and peak > self.budget:
            keep_transposes(blocks, [False] * len(blocks))
            return plan
        kept = held_bytes(t for block in blocks if block.transpose is not None for t in block.transpose.tensors())
        logger.info("one micro-batch of a batch trained on every step: %d of its %d blocks keep their transpose "
                    "(%.1f MiB) for their aggregation's backward", sum(keep), len(blocks), kept / 2**20)
        split = plan.split  # its K = 1 estimates were made without them (its `tried` keeps what the search saw)
        split = replace(split, estimates=[peak] if split.estimates else [],
                        full_batch_estimate=peak if split.full_batch_estimate else 0)
        return replace(plan, split=split, kept_transpose_bytes=kept)

    def _whole_batch_estimate(self, batch: Batch) -> Callable[[], int]:
        """``() →`` the estimated peak of ``batch`` in one micro-batch, bytes (0 without an estimator), made when
        first asked and then kept: what the K search starts from and the chunk search's ceiling, so that
        ``micro_batch.mode=auto`` estimates it once for both."""
        estimator = self.estimator
        return functools.cache(lambda: estimator.peak(batch.blocks, weighted=edge_weighted(batch))
                               if estimator is not None else 0)

    def _search(self, kind: str, batch: Batch, min_pieces: int, whole: Callable[[], int]) -> StepPlan:
        """One candidate plan of ``kind``, in one call down: the K search (``micro_batches``; the outputs' splitter,
        its REG built once, is kept for the batch's re-plans) or the chunk search (``layerwise``), each handed the
        estimator's answer for this batch and ``whole``, the batch's estimate in one micro-batch
        (:meth:`_whole_batch_estimate`); ``num_micro_batches`` pieces without a budget.

        Raises:
            BudgetError: nothing of this kind fits the budget.
        """
        estimator, budget, config = self.estimator, self.budget, self.config
        closed_form = estimator is not None and estimator.closed_form
        if kind == "micro_batches":
            weighted = edge_weighted(batch)
            estimate = functools.partial(estimator.peak, weighted=weighted) if estimator is not None else None
            split, partitioner = self._graph_split(batch, estimate, min_pieces, whole) or (None, "")
            if split is None:
                if self._splitter is None:
                    self._splitter = OutputSplitter(batch.blocks[-1], config.partitioner)
                # a fixed K decides nothing by the estimates: a closed form estimates the plan when asked
                split, partitioner = make_split(
                    batch.blocks, None if budget is None and closed_form else estimate, budget=budget,
                    k=None if budget is not None else min(config.num_micro_batches, batch.output_nodes.numel()),
                    resident_bytes=self.resident, min_k=min_pieces, partitioner=config.partitioner, seed=self.seed,
                    balance=config.balance, splitter=self._splitter, full_batch_estimate=whole), config.partitioner
                if self.graph_partition is not None and budget is not None and (self.graph_k or 0) < split.k:
                    self._move_graph_k(split.k, "the per-batch search needed as many")  # the first batch's: the graph's
            itemise = functools.partial(estimator.itemised, weighted=weighted) if closed_form else None
            return MicroBatchPlan(batch, split, estimator.micro_batch_work if closed_form else None, partitioner,
                                  self.feature_store_bytes, itemise)
        layerwise = estimator.layerwise(batch.blocks) if closed_form else None
        # the whole batch in one micro-batch: less work, so no chunking above it
        ceiling = whole() if closed_form else None
        partitioner, splitters = config.partitioner, None
        if self.graph_partition is not None and budget is None and min_pieces <= 1:
            # K fixed: each layer's dst nodes by their node's part, one METIS for the run (a budget's search, or a
            # re-plan, tries chunk counts the run has not partitioned: per batch, as before)
            partitioner = GraphPartition.method
            splitters = [self.graph_partition.of_all_nodes().splitter(block.dst_nodes) for block in batch.blocks]
        search = search_chunks(batch.blocks, layerwise, budget=budget, k=config.num_micro_batches, min_k=min_pieces,
                               partitioner=partitioner, seed=self.seed, host_memory=self.device.type != "cpu",
                               ceiling=ceiling, splitters=splitters)
        if budget is None and ceiling is not None and search.peak > ceiling and not self._warned_above:
            self._warned_above = True  # said once per planner
            logger.warning("layer by layer in %d chunks per layer (micro_batch.num_micro_batches) is estimated at %.1f "
                           "MiB, above the whole batch in one micro-batch (%.1f MiB), which also needs less work; "
                           "ask for more chunks per layer, or set micro_batch.mode=micro_batches or a budget",
                           search.chunks.k, search.peak / 2**20, ceiling / 2**20)
        work = layerwise.work(search.chunks.layers) if layerwise is not None else float(search.chunks.work)
        return LayerwisePlan(batch, search.chunks, work, search.partitioners, search.peak, budget, search.tried,
                             search.seconds, self.feature_store_bytes)

    def _graph_split(self, batch: Batch, estimate: Estimate | None, min_pieces: int,
                     whole: Callable[[], int]) -> tuple[Split, str] | None:
        """``batch``'s outputs split by the run's graph partition (see the class docstring; ``whole``: the batch's
        estimate in one micro-batch, as :meth:`_search`'s) and what split them (:data:`GraphPartition.method
        <partition.GraphPartition.method>`, or :data:`REFINED_METHOD` for a split whose missed micro-batches were cut
        in two), or ``None``: no graph partition; under a budget, no K
        yet (the run's first batch), or a split whose largest estimate misses the budget at the graph's K, whose
        missed micro-batches, each cut in two by a bisection of its part, miss again or make more micro-batches
        than the K the miss asks for, and which misses again at that K (counted in ``fallbacks``; the next batches
        try the first miss's K, or the per-batch search's if more). A split refined so (counted in ``refined``)
        leaves the graph's K as it is."""
        if self.graph_partition is None or (self.budget is not None and self.graph_k is None):
            return None
        n = batch.output_nodes.numel()
        if self.budget is None:  # nothing is decided by the estimates: the plan estimates its micro-batches when asked
            k = min(max(self.config.num_micro_batches, min_pieces), n)
            return self._split_by_graph(batch, None, k, whole), GraphPartition.method
        k = self.graph_k
        for attempt in range(2):  # the graph's K, then once the K its miss asks for
            k = min(max(k, min_pieces), n)  # a re-plan's pieces, a batch of fewer outputs
            split = self._split_by_graph(batch, estimate, k, whole)
            largest = max(split.estimates)
            if largest <= self.budget:
                if k == self.graph_k:  # only the graph's own K tells whether a lower one would do
                    self._fits(k, largest)
                return split, GraphPartition.method
            self._missed_k = max(self._missed_k, k)
            if attempt or k >= n:  # planned per batch; the next batches try the K the first miss asked for
                break
            # a micro-batch's own bytes shrink about as 1/K (the K search's start, make_split): the K that brings
            # the largest under the budget, at least one more; the graph's K never drops on a miss
            asked = max(k + 1, k_to_fit(k, largest, self.resident, self.budget))
            if k + sum(peak > self.budget for peak in split.estimates) <= asked:  # a few missed: cut them in two
                refined = refine_split(split, estimate, self.budget, functools.partial(
                    self.graph_partition.splitter(batch.output_nodes).halves, k, self.seed))
                if refined.k <= asked and max(refined.estimates) <= self.budget:
                    self.refined += 1
                    return refined, REFINED_METHOD
            k = asked
            self._move_graph_k(max(k, self.graph_k), "its largest micro-batch missed the budget")
        self.fallbacks += 1
        return None

    def _split_by_graph(self, batch: Batch, estimate: Estimate | None, k: int, whole: Callable[[], int]) -> Split:
        return make_split(batch.blocks, estimate, k=k, resident_bytes=self.resident, partitioner=GraphPartition.method,
                          seed=self.seed, splitter=self.graph_partition.splitter(batch.output_nodes),
                          full_batch_estimate=whole)

    def _fits(self, k: int, largest: int) -> None:
        """A graph split at ``k`` fitted the budget with ``largest`` its largest estimate: after
        :data:`GRAPH_K_SHRINK_AFTER` batches at this K, the graph's K drops to the largest K that the 1/K model
        (:func:`~partition.k_to_fit`) says those batches needed, where that is lower, but never to a K at or below
        one that missed (each K is a METIS of the whole graph, made once)."""
        self._needed_k = max(self._needed_k, k_to_fit(k, largest, self.resident, self.budget))
        self._fitted += 1
        if self._fitted >= GRAPH_K_SHRINK_AFTER:
            lower = max(self._needed_k, self._missed_k + 1, 1)
            if lower < k:
                self._move_graph_k(lower, f"its last {self._fitted} batches are estimated to fit with fewer")
            self._needed_k, self._fitted = 0, 0

    def _move_graph_k(self, k: int, why: str) -> None:
        logger.info("the graph partition's K: %s → %d (%s)", self.graph_k, k, why)
        self.graph_k, self._needed_k, self._fitted = k, 0, 0


REFINED_METHOD = f"{GraphPartition.method}+halves"
"""What split a batch whose graph split's missed micro-batches were cut in two (:meth:`Planner._graph_split`), as
its plan's ``partitioner`` (``plan.json``, ``betty-train plan``) says: the graph's K-way partition, then a METIS
bisection of some of its parts (:meth:`GraphSplitter.halves <partition.partitioners.GraphSplitter.halves>`)."""

GRAPH_K_SHRINK_AFTER = 8
"""Batches a graph split must fit the budget at one K before the planner tries the graph's K lower
(:meth:`Planner._fits`)."""


@dataclass
class _LastPlan:
    min_pieces: int
    splitter: OutputSplitter | None
    plan: StepPlan


def edge_weighted(batch: Batch) -> list[bool]:
    """Per block of ``batch`` (input layer first), whether it carries edge weights: what the estimate is told of
    the batch's counted sizes and layer slices, which carry none (:func:`estimator.counts.counts_of`)."""
    return [block.edge_weight is not None for block in batch.blocks]


def same_structure(one: Batch, other: Batch) -> bool:
    """Whether two batches have equal blocks: ``num_dst``, ``src_nodes``, ``indptr``, ``indices`` and
    ``edge_weight`` equal element by element (``torch.equal``; cost linear in the batch, ~1 ms per
    million edges on a CPU). Tensors that are the same object are not compared."""
    if one is other:
        return True
    if len(one.blocks) != len(other.blocks):
        return False
    for a, b in zip(one.blocks, other.blocks):
        if a.num_dst != b.num_dst or (a.edge_weight is None) != (b.edge_weight is None):
            return False
        pairs = [(a.src_nodes, b.src_nodes), (a.indptr, b.indptr), (a.indices, b.indices)]
        if a.edge_weight is not None:
            pairs.append((a.edge_weight, b.edge_weight))
        for x, y in pairs:
            if x is not y and (x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or not torch.equal(x, y)):
                return False
    return True


def plan_micro_batches(batch: Batch, num_micro_batches: int, partitioner: str, seed: int,
                       balance: bool = True) -> list[Batch]:
    """Split ``batch`` into ``num_micro_batches`` micro-batches with ``partitioner`` (no budget,
    no estimate; Betty §4.3).

    ``K`` is capped at the number of output nodes (a mini-batch smaller than ``K``).

    Raises:
        ValueError: an unknown partitioner.
    """
    split = make_split(batch.blocks, k=min(num_micro_batches, batch.output_nodes.numel()),
                       partitioner=partitioner, seed=seed, balance=balance)
    return list(MicroBatches(batch, split.groups))


def make_planner(config: Config, graph: Graph, model: nn.Module | None, device: torch.device,
                 features: FeatureStore, seed: int = 0, partition: GraphPartition | None = None,
                 bulk_draw: BulkDraw | None = None) -> Planner:
    """The planner of a training run on ``graph`` whose input rows come from ``features``: the budget a step
    may use is ``micro_batch.budget`` less the store's ``max_device_bytes`` (its node cache and staged
    macro-batch; :class:`~betty_trainer.data.feature_store.FeatureStore`) and what the sampler's ``bulk_draw``
    holds on the GPU (:class:`Planner`). The estimate is the closed form for the built-in model
    (``model=None``), its terms recorded from its code (on a torch the recorder is not tested with, the built-in
    model is estimated as a custom one, with a warning); a custom ``model`` with ``micro_batch.budget`` set is
    recorded first, once per pattern of edge-weighted blocks (:class:`~betty_trainer.memory.recorded.
    WeightedEstimates`: exact), or where the recorder refuses it (the reason is logged) calibrated on micro-batches
    weighted alike (:func:`~betty_trainer.memory.custom.calibrate_model`), both with the run's optimizer and
    ``config.model.num_layers`` layers; the time it took is logged at INFO level. ``seed``: the partitioner's
    (:func:`~betty_trainer.sampling.schedule.plan_seed`). ``partition``: another planner's
    :attr:`Planner.graph_partition` of the same run, shared so that its METIS cuts are made once; by default
    :func:`graph_partition`.

    Raises:
        ConfigError: see :class:`Planner`.
        CalibrationError: the recorder refused the custom model and it cannot be calibrated (the message names
            the cause).
    """
    mode, budget = config.micro_batch.mode, config.micro_batch.budget
    spec, refused = None, None
    if model is None:
        try:
            spec = model_spec(config, graph, device)
        except RecordingRefused as refusal:  # a torch the recorder is not tested with: estimated as a custom model
            refused = f"the memory recorder refused the built-in {config.model.arch} model ({refusal})"
            logger.warning("%s; it is estimated as a custom model", refused)
            model = build_model(config.model, graph)
    # the aggregation cache's layer 0 runs inside micro-batches only (auto then plans micro-batches)
    layer_by_layer = (model is None or runs_layer_by_layer(model)) and config.features.aggregation_cache is False
    if not layer_by_layer and mode == "layerwise":
        raise ConfigError(f"micro_batch.mode=layerwise: {type(model).__name__} cannot run layer by layer (it needs a "
                          "LayerStack whose forward is the stack's own); use micro_batch.mode=micro_batches")
    if model is not None and budget is not None:
        if mode == "layerwise":
            raise ConfigError(f"micro_batch.mode=layerwise under a budget needs a built-in model's estimate"
                              f"{f', and {refused}' if refused else ''}; use micro_batch.mode=micro_batches"
                              f"{'' if refused else ' for a custom model'}")
        resolve_budget(config.micro_batch, device)  # a budget that cannot be used fails before calibrating
    estimator = None  # a fixed K needs no estimate
    if spec is not None:  # the closed form, for every kind of plan; input rows read in place where the store hands them out
        estimator = PeakEstimator(replace(spec, features_in_place=hands_out_rows(features, device)))
    elif budget is not None:  # recorded, or where the recorder refuses calibrated: micro-batches, not chunks
        estimator, layer_by_layer = PeakEstimator(_custom_estimate(config, graph, model, device)), False
    return Planner(config.micro_batch, estimator, device, features.max_device_bytes, seed, layer_by_layer,
                   partition or graph_partition(config, graph), bulk_draw, not samples_batches(config, graph))


def graph_partition(config: Config, graph: Graph) -> GraphPartition | None:
    """The run's :class:`~partition.GraphPartition` of ``graph``, balancing its training nodes, where
    ``micro_batch.assignment`` is ``graph``, or ``auto`` with a METIS-based ``micro_batch.partitioner`` for sampled
    batches (``sampling.batch_size`` below the training nodes, or a fanout that samples); else ``None``. Nothing
    is partitioned until a batch asks."""
    section = config.micro_batch
    sampled = samples_batches(config, graph)
    if section.assignment == "batch" or (section.assignment == "auto" and not (sampled and section.partitioner in GRAPHS)):
        return None
    balanced = torch.zeros(graph.num_nodes, dtype=torch.bool)
    balanced[graph.train_idx] = True
    return GraphPartition(graph.indptr, graph.indices, balanced)


def samples_batches(config: Config, graph: Graph) -> bool:
    """Whether the run's batches are sampled (``sampling.batch_size`` below the training nodes, or a fanout that
    samples); else it trains on one full batch of full neighbourhoods every step."""
    sampling = config.sampling
    return ((sampling.batch_size is not None and sampling.batch_size < graph.train_idx.numel())
            or any(fanout != -1 for fanout in sampling.fanouts or []))


def _custom_estimate(config: Config, graph: Graph, model: nn.Module, device: torch.device) -> WeightedEstimates:
    """:func:`make_planner`'s estimate of a custom model (:class:`~betty_trainer.memory.recorded.WeightedEstimates`:
    recorded, or where the recorder refuses it, the reason logged, calibrated), with the time it took logged at
    INFO level.

    Raises:
        CalibrationError: see :func:`make_planner`.
    """
    started, name = time.perf_counter(), type(model).__name__
    estimate = WeightedEstimates(model, graph, config.model.num_layers, config.optim.make_optimizer, device)
    unweighted = estimate.unweighted
    if estimate.recorded:
        logger.info("recorded the memory estimate of %s in %.2f s (%d allocations per step)", name,
                    time.perf_counter() - started, unweighted.allocations)
    else:
        logger.info("calibrated the memory estimate of %s in %.2f s (largest error on the calibration samples %.1f%%)",
                    name, time.perf_counter() - started, 100 * unweighted.max_relative_error)
    return estimate
