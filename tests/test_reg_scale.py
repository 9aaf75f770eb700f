"""REG on a power-law batch, scaled down from ``benchmarks/reg_scale.py`` (issue 7, "REG at scale")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import partition.reg as reg_module
from benchmarks.reg_scale import power_law_graph
from betty_trainer.sampling import sample_batch
from partition import OutputSplitter, make_split, redundancy, slice_layers
from partition.reg import build_reg, hub_threshold, reader_counts


@pytest.fixture(scope="module")
def power_law_batch():
    graph = power_law_graph(50_000, 360_000, 6_000, seed=0)
    seeds = torch.from_numpy(np.random.default_rng(1).choice(graph.num_nodes, 5_000, replace=False))
    return sample_batch(graph, seeds, [10, 25], torch.Generator().manual_seed(0))


def test_clipped_reg_stays_sparse_and_beats_induced_metis(power_law_batch, monkeypatch):
    batch, k = power_law_batch, 8
    block = batch.blocks[-1]
    bound = 20 * block.num_dst  # twice the 2M-node benchmark's MAX_PAIRS per output (2·10⁶ / 200k)
    monkeypatch.setattr(reg_module, "MAX_PAIRS", bound)
    readers = reader_counts(block)
    threshold = hub_threshold(readers, bound)
    assert readers.max() > 20 * threshold, "a power-law batch: some src nodes are read by far more outputs"
    unclipped = build_reg(block, clip_hubs=False)
    splitter = OutputSplitter(block, "reg")
    assert splitter.graph.nnz <= bound < unclipped.nnz / 5, (splitter.graph.nnz, bound, unclipped.nnz)
    reg_plan = make_split(batch.blocks, k=k, partitioner="reg", splitter=splitter)
    metis_plan = make_split(batch.blocks, k=k, partitioner="metis")
    reg_redundancy = redundancy(batch.blocks, reg_plan.sizes)[0]
    metis_redundancy = redundancy(batch.blocks, metis_plan.sizes)[0]
    assert reg_redundancy <= metis_redundancy, (reg_redundancy, metis_redundancy)
    paper = make_split(batch.blocks, k=k, partitioner="reg", splitter=OutputSplitter(block, "reg", graph=unclipped))
    assert reg_redundancy <= redundancy(batch.blocks, paper.sizes)[0], "clipping costs no redundancy here"


def test_plan_slices_equal_the_tensor_path_on_a_power_law_batch(power_law_batch):
    """The compiled CPU slicing the plan uses and the tensor path GPUs take agree on a batch with hubs
    (src nodes read by thousands of outputs, so every micro-batch shares them)."""
    from partition.slicing import slice_block_tensors
    from tests.test_partition import assert_same_slices, slice_with

    batch = power_law_batch
    plan = make_split(batch.blocks, k=8, partitioner="reg")
    assert plan.k == 8
    for group in plan.groups:
        assert_same_slices(slice_layers(batch.blocks, group), slice_with(slice_block_tensors, batch.blocks, group))
