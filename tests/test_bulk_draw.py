"""The memory of a bulk draw (betty_trainer/sampling/bulk.py › BulkSampler.draw_bytes): real draws measured at or
under the stated bytes, ``sampling.bulk: auto`` taking the most batches whose draw fits ``sampling.bulk_memory``,
and the memory plan counting the draw (on a GPU, off the step's budget; on the CPU, reported)."""

from __future__ import annotations

import logging
import tracemalloc

import pytest
import torch

from betty_trainer import Graph
from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.memory.planner import Planner, make_planner
from betty_trainer.sampling import SampleKey
from betty_trainer.sampling import bulk as bulk_module
from betty_trainer.sampling.bulk import BulkDraw, BulkLadiesSampler, BulkNeighborSampler
from betty_trainer.sampling.schedule import batch_rounds, batches_per_epoch, epoch_seeds, first_batch, make_sampler
from betty_trainer.training.dry_run import dry_run
from estimator.measure import measure_peak
from tests.test_sampling_bulk import assert_same_batch

SAMPLERS = {"ns-10-10": (BulkNeighborSampler, [10, 10]), "ns-full-5": (BulkNeighborSampler, [None, 5]),
            "ladies-256": (BulkLadiesSampler, [256, 256]), "ladies-full-64": (BulkLadiesSampler, [None, 64])}

LOOSENESS = 3.5
"""How far above a measured draw its stated bytes may be where the bound's counts are reached (every in-degree
above the fanouts, few repeated src nodes). The bound adds up, per layer, the phase of the code whose live
tensors are largest, counting some temporaries for longer than they live (up to about 2× on the tensor ops: the
measurements below give 1.8× to 2.1×), and sizes the numba kernel's hash table at its worst fill, a power of two up
to twice the ids it holds (up to 3.1× for one batch, whose table weighs most)."""


def measured_draw_bytes(sampler, seeds: list[torch.Tensor], keys: list[SampleKey]) -> int:
    """The peak bytes one ``sample_many`` allocates: torch's allocator's peak from the profiler's records
    (:func:`estimator.measure.measure_peak`) plus the numba kernels' arrays' peak (numba's runtime allocates
    through CPython's allocator, which ``tracemalloc`` follows; so do the draw's Python objects), each from its
    own run of the same draw after a warm-up one (numba compiles on first call). The sum of the two peaks is at
    least the peak of the two together, so the checks of the stated bytes against it are on the safe side."""
    draw = lambda: sampler.sample_many(seeds, keys)  # noqa: E731
    draw()
    torch_peak = measure_peak(draw, "cpu").peak_bytes
    tracemalloc.start()
    try:
        draw()
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return torch_peak + python_peak


@pytest.fixture(scope="module")
def regular_graph():
    """200,000 nodes of in-degree 12 (11 for a few: duplicates dropped), sources uniform: every row keeps its full
    fanout, and 16 batches of 64 seeds reach few nodes twice, so the bound's counts are nearly reached."""
    generator = torch.Generator().manual_seed(0)
    nodes, degree = 200_000, 12
    dst = torch.arange(nodes).repeat_interleave(degree)
    src = torch.randint(0, nodes, (nodes * degree,), generator=generator)
    empty = torch.empty(0, dtype=torch.int64)
    return Graph.from_edges(src, dst, nodes, symmetric=False, x=torch.zeros(nodes, 1),
                            y=torch.zeros(nodes, dtype=torch.long), train_idx=torch.arange(nodes), val_idx=empty,
                            test_idx=empty)


