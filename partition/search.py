"""The K search: the smallest K whose largest micro-batch fits a budget (Betty §4.4.3).

The search knows nothing of models: it takes an ``estimate`` callable mapping a
micro-batch's block structures to estimated peak bytes (the estimator, composed by
the trainer) and searches K. Micro-batches run in plan order and accumulate their
gradients, so the estimate is asked whether earlier micro-batches of the batch ran
before (their gradients are then resident, which costs more).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from partition.partitioners import OutputSplitter, Splitter
from partition.reg import output_adjacency
from partition.slicing import BlockStructure, SliceSize, count_layers

Estimate = Callable[[Sequence[BlockStructure], bool], int]  # (micro-batch, accumulating) → peak bytes


class BudgetError(ValueError):
    """No split of the batch fits the budget; the message gives the numbers."""


@dataclass
class Split:
    """K micro-batches of one batch and their estimated peaks.

    A split keeps what makes a micro-batch, not the micro-batch: its output positions, and the sizes of its
    layers (for the work, the redundancy and the report). A micro-batch's :class:`~partition.slicing.LayerSlice` s
    (``O(its edges)``) are sliced again when it runs (:func:`~partition.slicing.slice_layers` of its group), so
    the split holds ``8 · outputs`` bytes of tensors of its own at any K (and the batch's blocks, which a plan of the
    batch holds anyway), not every micro-batch's slices.

    The sizes are counted (:func:`~partition.slicing.count_layers`) while planning only where the search estimates
    the micro-batches; a split of a given K made without an estimate counts them when :attr:`sizes` is first read
    (issue 23: for a sampled mini-batch at a fixed K, the count was most of its plan, and a step that slices the
    micro-batches anyway gives their sizes as it runs:
    :class:`~betty_trainer.execution.micro_batches.MicroBatchPlan`).

    Attributes:
        groups: per micro-batch, ``(m_k,)`` int64 sorted positions among the batch's output nodes (they
            partition them).
        blocks: the batch's block structures the groups split, input layer first (what :attr:`sizes` counts).
        estimates: per micro-batch, estimated peak bytes (empty: made without an estimate).
        budget: the budget in bytes (``None``: K was given, not searched).
        full_batch_estimate: estimated peak of the unsplit batch, bytes; 0 where it was not estimated (no
            estimate, or a given K above 1).
        tried: ``(K, largest estimate)`` for every K evaluated, in order.
        seconds: wall time of planning (a count made when :attr:`sizes` is first read is not in it).
        stage_seconds: wall seconds of planning by stage, summed over every K tried: ``"weights"`` (the
            METIS vertex weights, :func:`output_costs`), ``"partition"`` (splitting the outputs: METIS,
            and building the REG when the splitter had not built it yet; for a graph splitter, the look-up, and
            the graph's METIS for a K the run had not partitioned yet), ``"counting"`` (the micro-batches'
            layer sizes, :func:`~partition.slicing.count_layers`; a count made when :attr:`sizes` is first read
            adds to it; K = 1's sizes are the whole blocks', read, not counted), ``"estimate"``.
        counted: per micro-batch, its :class:`~partition.slicing.SliceSize` per layer (input layer first), or
            ``None`` until :attr:`sizes` is first read.
    """

    groups: list[Tensor]
    blocks: Sequence[BlockStructure]
    estimates: list[int]
    budget: int | None
    full_batch_estimate: int
    tried: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    counted: list[list[SliceSize]] | None = None

    @property
    def sizes(self) -> list[list[SliceSize]]:
        """Per micro-batch, its :class:`~partition.slicing.SliceSize` per layer (input layer first, degree histograms
        included; at ``K = 1`` the whole blocks' sizes, without a histogram): :attr:`counted`, counted now
        (:func:`~partition.slicing.count_layers`, ``O(E + K · S / 64)``) where it was not yet."""
        if self.counted is None:
            self.counted = [[SliceSize.of(block) for block in self.blocks]] if self.k == 1 else \
                _timed(self.stage_seconds, "counting", count_layers, self.blocks, self.groups)
        return self.counted

    @property
    def k(self) -> int:
        return len(self.groups)

    @property
    def work(self) -> int:
        """Estimated work of running the micro-batches: ``3 · Σ_micro-batches Σ_layers (src rows + edges)``
        (a forward, and a backward of about twice its cost, over every row and edge a micro-batch holds;
        rows shared by several micro-batches count once in each: the redundancy). Compared with
        :attr:`partition.chunks.LayerChunks.work` by ``micro_batch.mode=auto``."""
        return 3 * sum(piece.num_src + piece.num_edges for layers in self.sizes for piece in layers)


def output_costs(blocks: Sequence[BlockStructure]) -> np.ndarray:
    """Per output node, the edges of its receptive field counted with multiplicity.

    ``v_0 = deg_0``, ``v_l = deg_l + A_l · v_{l−1}``, cost = ``v_{L−1}``: one sparse
    mat-vec per layer (the ``A_l`` are the blocks' dst × src adjacencies). Used as METIS
    vertex weights so micro-batches get similar work, not just similar output counts
    (Betty §4.4.1).

    Returns:
        ``(num_outputs,)`` float64.
    """
    value = np.zeros(0)
    for block in blocks:
        degrees = np.diff(block.indptr.cpu().numpy()).astype(np.float64)
        if value.size:
            value = degrees + output_adjacency(block).astype(np.float64) @ value
        else:
            value = degrees
    return value


def integer_weights(costs: np.ndarray, total: float = 1e8) -> np.ndarray:
    """Positive int64 METIS weights proportional to ``costs`` with a sum near ``total`` at most."""
    scale = max(1.0, float(costs.sum()) / total)
    return np.maximum(1, np.ceil(costs / scale)).astype(np.int64)


def k_to_fit(k: int, peak: float, resident: float, budget: float) -> int:
    """The K at which a split whose largest micro-batch at ``k`` is estimated at ``peak`` bytes is expected to fit
    ``budget`` bytes: a micro-batch's own bytes (above the ``resident`` ones) shrink about as ``1/K``, so
    ``⌈k · (peak − resident) / (budget − resident)⌉`` (the K search's start from the whole batch, ``k = 1``)."""
    return math.ceil(k * (peak - resident) / (budget - resident))


def _timed(stage_seconds: dict[str, float], stage: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its wall seconds added to ``stage_seconds[stage]`` (a :class:`Split`'s ``stage_seconds``)."""
    started = time.perf_counter()
    result = fn(*args)
    stage_seconds[stage] = stage_seconds.get(stage, 0.0) + time.perf_counter() - started
    return result


def make_split(
    blocks: Sequence[BlockStructure],
    estimate: Estimate | None = None,
    *,
    budget: int | None = None,
    k: int | None = None,
    resident_bytes: int = 0,
    min_k: int = 1,
    partitioner: str = "reg",
    seed: int = 0,
    balance: bool = True,
    splitter: Splitter | None = None,
    search: str = "linear",
    full_batch_estimate: Callable[[], int] | None = None,
) -> Split:
    """Split a batch into micro-batches: K given, or the smallest K that fits ``budget``.

    With a budget the search starts at a K no valid split can beat: for ``K`` parts
    the largest part's dynamic memory is at least the mean, and the parts' dynamic
    memory sums to at least the full batch's (every edge and output is in one part,
    every node in at least one), so ``K ≥ K₀ = ⌈(full − resident) / (budget − resident)⌉``.
    From ``K₀`` the default ``search="linear"`` tries K₀, K₀ + 1, … and returns the first
    K that fits: the smallest, exactly. ``search="gallop"`` tries K₀, K₀ + 1, K₀ + 3,
    K₀ + 7, … (steps 1, 2, 4, …) to the first K that fits, then bisects between it and
    the last K that did not: ``O(log ΔK)`` partitions instead of ``ΔK``, and the same K
    when "fits" is monotone in K. METIS parts are balanced only up to a tolerance, so
    where micro-batches hold a few outputs each "fits" can flip back and forth with K
    (on Cora's training batch with fanouts 10,10 and a tight budget K = 31 fits, 34 and
    35 do not, 36 does); there galloping can return a larger K than the smallest, hence
    not the default.
    The partitioner's graph (the REG) is built once and reused for every K tried.

    Args:
        blocks: the batch's blocks, input layer first.
        estimate: ``(micro-batch block structures, accumulating)`` → estimated peak bytes,
            with ``accumulating`` true for every micro-batch after the first; may be ``None``
            with ``k`` (then ``estimates`` are empty and ``full_batch_estimate`` is 0).
            With a given ``k > 1`` the unsplit batch is not estimated (``full_batch_estimate`` is 0).
        budget: bytes; ``None`` to use ``k``.
        k: number of micro-batches when there is no budget.
        resident_bytes: bytes every micro-batch's estimate includes before its own data
            (parameters, optimizer state, buffers).
        min_k: never fewer micro-batches (used to re-plan after an out-of-memory error).
        partitioner: a name in :data:`partition.PARTITIONERS`, or ``"graph"`` with a
            :class:`~partition.partitioners.GraphSplitter` (the run's graph partition).
        seed: partitioner seed.
        balance: weight METIS vertices by :func:`output_costs`.
        splitter: a :class:`~partition.partitioners.Splitter` of ``blocks[-1]``'s outputs with method
            ``partitioner``: an :class:`~partition.partitioners.OutputSplitter` of ``blocks[-1]`` (or of a
            block with the same structure) to reuse (its REG already built), or a
            :class:`~partition.partitioners.GraphSplitter`; default: a new ``OutputSplitter``.
        search: ``"linear"`` (the smallest K, exactly) or ``"gallop"`` (galloping then
            bisection; the smallest K when fitting is monotone in K).
        full_batch_estimate: ``() → estimate(blocks, False)``, the unsplit batch's estimated peak in bytes, called
            at most once and only where the search needs it: a caller that estimates the whole batch for another
            search too (the planner's ``micro_batch.mode=auto``) hands both one cached callable; default: ``estimate``
            asked. Ignored without an ``estimate``.

    Returns:
        A :class:`Split`.

    Raises:
        BudgetError: the budget is below the resident bytes, or even one output node's
            micro-batch exceeds it (with the numbers).
        ValueError: neither or both of ``budget`` and ``k``; K out of range; a ``splitter``
            of another block or method; an unknown ``search``.
    """
    started = time.perf_counter()
    _check_split_arguments(blocks, estimate, budget, k, splitter, partitioner, search)
    if splitter is None:
        splitter = OutputSplitter(blocks[-1], partitioner)
    num_outputs = blocks[-1].num_dst
    # the unsplit batch's estimate: what the search starts from, K = 1's estimate; not made for a batch split into a
    # given K > 1
    full = functools.cache(lambda: 0 if estimate is None else
                           full_batch_estimate() if full_batch_estimate is not None else estimate(blocks, False))
    weighted = balance and partitioner in ("reg", "reg_unweighted", "metis")
    # METIS vertex weights, and (with a budget) which output is the hungriest; made when first needed
    costs = functools.cache(lambda: output_costs(blocks))
    weights = functools.cache(lambda: integer_weights(costs()) if weighted else None)
    tried: list[tuple[int, int]] = []
    splits: dict[int, tuple[list[Tensor], list[list[SliceSize]] | None, list[int]]] = {}

    stage_seconds = {"weights": 0.0, "partition": 0.0, "counting": 0.0, "estimate": 0.0}

    timed = functools.partial(_timed, stage_seconds)

    def split(parts: int) -> tuple[list[Tensor], list[list[SliceSize]] | None, list[int]]:
        sizes, estimates = None, []  # counted here only to be estimated (else when the split's sizes are first read)
        if parts == 1:  # the whole batch: no partitioning, no slicing; its estimate is the full batch's
            groups = [torch.arange(num_outputs)]
            if estimate is not None:
                estimates = [full()]
        else:
            vertex_weights = timed("weights", weights)
            groups = timed("partition", splitter.split, parts, seed, vertex_weights)
            if estimate is not None:
                sizes = timed("counting", count_layers, blocks, groups)  # every micro-batch's sizes, none sliced
                estimates = [timed("estimate", estimate, layers, index > 0) for index, layers in enumerate(sizes)]
        tried.append((parts, max(estimates, default=0)))
        splits[parts] = groups, sizes, estimates
        return splits[parts]

    def done(parts: int) -> Split:
        groups, sizes, estimates = splits[parts]
        full_batch = full() if budget is not None or parts == 1 else 0
        return Split(groups, blocks, estimates, budget, full_batch, tried, time.perf_counter() - started, stage_seconds,
                     sizes)

    if budget is None:
        split(min(max(k, min_k), num_outputs))
        return done(tried[-1][0])

    if budget <= 0:
        raise BudgetError(f"memory budget must be positive, got {budget} bytes")
    resident = resident_bytes
    if full() <= budget and min_k <= 1:
        split(1)
        return done(1)
    if budget <= resident:
        raise BudgetError(
            f"memory budget {_mib(budget)} is below what training holds before any micro-batch "
            f"({_mib(resident)}: parameters, optimizer state, model buffers)"
        )
    hungriest = int(np.argmax(costs()))
    alone = estimate(count_layers(blocks, [torch.tensor([hungriest])])[0], True)
    if alone > budget:
        raise BudgetError(
            f"memory budget {_mib(budget)} is impossible: output node {hungriest} of the batch alone needs "
            f"{_mib(alone)} (its receptive field); raise the budget or use smaller fanouts"
        )
    start = min(max(min_k, 2, k_to_fit(1, full(), resident, budget)), num_outputs)
    parts = _first_fitting_k(lambda parts: max(split(parts)[2]) <= budget, start, num_outputs, search == "gallop")
    if parts is None:
        raise BudgetError(
            f"memory budget {_mib(budget)} is impossible: even {num_outputs} micro-batches of one output "
            f"node each need up to {_mib(max(splits[num_outputs][2]))}"
        )
    return done(parts)


def refine_split(split: Split, estimate: Estimate, budget: int, cut: Callable[[Tensor], list[Tensor]]) -> Split:
    """``split`` with each micro-batch estimated over ``budget`` cut by ``cut`` (its sorted output positions → the
    pieces' sorted positions, which partition them), in its place; the micro-batches that fit are kept as they
    are, with their sizes and estimates (each keeps its place or moves later, so whether it accumulates does not
    change). The pieces are counted and estimated; ``tried`` gains ``(refined K, largest estimate)`` and
    ``stage_seconds`` the cut (``"partition"``), the pieces' ``"counting"`` and ``"estimate"``. The planner cuts a
    graph split's missed micro-batches in two this way (:meth:`~partition.partitioners.GraphSplitter.halves`;
    ``betty_trainer.memory.planner``): where few miss, that costs fewer micro-batches than a larger K for all.

    Args:
        split: a split of a batch's outputs with its ``estimates``.
        estimate: as :func:`make_split`'s.
        budget: bytes; the refined split's ``budget``.
        cut: splits one micro-batch's outputs.

    Returns:
        A :class:`Split` whose micro-batches partition the outputs; its estimates may still exceed the budget.

    Raises:
        ValueError: ``split`` has no estimates.
    """
    started = time.perf_counter()
    if len(split.estimates) != split.k:
        raise ValueError("refining a split needs its micro-batches' estimates")
    stage_seconds = dict(split.stage_seconds)

    timed = functools.partial(_timed, stage_seconds)

    groups: list[Tensor] = []
    sizes: list[list[SliceSize]] = []
    estimates: list[int] = []
    for group, layers, peak in zip(split.groups, split.sizes, split.estimates):
        if peak <= budget:
            groups.append(group)
            sizes.append(layers)
            estimates.append(peak)
            continue
        pieces = timed("partition", cut, group)
        for piece, piece_layers in zip(pieces, timed("counting", count_layers, split.blocks, pieces), strict=True):
            estimates.append(timed("estimate", estimate, piece_layers, bool(groups)))  # accumulating after the first
            groups.append(piece)
            sizes.append(piece_layers)
    return Split(groups, split.blocks, estimates, budget, split.full_batch_estimate,
                 split.tried + [(len(groups), max(estimates))], split.seconds + time.perf_counter() - started,
                 stage_seconds, sizes)


def _check_split_arguments(blocks: Sequence[BlockStructure], estimate: Estimate | None, budget: int | None,
                           k: int | None, splitter: Splitter | None, partitioner: str, search: str) -> None:
    """:func:`make_split`'s argument checks (its ``ValueError`` s)."""
    if (budget is None) == (k is None):
        raise ValueError("give exactly one of budget and k")
    if estimate is None and budget is not None:
        raise ValueError("planning for a budget needs an estimate")
    if search not in ("linear", "gallop"):
        raise ValueError(f"unknown search {search!r}; choose 'linear' or 'gallop'")
    if splitter is not None and (splitter.num_outputs != blocks[-1].num_dst or splitter.method != partitioner):
        raise ValueError("splitter was made for another output block or partitioner")


def _first_fitting_k(fits: Callable[[int], bool], start: int, limit: int, gallop: bool) -> int | None:
    """:func:`make_split`'s search for K in ``start … limit``: K = start, start + 1, … (or, ``gallop``, steps
    1, 2, 4, …) to the first K that ``fits``, then bisection between it and the last K that did not; ``None``
    when ``limit`` does not fit."""
    below, step, parts = start - 1, 1, start  # below: the largest K known not to fit (or under the start)
    while not fits(parts):
        if parts == limit:
            return None
        below, parts = parts, min(parts + step, limit)
        step = 2 * step if gallop else 1
    while parts - below > 1:  # parts fits; below does not (or is under the lower bound)
        middle = (below + parts) // 2
        below, parts = (below, middle) if fits(middle) else (middle, parts)
    return parts


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB ({int(nbytes)} bytes)"
