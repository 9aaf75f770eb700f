"""The memory-lean aggregation ops (models/aggregate.py): the same math as dense references, on both kernel
paths, and nothing of size (E, F) kept for backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from betty_trainer import Block
from betty_trainer.models import aggregate
from estimator.counts import SHORT_POSITIONS_MAX_DST, LayerCounts, kept_transpose_bytes

CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # float32 results against float64 references


def random_block(num_dst=40, num_src=70, max_degree=9, seed=0) -> Block:
    generator = torch.Generator().manual_seed(seed)
    degrees = torch.randint(0, max_degree, (num_dst,), generator=generator)
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    indptr[1:] = degrees.cumsum(0)
    rows = [torch.randperm(num_src, generator=generator)[:d].sort().values for d in degrees.tolist()]
    return Block(torch.arange(num_src) * 3, num_dst, indptr, torch.cat(rows))


def dense(block: Block, values: torch.Tensor) -> torch.Tensor:
    """``(num_dst, num_src)`` adjacency holding ``values``."""
    matrix = torch.zeros(block.num_dst, block.num_src, dtype=torch.float64)
    matrix[block.edge_dst(), block.indices] = values.double()
    return matrix


WEIGHTINGS = {"sum": (False, False, False), "values": (True, False, False), "mean-like": (False, True, False),
              "gcn-like": (False, True, True), "all": (True, True, True)}
"""``aggregate``'s optional inputs: (values, row_scale, col_scale) given."""


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-cpu-kernel", "tensor-ops"])
@pytest.mark.parametrize("with_self", [False, True])
@pytest.mark.parametrize("weighting", list(WEIGHTINGS))
@pytest.mark.parametrize("width", [6, aggregate.SCATTER_MAX_WIDTH + 8], ids=["scatter", "transpose"])
def test_aggregate_equals_the_dense_product_and_its_gradient(monkeypatch, compiled, with_self, weighting, width):
    if not compiled:
        monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
    block = random_block()
    generator = torch.Generator().manual_seed(1)
    with_values, with_rows, with_cols = WEIGHTINGS[weighting]
    values = torch.rand(block.num_edges, generator=generator) if with_values else None
    row_scale = torch.rand(block.num_dst, generator=generator) if with_rows else None
    col_scale = torch.rand(block.num_src, generator=generator) if with_cols else None
    scale = torch.rand(block.num_dst, generator=generator) if with_self else None
    h = torch.randn(block.num_src, width, generator=generator, requires_grad=True)
    out = aggregate.aggregate(block, h, values, scale, row_scale=row_scale, col_scale=col_scale)
    weights = torch.randn(block.num_dst, width, generator=generator)
    (out * weights).sum().backward()

    h64 = h.detach().double().requires_grad_(True)
    matrix = dense(block, torch.ones(block.num_edges) if values is None else values)
    if with_rows:
        matrix = row_scale.double().unsqueeze(1) * matrix
    if with_cols:
        matrix = matrix * col_scale.double()
    reference = matrix @ h64
    if with_self:
        reference = reference + scale.double().unsqueeze(1) * h64[: block.num_dst]
    (reference * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), reference, **CLOSE)
    torch.testing.assert_close(h.grad.double(), h64.grad, **CLOSE)


@pytest.mark.parametrize("with_values", [False, True])
def test_compiled_transpose_equals_the_tensor_path(monkeypatch, with_values):
    block = random_block(num_dst=300, num_src=500, max_degree=30, seed=4)
    values = torch.rand(block.num_edges) if with_values else None
    compiled = aggregate._transpose(block, values, torch.float32)
    monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
    tensor_ops = aggregate._transpose(block, values, torch.float32)
    assert (compiled[2] is None) == (tensor_ops[2] is None) == (not with_values)
    for left, right in zip(compiled, tensor_ops):
        assert left is None or torch.equal(left.to(right.dtype), right)


@pytest.mark.parametrize("width", [40, aggregate.SCATTER_MAX_WIDTH + 8], ids=["scatter", "transpose"])
def test_compiled_backward_gives_the_same_bits_on_any_thread_count(width):
    """Each src row's gradient sums its edges in dst order whatever the threads: the scatter splits the columns
    among them (width 40: two column blocks on two threads), the gather on ``Aᵀ`` the rows. One thread and two
    give the same gradient, bit for bit."""
    numba = pytest.importorskip("numba")
    block = random_block(num_dst=300, num_src=500, max_degree=30, seed=4)
    generator = torch.Generator().manual_seed(2)
    h = torch.randn(block.num_src, width, generator=generator, requires_grad=True)
    grad = torch.randn(block.num_dst, width, generator=generator)
    threads = numba.get_num_threads()
    gradients = []
    try:
        for count in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(count)
            h.grad = None
            aggregate.mean_neighbours(block, h).backward(grad)
            gradients.append(h.grad.clone())
    finally:
        numba.set_num_threads(threads)
    assert all(torch.equal(gradients[0], other) for other in gradients[1:])


