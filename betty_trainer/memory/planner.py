"""The planner: the estimator and the partitioner composed into the :class:`~betty_trainer.execution.plan.StepPlan`
of each batch (Betty §4.4.3).

``Planner.plan(batch)`` returns what to run: ``K`` micro-batches or ``K`` chunks per layer from the config, or,
with ``micro_batch.budget``, the fewest whose estimated peak fits the budget. The estimate is the closed form for a
built-in model and a calibrated fit for a custom one (:func:`make_planner`). This module is the one home of plan
composition: :func:`plan_micro_batches` (a fixed K, no estimate) and the planner both call
:func:`partition.make_split`, and only here does its ``BudgetError`` become the user-facing
:class:`~betty_trainer.errors.PlanningError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from betty_trainer.config import Config, MicroBatchConfig
from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError, PlanningError
from betty_trainer.execution.layerwise import LayerwisePlan, projected_terms
from betty_trainer.execution.micro_batches import MicroBatchPlan
from betty_trainer.execution.plan import StepPlan
from betty_trainer.memory.budget import resolve_budget
from betty_trainer.memory.custom import calibrate_model
from betty_trainer.memory.spec import model_spec
from betty_trainer.memory.work import step_work
from betty_trainer.models.stack import LayerStack, runs_layer_by_layer
from estimator.calibrate import CalibratedModel
from estimator.counts import LayerCounts, counts_of
from estimator.estimate import MemoryEstimate, estimate_micro_batch, model_state_bytes
from estimator.layerwise import estimate_layerwise, layerwise_floor
from estimator.spec import ModelSpec
from partition import BudgetError, OutputSplitter, make_split
from partition.chunks import LayerChunks, chunk_layers
from partition.slicing import BlockStructure, slice_layers

logger = logging.getLogger(__name__)


class Planner:
    """Plans each batch: its micro-batches or its layer-wise chunks (``micro_batch.mode``).

    Args:
        config: the ``micro_batch`` section.
        spec: the built-in model for the closed-form estimator, a custom model's
            :class:`~estimator.calibrate.CalibratedModel` (see :func:`make_planner`), or
            ``None`` for an uncalibrated custom model; without an estimate only a fixed
            ``K`` is possible.
        device: where training runs (for ``budget: auto``).
        seed: the partitioner's seed (:func:`~betty_trainer.sampling.schedule.plan_seed`).
        feature_store_bytes: device bytes the feature store holds between steps (its node cache and a
            staged macro-batch: the store's ``max_device_bytes``); the budget a step may use is
            ``micro_batch.budget`` minus these and the allocator's margin (``budget_terms``:
            :class:`~betty_trainer.memory.budget.BudgetTerms`).

    Plan reuse: a batch whose structure equals the last planned batch's (same blocks:
    ``src_nodes``, ``indptr``, ``indices`` and ``edge_weight`` compared with
    ``torch.equal``), planned with the same ``min_pieces``, gets the last plan back without
    partitioning or slicing again; a full-neighbourhood full batch is such a batch every epoch.
    With another ``min_pieces`` (re-planning after an out-of-memory error) the batch's REG is
    reused. ``plans_made`` and ``plans_reused`` count the two cases.

    Raises:
        ConfigError: a budget with an uncalibrated custom model, ``auto`` on CPU, or an allocator margin and a
            feature store that take the whole budget.
    """

    def __init__(self, config: MicroBatchConfig, spec: ModelSpec | CalibratedModel | None, device: torch.device,
                 feature_store_bytes: int = 0, seed: int = 0):
        self.config = config
        self.seed = seed
        self.spec = spec if isinstance(spec, ModelSpec) else None
        self.calibrated = spec if isinstance(spec, CalibratedModel) else None
        self.feature_store_bytes = feature_store_bytes
        self.device = torch.device(device)
        self.budget_terms = resolve_budget(config, device, feature_store_bytes)
        self.budget = self.budget_terms.step_bytes
        if self.budget is not None and spec is None:
            raise ConfigError("micro_batch.budget needs a memory estimate of the custom model: calibrate it with "
                              "betty_trainer.memory.custom.calibrate_model (train() does), or set "
                              "micro_batch.num_micro_batches instead")
        if self.spec is not None:
            self.resident = sum(model_state_bytes(self.spec).values())
        else:
            self.resident = self.calibrated.resident_bytes if self.calibrated is not None else 0
        self.plans_made = 0
        self.plans_reused = 0
        self.layerwise_allowed = True  # make_planner: False for a custom model that cannot run layer by layer
        self._last: _LastPlan | None = None
        self._splitter: OutputSplitter | None = None
        self._warned_fewer = False  # fewer micro-batches or chunks than asked: said once

    def report(self, plan: StepPlan, measured: list[int] | None = None) -> dict:
        """``plan.json``'s content: ``plan``'s report (:meth:`~betty_trainer.execution.plan.StepPlan.report`) and
        ``memory_terms``, every term of the budget (:meth:`BudgetTerms.report
        <betty_trainer.memory.budget.BudgetTerms.report>`) and what every estimate holds resident: ``parameters``,
        ``optimizer_state`` and ``device_workspace`` (bytes; 0 for a custom model, whose calibrated fit measured them)."""
        resident = model_state_bytes(self.spec) if self.spec is not None else {}
        terms = {name: resident.get(name, 0) for name in ("parameters", "optimizer_state", "device_workspace")}
        return {**plan.report(measured), "memory_terms": {**self.budget_terms.report(), **terms}}

    def estimate(self, structures: Sequence[BlockStructure], accumulate: bool = False,
                 weighted: Sequence[bool] | None = None) -> MemoryEstimate:
        """Itemised estimate of one micro-batch's training step (built-in models: the closed form);
        ``accumulate``: an earlier micro-batch of the batch ran before it; ``weighted``: per layer,
        whether the blocks carry edge weights (read from blocks when ``None``; see
        :func:`~estimator.counts.counts_of`)."""
        return estimate_micro_batch(counts_of(structures, weighted), self.spec, accumulate)

    def peak_bytes(self, structures: Sequence[BlockStructure], accumulate: bool = False,
                   weighted: Sequence[bool] | None = None) -> int:
        """Estimated peak bytes of one micro-batch's training step: closed form, or the calibrated
        fit (of accumulating steps, less the measured saving of a batch's first micro-batch)."""
        if self.calibrated is not None:
            return self.calibrated.estimate(counts_of(structures, weighted), accumulate)
        return self.estimate(structures, accumulate, weighted).peak_bytes

    def plan(self, batch: Batch, min_pieces: int = 1) -> StepPlan:
        """What to run for ``batch``: its micro-batches, or its layer-wise chunks (``micro_batch.mode``); at least
        ``min_pieces`` micro-batches or chunks per layer (after an out-of-memory error).

        ``auto`` plans both and keeps, among those that fit the budget, the one with less estimated
        work (multiply-adds from the model's widths, :func:`~betty_trainer.memory.work.step_work`); without a budget
        it compares them at the configured K. Returns the last plan (the same object) when ``batch`` is structurally
        the last planned batch and ``min_pieces`` is the same (see the class docstring).

        Raises:
            PlanningError: no split fits the budget (with the numbers).
        """
        last = self._last
        same_batch = last is not None and same_structure(last.plan.batch, batch)
        if same_batch and last.min_pieces == min_pieces:
            self.plans_reused += 1
            return last.plan
        mode = self.config.mode if self.layerwise_allowed else "micro_batches"
        candidates, errors, self._splitter = [], [], None
        for kind in (("micro_batches", "layerwise") if mode == "auto" else (mode,)):
            try:
                candidates.append(self._plan_micro_batches(batch, min_pieces, last if same_batch else None)
                                  if kind == "micro_batches" else self._plan_layerwise(batch, min_pieces))
            except PlanningError as error:
                errors.append(f"{kind}: {error}")
        if not candidates:
            raise PlanningError("; ".join(errors))
        plan = min(candidates, key=lambda candidate: candidate.work)
        self.plans_made += 1
        self._last = _LastPlan(min_pieces, self._splitter, plan)
        if len(candidates) > 1:
            logger.info("micro_batch.mode=auto chose %s (estimated work %.3g vs %.3g)", plan.method,
                        plan.work, max(candidate.work for candidate in candidates))
        return plan

    def _plan_micro_batches(self, batch: Batch, min_pieces: int, last: _LastPlan | None) -> MicroBatchPlan:
        splitter = last.splitter if last is not None and last.splitter is not None else OutputSplitter(
            batch.blocks[-1], self.config.partitioner)
        weighted = [block.edge_weight is not None for block in batch.blocks]  # the slices planned carry none
        estimate = None if self.spec is None and self.calibrated is None else (
            lambda structures, accumulate: self.peak_bytes(structures, accumulate, weighted))
        fixed_k = None if self.budget is not None else min(self.config.num_micro_batches, batch.output_nodes.numel())
        try:
            split = make_split(
                batch.blocks, estimate, budget=self.budget, k=fixed_k, resident_bytes=self.resident,
                min_k=min_pieces, partitioner=self.config.partitioner, seed=self.seed, balance=self.config.balance,
                splitter=splitter,
            )
        except BudgetError as error:
            raise PlanningError(str(error)) from None
        if fixed_k is not None:
            self._warn_fewer(max(self.config.num_micro_batches, min_pieces), split.k, "micro-batches",
                             batch.output_nodes.numel(), "output nodes")
        self._splitter = splitter
        work = (float(split.work) if self.spec is None else
                step_work(self.spec, [list(layer) for layer in zip(*split.layers)], False))
        return MicroBatchPlan(batch, split, work, self.config.partitioner, self.feature_store_bytes,
                              self.estimate if self.spec is not None else None)

    def _warn_fewer(self, asked: int, made: int, what: str, limit: int, nodes: str) -> None:
        """Say once per planner, with the request and what runs, when a fixed K gave fewer ``what`` than asked:
        more than the ``limit`` ``nodes`` that can each be one, or parts the partitioner left empty."""
        if made >= asked or self._warned_fewer:
            return
        self._warned_fewer = True
        cause = f"the batch has {limit} {nodes}, at most one per piece; " if asked > limit else ""
        empty = (f" (it left parts empty; micro_batch.partitioner=range or random give exactly min(K, {limit}))"
                 if made < min(asked, limit) else "")
        logger.warning("micro_batch.num_micro_batches asks for %d %s; %s%s made %d%s, so %d run",
                       asked, what, cause, self.config.partitioner, made, empty, made)

    def layerwise_peak(self, batch: Batch, chunks: LayerChunks, host_outputs: bool | None = None,
                       layers: Sequence[LayerCounts] | None = None) -> int:
        """Estimated peak bytes of running ``batch`` layer by layer in ``chunks`` (built-in models), on the
        device: with the hidden layers' outputs kept there, or in host memory (``host_outputs``; default:
        as ``chunks.host_outputs`` says). ``layers``: the batch's ``counts_of(batch.blocks)`` when the caller
        has them (a search estimates many chunkings of one batch)."""
        if host_outputs is None:
            host_outputs = chunks.host_outputs
        layers = counts_of(batch.blocks) if layers is None else layers
        pieces = [counts_of(layer, [counts.weighted] * len(layer)) for layer, counts in zip(chunks.layers, layers)]
        return estimate_layerwise(layers, pieces, self.spec, self._projections(), host_outputs).peak_bytes

    def layerwise_floor(self, batch: Batch, layers: Sequence[LayerCounts] | None = None) -> int:
        """Bytes below which no number of chunks per layer runs ``batch`` layer by layer
        (:func:`estimator.layerwise.layerwise_floor`, from each block's dst node of largest in-degree, whose
        in-edges no chunking splits); on a GPU the lower of ``h_l`` on the device and in host memory.
        ``layers``: as :meth:`layerwise_peak`'s."""
        layers, largest = counts_of(batch.blocks) if layers is None else layers, []
        for block, counts in zip(batch.blocks, layers):
            node = block.in_degrees().argmax().reshape(1)
            largest.append(counts_of(slice_layers([block], node), [counts.weighted])[0])
        kept = (False, True) if self.device.type != "cpu" and len(batch.blocks) > 1 else (False,)
        return min(layerwise_floor(layers, largest, self.spec, self._projections(), host) for host in kept)

    def _projections(self) -> list | None:
        """Per layer, the built-in model's projected-layer terms (``execution.layerwise.projected_terms``: a layer
        projected once per pass, else ``None``); ``None`` when the spec's terms are not a ``LayerStack``'s."""
        model = getattr(self.spec.layer_terms, "__self__", None)  # the instance whose terms the spec holds
        return projected_terms(model) if isinstance(model, LayerStack) else None

    def _plan_layerwise(self, batch: Batch, min_pieces: int) -> LayerwisePlan:
        """``num_micro_batches`` chunks per layer, or under a budget the fewest that fit: doubling
        from ``min_pieces`` to the first K that fits, then bisecting below it. A budget below :meth:`layerwise_floor`
        is refused before any chunking. Above it the doubling goes on (the peak falls unevenly as the chunk
        boundaries move around the hub nodes, whose chunks hold the most src rows) until doubling the request
        gives the partitioner's split no more chunks (REG and METIS stop short of one node per chunk) or every
        dst node would be its own chunk; then one dst node per chunk (``range`` at the largest layer's dst
        count, whose estimate is the floor plus 8 bytes per chunk past each layer's first) is tried, so a budget
        at least that is never refused. A K fits with the hidden layers' outputs ``h_l`` on the device or,
        when those do not fit, with ``h_l`` in host memory
        (``LayerChunks.host_outputs``; a step then copies each chunk's rows of ``h_{l−1}`` to the device). On
        the CPU host memory is the device's own, so ``h_l`` stays where it is."""
        started, tried = time.perf_counter(), []
        most = max(block.num_dst for block in batch.blocks)
        layers = counts_of(batch.blocks)  # estimated against every chunking tried
        partitioner = self.config.partitioner

        def attempt(k: int) -> tuple[LayerChunks, int]:
            chunks = chunk_layers(batch.blocks, k, partitioner, self.seed)
            peak = self.layerwise_peak(batch, chunks, False, layers) if self.spec is not None else 0
            if (self.budget is not None and peak > self.budget and len(batch.blocks) > 1
                    and self.device.type != "cpu"):  # on the CPU, host memory is the device's memory
                on_host = self.layerwise_peak(batch, chunks, True, layers)
                if on_host <= self.budget:
                    chunks.host_outputs, peak = True, on_host
                else:  # neither fits: the lower peak is what more chunks can still improve on (the floor check)
                    peak = min(peak, on_host)
            tried.append((chunks.k, peak))
            return chunks, peak

        if self.budget is None:
            chosen, peak = attempt(max(min_pieces, self.config.num_micro_batches))
            self._warn_fewer(max(min_pieces, self.config.num_micro_batches), chosen.k, "chunks per layer", most,
                             "dst nodes in its largest layer")
        else:
            if self.spec is None:
                raise PlanningError("a layer-wise plan under a budget needs a built-in model's estimate")
            floor = self.layerwise_floor(batch, layers)
            if floor > self.budget:
                raise PlanningError(
                    f"memory budget {self.budget} bytes is impossible layer by layer: at any number of chunks per "
                    f"layer a step needs at least {floor} bytes (the model state, the batch's structure, the whole "
                    "layers a backward holds at once and the in-edges of the node of largest in-degree); raise the budget")
            below, k = max(min_pieces, 1) - 1, max(min_pieces, 1)
            chosen, peak = attempt(k)
            saturated = False  # the last doubling of the request gave no more chunks
            while peak > self.budget:
                if k >= most or saturated:  # no more, smaller chunks from this partitioner
                    partitioner, below, k = "range", most, most
                    chosen, peak = attempt(most)  # one dst node per chunk
                    if peak > self.budget:
                        least_k, least = min(tried, key=lambda entry: entry[1])
                        raise PlanningError(
                            f"memory budget {self.budget} bytes is impossible layer by layer: the least any chunking "
                            f"tried needs is {least} bytes ({least_k} chunks per layer), above the floor of {floor} "
                            "bytes that no chunking goes below; raise the budget")
                    break
                below, k, made = k, min(2 * k, most), chosen.k
                chosen, peak = attempt(k)
                saturated = chosen.k <= made
            while k - below > 1:
                middle = (below + k) // 2
                candidate, middle_peak = attempt(middle)
                if middle_peak <= self.budget:
                    chosen, peak, k = candidate, middle_peak, middle
                else:
                    below = middle
        if self.spec is None:
            work = float(chosen.work)
        else:
            projections = self._projections() or [None] * len(batch.blocks)
            rows = [block.num_src if terms is not None else None for block, terms in zip(batch.blocks, projections)]
            work = step_work(self.spec, chosen.layers, True, rows)
        return LayerwisePlan(batch, chosen, work, partitioner, peak, self.budget, tried, time.perf_counter() - started,
                             self.feature_store_bytes)


@dataclass
class _LastPlan:
    min_pieces: int
    splitter: OutputSplitter | None
    plan: StepPlan


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
    return [batch.restrict(layers) for layers in split.layers]


def make_planner(config: Config, graph: Graph, model: nn.Module | None, device: torch.device,
                 features: FeatureStore, seed: int = 0) -> Planner:
    """The planner of a training run on ``graph`` whose input rows come from ``features``: the budget a step
    may use is ``micro_batch.budget`` less the store's ``max_device_bytes`` (its node cache and staged
    macro-batch; :class:`~betty_trainer.data.feature_store.FeatureStore`). The estimate is the closed form for the built-in model
    (``model=None``); a custom ``model`` with ``micro_batch.budget`` set is calibrated first,
    once (:func:`~betty_trainer.memory.custom.calibrate_model` with the run's Adam settings and
    ``config.model.num_layers`` layers), and the time it took is logged at INFO level. ``seed``: the
    partitioner's (:func:`~betty_trainer.sampling.schedule.plan_seed`).

    Raises:
        ConfigError: see :class:`Planner`.
        CalibrationError: the custom model cannot be calibrated (the message names the cause).
    """
    reserved = features.max_device_bytes
    if model is None:
        return Planner(config.micro_batch, model_spec(config, graph, device), device, reserved, seed)
    if config.micro_batch.mode == "layerwise" and not runs_layer_by_layer(model):
        raise ConfigError(f"micro_batch.mode=layerwise: {type(model).__name__} cannot run layer by layer (it needs a "
                          "LayerStack whose forward is the stack's own); use micro_batch.mode=micro_batches")
    if config.micro_batch.budget is None:
        planner = Planner(config.micro_batch, None, device, reserved, seed)
        planner.layerwise_allowed = runs_layer_by_layer(model)
        return planner
    if config.micro_batch.mode == "layerwise":
        raise ConfigError("micro_batch.mode=layerwise under a budget needs a built-in model's estimate; "
                          "use micro_batch.mode=micro_batches for a custom model")
    resolve_budget(config.micro_batch, device)  # a budget that cannot be used fails before calibrating
    started = time.perf_counter()
    calibrated = calibrate_model(model, graph, config.model.num_layers, config.optim.make_optimizer, device)
    logger.info("calibrated the memory estimate of %s in %.2f s (largest error on the calibration samples %.1f%%)",
                type(model).__name__, time.perf_counter() - started, 100 * calibrated.max_relative_error)
    planner = Planner(config.micro_batch, calibrated, device, reserved, seed)
    planner.layerwise_allowed = False  # a calibrated fit models micro-batches, not layer-wise chunks
    return planner
