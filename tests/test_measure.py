"""The measured peak (estimator.measure, betty_trainer.execution.micro_batches): exact on allocations whose peak is known by hand.

Tolerance: ``SLACK`` bytes above the hand-computed peak. The only allocations a step
makes besides the tensors counted by hand are 0-d scalars (4–8 bytes: a loss, NLL's
total weight, a Python number wrapped as a tensor); the profiler itself allocates no
tensors. 4 KiB is far above that and far below every size the tests distinguish (≥ 256 KB).
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import estimator
from betty_trainer import GraphSAGE, make_sbm, sample_batch
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.execution.micro_batches import measure_training_step
from estimator import MeasuredPeak, measure_peak
from estimator.measure import CPU_METHOD, CUDA_METHOD, storage_bytes

MB = 1_000_000
SLACK = 4096
CPU = torch.device("cpu")


def assert_step_peak(measured: MeasuredPeak, expected_step_bytes: int) -> None:
    """The step's own peak (above resident) is ``expected_step_bytes`` up to ``SLACK``."""
    step_bytes = measured.peak_bytes - measured.resident_bytes
    assert expected_step_bytes <= step_bytes <= expected_step_bytes + SLACK, (step_bytes, expected_step_bytes)


def test_overlapping_allocations_add_up():
    def step():
        first = torch.empty(10 * MB, dtype=torch.uint8)
        second = torch.empty(20 * MB, dtype=torch.uint8)  # allocated while `first` is alive
        del first, second

    measured = measure_peak(step, CPU)
    assert measured == MeasuredPeak(measured.peak_bytes, 0, "cpu", CPU_METHOD)
    assert_step_peak(measured, 30 * MB)


def test_frees_are_replayed_in_order():
    def step():
        first = torch.empty(10 * MB, dtype=torch.uint8)
        del first
        second = torch.empty(20 * MB, dtype=torch.uint8)
        del second

    assert_step_peak(measure_peak(step, CPU), 20 * MB)  # not 30 MB: `first` is gone when `second` arrives


def test_resident_storages_are_counted_once():
    weight = torch.empty(1000, 1000)  # 4 MB
    other = torch.empty(250, dtype=torch.float64)  # 2 KB
    resident = [weight, weight.t(), weight[:10], weight.view(-1), other]
    measured = measure_peak(lambda: torch.empty(MB, dtype=torch.uint8), CPU, resident)
    assert measured.resident_bytes == storage_bytes(resident) == 4 * MB + 2000
    assert_step_peak(measured, MB)


def test_nested_ops_count_once_where_inclusive_figures_overstate():
    # a.float() runs aten::to → aten::_to_copy → aten::empty_strided: one 40 MB allocation, three nested ops.
    a = torch.zeros(10 * MB, dtype=torch.uint8)
    measured = measure_peak(a.float, CPU, [a])
    assert measured.resident_bytes == 10 * MB
    assert_step_peak(measured, 40 * MB)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a.float()
    inclusive = sum(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)
    assert inclusive >= 3 * 40 * MB  # what replaying the inclusive per-op figure would count


def test_temporary_freed_inside_an_op_is_seen():
    # Without autograd, cross_entropy's log_softmax output (N × C float32) lives only inside the op;
    # the op's net (self) memory is a 4-byte scalar, the peak is the temporary plus that scalar.
    logits, target = torch.randn(100_000, 10), torch.randint(10, (100_000,))
    measured = measure_peak(lambda: F.cross_entropy(logits, target, reduction="sum"), CPU, [logits, target])
    assert_step_peak(measured, 100_000 * 10 * 4)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        F.cross_entropy(logits, target, reduction="sum")
    assert sum(event.self_cpu_memory_usage for event in prof.events()) <= 16  # the net figure misses it


def test_matmul_chain_peaks_at_two_live_products():
    a, b = torch.randn(1000, 1000), torch.randn(1000, 1000)  # 4 MB each

    def step():
        h = a
        for _ in range(5):
            h = h @ b  # the previous product is freed only after the next one exists
        return h

    measured = measure_peak(step, CPU, [a, b])
    assert measured.resident_bytes == 8 * MB
    assert_step_peak(measured, 8 * MB)  # 5 products of 4 MB are allocated, at most 2 at a time


def test_mlp_forward_backward_matches_hand_count():
    batch, d_in, hidden, classes = 512, 256, 512, 128
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d_in, generator=generator)
    y = torch.randint(classes, (batch,), generator=generator)
    w1 = torch.randn(d_in, hidden, generator=generator).requires_grad_()
    w2 = torch.randn(hidden, classes, generator=generator).requires_grad_()

    def step():
        F.cross_entropy(torch.relu(x @ w1) @ w2, y, reduction="sum").backward()

    # Forward keeps r = relu(x·w1) (B×H; x·w1 itself is freed after relu) and log_softmax (B×C).
    # Backward: ∂logits (B×C), then ∂w2 (H×C, kept as .grad) and ∂r (B×H); ∂logits is freed;
    # relu's backward allocates ∂h (B×H) while r and ∂r are alive → 3·B·H + H·C float32,
    # which exceeds the forward peak 2·B·H and the w2 backward 2·B·H + B·C + H·C since H > C.
    measured = measure_peak(step, CPU, [x, y, w1, w2])
    assert measured.resident_bytes == (batch * d_in + d_in * hidden + hidden * classes) * 4 + batch * 8
    assert_step_peak(measured, (3 * batch * hidden + hidden * classes) * 4)
    assert w1.grad is not None and w2.grad is not None


