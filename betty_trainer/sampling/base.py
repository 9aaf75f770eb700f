"""The sampler seam (docs/design.md › Seams › Sampler): a batch's randomness is keyed by
``(seed, epoch, step)``, never drawn from a generator stream shared across batches, so a
batch is a pure function of its seed nodes and its key (resume, micro-batch slicing and
cooperative training rely on it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.cache import NodeSource
from betty_trainer.rng import mix_key

if TYPE_CHECKING:  # the bulk samplers' record; bulk.py imports this module
    from betty_trainer.sampling.bulk import BulkDraw

_SAMPLING_DOMAIN = 0x4E53  # "NS": keeps sampling keys apart from dropout's mix_key(seed, step, layer)


@dataclass(frozen=True)
class SampleKey:
    """What keys one batch's randomness (docs/design.md › Seams › Sampler).

    Attributes:
        seed: the run's seed (any non-negative int up to 64 bits).
        epoch: the epoch, from 0.
        step: the batch's index within the epoch, from 0.
    """

    seed: int
    epoch: int = 0
    step: int = 0

    def layer_key(self, layer: int) -> int:
        """The 32-bit key of block ``layer`` (input layer first) of this batch."""
        return mix_key(self.seed, self.epoch, self.step, layer, _SAMPLING_DOMAIN)

    def position(self, batches_per_epoch: int | None) -> tuple[int, int]:
        """Where this batch lies in the run's sequence of batches: ``(sequence, index)``.

        With ``batches_per_epoch`` the run is one sequence (``0``) and the batch is its
        ``epoch · batches_per_epoch + step``-th; without it every epoch is its own sequence
        (``epoch + 1``) and the index is ``step``. Samplers whose randomness spans batches (LABOR's
        batch dependency, GNS's cache refresh) key it by this pair.
        """
        if batches_per_epoch is None:
            return self.epoch + 1, self.step
        return 0, self.epoch * batches_per_epoch + self.step

    @classmethod
    def draw(cls, generator: torch.Generator | None = None) -> SampleKey:
        """A key whose seed is one draw from ``generator`` (the global RNG if ``None``)."""
        device = None if generator is None else generator.device
        return cls(int(torch.randint(0, 2**62, (1,), generator=generator, device=device)))


@dataclass(frozen=True)
class SampleKeys:
    """``k`` :class:`SampleKey` as tensors, so the keys of every batch of a bulk draw are computed in one pass.

    Attributes:
        seed, epoch, step: ``(k,)`` int64 (seeds below 2⁶³), on the sampling device.
    """

    seed: Tensor
    epoch: Tensor
    step: Tensor

    @classmethod
    def of(cls, keys: Sequence[SampleKey], device: torch.device | str) -> SampleKeys:
        """The stacked ``keys``, on ``device``.

        Raises:
            ValueError: a seed of 2⁶³ or more (an int64 tensor cannot hold it).
        """
        if any(key.seed >= 2**63 for key in keys):
            raise ValueError("bulk sampling keys batches by int64 tensors: use seeds below 2⁶³")
        parts = torch.tensor([[key.seed, key.epoch, key.step] for key in keys], dtype=torch.int64).reshape(-1, 3)
        return cls(*parts.to(device).unbind(1))

    def layer_keys(self, layer: int) -> Tensor:
        """``(k,)`` int64: batch ``i``'s :meth:`SampleKey.layer_key` of ``layer``."""
        return mix_key(self.seed, self.epoch, self.step, layer, _SAMPLING_DOMAIN)

    def round_keys(self, layer: int, rounds: int) -> Tensor:
        """``(k, rounds)`` int64: batch ``i``'s NS round keys of ``layer``, ``mix_key(layer_key, r)``
        (:func:`~betty_trainer.sampling.neighbor.sample_block`)."""
        return mix_key(self.layer_keys(layer)[:, None], torch.arange(rounds, device=self.seed.device))


class Sampler(Protocol):
    """A sampler (docs/design.md › Seams): ``sample(seeds, key) -> Batch``.

    The batch must be a pure function of ``(seeds, key)``. With NS, LABOR-0 and GNS
    the blocks a seed receives do not depend on the other seeds beyond the union they
    form; LABOR-*'s importance probabilities are a function of the whole dst set of a
    layer (cooperative paper A.1.2), its variates are not. Micro-batches are slices of
    the sampled batch, so gradient exactness holds for every sampler.

    Attributes:
        node_cache: the node set a device cache should hold for each batch
            (:class:`~betty_trainer.data.cache.NodeSource`), for a sampler that samples
            from a node cache (GNS §3.1); ``None`` for the others. The feature store reads
            it; no caller asks which sampler it holds.
        bulk: how many consecutive batches of an epoch the schedule hands :meth:`sample_many` at once
            (``sampling.bulk`` for the bulk sampler, 1 for the others).
        bulk_draw: what a draw of ``bulk`` batches holds and where
            (:class:`~betty_trainer.sampling.bulk.BulkDraw`; the planner counts it), or ``None``: the sampler draws
            one batch at a time on the graph's device.
    """

    node_cache: NodeSource | None
    bulk: int
    bulk_draw: BulkDraw | None

    def sample(self, seeds: Tensor, key: SampleKey) -> Batch: ...

    def sample_many(self, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]) -> list[Batch]:
        """The batches of ``seed_batches[i]`` under ``keys[i]``, each the same as :meth:`sample` gives alone."""
        ...


