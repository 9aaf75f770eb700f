"""The batches of a run (docs/design.md › Seams › Sampler): which seed nodes each batch of an epoch
holds, the sampler the config names, and the key of each batch's randomness. ``train`` and
``betty-train plan`` both take their batches from here, so the plan dry run plans exactly the
batch training starts with."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor
from torch.profiler import record_function

from betty_trainer.config import Config
from betty_trainer.data.block import Batch
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError
from betty_trainer.phases import SAMPLE
from betty_trainer.rng import derive_seed
from betty_trainer.sampling.base import BlockSampler, SampleKey, Sampler
from betty_trainer.sampling.bulk import BulkLadiesSampler, BulkNeighborSampler, BulkSampler
from betty_trainer.sampling.gns import GNSSampler
from betty_trainer.sampling.labor import LaborSampler
from betty_trainer.sampling.neighbor import NeighborSampler

_PLAN_STREAM = (0, 2)  # derive_seed(seed, 0, 2) seeds the partitioner; epochs use (seed, epoch)


def split_seeds(train_idx: Tensor, batch_size: int | None, generator: torch.Generator) -> list[Tensor]:
    """The batches of one epoch: the full batch (``batch_size=None``) or shuffled mini-batches."""
    if batch_size is None or batch_size >= train_idx.numel():
        return [train_idx]
    return list(train_idx[torch.randperm(train_idx.numel(), generator=generator)].split(batch_size))


def make_sampler(config: Config, graph: Graph) -> Sampler:
    """The sampler ``config.sampling.sampler`` names, on ``graph`` (docs/design.md › Seams › Sampler).

    * ``full``: every in-edge (:class:`NeighborSampler` with no fanouts);
    * ``ns``: uniform neighbour sampling with ``fanouts`` (input layer first; ``None``, the
      default, is the full neighbourhood);
    * ``bulk-ns``: :class:`BulkNeighborSampler`, ``ns``'s batches sampled ``sampling.bulk`` at a time as one
      stacked sparse product per layer, on ``sampling.device``;
    * ``bulk-ladies``: :class:`BulkLadiesSampler`, LADIES with ``fanouts`` vertices per batch and layer, sampled
      ``sampling.bulk`` batches at a time, on ``sampling.device``;

    a bulk sampler's ``k`` is ``sampling.bulk``, or under ``auto`` the most of the epoch's batches whose draw fits
    ``sampling.bulk_memory`` (:meth:`BulkSampler.fit`), and its ``bulk_draw`` says what a draw holds;
    * ``labor``: :class:`LaborSampler` with ``sampling.labor``'s importance iterations, layer and
      batch dependency;
    * ``gns``: :class:`GNSSampler` with ``sampling.gns``'s cache.

    With ``features.aggregation_cache`` the sampler samples layers 1 … L − 1 only (``first_layer = 1``), the blocks
    the uncached run samples there: layer 0 reads the cache's rows of their input nodes (BatchGNN §3).

    LABOR's batch groups and GNS's cache refreshes run across epochs: the samplers are told how
    many batches an epoch has.

    Raises:
        ConfigError: ``sampling.device=cuda`` where torch sees no CUDA device.
    """
    sampler = _sampler(config, graph)
    sampler.first_layer = int(config.features.aggregation_cache is not False)  # layer 0 reads the cache: no block
    if isinstance(sampler, BulkSampler):  # k, or under auto the most batches whose draw fits the cap
        sampling = config.sampling
        sampler.bulk_draw = sampler.fit(sampling.bulk, sampling.batch_size or graph.train_idx.numel(),
                                        batches_per_epoch(config, graph), sampling.bulk_memory)
    return sampler


def _sampler(config: Config, graph: Graph) -> BlockSampler:
    """:func:`make_sampler`'s sampler of every layer."""
    sampling = config.sampling
    layers = config.model.num_layers
    fanouts = sampling.fanouts or [None] * layers
    if sampling.sampler == "full":
        return NeighborSampler(graph, [None] * layers)
    if sampling.sampler == "ns":
        return NeighborSampler(graph, fanouts)
    if sampling.sampler.startswith("bulk-"):
        if sampling.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("sampling.device=cuda, but torch sees no CUDA device here: set sampling.device=cpu")
        bulk = BulkNeighborSampler if sampling.sampler == "bulk-ns" else BulkLadiesSampler
        return bulk(graph, fanouts, device=sampling.device)
    batches = batches_per_epoch(config, graph)
    if sampling.sampler == "labor":
        labor = sampling.labor
        kappa = math.inf if labor.batch_dependency == "inf" else labor.batch_dependency
        return LaborSampler(graph, fanouts, importance_iterations=labor.importance_iterations,
                            layer_dependency=labor.layer_dependency, batch_dependency=kappa,
                            batches_per_epoch=batches)
    gns = sampling.gns
    return GNSSampler(graph, fanouts, cache_fraction=gns.cache_fraction, refresh_every=gns.refresh_every,
                      cache_only_input_layer=gns.cache_only_input_layer, cache_probability=gns.cache_probability,
                      batches_per_epoch=batches)