@pytest.mark.parametrize("values", ["none", "the block's own", "others"])
@pytest.mark.parametrize("scales", ["none", "rows", "rows and columns"])
@pytest.mark.parametrize("width", [6, 64, aggregate.SCATTER_MAX_WIDTH + 8])
def test_a_kept_transpose_gives_the_gradient_its_call_would_make(monkeypatch, values, scales, width):
    """With the block's transpose kept (:func:`aggregate.keep_transposes`) the backward gathers on it and makes
    the gradient the call makes without it: the same bits where that call builds the same transpose (wider than
    the scatter), the same sums in another order where it scatters. Values other than the block's own weights
    are not its transpose's: the call runs as without it."""
    block = random_block(num_dst=300, num_src=500, max_degree=30, seed=4)
    generator = torch.Generator().manual_seed(5)
    block.edge_weight = torch.rand(block.num_edges, generator=generator)
    given = {"none": None, "the block's own": block.edge_weight,
             "others": torch.rand(block.num_edges, generator=generator)}[values]
    row_scale = None if scales == "none" else torch.rand(block.num_dst, generator=generator)
    col_scale = torch.rand(block.num_src, generator=generator) if scales == "rows and columns" else None
    h = torch.randn(block.num_src, width, generator=generator, requires_grad=True)
    grad = torch.randn(block.num_dst, width, generator=generator)

    def gradient() -> torch.Tensor:
        h.grad = None
        aggregate.aggregate(block, h, given, row_scale=row_scale, col_scale=col_scale).backward(grad)
        return h.grad.clone()

    made = gradient()
    aggregate.keep_transposes([block], [True])
    kept = block.transpose
    assert kept.pointer.dtype == torch.int32 and kept.positions.dtype == torch.int16  # 300 dst nodes
    if values != "others":  # nothing but the kept transpose may serve
        monkeypatch.setattr(aggregate, "_csr_scatter", None)
        monkeypatch.setattr(aggregate, "_transpose", None)
    with_kept = gradient()
    if width > aggregate.SCATTER_MAX_WIDTH or values == "others":
        assert torch.equal(with_kept, made)
    else:
        torch.testing.assert_close(with_kept, made, **CLOSE)
    aggregate.keep_transposes([block], [False])
    assert block.transpose is None


@pytest.mark.parametrize("num_dst", [SHORT_POSITIONS_MAX_DST, SHORT_POSITIONS_MAX_DST + 1])
def test_a_kept_transpose_at_the_int16_boundary_gives_the_int32_transpose_s_gradient(num_dst):
    """The largest block kept with int16 positions (positions up to 2¹⁵ − 2) and the smallest kept with int32: the
    gather on the kept transpose gives the bits of the gather on the per-call int32 transpose (width 136, above
    the scatter), rows of high positions included, and its bytes are what the estimate counts
    (:func:`estimator.counts.kept_transpose_bytes`)."""
    generator = torch.Generator().manual_seed(7)
    degrees = torch.randint(1, 4, (num_dst,), generator=generator)  # every dst node has in-edges
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    indptr[1:] = degrees.cumsum(0)
    block = Block(torch.arange(num_dst + 10), num_dst, indptr,
                  torch.randint(0, num_dst + 10, (int(indptr[-1]),), generator=generator))
    h = torch.randn(block.num_src, aggregate.SCATTER_MAX_WIDTH + 8, generator=generator, requires_grad=True)
    grad = torch.randn(block.num_dst, h.shape[1], generator=generator)
    aggregate.mean_neighbours(block, h).backward(grad)
    per_call, h.grad = h.grad, None
    aggregate.keep_transposes([block], [True])
    assert block.transpose.positions.dtype == (torch.int16 if num_dst <= SHORT_POSITIONS_MAX_DST else torch.int32)
    assert int(block.transpose.positions.max()) == num_dst - 1
    assert sum(t.numel() * t.element_size() for t in block.transpose.tensors()) == kept_transpose_bytes(
        LayerCounts(block.num_src, block.num_dst, block.num_edges))
    aggregate.mean_neighbours(block, h).backward(grad)
    assert torch.equal(h.grad, per_call)