def draw_of(graph: Graph, k: int, batch_size: int, seed: int = 0) -> tuple[list[torch.Tensor], list[SampleKey]]:
    order = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(seed))
    return list(order[:k * batch_size].split(batch_size)), [SampleKey(1, 0, i) for i in range(k)]


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("kernel", ["tensor", "numba"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_draw_measures_at_most_its_stated_bytes_and_not_far_below(regular_graph, name, kernel, k):
    """Tensor ops (the code a GPU runs) and the CPU kernels: ``measured ≤ stated ≤ LOOSENESS × measured``."""
    cls, fanouts = SAMPLERS[name]
    sampler = cls(regular_graph, fanouts, kernel=kernel)
    measured = measured_draw_bytes(sampler, *draw_of(regular_graph, k, 64))
    stated = sampler.draw_bytes(k, 64)
    assert measured <= stated <= LOOSENESS * measured, (measured, stated, stated / measured)


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("kernel", ["tensor", "numba"])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_draws_with_hubs_and_either_extraction_measure_at_most_their_stated_bytes(cora, name, kernel, dense,
                                                                                  monkeypatch):
    """Cora (hubs of in-degree up to 168) with the extraction's dense arrays (its default there) and without them
    (the sort, the kernel's hash tables): the bound holds whichever branch runs, for 1 and 8 batches of 128."""
    if not dense:
        monkeypatch.setattr(bulk_module, "_DENSE_RELABEL", 0)
    cls, fanouts = SAMPLERS[name]
    sampler = cls(cora, fanouts, kernel=kernel)
    for k in (1, 8):
        measured = measured_draw_bytes(sampler, *draw_of(cora, k, 128, seed=k))
        assert measured <= sampler.draw_bytes(k, 128), (k, measured, sampler.draw_bytes(k, 128))


def test_the_measurement_catches_a_bound_of_the_blocks_alone(regular_graph, monkeypatch):
    """Guard: stating only the blocks a draw returns (no intermediates of ``P = Q·A``, the draw or the extraction)
    is caught by the measurement the tests above rely on."""
    monkeypatch.setattr(BulkNeighborSampler, "_layer_bytes", lambda self, stack, index: 0)
    sampler = BulkNeighborSampler(regular_graph, [10, 10], kernel="tensor")
    assert measured_draw_bytes(sampler, *draw_of(regular_graph, 16, 64)) > sampler.draw_bytes(16, 64)


def test_the_stated_bytes_grow_with_k_and_with_the_batch(cora):
    sampler = BulkNeighborSampler(cora, [5, 10])
    by_k = [sampler.draw_bytes(k, 64) for k in range(1, 10)]
    assert all(a < b for a, b in zip(by_k, by_k[1:]))
    assert sampler.draw_bytes(4, 32) < sampler.draw_bytes(4, 64)
    assert sampler.bulk_for_cap(by_k[3], 64, 9) == 4 and sampler.bulk_for_cap(by_k[3] - 1, 64, 9) == 3
    assert sampler.bulk_for_cap(by_k[0] - 1, 64, 9) == 0 and sampler.bulk_for_cap(10 * by_k[-1], 64, 9) == 9


# ---------------------------------------------------------------- sampling.bulk: auto


@pytest.mark.parametrize("sampler_name", ["bulk-ns", "bulk-ladies"])
def test_auto_takes_the_most_batches_whose_draw_fits_the_cap(cora, sampler_name):
    """A cap between the bytes of 3 and 4 batches gives k = 3 (and one byte less than 3's gives 2); the batches of
    the epoch are NS's (bulk-ns) or the explicit k's (bulk-ladies), bit for bit."""
    overrides = [f"sampling.sampler={sampler_name}", "sampling.fanouts=[5,10]", "sampling.batch_size=16",
                 "model.num_layers=2"]
    probe = make_sampler(load_config(None, [*overrides, "sampling.bulk=1"]), cora)
    three, four = probe.draw_bytes(3, 16), probe.draw_bytes(4, 16)
    for cap, k in ((three, 3), ((three + four) // 2, 3), (four - 1, 3), (four, 4), (three - 1, 2)):
        config = load_config(None, [*overrides, f"sampling.bulk_memory={cap}"])
        assert config.sampling.bulk == "auto"
        sampler = make_sampler(config, cora)
        assert sampler.bulk == k, (cap, sampler.bulk)
        assert sampler.bulk_draw == BulkDraw(k, cap, 16, probe.draw_bytes(k, 16), 0, "cpu")
        assert sampler.bulk_draw.device_bytes == 0, "host bytes on the CPU: reported, not taken off a device budget"

    config = load_config(None, [*overrides, f"sampling.bulk_memory={three}"])
    reference = load_config(None, [*overrides, "sampling.bulk=1", "sampling.sampler=ns"]) \
        if sampler_name == "bulk-ns" else load_config(None, [*overrides, "sampling.bulk=1"])
    seeds = epoch_seeds(config, cora, 0)
    assert len(seeds) == batches_per_epoch(config, cora) == 9
    ours = [b for r in batch_rounds(config, make_sampler(config, cora), seeds, 0, row_bytes=4) for b in r.batches]
    theirs = [b for r in batch_rounds(reference, make_sampler(reference, cora), seeds, 0, row_bytes=4)
              for b in r.batches]
    assert len(ours) == len(theirs) == 9
    for (key, _, batch), (their_key, _, their_batch) in zip(ours, theirs):
        assert key == their_key
        if sampler_name == "bulk-ns":
            assert_same_batch(their_batch, batch)
        else:
            for a, b in zip(their_batch.blocks, batch.blocks):
                assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indices, b.indices)
                assert torch.equal(a.edge_weight, b.edge_weight)


def test_auto_is_capped_by_the_epoch_and_one_batch_over_the_cap_warns(cora, caplog):
    overrides = ["sampling.sampler=bulk-ns", "sampling.fanouts=[5,10]", "sampling.batch_size=16"]
    assert make_sampler(load_config(None, [*overrides, "sampling.bulk_memory=1GiB"]), cora).bulk == 9
    with caplog.at_level(logging.WARNING, logger="betty_trainer.sampling.bulk"):
        sampler = make_sampler(load_config(None, [*overrides, "sampling.bulk_memory=1KiB"]), cora)
    assert sampler.bulk == 1 and sampler.bulk_draw.bulk_memory == 1024
    assert [r.getMessage() for r in caplog.records if "sampling.bulk_memory" in r.getMessage()] == [
        f"sampling.bulk=auto: one batch's draw may take {sampler.draw_bytes(1, 16)} bytes, above "
        "sampling.bulk_memory (1024 bytes); drawing one batch at a time"]
    explicit = make_sampler(load_config(None, [*overrides, "sampling.bulk=5", "sampling.bulk_memory=1KiB"]), cora)
    assert explicit.bulk == 5 and explicit.bulk_draw.bulk_memory is None, "an explicit k is used as given"
    assert explicit.bulk_draw.draw_bytes == explicit.draw_bytes(5, 16)
    full = make_sampler(load_config(None, ["sampling.sampler=bulk-ns", "sampling.fanouts=[5,10]"]), cora)
    assert (full.bulk, full.bulk_draw.batch_size) == (1, cora.train_idx.numel()), "the full batch: one a draw"
    assert make_sampler(load_config(None, ["sampling.fanouts=[5,10]"]), cora).bulk_draw is None


# ---------------------------------------------------------------- the memory plan


def test_the_plan_takes_a_gpu_draw_off_a_gpu_budget_and_reports_a_host_draw(cora):
    """``sampling.device: cuda`` (its record made here without a GPU): where the step trains on CUDA, the structure
    and the draw's bytes are the budget's ``sampler_bytes``; a step on the CPU keeps its budget (host memory), as it
    does with a draw on the CPU, which is reported under ``sampling``."""
    config = load_config(None, ["sampling.sampler=bulk-ns", "sampling.fanouts=[5,10]", "sampling.batch_size=16",
                                "micro_batch.budget=64MiB", "micro_batch.safety_margin=0", "train.device=cpu"])
    sampler = make_sampler(config, cora)
    batch = first_batch(config, cora, sampler)
    features = HostFeatureStore(cora.x)
    host = make_planner(config, cora, None, torch.device("cpu"), features, bulk_draw=sampler.bulk_draw)
    report = host.report(host.plan(batch))
    assert report["sampling"] == {**sampler.bulk_draw.report(), "device_bytes": 0}
    assert report["memory_terms"]["sampler_bytes"] == 0 and host.budget == 64 * 2**20

    structure = cora.indptr.nbytes + cora.indices.nbytes
    gpu_draw = BulkDraw(sampler.bulk, config.sampling.bulk_memory, 16, sampler.bulk_draw.draw_bytes, structure, "cuda")
    assert gpu_draw.device_bytes == structure + sampler.bulk_draw.draw_bytes
    cpu_step = make_planner(config, cora, None, torch.device("cpu"), features, bulk_draw=gpu_draw)
    assert cpu_step.report(cpu_step.plan(batch))["memory_terms"]["sampler_bytes"] == 0
    assert cpu_step.budget == 64 * 2**20, "GPU bytes are not taken off a CPU step's budget"
    gpu = Planner(config.micro_batch, host.estimator, torch.device("cuda"), bulk_draw=gpu_draw)  # no CUDA call
    terms = gpu.memory_terms()
    assert terms["sampler_bytes"] == gpu_draw.device_bytes
    assert gpu.budget == terms["step_bytes"] == 64 * 2**20 - terms["allocator_margin"] - gpu_draw.device_bytes


def test_betty_train_plan_shows_the_draw(cora, planetoid_dir):
    config = load_config(None, [f"dataset.data_dir={planetoid_dir}", "dataset.name=cora", "sampling.sampler=bulk-ns",
                                "sampling.fanouts=[5,10]", "sampling.batch_size=16", "train.device=cpu"])
    draw = dry_run(config, graph=cora)["sampling"]
    sampler = BulkNeighborSampler(cora, [5, 10])
    assert draw == {"bulk": 9, "bulk_memory": 128 * 2**20, "batch_size": 16, "draw_bytes": sampler.draw_bytes(9, 16),
                    "structure_bytes": 0, "device": "cpu", "device_bytes": 0}
