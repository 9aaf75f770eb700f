"""Cooperative sampling (cooperative paper §3.1, Alg. 1, "Sampling"): ``P`` ranks sample one global batch.

Rank ``p`` keeps the global batch's seeds it owns, ``S_p⁰``, and for each layer, output layer first, samples the
in-edges of its dst nodes with the wrapped sampler's one-layer function (:meth:`BlockSampler.sample_layer`),
then sends the sampled src ids ``S̃_p`` to their owners (:func:`~betty_trainer.distributed.exchange.plan_exchange`);
what each rank receives, deduplicated, is its dst set for the next layer down. The exchanges are kept: the forward
and backward passes move embeddings along them.

Randomness is keyed by ``(seed, epoch, step)`` and node ids (NS: per dst node; LABOR-0: per src node and dst
degree), never by which rank samples a node, so with NS and LABOR-0 the blocks of all ranks together are the
single-process sample of the same global batch: each dst node gets the same in-edges and edge weights, and the
gradients of a cooperative step equal the single-process step's (``tests/test_cooperative.py``). LABOR-*'s
importance probabilities depend on the whole dst set of a layer, so a rank's share differs from the
single-process batch there (its variates do not).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from betty_trainer.distributed.exchange import ExchangeTraffic, plan_exchange
from betty_trainer.distributed.share import CooperativeBatch
from betty_trainer.sampling.base import BlockSampler, SampleKey


class CooperativeSampler:
    """Alg. 1's sampling on one rank, around a :class:`BlockSampler` (full, NS, bulk-ns's NS one batch at a time,
    LABOR) over the whole graph.

    Args:
        sampler: the per-layer sampler (each rank holds the graph; it samples only its own dst nodes'
            in-edges, the rank's ``E_p``).
        owners: ``(N,)`` int64 rank of every vertex, the same on every rank
            (:func:`~betty_trainer.distributed.ownership.load_owners`).
        group: the process group of the ranks that share the batch (``None``: the default group). Its backend
            must move CPU tensors (gloo), as the sampled ids are on the CPU.
        row_group: the group the rows of the exchanges move over (``None``: ``group``; NCCL on CUDA).
        traffic: where the bytes sent to the others are counted (default: a new counter).

    Attributes:
        traffic: the bytes this rank sent to the others through every exchange of its shares so far (ids here,
            rows as the shares run; :class:`~betty_trainer.distributed.exchange.ExchangeTraffic`).
        node_cache: ``None``: a rank's feature store caches the rows it owns, with no sampler-given node set.
        bulk_draw: ``None``: one batch at a time, each a collective of its own.
    """

    node_cache = None
    bulk = 1  # each batch is a collective of its own
    bulk_draw = None

    def __init__(self, sampler: BlockSampler, owners: Tensor, group: dist.ProcessGroup | None = None,
                 row_group: dist.ProcessGroup | None = None, traffic: ExchangeTraffic | None = None) -> None:
        self.sampler = sampler
        self.owners = owners.long()
        self.group = group
        self.row_group = row_group
        self.traffic = traffic if traffic is not None else ExchangeTraffic()

    def sample(self, seeds: Tensor, key: SampleKey) -> CooperativeBatch:
        """This rank's share of the global batch ``seeds`` under ``key`` (a collective: every rank of the
        group calls it with the same ``seeds`` and ``key``).

        Args:
            seeds: ``(B,)`` int64 distinct seed ids of the global batch, the same on every rank.
            key: the batch's :class:`SampleKey`.

        Returns:
            The :class:`CooperativeBatch` of this rank.
        """
        seeds = seeds.long()
        dst = seeds[self.owners[seeds] == dist.get_rank(self.group)]
        blocks, exchanges = [], []
        for layer in reversed(range(len(self.sampler.fanouts))):
            block = self.sampler.sample_layer(dst, layer, key)
            exchange = plan_exchange(block.src_nodes, self.owners, self.group, self.row_group, self.traffic)
            blocks.append(block)
            exchanges.append(exchange)
            dst = exchange.owned
        blocks.reverse()
        exchanges.reverse()
        return CooperativeBatch(blocks, exchanges, seeds, key)

    def sample_many(self, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]) -> list[CooperativeBatch]:
        """This rank's share of each global batch, one after the other (each a collective)."""
        return [self.sample(seeds, key) for seeds, key in zip(seed_batches, keys, strict=True)]

    def rounds(self, seeds: Tensor, key: SampleKey, k: int) -> Iterator[CooperativeBatch]:
        """The global batch in ``k`` micro-batch rounds, sampled one round at a time (a collective).

        Every rank splits the seeds it owns into ``k`` consecutive parts; round ``r`` is the global batch of
        every rank's part ``r`` (each rank computes all parts itself from ``owners``: no communication). A round's
        sample is the global batch's sample restricted to its seeds (randomness is keyed per node), so running
        the rounds with the loss divided by the global seed count accumulates the global batch's gradient
        (Betty §4.2 across ranks). Every rank runs ``k`` rounds, so the collectives match even where a rank owns
        fewer than ``k`` seeds (its part is then empty).

        Args:
            seeds: ``(B,)`` int64 distinct seed ids of the global batch, the same on every rank.
            key: the batch's :class:`SampleKey`.
            k: micro-batch rounds, ``≥ 1``, the same on every rank.

        Yields:
            This rank's :class:`CooperativeBatch` of each round.

        Raises:
            ValueError: ``k < 1``.
        """
        if k < 1:
            raise ValueError(f"a cooperative batch needs at least one round, got {k}")
        seeds = seeds.long()
        owner = self.owners[seeds]
        parts = [seeds[owner == q].tensor_split(k) for q in range(dist.get_world_size(self.group))]
        for index in range(k):
            yield self.sample(torch.cat([part[index] for part in parts]), key)

    def __repr__(self) -> str:
        return f"CooperativeSampler({self.sampler!r}, world_size={dist.get_world_size(self.group)})"