def test_a_kept_transpose_is_the_block_s_own_and_stays_on_its_device():
    """A kept transpose is the counting sort's CSR of ``Aᵀ`` with the block's weights in its order (its dst
    positions int16 below 2¹⁵ dst nodes: the test above has the boundary); it is among the block's tensors, comes
    along when the block is moved to its own device and is left behind on another."""
    block = random_block(num_dst=300, num_src=500, max_degree=30, seed=4)
    block.edge_weight = torch.rand(block.num_edges)
    aggregate.keep_transposes([block], [True])
    pointer, positions, values = aggregate._transpose(block, block.edge_weight, torch.float32)
    kept = block.transpose
    assert kept.positions.dtype == torch.int16 and sum(t.numel() * t.element_size() for t in kept.tensors()) == \
        kept_transpose_bytes(LayerCounts(block.num_src, block.num_dst, block.num_edges, weighted=True))
    assert torch.equal(kept.pointer, pointer) and torch.equal(kept.positions.int(), positions)
    assert torch.equal(kept.values, values)
    assert all(any(t is held for held in block.tensors()) for t in (kept.pointer, kept.positions, kept.values))
    assert block.to("cpu").transpose is kept
    assert block.to("meta").transpose is None
    with pytest.raises(ValueError, match="keeps no transpose"):
        aggregate.keep_transposes([block.to("meta")], [True])
    assert dataclasses.replace(block, edge_weight=torch.rand(block.num_edges)).transpose is None
    block.edge_weight = torch.rand(block.num_edges)  # other weights: the transpose made of the old ones serves no more
    assert block.transpose is kept
    assert block.kept_transpose is None and block.transpose is None and len(block.tensors()) == 4  # let go
    aggregate.keep_transposes([block], [True])
    assert torch.equal(block.kept_transpose.values, aggregate._transpose(block, block.edge_weight, torch.float32)[2])
    block.edge_weight.mul_(2)  # changed in place: the transpose's values are the old weights
    assert block.kept_transpose is None


def test_mean_sum_and_weighted_mean():
    block = random_block(seed=2)
    h = torch.randn(block.num_src, 5)
    degrees = block.in_degrees().double().clamp(min=1).unsqueeze(1)
    ones = torch.ones(block.num_edges)
    torch.testing.assert_close(aggregate.aggregate(block, h, ones).double(), dense(block, ones) @ h.double(), **CLOSE)
    torch.testing.assert_close(aggregate.mean_neighbours(block, h).double(), dense(block, ones) @ h.double() / degrees, **CLOSE)
    weight = torch.rand(block.num_edges) + 0.1
    weighted = Block(block.src_nodes, block.num_dst, block.indptr, block.indices, weight)
    sums = dense(block, weight).sum(1, keepdim=True).clamp(min=1e-12)
    torch.testing.assert_close(aggregate.mean_neighbours(weighted, h).double(), dense(block, weight) @ h.double() / sums, **CLOSE)