def test_block_from_an_earlier_profiled_step_freed_now_is_ignored():
    kept = [torch.empty(0)]
    measure_peak(lambda: kept.__setitem__(0, torch.empty(7 * MB, dtype=torch.uint8)), CPU)

    def step():
        kept.clear()  # the profiler reports this free (−7 MB): it saw the block allocated last time
        return torch.empty(MB, dtype=torch.uint8)

    assert_step_peak(measure_peak(step, CPU), MB)  # a plain running sum would say 0


def test_bad_device_resident_and_nested_profiler_are_refused():
    with pytest.raises(ValueError, match="cannot measure memory on device 'meta'"):
        measure_peak(lambda: None, "meta")
    with pytest.raises(ValueError, match="resident tensor on meta"):
        measure_peak(lambda: None, CPU, [torch.empty(3, device="meta")])
    with profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="inside another torch profiler"):
            measure_peak(lambda: None, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_includes_what_was_allocated_before():
    # Sizes in whole 2 MiB: the caching allocator rounds a block up to 512 B and, for a large request, may hand
    # out its whole new segment (rounded to 2 MiB) when the remainder is under 1 MiB, so 1e6-byte sizes do not
    # add up exactly in max_memory_allocated (this test failed on an H100 with MB = 10**6).
    mib = 2**20
    torch.cuda.empty_cache()  # no cached block left by an earlier test can serve (and round up) these requests
    before = torch.empty(5 * mib, dtype=torch.uint8, device="cuda")

    def step():
        first = torch.empty(10 * mib, dtype=torch.uint8, device="cuda")
        second = torch.empty(20 * mib, dtype=torch.uint8, device="cuda")
        del first, second

    measured = measure_peak(step, "cuda")
    assert measured.method == CUDA_METHOD and measured.device.startswith("cuda:")
    assert measured.resident_bytes >= before.numel()
    assert measured.peak_bytes - measured.resident_bytes == 30 * mib


@pytest.fixture(scope="module")
def sbm_setup():
    graph = make_sbm(num_nodes=2000, num_features=64, seed=0)
    batch = sample_batch(graph, graph.train_idx, [10, 5], torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GraphSAGE(graph.num_features, 32, graph.num_classes, 2, dropout=0.5)
    return graph, batch, model


def test_training_step_peak(sbm_setup):
    graph, batch, template = sbm_setup
    model = copy.deepcopy(template)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    input_bytes = batch.input_nodes.numel() * graph.num_features * 4
    block_bytes = storage_bytes(t for b in batch.blocks for t in (b.src_nodes, b.indptr, b.indices))
    before = [p.detach().clone() for p in params]

    first = measure_training_step(model, optimizer, batch, HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    assert first.resident_bytes == param_bytes + block_bytes  # no gradients (set to None), no Adam state yet
    # x (gathered in the step) and the new gradients are both alive at the end of backward.
    assert first.peak_bytes >= first.resident_bytes + input_bytes + param_bytes
    assert all(p.grad is not None for p in params)
    assert any(not torch.equal(p, q) for p, q in zip(params, before))  # a real step

    for p in params:
        p.grad.fill_(1e6)  # stale gradients are dropped (set to None) before the step, not accumulated into
    second = measure_training_step(model, optimizer, batch, HostFeatureStore(graph.x, pin=False), graph.y, CPU)
    assert all(p.grad.abs().max() < 1e5 for p in params)
    state_bytes = sum(v.nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    assert state_bytes >= 2 * param_bytes  # Adam's two moments
    assert second.resident_bytes == param_bytes + block_bytes + state_bytes
    assert second.peak_bytes > second.resident_bytes + input_bytes

    # a later micro-batch of a batch: the earlier ones' gradients are resident and the new ones are added to them
    third = measure_training_step(model, optimizer, batch, HostFeatureStore(graph.x, pin=False), graph.y, CPU, accumulate=True)
    assert third.resident_bytes == second.resident_bytes + param_bytes
    assert third.peak_bytes > second.peak_bytes


def test_training_step_loss_divisor(sbm_setup):
    graph, batch, template = sbm_setup
    deltas = []
    for num_outputs in (None, 2 * batch.output_nodes.numel()):
        model = copy.deepcopy(template)
        measure_training_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch,
                              HostFeatureStore(graph.x, pin=False), graph.y, CPU, num_outputs)
        deltas.append(torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), template.parameters())]))
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[1], deltas[0] / 2)  # float32 defaults: one halving and round-off in p − q


def test_estimator_does_not_import_betty_trainer():
    """Imports flow betty_trainer → estimator, never back (checked on every module of the package)."""
    package = Path(estimator.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] == "betty_trainer" for name in names), f"{path} imports {names}"
