"""Independent minibatching's sampling (cooperative paper §1, the data-parallel baseline): each of ``P`` ranks
samples its own ``B/P`` share of the global batch's seeds with no communication."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from betty_trainer.data.block import Batch
from betty_trainer.sampling.base import SampleKey, Sampler


class IndependentSampler:
    """Samples this rank's share of each global batch with ``sampler``.

    The global batch's seeds (the same on every rank) are cut into ``P`` consecutive parts of sizes differing by
    at most one (``tensor_split``); rank ``p`` samples part ``p`` under the global batch's key, so with NS and
    LABOR-0 each seed's blocks are those of the single-process sample of the global batch (randomness is keyed
    per node), and only the overlap between the parts' receptive fields is sampled, loaded and computed again.

    Args:
        sampler: the per-rank sampler over the whole graph.
        rank: this rank; ``world_size``: ``P``.
    """

    def __init__(self, sampler: Sampler, rank: int, world_size: int) -> None:
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.node_cache = sampler.node_cache
        self.bulk, self.bulk_draw = sampler.bulk, sampler.bulk_draw

    def sample(self, seeds: Tensor, key: SampleKey) -> Batch:
        """The batch of this rank's part of the global batch ``seeds`` (``(B,)`` int64) under ``key``."""
        return self.sampler.sample(seeds.tensor_split(self.world_size)[self.rank], key)

    def sample_many(self, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]) -> list[Batch]:
        """This rank's part of each global batch, sampled together by the wrapped sampler."""
        return self.sampler.sample_many([seeds.tensor_split(self.world_size)[self.rank] for seeds in seed_batches],
                                        keys)

    def __repr__(self) -> str:
        return f"IndependentSampler({self.sampler!r}, rank={self.rank}, world_size={self.world_size})"
