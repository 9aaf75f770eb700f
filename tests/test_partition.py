"""Micro-batch slicing invariants, REG construction and redundancy (Betty §4.2.3, §4.3)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty_trainer import Block, plan_micro_batches, sample_batch
from partition import PARTITIONERS, build_reg, partition_outputs, redundancy
from partition.metis import metis_kway

from tests.test_sampling import global_edges


def reachable_edges(batch, outputs):
    """Reference slicing by plain set traversal: per layer, the full batch's edges reachable from ``outputs``."""
    per_layer, frontier = [], set(outputs)
    for block in reversed(batch.blocks):
        kept = {(s, d) for s, d in global_edges(block) if d in frontier}
        per_layer.append(kept)
        frontier = frontier | {s for s, _ in kept}
    return per_layer[::-1]


@pytest.mark.parametrize("fanouts", [[None, None], [3, 5]])
@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_micro_batches_partition_outputs_and_hold_exactly_reachable_edges(cora, fanouts, partitioner):
    batch = sample_batch(cora, cora.train_idx, fanouts, torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, 4, partitioner, seed=0)
    outputs = torch.cat([mb.output_nodes for mb in micro_batches])
    assert sorted(outputs.tolist()) == sorted(batch.output_nodes.tolist()), "each output in exactly one micro-batch"
    for mb in micro_batches:
        expected = reachable_edges(batch, set(mb.output_nodes.tolist()))
        for layer, block in enumerate(mb.blocks):
            assert global_edges(block) == expected[layer]
            assert block.num_edges == len(expected[layer]), "no duplicate edges"
            endpoints = {s for s, _ in expected[layer]} | set(block.dst_nodes.tolist())
            assert set(block.src_nodes.tolist()) == endpoints, "src nodes: the dst nodes and the edges' sources only"
        for lower, upper in zip(mb.blocks[:-1], mb.blocks[1:]):
            assert torch.equal(lower.dst_nodes, upper.src_nodes)


def test_reg_counts_shared_in_neighbours():
    # dst 0 <- {2, 3, 4}; dst 1 <- {3, 4}; dst 2 <- {4} (src positions; dst nodes are src 0..2)
    block = Block(torch.arange(5), 3, torch.tensor([0, 3, 5, 6]), torch.tensor([2, 3, 4, 3, 4, 4]))
    reg = build_reg(block).toarray()
    assert reg.tolist() == [[0, 2, 1], [2, 0, 1], [1, 1, 0]]
    assert build_reg(block, weighted=False).toarray().tolist() == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]


def cycle_with_weights(weights):
    """Symmetric CSR of the 4-cycle 0-1-2-3-0 with the given weights of edges 01, 12, 23, 30."""
    edges = [(0, 1), (1, 2), (2, 3), (3, 0)]
    rows = [a for a, b in edges] + [b for a, b in edges]
    cols = [b for a, b in edges] + [a for a, b in edges]
    return sp.csr_matrix((np.array(weights * 2, dtype=np.int64), (rows, cols)), shape=(4, 4))


def test_metis_uses_edge_weights():
    """On a 4-cycle both 2-2 cuts cut two edges; only the weights decide which pair stays together."""
    parts = metis_kway(cycle_with_weights([100, 1, 100, 1]), 2, seed=0)
    assert parts[0] == parts[1] and parts[2] == parts[3] and parts[0] != parts[2]
    parts = metis_kway(cycle_with_weights([1, 100, 1, 100]), 2, seed=0)
    assert parts[1] == parts[2] and parts[3] == parts[0] and parts[0] != parts[1]


@pytest.mark.parametrize("dataset", ["cora", "citeseer"])
def test_reg_has_lowest_input_redundancy_at_k8(dataset, request):
    graph = request.getfixturevalue(dataset)
    batch = sample_batch(graph, graph.train_idx, [None, None])
    input_redundancy = {}
    for name in ("reg", "range", "random"):
        micro_batches = plan_micro_batches(batch, 8, name, seed=0)
        input_redundancy[name] = redundancy(batch.blocks, [mb.blocks for mb in micro_batches])[0]
    assert input_redundancy["reg"] < input_redundancy["range"]
    assert input_redundancy["reg"] < input_redundancy["random"]


def test_redundancy_is_one_for_a_single_micro_batch(cora):
    batch = sample_batch(cora, cora.train_idx, [None, None])
    assert redundancy(batch.blocks, [batch.blocks]) == [1.0, 1.0]


def test_partitions_are_deterministic_and_balanced(cora):
    batch = sample_batch(cora, cora.train_idx, [None, None])
    for name in PARTITIONERS:
        one = partition_outputs(batch.blocks[-1], 4, name, seed=7)
        two = partition_outputs(batch.blocks[-1], 4, name, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(one, two))
        sizes = [g.numel() for g in one]
        assert max(sizes) <= 1.1 * 140 / 4 + 1, (name, sizes)


def test_bad_partition_requests(cora):
    batch = sample_batch(cora, cora.train_idx[:3], [None, None])
    with pytest.raises(ValueError, match="unknown partitioner"):
        partition_outputs(batch.blocks[-1], 2, "spectral")
    with pytest.raises(ValueError, match="cannot split 3 output nodes into 4"):
        partition_outputs(batch.blocks[-1], 4, "reg")
