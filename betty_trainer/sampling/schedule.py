"""The batches of a run (DESIGN.md › Seams › Sampler): which seed nodes each batch of an epoch
holds, the sampler the config names, and the key of each batch's randomness. ``train`` and
``betty-train plan`` both take their batches from here, so the plan dry run plans exactly the
batch training starts with."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from betty_trainer.config import Config
from betty_trainer.data.block import Batch
from betty_trainer.data.graph import Graph
from betty_trainer.rng import derive_seed
from betty_trainer.sampling.base import SampleKey, Sampler
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
    """The sampler ``config.sampling.sampler`` names, on ``graph`` (DESIGN.md › Seams › Sampler).

    * ``full``: every in-edge (:class:`NeighborSampler` with no fanouts);
    * ``ns``: uniform neighbour sampling with ``fanouts`` (input layer first; ``None``, the
      default, is the full neighbourhood);
    * ``labor``: :class:`LaborSampler` with ``sampling.labor``'s importance iterations, layer and
      batch dependency;
    * ``gns``: :class:`GNSSampler` with ``sampling.gns``'s cache.

    LABOR's batch groups and GNS's cache refreshes run across epochs: the samplers are told how
    many batches an epoch has.
    """
    sampling = config.sampling
    layers = config.model.num_layers
    fanouts = sampling.fanouts or [None] * layers
    if sampling.sampler == "full":
        return NeighborSampler(graph, [None] * layers)
    if sampling.sampler == "ns":
        return NeighborSampler(graph, fanouts)
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


def first_batch(config: Config, graph: Graph) -> Batch:
    """The batch training starts with (epoch 0, batch 0), as ``train`` samples it: what
    ``betty-train plan`` plans."""
    return make_sampler(config, graph).sample(epoch_seeds(config, graph, 0)[0], SampleKey(config.seed, 0, 0))
