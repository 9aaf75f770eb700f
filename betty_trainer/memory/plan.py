"""Micro-batch planning for training: the estimator and the partitioner composed (Betty §4.4.3).

``MicroBatchPlanner.plan(batch)`` returns the micro-batches to run: ``K`` from the
config, or, with ``micro_batch.budget``, the smallest ``K`` whose largest estimated
micro-batch fits the budget. The estimate is the closed form for a built-in model and
a calibrated fit for a custom one (:func:`make_planner`). This module is the one home of
plan composition: :func:`plan_micro_batches` (a fixed K, no estimate) and the planner
both call :func:`partition.make_plan`, and only here does its ``BudgetError`` become the
user-facing :class:`~betty_trainer.errors.PlanningError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from betty_trainer.config import Config, MicroBatchConfig
from betty_trainer.data.block import Batch
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError, PlanningError
from betty_trainer.memory.custom import calibrate_model
from betty_trainer.models import GAT, GCN, GraphSAGE, build_model
from betty_trainer.models.stack import LayerStack, runs_layer_by_layer
from betty_trainer.rng import compiled_kernels
from betty_trainer.sampling.schedule import feature_store_device_bytes
from betty_trainer.training.layerwise import LayerwiseBatch, projected_terms
from betty_trainer.training.step import MicroBatches
from estimator.calibrate import CalibratedModel
from estimator.counts import LayerCounts, counts_of
from estimator.estimate import MemoryEstimate, estimate_micro_batch, model_state_bytes
from estimator.layerwise import estimate_layerwise, layerwise_floor
from estimator.spec import ModelSpec, adam_uses_foreach
from partition import BudgetError, OutputSplitter, Plan, make_plan, redundancy
from partition.chunks import Chunk, LayerChunks, chunk_layers
from partition.slicing import BlockStructure, LayerSlice, slice_layers

logger = logging.getLogger(__name__)
MASK_COST = 4  # multiply-adds one input element's gather and node-keyed dropout mask cost (hash, compare, scale)


def model_spec(config: Config, graph: Graph, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of the built-in model ``config.model`` on ``graph`` (built on the meta
    device, so no memory is used; see :func:`spec_of`)."""
    with torch.device("meta"):
        model = build_model(config.model, graph)
    return spec_of(model, config, device)