class BlockSampler(ABC):
    """The per-layer loop every built-in sampler shares (docs/design.md › Seams › Sampler): a sampler
    writes one layer, :meth:`sample_layer`, and :meth:`sample` walks from the output layer to the input
    layer, each block's src nodes being the next block's dst nodes (DGL's ``BlockSampler``). A sampler that
wraps another one layer by layer (the cooperative sampler's all-to-all between layers) overrides
:meth:`sample_layer` only.

    :meth:`sample_many` samples several batches, one at a time here; the bulk samplers
    (:mod:`betty_trainer.sampling.bulk`) override it to walk the layers of all of them at once.

    Attributes:
        fanouts: one entry per layer, input layer first; ``None`` keeps every in-edge.
        node_cache: ``None`` (no node cache) unless a subclass samples from one.
        bulk: batches the schedule samples at once (:class:`Sampler`); 1 unless a subclass samples in bulk.
        bulk_draw: ``None`` unless a subclass samples in bulk (:class:`Sampler`).
        first_layer: the first layer :meth:`sample` samples (``0``; ``1`` when layer 0 reads the input-feature
            aggregation cache, BatchGNN §3): layers ``first_layer …`` keep their indices, keys and fanouts, so their
            blocks are the uncached batch's.
    """

    fanouts: list[int | None]
    node_cache: NodeSource | None = None
    bulk: int = 1
    bulk_draw: BulkDraw | None = None
    first_layer: int = 0

    @abstractmethod
    def sample_layer(self, dst: Tensor, layer: int, key: SampleKey) -> Block:
        """Block ``layer`` (input layer first) of batch ``key``: its dst nodes are ``dst``.

        Args:
            dst: ``(n,)`` int64 distinct global ids, on the graph's device.
            layer: the block's index, ``0`` the input layer.
            key: the batch's :class:`SampleKey`.

        Returns:
            A :class:`Block` with ``src_nodes[:n] == dst``.
        """

    def sample(self, seeds: Tensor, key: SampleKey) -> Batch:
        """The batch computing ``seeds`` under ``key``.

        Args:
            seeds: ``(B,)`` int64 distinct output node ids, on the graph's device.
            key: the batch's :class:`SampleKey`.

        Returns:
            A :class:`Batch` of ``len(fanouts) − first_layer`` blocks, input layer first.
        """
        dst = seeds.long()
        blocks = []
        for layer in reversed(range(self.first_layer, len(self.fanouts))):
            block = self.sample_layer(dst, layer, key)
            blocks.append(block)
            dst = block.src_nodes
        blocks.reverse()
        return Batch(blocks)

    def sample_many(self, seed_batches: Sequence[Tensor], keys: Sequence[SampleKey]) -> list[Batch]:
        """``sample(seed_batches[i], keys[i])`` for each ``i``, one after the other (a bulk sampler overrides it).

        Args:
            seed_batches: ``k`` tensors of ``(B_i,)`` int64 distinct output node ids, on the graph's device.
            keys: ``k`` :class:`SampleKey`, one per batch.

        Returns:
            ``k`` :class:`Batch`, batch ``i`` what :meth:`sample` gives for ``(seed_batches[i], keys[i])`` alone.
        """
        return [self.sample(seeds, key) for seeds, key in zip(seed_batches, keys, strict=True)]