def batches_per_epoch(config: Config, graph: Graph) -> int:
    """How many batches one epoch has: ``⌈|train| / batch_size⌉`` (1 for the full batch)."""
    size = config.sampling.batch_size
    total = graph.train_idx.numel()
    return 1 if size is None or size >= total else -(-total // size)


def epoch_seeds(config: Config, graph: Graph, epoch: int) -> list[Tensor]:
    """The seed nodes of each batch of ``epoch``, in training order: the full batch of training nodes, or
    mini-batches of ``sampling.batch_size`` shuffled by ``(seed, epoch)`` (:func:`split_seeds`)."""
    generator = torch.Generator().manual_seed(derive_seed(config.seed, epoch))
    return split_seeds(graph.train_idx, config.sampling.batch_size, generator)


def plan_seed(config: Config) -> int:
    """The seed of the partitioner's randomness (a 31-bit int, as METIS takes). The same in every epoch,
    so a batch identical to the last one (a full-neighbourhood full batch) reuses its plan, in a resumed
    run as in an uninterrupted one."""
    return derive_seed(config.seed, *_PLAN_STREAM) % 2**31


def first_batch(config: Config, graph: Graph, sampler: Sampler | None = None, epoch: int = 0) -> Batch:
    """The batch an epoch starts with (batch 0 of ``epoch``; default epoch 0, what ``betty-train plan`` plans),
    as ``train`` samples it: by ``sampler`` (default: :func:`make_sampler`'s)."""
    sampler = sampler if sampler is not None else make_sampler(config, graph)
    return sampler.sample(epoch_seeds(config, graph, epoch)[0], SampleKey(config.seed, epoch, 0))


def check_macro_batch_budget(config: Config) -> None:
    """Refuse macro-batches (``features.macro_batch``) under a ``micro_batch.budget`` without
    ``features.macro_batch_budget``: a staged macro-batch's size would be unbounded, so the plan could not
    leave room for it (checked by ``validate`` and ``train`` before any data is loaded).

    Raises:
        ConfigError: naming the keys and the fix.
    """
    features = config.features
    if features.macro_batch and features.macro_batch_budget is None and config.micro_batch.budget is not None:
        raise ConfigError("features.macro_batch under micro_batch.budget needs features.macro_batch_budget (the "
                          "device bytes a staged macro-batch may take), so the plan can leave room for it")


@dataclass
class BatchRound:
    """Consecutive batches of an epoch that run together, and the input nodes staged for them.

    Attributes:
        batches: ``(key, seeds, batch)`` per batch, in training order: the :class:`SampleKey` the batch was
            sampled with (``key.step``: its position in the epoch), its seed nodes and the batch.
        staged_nodes: the union of their input nodes (with duplicates) for the feature store to stage on the
            device before they run (``FeatureStore.prefetch``; BatchGNN §3), or ``None``: each batch gathers its
            own rows.
    """

    batches: list[tuple[SampleKey, Tensor, Batch]]
    staged_nodes: Tensor | None


def batch_rounds(config: Config, sampler: Sampler, seed_batches: Sequence[Tensor], epoch: int,
                 row_bytes: int) -> Iterator[BatchRound]:
    """The batches of ``epoch`` in rounds: one batch per round, or with ``features.macro_batch = M ≥ 1`` every ``M``
    consecutive batches sampled ahead, whose input nodes the store stages on the device in one gather (BatchGNN
    §3). Batches are keyed by ``SampleKey(config.seed, epoch, index)`` whether sampled ahead or not, so the
    batches are the same with and without macro-batching.

    With ``features.macro_batch_budget``, the ``M`` batches are staged in rounds whose distinct rows of
    ``row_bytes`` bytes fit it (:func:`staging_rounds`); a batch whose own rows do not fit is a round that stages
    nothing (its micro-batches gather as without macro-batching), so a staged macro-batch never holds more than
    the budget.

    Batches are sampled ``sampler.bulk`` at a time (:meth:`Sampler.sample_many`; the bulk sampler's stacked
    product), independently of how they are grouped into rounds: a batch is the same either way.

    Memory: with macro-batching ``M`` sampled batches are alive at once, and up to ``sampler.bulk`` more.
    """
    group = max(1, config.features.macro_batch)
    staging = config.features.macro_batch > 0
    budget = config.features.macro_batch_budget
    sampled = _sampled(sampler, seed_batches, [SampleKey(config.seed, epoch, i) for i in range(len(seed_batches))])
    while chunk := list(islice(sampled, group)):
        keys, batches = [key for key, _ in chunk], [batch for _, batch in chunk]
        del chunk
        rounds = staging_rounds([batch.input_nodes for batch in batches], row_bytes, budget) \
            if staging else [range(m, m + 1) for m in range(len(batches))]
        for members in rounds:
            nodes = torch.cat([batches[m].input_nodes for m in members]) if staging else None
            if nodes is not None and budget is not None and torch.unique(nodes).numel() * row_bytes > budget:
                nodes = None  # a batch over the budget on its own is gathered per micro-batch, not staged
            yield BatchRound([(keys[m], seed_batches[keys[m].step], batches[m]) for m in members], nodes)
        del batches


def _sampled(sampler: Sampler, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]
             ) -> Iterator[tuple[SampleKey, Batch]]:
    """``(key, batch)`` of each of ``keys`` in order, sampled ``sampler.bulk`` consecutive batches at a time."""
    for start in range(0, len(keys), sampler.bulk):
        some = keys[start:start + sampler.bulk]
        with record_function(SAMPLE):
            batches = sampler.sample_many([seed_batches[key.step] for key in some], some)
        yield from zip(some, batches, strict=True)


def staging_rounds(inputs: Sequence[Tensor], row_bytes: int, budget: int | None) -> list[range]:
    """Consecutive runs of ``inputs`` (the input nodes of a macro-batch's batches) whose distinct nodes ×
    ``row_bytes`` fit ``budget`` bytes, greedily from the first (BatchGNN §3: F ≤ B batches per fetch round).
    A batch joins the round before it whenever it adds no new node; one over the budget on its own is a
    round by itself. ``budget=None``: one round of every batch."""
    if budget is None:
        return [range(len(inputs))]
    rounds, first, union = [], 0, None
    for index, nodes in enumerate(inputs):
        grown = torch.unique(nodes) if union is None else torch.unique(torch.cat([union, nodes]))
        if union is not None and grown.numel() > union.numel() and grown.numel() * row_bytes > budget:
            rounds.append(range(first, index))
            first, grown = index, torch.unique(nodes)
        union = grown
    rounds.append(range(first, len(inputs)))
    return rounds
