"""Sampling a batch's blocks (MFGs) from its seed nodes: the :class:`Sampler` seam and the samplers
behind it: full, NS, bulk NS and LADIES, LABOR, GNS (docs/design.md › NS, LABOR, GNS, › Seams)."""

from betty_trainer.sampling.base import SampleKey, Sampler
from betty_trainer.sampling.bulk import BulkLadiesSampler, BulkNeighborSampler
from betty_trainer.sampling.gns import GNSSampler
from betty_trainer.sampling.labor import LaborSampler
from betty_trainer.sampling.neighbor import NeighborSampler, floyd_offsets, sample_batch, sample_block

__all__ = ["BulkLadiesSampler", "BulkNeighborSampler", "GNSSampler", "LaborSampler", "NeighborSampler", "SampleKey", "Sampler",
           "floyd_offsets", "sample_batch", "sample_block"]