def spec_of(model: nn.Module, config: Config, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of a built-in model **instance** trained on ``device`` as
    :func:`~betty_trainer.training.trainer.train` trains it: its kind, widths, aggregator, heads, dropout,
    parameter tensors (in ``model.parameters()`` order) and buffers read off the instance; Adam with
    ``config.optim.weight_decay`` on the foreach or single-tensor path PyTorch picks for the device;
    the kernels dropout and aggregation use there; and the model's own memory terms (each layer's
    ``memory_terms`` beside its ``forward``), which the estimate replays.

    Raises:
        PlanningError: ``model`` is not a built-in model (custom models are calibrated instead).
    """
    arch = {GraphSAGE: "sage", GCN: "gcn", GAT: "gat"}.get(type(model))
    if arch is None:
        raise PlanningError(f"{type(model).__name__} has no closed-form memory estimate; custom models are calibrated")
    first = model.layers[0]
    parameter = next(model.parameters())
    return ModelSpec(
        arch, model.widths,
        aggregator=getattr(first, "aggregator", "mean"), heads=getattr(first, "heads", 1), dropout=model.dropout.p,
        dtype_bytes=parameter.element_size(), optimizer="adam",
        parameter_numels=tuple(tuple(p.numel() for p in layer.parameters()) for layer in model.layers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        weight_decay=config.optim.weight_decay != 0, foreach=adam_uses_foreach(device),
        compiled_kernels=compiled_kernels(device, parameter.dtype), forward_terms=model.memory_terms,
        layer_terms=model.layer_memory_terms)


def resolve_budget(config: MicroBatchConfig, device: torch.device) -> int | None:
    """The budget in bytes: as configured, or for ``auto`` the GPU's free memory (NVML) minus
    ``safety_margin``; ``None`` without a budget.

    Raises:
        ConfigError: ``auto`` without a CUDA device, or a margin that leaves nothing.
    """
    if config.budget != "auto":
        return config.budget
    if device.type != "cuda":
        raise ConfigError("micro_batch.budget=auto reads free GPU memory and needs a CUDA device; "
                          "on CPU give a size, e.g. micro_batch.budget=4GiB")
    import pynvml

    pynvml.nvmlInit()
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free
    finally:
        pynvml.nvmlShutdown()
    if free <= config.safety_margin:
        raise ConfigError(f"the GPU has {free} bytes free, not more than micro_batch.safety_margin "
                          f"({config.safety_margin}); lower the margin or free GPU memory")
    return free - config.safety_margin


class MicroBatchPlanner:
    """Plans the micro-batches of each batch.

    Args:
        config: the ``micro_batch`` section.
        spec: the built-in model for the closed-form estimator, a custom model's
            :class:`~estimator.calibrate.CalibratedModel` (see :func:`make_planner`), or
            ``None`` for an uncalibrated custom model; without an estimate only a fixed
            ``K`` is possible.
        device: where training runs (for ``budget: auto``).
        feature_store_bytes: device bytes the feature store holds between steps (its node cache and a
            staged macro-batch: :func:`~betty_trainer.sampling.schedule.feature_store_device_bytes`);
            the budget a step may use is ``micro_batch.budget`` minus these.

    Plan reuse: a batch whose structure equals the last planned batch's (same blocks:
    ``src_nodes``, ``indptr``, ``indices`` and ``edge_weight`` compared with
    ``torch.equal``), planned with the same ``seed`` and ``min_k``, gets the last plan
    and micro-batches back without partitioning or slicing again; a full-neighbourhood
    full batch is such a batch every epoch. With another ``min_k`` (re-planning after an
    out-of-memory error) the batch's REG is reused. ``plans_made`` and ``plans_reused``
    count the two cases.

    Raises:
        ConfigError: a budget with an uncalibrated custom model, ``auto`` on CPU, or a feature store that
            takes the whole budget.
    """

    def __init__(self, config: MicroBatchConfig, spec: ModelSpec | CalibratedModel | None, device: torch.device,
                 feature_store_bytes: int = 0):
        self.config = config
        self.spec = spec if isinstance(spec, ModelSpec) else None
        self.calibrated = spec if isinstance(spec, CalibratedModel) else None
        self.feature_store_bytes = feature_store_bytes
        self.device = torch.device(device)
        self.budget = resolve_budget(config, device)
        if self.budget is not None and feature_store_bytes:
            if feature_store_bytes >= self.budget:
                raise ConfigError(f"the feature store's node cache and staged macro-batch take {feature_store_bytes} "
                                  f"bytes of the {self.budget}-byte micro_batch.budget, leaving nothing for a training "
                                  "step; shrink features.cache.size or features.macro_batch_budget, or raise the budget")
            self.budget -= feature_store_bytes
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
        self._warned_fewer = False  # REG gave fewer micro-batches than asked: said once

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

    def plan(self, batch: Batch, seed: int, min_k: int = 1) -> tuple[MicroBatches | LayerwiseBatch, Plan | LayerwisePlan]:
        """What to run for ``batch``: Betty's micro-batches, or its layer-wise chunks (``micro_batch.mode``);
        at least ``min_k`` micro-batches or chunks per layer (after an out-of-memory error).

        ``auto`` plans both and keeps, among those that fit the budget, the one with less estimated
        work (:meth:`plan_work`: multiply-adds from the model's widths, :func:`step_work`); without a budget it
        compares them at the configured K. Returns the last plan (the same objects) when ``batch`` is structurally the
        last planned batch and ``seed`` and ``min_k`` are the same (see the class docstring).

        Raises:
            PlanningError: no split fits the budget (with the numbers).
        """
        last = self._last
        same_batch = last is not None and same_structure(last.batch, batch)
        if same_batch and last.seed == seed and last.min_k == min_k:
            self.plans_reused += 1
            return last.micro_batches, last.plan
        mode = self.config.mode if self.layerwise_allowed else "betty"
        candidates, errors, self._splitter = [], [], None
        for kind in (("betty", "layerwise") if mode == "auto" else (mode,)):
            try:
                candidates.append(self._plan_betty(batch, seed, min_k, last if same_batch else None)
                                  if kind == "betty" else self._plan_layerwise(batch, seed, min_k))
            except PlanningError as error:
                errors.append(f"{kind}: {error}")
        if not candidates:
            raise PlanningError("; ".join(errors))
        costs = [self.plan_work(batch, candidate[1]) for candidate in candidates]
        work, plan = candidates[costs.index(min(costs))]
        self.plans_made += 1
        self._last = _LastPlan(batch, seed, min_k, self._splitter, work, plan)
        if len(candidates) > 1:
            logger.info("micro_batch.mode=auto chose %s (estimated multiply-adds %.3g vs %.3g)", plan.mode,
                        min(costs), max(costs))
        return work, plan

    def plan_work(self, batch: Batch, plan: Plan | LayerwisePlan) -> float:
        """The estimated cost of running ``plan`` that ``auto`` minimises: :func:`step_work` for a built-in
        model; the plan's ``work`` (rows and edges processed) for a custom one."""
        if self.spec is None:
            return float(plan.work)
        if isinstance(plan, LayerwisePlan):
            projections = self._projections() or [None] * len(batch.blocks)
            rows = [block.num_src if terms is not None else None for block, terms in zip(batch.blocks, projections)]
            return step_work(self.spec, plan.chunks.layers, True, rows)
        return step_work(self.spec, [list(layer) for layer in zip(*plan.layers)], False)

    def _plan_betty(self, batch: Batch, seed: int, min_k: int, last: _LastPlan | None) -> tuple[MicroBatches, Plan]:
        splitter = last.splitter if last is not None and last.splitter is not None else OutputSplitter(
            batch.blocks[-1], self.config.partitioner)
        weighted = [block.edge_weight is not None for block in batch.blocks]  # the slices planned carry none
        estimate = None if self.spec is None and self.calibrated is None else (
            lambda structures, accumulate: self.peak_bytes(structures, accumulate, weighted))
        fixed_k = None if self.budget is not None else min(self.config.num_micro_batches, batch.output_nodes.numel())
        try:
            plan = make_plan(
                batch.blocks, estimate, budget=self.budget, k=fixed_k, resident_bytes=self.resident,
                min_k=min_k, partitioner=self.config.partitioner, seed=seed, balance=self.config.balance,
                splitter=splitter,
            )
        except BudgetError as error:
            raise PlanningError(str(error)) from None
        if fixed_k is not None and plan.k < max(fixed_k, min_k) and not self._warned_fewer:
            self._warned_fewer = True
            logger.warning("micro_batch.num_micro_batches asks for %d micro-batches; %s made %d (METIS left parts "
                           "empty); micro_batch.partitioner=range or random give exactly K",
                           max(fixed_k, min_k), self.config.partitioner, plan.k)
        self._splitter = splitter
        return MicroBatches(batch, plan.layers), plan  # each micro-batch built when it is read

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
        """Per layer, the built-in model's projected-layer terms (``training.layerwise.projected_terms``: a layer
        projected once per pass, else ``None``); ``None`` when the spec's terms are not a ``LayerStack``'s."""
        model = getattr(self.spec.layer_terms, "__self__", None)  # the instance whose terms the spec holds
        return projected_terms(model) if isinstance(model, LayerStack) else None

    def _plan_layerwise(self, batch: Batch, seed: int, min_k: int) -> tuple[LayerwiseBatch, LayerwisePlan]:
        """``num_micro_batches`` chunks per layer, or under a budget the fewest that fit: doubling
        from ``min_k`` to the first K that fits, then bisecting below it. A budget below :meth:`layerwise_floor`
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
            chunks = chunk_layers(batch.blocks, k, partitioner, seed)
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
            chosen, peak = attempt(max(min_k, self.config.num_micro_batches))
        else:
            if self.spec is None:
                raise PlanningError("a layer-wise plan under a budget needs a built-in model's estimate")
            floor = self.layerwise_floor(batch, layers)
            if floor > self.budget:
                raise PlanningError(
                    f"memory budget {self.budget} bytes is impossible layer by layer: at any number of chunks per "
                    f"layer a step needs at least {floor} bytes (the model state, the batch's structure, the whole "
                    "layers a backward holds at once and the in-edges of the node of largest in-degree); raise the budget")
            below, k = max(min_k, 1) - 1, max(min_k, 1)
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
        plan = LayerwisePlan(chosen, peak, self.budget, tried, time.perf_counter() - started, partitioner)
        return LayerwiseBatch(batch, chosen), plan




def step_work(spec: ModelSpec, layers: Sequence[Sequence[LayerSlice | Chunk]], layerwise: bool,
              projected_rows: Sequence[int | None] = ()) -> float:
    """Estimated multiply-adds of one training step over ``layers`` (per layer, the slices it runs: a layer-wise
    plan's chunks, or every micro-batch's slice of that layer), which ``micro_batch.mode=auto`` compares.

    Per layer of widths ``a → b`` (a GAT layer's ``b``: its heads' width), from the rows and edges the slices
    hold (a row read by several slices counts in each: the redundancy):

    - the linear maps: ``a·b`` per row they run on: the src rows when the layer projects first (SAGE
      ``mean``/``gcn`` and GCN when ``a > b``, GAT always), else the dst rows; SAGE's self term (every
      aggregator but ``gcn``) on the dst rows; SAGE ``pool``'s ``fc_pool`` (``a·a``) on the src rows;
    - the aggregation: per edge, the width aggregated (``b`` when projected first, else ``a``); SAGE
      ``lstm``: one LSTM step per edge, ``8·a²`` (four gates over the input and the hidden state);
    - the input rows' gather and node-keyed dropout: :data:`MASK_COST` per element (a projected layer: its
      block's src rows at width ``a``, each chunk's rows of ``z`` at width ``b`` and, SAGE ``mean``, each
      chunk's dst input rows at width ``a``).

    Passes: a micro-batch runs a forward and a backward (two more of each linear map above layer 1, one at
    layer 1, whose input takes no gradient); a layer-wise step runs a forward without autograd, the
    recomputed forward and the backward, so one pass more of each term (and one more gather and mask). A
    layer with ``projected_rows`` (layer-wise GAT, and SAGE ``mean``/``gcn`` when it projects first: its
    block's src rows) projects those once per pass, not each chunk's src rows (SAGE's self term still runs
    on each chunk's dst rows).

    Returns:
        Multiply-adds (a relative cost: only ratios between plans are meaningful).
    """
    total = 0.0
    for index, pieces in enumerate(layers):
        a, b = spec.widths[index], spec.widths[index + 1]
        if spec.arch == "gat" and index == len(layers) - 1:
            b *= spec.heads  # the output layer averages its heads after projecting to all of them
        src = sum(piece.num_src for piece in pieces)
        dst = sum(piece.num_dst for piece in pieces)
        edges = sum(int(piece.indptr[-1]) for piece in pieces)  # a slice or a chunk: its CSC pointer
        linear_aggregator = spec.arch != "sage" or spec.aggregator in ("mean", "gcn")
        first = spec.arch == "gat" or (linear_aggregator and a > b)
        linear_rows = src if first else dst
        if index < len(projected_rows) and projected_rows[index] is not None:
            linear_rows = projected_rows[index]
        if spec.arch == "sage" and spec.aggregator != "gcn":
            linear_rows += dst  # fc_self
        linear, aggregate, gather = linear_rows * a * b, edges * (b if first else a), src * a * MASK_COST
        if index < len(projected_rows) and projected_rows[index] is not None:
            # the projection's row blocks (a wide), each chunk's rows of z (b wide), SAGE mean's dst input rows
            self_rows = dst if spec.arch == "sage" and spec.aggregator == "mean" else 0
            gather = (projected_rows[index] * a + src * b + self_rows * a) * MASK_COST
        if spec.arch == "sage" and spec.aggregator == "pool":
            linear += src * a * a  # fc_pool, before the max
        elif spec.arch == "sage" and spec.aggregator == "lstm":
            aggregate = edges * 8 * a * a  # an LSTM step per edge
        backward_linear = 1 if index == 0 else 2
        passes = 1 + backward_linear + (1 if layerwise else 0)
        total += passes * (linear + aggregate) + (2 if layerwise else 1) * gather
    return total


@dataclass
class LayerwisePlan:
    """A layer-wise plan of one batch (issue 10): its chunks and what was estimated.

    Attributes:
        chunks: the :class:`~partition.chunks.LayerChunks`.
        estimate: estimated peak bytes (0 without a built-in model's estimate).
        budget: bytes, or ``None`` (K given).
        tried: ``(chunks per layer, estimated peak)`` for every chunking evaluated, in order.
        seconds: wall time of planning.
        partitioner: what split the chunks (``micro_batch.partitioner``, or ``range`` for one dst node per chunk
            when that partitioner could not fit the budget).
    """

    chunks: LayerChunks
    estimate: int
    budget: int | None
    tried: list[tuple[int, int]]
    seconds: float
    partitioner: str
    mode: ClassVar[str] = "layerwise"

    @property
    def k(self) -> int:
        return self.chunks.k

    @property
    def work(self) -> int:
        """Estimated work (:attr:`partition.chunks.LayerChunks.work`)."""
        return self.chunks.work

    @property
    def host_outputs(self) -> bool:
        """Whether the hidden layers' outputs ``h_l`` are kept in host memory (the device budget does not
        hold them at this K), not on the device."""
        return self.chunks.host_outputs


@dataclass
class _LastPlan:
    batch: Batch
    seed: int
    min_k: int
    splitter: OutputSplitter | None
    micro_batches: MicroBatches | LayerwiseBatch
    plan: Plan | LayerwisePlan


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
    plan = make_plan(batch.blocks, k=min(num_micro_batches, batch.output_nodes.numel()),
                     partitioner=partitioner, seed=seed, balance=balance)
    return [batch.restrict(layers) for layers in plan.layers]


def make_planner(config: Config, graph: Graph, model: nn.Module | None, device: torch.device) -> MicroBatchPlanner:
    """The planner of a training run on ``graph``: the closed form for the built-in model
    (``model=None``); a custom ``model`` with ``micro_batch.budget`` set is calibrated first,
    once (:func:`~betty_trainer.memory.custom.calibrate_model` with the run's Adam settings and
    ``config.model.num_layers`` layers), and the time it took is logged at INFO level.

    Raises:
        ConfigError: see :class:`MicroBatchPlanner`.
        CalibrationError: the custom model cannot be calibrated (the message names the cause).
    """
    reserved = feature_store_device_bytes(config, graph)
    if model is None:
        return MicroBatchPlanner(config.micro_batch, model_spec(config, graph, device), device, reserved)
    if config.micro_batch.mode == "layerwise" and not runs_layer_by_layer(model):
        raise ConfigError(f"micro_batch.mode=layerwise: {type(model).__name__} cannot run layer by layer (it needs a "
                          "LayerStack whose forward is the stack's own); use micro_batch.mode=betty")
    if config.micro_batch.budget is None:
        planner = MicroBatchPlanner(config.micro_batch, None, device, reserved)
        planner.layerwise_allowed = runs_layer_by_layer(model)
        return planner
    if config.micro_batch.mode == "layerwise":
        raise ConfigError("micro_batch.mode=layerwise under a budget needs a built-in model's estimate; "
                          "use micro_batch.mode=betty for a custom model")
    resolve_budget(config.micro_batch, device)  # a budget that cannot be used fails before calibrating
    started = time.perf_counter()
    optim = config.optim
    calibrated = calibrate_model(
        model, graph, config.model.num_layers,
        lambda params: torch.optim.Adam(params, lr=optim.lr, weight_decay=optim.weight_decay), device)
    logger.info("calibrated the memory estimate of %s in %.2f s (largest error on the calibration samples %.1f%%)",
                type(model).__name__, time.perf_counter() - started, 100 * calibrated.max_relative_error)
    planner = MicroBatchPlanner(config.micro_batch, calibrated, device, reserved)
    planner.layerwise_allowed = False  # a calibrated fit models micro-batches, not layer-wise chunks
    return planner


def plan_redundancy(batch: Batch, plan: Plan | LayerwisePlan) -> list[float]:
    """Per layer, the src rows the plan gathers over the batch's src rows (≥ 1; Betty Table 6): summed over
    the micro-batches (:func:`partition.redundancy`), or over a layer's chunks."""
    if isinstance(plan, LayerwisePlan):
        return [sum(piece.num_src for piece in pieces) / block.num_src
                for block, pieces in zip(batch.blocks, plan.chunks.layers)]
    return redundancy(batch.blocks, plan.layers)


def plan_report(planner: MicroBatchPlanner, batch: Batch, micro_batches: Sequence[Batch] | LayerwiseBatch,
                plan: Plan | LayerwisePlan) -> dict:
    """A JSON-ready description of a plan: per micro-batch sizes per layer, itemised estimate
    (bytes live at the peak, by component), redundancy per layer, K, budget, planning time; for a
    layer-wise plan, per layer its chunks' sizes, the estimated peak and the rows gathered per layer
    over the layer's src nodes (its redundancy)."""
    if isinstance(plan, LayerwisePlan):
        return {
            "mode": "layerwise",
            "chunks_per_layer": plan.k,
            "layer_outputs_on": "host" if plan.host_outputs else "device",
            "budget_bytes": plan.budget,
            "feature_store_bytes": planner.feature_store_bytes,
            "partitioner": plan.partitioner,
            "full_batch": {"outputs": batch.output_nodes.numel(), "layers": _layer_sizes(batch)},
            "estimate_peak_bytes": plan.estimate or None,
            "work": plan.work,
            "redundancy_per_layer": plan_redundancy(batch, plan),
            "tried": [{"k": k, "largest_estimate_bytes": peak} for k, peak in plan.tried],
            "planning_seconds": plan.seconds,
            "layers": [[{"src": piece.num_src, "dst": piece.num_dst, "edges": int(piece.indptr[-1])} for piece in pieces]
                       for pieces in plan.chunks.layers],
        }
    rows = []
    for index, micro_batch in enumerate(micro_batches):
        row = {
            "micro_batch": index,
            "outputs": micro_batch.output_nodes.numel(),
            "layers": _layer_sizes(micro_batch),
        }
        if planner.spec is not None:
            estimate = planner.estimate(micro_batch.blocks, accumulate=index > 0)
            row["estimate"] = {"peak_bytes": estimate.peak_bytes, "at_peak": estimate.at_peak}
        rows.append(row)
    return {
        "mode": "betty",
        "work": plan.work,
        "num_micro_batches": plan.k,
        "budget_bytes": plan.budget,
        "feature_store_bytes": planner.feature_store_bytes,
        "partitioner": planner.config.partitioner,
        "full_batch": {"outputs": batch.output_nodes.numel(), "estimate_peak_bytes": plan.full_batch_estimate or None,
                       "layers": _layer_sizes(batch)},
        "redundancy_per_layer": plan_redundancy(batch, plan),
        "tried": [{"k": k, "largest_estimate_bytes": largest} for k, largest in plan.tried],
        "planning_seconds": plan.seconds,
        "micro_batches": rows,
    }


def _layer_sizes(batch: Batch) -> list[dict[str, int]]:
    return [{"src_nodes": b.num_src, "dst_nodes": b.num_dst, "edges": b.num_edges} for b in batch.blocks]