@pytest.mark.parametrize("op", ["mean", "attention"])
def test_nothing_edge_by_feature_sized_is_kept_for_backward(op):
    """What autograd saves for the aggregation is per edge (values, attention, edge ends) or per node,
    never an (E, F) message tensor: the (E, F) bound is what a gather-scatter would keep."""
    block = random_block(num_dst=200, num_src=300, max_degree=20, seed=3)
    width, saved = 64, []
    h = torch.randn(block.num_src, width, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if op == "mean":
            aggregate.mean_neighbours(block, h)
        else:
            z = h.view(block.num_src, 4, width // 4)
            alpha = torch.rand(block.num_edges, 4, requires_grad=True)
            aggregate.attention_aggregate(z, alpha, block.indices, block.edge_dst(), block.num_dst)
    largest_new = max((t.numel() for t in saved if t.data_ptr() != h.data_ptr()), default=0)
    assert largest_new <= block.num_edges * 4 < block.num_edges * width
    if op == "mean":  # a row scale: nothing per edge at all
        assert largest_new <= block.num_dst


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-cpu-kernel", "tensor-ops"])
def test_max_equals_a_per_row_reference_and_its_gradient(monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
        monkeypatch.setattr(aggregate, "MAX_CHUNK_ELEMENTS", 64)  # several chunks of edges
    block = random_block(seed=5)
    generator = torch.Generator().manual_seed(6)
    h = torch.randn(block.num_src, 7, generator=generator, requires_grad=True)
    out = aggregate.max_neighbours(block, h)
    weights = torch.randn(block.num_dst, 7, generator=generator)
    (out * weights).sum().backward()

    h_ref = h.detach().clone().requires_grad_(True)
    rows = [h_ref[block.indices[block.indptr[d]:block.indptr[d + 1]]].max(0).values
            if block.indptr[d + 1] > block.indptr[d] else torch.zeros(7) for d in range(block.num_dst)]
    (torch.stack(rows) * weights).sum().backward()
    assert torch.equal(out, torch.stack(rows))
    torch.testing.assert_close(h.grad, h_ref.grad, **CLOSE)


def test_max_ties_go_to_the_first_edge_on_both_paths(monkeypatch):
    block = random_block(seed=7)
    h = torch.randint(0, 3, (block.num_src, 5)).float().requires_grad_(True)  # many ties
    aggregate.max_neighbours(block, h).sum().backward()
    compiled = h.grad.clone()
    h.grad = None
    monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
    aggregate.max_neighbours(block, h).sum().backward()
    assert torch.equal(compiled, h.grad)
    assert compiled.sum() == sum(1 for d in range(block.num_dst) if block.indptr[d + 1] > block.indptr[d]) * 5


def test_weighted_gcn_aggregator_normalises_by_the_weight_sum():
    """SAGE's gcn aggregator on a weighted block: (h_d + Σ w_e h_s) / (Σ w_e + 1), against a float64 dense
    reference; with unit weights it is the unweighted aggregator exactly (Σ w = the in-degree)."""
    import dataclasses

    from betty_trainer.models.sage import SAGEConv

    block = random_block(seed=3)
    h = torch.randn(block.num_src, 6, generator=torch.Generator().manual_seed(1))
    layer = SAGEConv(6, 4, "gcn")
    weights = torch.rand(block.num_edges, generator=torch.Generator().manual_seed(2)) * 3 + 0.1
    weighted = dataclasses.replace(block, edge_weight=weights)
    adjacency = dense(block, weights)
    reference = (h[: block.num_dst].double() + adjacency @ h.double()) / (adjacency.sum(1, keepdim=True) + 1)
    torch.testing.assert_close(layer.aggregate(weighted, h), reference.float(), **CLOSE)
    ones = dataclasses.replace(block, edge_weight=torch.ones(block.num_edges))
    assert torch.equal(layer.aggregate(ones, h), layer.aggregate(block, h))


def test_weighted_gat_attends_as_if_each_edge_were_repeated_its_weight_times():
    """GAT on a weighted block takes α ∝ w·exp(e): an edge of integer weight w attends exactly as w copies of
    the edge would on an unweighted block (same output and same input gradient, float64)."""
    from betty_trainer.models.gat import GATConv

    generator = torch.Generator().manual_seed(3)
    num_src, num_dst = 12, 5
    indptr, indices, weights = [0], [], []
    for d in range(num_dst):
        sources = [s for s in torch.randperm(num_src, generator=generator).tolist() if s != d][: 2 + d % 3]
        indices += sources
        weights += torch.randint(1, 4, (len(sources),), generator=generator).tolist()
        indptr.append(len(indices))
    repeated_ptr, repeated = [0], []
    for d in range(num_dst):
        for e in range(indptr[d], indptr[d + 1]):
            repeated += [indices[e]] * weights[e]
        repeated_ptr.append(len(repeated))
    src_nodes = torch.arange(num_src)
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    weighted = Block(src_nodes, num_dst, as_long(indptr), as_long(indices), torch.tensor(weights, dtype=torch.float32))
    copies = Block(src_nodes, num_dst, as_long(repeated_ptr), as_long(repeated))
    layer = GATConv(6, 4, heads=2).double()
    h = torch.randn(num_src, 6, dtype=torch.float64, generator=generator)
    outputs, gradients = [], []
    for block in (weighted, copies):
        x = h.clone().requires_grad_(True)
        out = layer(block, x)
        out.pow(2).sum().backward()
        outputs.append(out.detach())
        gradients.append(x.grad)
    assert max(weights) > 1
    # float64: the weighted and the repeated edges sum the same terms in another order (~1e-16 per term)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-12, atol=1e-12)
    unweighted = Block(src_nodes, num_dst, as_long(indptr), as_long(indices))
    assert not torch.allclose(layer(unweighted, h), outputs[0])  # the weights change the attention


@pytest.mark.parametrize("self_loop", [False, True], ids=["mean", "gcn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_rows_off_the_whole_block_equal_the_aggregation_and_its_transpose(self_loop, weighted):
    """``aggregate_rows`` (an affine layer's row block in layer-wise execution) on a range of dst rows equals those
    rows of the whole-block mean (or GCN-style mean with the self loop) against a float64 dense reference, a
    row without in-edges included; ``aggregate_rows_transpose_`` adds the gradient of exactly those rows into
    a sink that already holds something, and leaves rows no edge reaches as they were."""
    pytest.importorskip("numba")
    block = random_block(num_dst=60, num_src=90, max_degree=12, seed=5)
    generator = torch.Generator().manual_seed(3)
    if weighted:
        block.edge_weight = torch.rand(block.num_edges, generator=generator) + 0.1
    values = block.edge_weight if weighted else torch.ones(block.num_edges)
    matrix = dense(block, values)
    if self_loop:
        matrix[torch.arange(block.num_dst), torch.arange(block.num_dst)] += 1
    totals = matrix.sum(1, keepdim=True)
    matrix = torch.where(totals > 0, matrix / totals, matrix)
    begin, end = 20, 45
    rows = torch.arange(begin, end)
    assert (block.in_degrees()[rows] == 0).any()  # a row without in-edges: 0 (mean) or its own row (gcn)
    z = torch.randn(block.num_src, 20, generator=generator)
    out = aggregate.aggregate_rows(block, begin, end, z, self_loop)
    torch.testing.assert_close(out.double(), matrix[rows] @ z.double(), **CLOSE)
    grad = torch.randn(rows.numel(), 20, generator=generator)
    sink = torch.randn(block.num_src, 20, generator=generator)
    before = sink.clone()
    aggregate.aggregate_rows_transpose_(block, begin, grad, sink, self_loop)
    torch.testing.assert_close((sink - before).double(), matrix[rows].T @ grad.double(), **CLOSE)
    reached = (matrix[rows] != 0).any(0)
    assert torch.equal(sink[~reached], before[~reached])


def test_rows_off_the_whole_block_refuse_where_the_compiled_kernels_do_not_run():
    block = random_block()
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        aggregate.aggregate_rows(block, 0, 3, torch.randn(block.num_src, 4, dtype=torch.float64), False)


def test_edge_softmax_is_each_dst_nodes_softmax_with_first_and_second_derivatives():
    """The softmax keeps only its result for backward (one Function, its Jacobian applied in one pass); its values
    are torch.softmax's per dst node, and its first and second derivatives pass gradcheck (float64)."""
    edge_softmax = aggregate.edge_softmax
    torch.manual_seed(0)
    num_dst, edges, heads = 6, 40, 2
    dst = torch.sort(torch.randint(0, num_dst, (edges,))).values
    scores = torch.randn(edges, heads, dtype=torch.float64, requires_grad=True)
    alpha = edge_softmax(scores, dst, num_dst)
    for d in range(num_dst):
        if (dst == d).any():
            torch.testing.assert_close(alpha[dst == d], torch.softmax(scores[dst == d], 0))
    assert torch.autograd.gradcheck(lambda s: edge_softmax(s, dst, num_dst), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: edge_softmax(s, dst, num_dst), (scores,))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-cpu-kernel", "tensor-ops"])
def test_max_of_a_block_without_edges_is_zeros_on_both_paths(monkeypatch, compiled):
    """Dst nodes without in-edges (isolated outputs, a chunk of them): zeros, and no gradient reaches ``h``."""
    if not compiled:
        monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
    block = Block(torch.arange(3), 2, torch.zeros(3, dtype=torch.int64), torch.empty(0, dtype=torch.int32), None)
    h = torch.randn(3, 4, requires_grad=True)
    out = aggregate.max_neighbours(block, h)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(2, 4)) and torch.equal(h.grad, torch.zeros(3, 4))


def test_a_nan_maximum_sends_its_gradient_to_its_own_row_s_first_edge_on_both_paths(monkeypatch):
    """A NaN among a row's values is that column's maximum on both paths, and its gradient goes to the row's own
    edge (the first), never to another row's source."""
    block = Block(torch.arange(4), 2, torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    h = torch.tensor([[float("nan"), 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]])
    grads = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(aggregate, "compiled_kernels", lambda device, dtype: False)
        x = h.clone().requires_grad_(True)
        out = aggregate.max_neighbours(block, x)
        out.sum().backward()
        assert out[0, 0].isnan() and torch.equal(out[1], torch.tensor([6.0, 7.0]))
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert grads[1][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
