"""Batch-level partitioning (Betty §4.2–4.3): REG, partitioners, micro-batch slicing, redundancy.

This package works on block *structure* (any object with ``indptr``, ``indices``,
``num_dst`` and ``num_src``, see :class:`partition.slicing.BlockStructure`) and never
imports the trainer.
"""

from partition.partitioners import PARTITIONERS, GraphPartition, OutputSplitter, partition_outputs
from partition.redundancy import redundancy
from partition.reg import build_reg
from partition.search import BudgetError, Split, make_split
from partition.slicing import BlockStructure, LayerSlice, SliceSize, slice_layers

__all__ = [
    "PARTITIONERS",
    "BlockStructure",
    "BudgetError",
    "GraphPartition",
    "LayerSlice",
    "OutputSplitter",
    "SliceSize",
    "Split",
    "build_reg",
    "make_split",
    "partition_outputs",
    "redundancy",
    "slice_layers",
]
