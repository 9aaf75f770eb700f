"""Sampling a batch's blocks (MFGs) from its seed nodes: the :class:`Sampler` seam and the samplers
behind it (DESIGN.md › NS, › Seams)."""

from betty_trainer.sampling.base import SampleKey, Sampler
from betty_trainer.sampling.neighbor import NeighborSampler, floyd_offsets, sample_batch, sample_block

__all__ = ["NeighborSampler", "SampleKey", "Sampler", "floyd_offsets", "sample_batch", "sample_block"]
