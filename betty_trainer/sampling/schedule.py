"""The batches of a run (DESIGN.md › Seams › Sampler): which seed nodes each batch of an epoch
holds, the sampler the config names, and the key of each batch's randomness. ``train`` and
``betty-train plan`` both take their batches from here, so the plan dry run plans exactly the
batch training starts with."""

from __future__ import annotations

import torch
from torch import Tensor

from betty_trainer.config import Config
from betty_trainer.data.block import Batch
from betty_trainer.data.graph import Graph
from betty_trainer.rng import derive_seed
from betty_trainer.sampling.base import SampleKey, Sampler
from betty_trainer.sampling.neighbor import NeighborSampler

_PLAN_STREAM = (0, 2)  # derive_seed(seed, 0, 2) seeds the partitioner; epochs use (seed, epoch)


def split_seeds(train_idx: Tensor, batch_size: int | None, generator: torch.Generator) -> list[Tensor]:
    """The batches of one epoch: the full batch (``batch_size=None``) or shuffled mini-batches."""
    if batch_size is None or batch_size >= train_idx.numel():
        return [train_idx]
    return list(train_idx[torch.randperm(train_idx.numel(), generator=generator)].split(batch_size))


def make_sampler(config: Config, graph: Graph) -> Sampler:
    """The sampler of ``config.sampling`` on ``graph``: neighbour sampling with ``fanouts`` (input layer
    first; ``None`` everywhere, the default, is the full neighbourhood)."""
    return NeighborSampler(graph, config.sampling.fanouts or [None] * config.model.num_layers)


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
