"""The memory promise on a real GPU: estimates against ``torch.cuda.max_memory_allocated``, a real out-of-memory
error recovered exactly, ``budget: auto`` from NVML, the node cache's host→device bytes.

Skipped without a CUDA GPU (CI has none). The CPU tests of the same paths are tests/test_device.py and
tests/test_planner.py (the out-of-memory re-plan with an injected ``torch.cuda.OutOfMemoryError``).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from betty_trainer.config import load_config
from betty_trainer.data.cache import CachedFeatureStore
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.datasets import load_dataset
from betty_trainer.memory.budget import resolve_budget
from betty_trainer.memory.device import allocator_margin, device_workspace
from betty_trainer.memory.planner import make_planner
from betty_trainer.models import set_dropout_key
from betty_trainer.process import allocator_setting
from betty_trainer.sampling.schedule import first_batch
from betty_trainer.training.checkpoint import load_checkpoint
from betty_trainer.training.trainer import init_model, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
GRAPH = {"num_nodes": 20_000, "num_features": 128, "avg_degree": 10, "train_per_class": 400, "num_val": 20,
         "num_test": 20}
BASE = ["train.device=cuda", "train.progress=false", "model.hidden=64", "sampling.fanouts=[10,10]"] + [
    f"dataset.synthetic.{key}={value}" for key, value in GRAPH.items()]
OOM_GRAPH = {"num_nodes": 200_000, "num_features": 256, "avg_degree": 10, "train_per_class": 2000, "num_val": 20,
             "num_test": 20}  # 10,000 seeds, fanouts 5,5: K = 8 needs well under half of K = 1's peak
MODELS = {
    "sage-mean": ["model.arch=sage", "model.aggregator=mean"],
    "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
    "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
    "sage-lstm": ["model.arch=sage", "model.aggregator=lstm"],
    "gcn": ["model.arch=gcn"],
    "gat": ["model.arch=gat"],
}


def _others_bytes() -> int:
    """Bytes this process holds on the device that no estimate counts (earlier tests' tensors): allocated now, less
    the BLAS workspaces (measured first, so that they exist), which every estimate counts."""
    workspace = device_workspace(CUDA)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(CUDA) - workspace


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_estimate_matches_max_memory_allocated(name, k):
    config = load_config(None, BASE + MODELS[name] + [f"micro_batch.num_micro_batches={k}"])
    graph = load_dataset(config.dataset)
    others = _others_bytes()
    planner = make_planner(config, graph, None, CUDA, HostFeatureStore(graph.x, pin=True))  # no cache configured
    plan = planner.plan(first_batch(config, graph))
    model = init_model(config, graph).to(CUDA)
    set_dropout_key(model, config.seed, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    measured = plan.measure(model, optimizer, HostFeatureStore(graph.x, pin=True), graph.y, CUDA)
    report = planner.report(plan, measured)
    assert report["memory_terms"]["device_workspace"] > 0, "cuBLAS keeps a workspace on every GPU"
    errors = []
    for row, peak in zip(report["pieces"], measured):
        estimate, own = row["estimate"]["peak_bytes"], peak - others
        assert row["estimate"]["at_peak"]["device_workspace"] == report["memory_terms"]["device_workspace"]
        errors.append((estimate - own) / own)
    print(f"{name}, K = {k}: errors {[f'{error:+.2%}' for error in errors]}")
    # issue 22 item 5's bounds: no micro-batch above its estimate by more than 1%, and within 2% beyond the measured
    # fixed cost (the CPU's is 0). On an H200 (torch 2.11,
    # 2026-11-27) every model but GAT was within -0.04%..+1.06% here; GAT was -4.7% (K = 1) and -7.6% (K = 4) before
    # the first sum of its ∂z was modelled out of place (now the recorder's; not re-run on a GPU)
    assert min(errors) >= -0.01, f"{name}, K = {k}: a micro-batch above its estimate by more than 1%: {errors}"
    assert max(abs(error) for error in errors) <= 0.02, f"{name}, K = {k}: errors {errors}"


@pytest.mark.parametrize("name", ["sage-mean", "gcn", "gat"])
def test_layerwise_estimate_matches_max_memory_allocated(name):
    """Layer-wise mode (8 chunks per layer, recomputation in backward): the estimate against the measured step."""
    config = load_config(None, BASE + MODELS[name] + ["micro_batch.mode=layerwise",
                                                      "micro_batch.num_micro_batches=8"])
    graph = load_dataset(config.dataset)
    others = _others_bytes()
    planner = make_planner(config, graph, None, CUDA, HostFeatureStore(graph.x, pin=True))
    plan = planner.plan(first_batch(config, graph))
    model = init_model(config, graph).to(CUDA)
    set_dropout_key(model, config.seed, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    (peak,) = plan.measure(model, optimizer, HostFeatureStore(graph.x, pin=True), graph.y, CUDA)
    report = planner.report(plan, [peak])
    assert report["mode"] == "layerwise" and report["chunks_per_layer"] == [8, 8]
    own = peak - others
    error = (report["estimate_peak_bytes"] - own) / own
    print(f"layer-wise {name}: estimate {report['estimate_peak_bytes']:,} B, measured {own:,} B ({error:+.2%})")
    assert -0.01 <= error <= 0.02, f"layer-wise {name}: error {error:+.2%}"


def test_a_real_out_of_memory_error_is_recovered_exactly(tmp_path):
    # SAGE mean: sparse matmuls with a stable transpose, no atomics, so two runs of one plan are bit-equal
    overrides = BASE + MODELS["sage-mean"] + ["optim.epochs=1", "micro_batch.partitioner=range", "model.hidden=256",
                                              "sampling.fanouts=[5,5]"] + [
        f"dataset.synthetic.{key}={value}" for key, value in OOM_GRAPH.items()]
    config = load_config(None, overrides + ["micro_batch.num_micro_batches=1"])
    graph = load_dataset(config.dataset)
    batch = first_batch(config, graph)
    peaks = {}
    for k in (1, 8):
        planner = make_planner(load_config(None, overrides + [f"micro_batch.num_micro_batches={k}"]), graph, None, CUDA,
                               HostFeatureStore(graph.x, pin=True))
        peaks[k] = max(row["estimate"]["peak_bytes"] for row in planner.report(planner.plan(batch))["pieces"])
    assert peaks[8] < 0.6 * peaks[1], peaks
    _others_bytes()
    base = torch.cuda.memory_reserved(CUDA) - device_workspace(CUDA)
    cap = base + (peaks[1] + peaks[8]) // 2  # K = 1 cannot fit under it; K = 8 fits with room for the allocator
    index = torch.cuda.current_device()  # set_per_process_memory_fraction takes no device without an index
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(index).total_memory, index)
    try:
        train(config, run_dir=tmp_path / "recovered")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    k = json.loads((tmp_path / "recovered" / "plan.json").read_text())["num_pieces"]
    assert k > 1, "the step ran out of memory with K = 1 and was re-planned"
    print(f"real out-of-memory error with K = 1 under a cap of {cap / 2**20:.1f} MiB: recovered with K = {k}")
    train(load_config(None, overrides + [f"micro_batch.num_micro_batches={k}"]), run_dir=tmp_path / "planned")
    recovered, planned = load_checkpoint(tmp_path / "recovered"), load_checkpoint(tmp_path / "planned")
    for name, tensor in planned["model"].items():
        assert torch.equal(tensor, recovered["model"][name]), name


def test_budget_auto_resolves_from_nvml():
    pynvml = pytest.importorskip("pynvml")
    device_workspace(CUDA)  # CUDA initialised, as the planner has it when it reads the budget
    terms = resolve_budget(load_config(None, ["micro_batch.budget=auto"]).micro_batch, CUDA)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(torch.cuda.current_device()))
        free = pynvml.nvmlDeviceGetMemoryInfo(handle).free
    finally:
        pynvml.nvmlShutdown()
    assert abs(terms.nvml_free - free) <= 256 * 2**20, "read from NVML (other processes may move it a little)"
    assert abs(terms.nvml_free - torch.cuda.mem_get_info(CUDA)[0]) <= 256 * 2**20, "NVML and CUDA agree"
    assert terms.process_reserved == torch.cuda.memory_reserved(CUDA)
    assert terms.device_bytes == terms.nvml_free + terms.process_reserved
    assert terms.allocator_margin == allocator_margin(terms.device_bytes, CUDA, allocator_setting())
    assert terms.step_bytes == terms.device_bytes - terms.allocator_margin > 0


@pytest.mark.parametrize("kind", ["lru", "static"])
def test_node_cache_moves_misses_times_row_bytes(kind):
    graph = load_dataset(load_config(None, BASE).dataset)
    host = HostFeatureStore(graph.x, pin=True)
    store = CachedFeatureStore(host, CUDA, kind, capacity=graph.num_nodes // 2, degrees=graph.out_degrees())
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, graph.num_nodes, (5000,), generator=generator)
        before = store.stats.snapshot()
        rows = store.gather(ids, CUDA)
        torch.cuda.synchronize()
        moved = store.stats - before
        assert moved.hits + moved.misses == ids.numel()
        assert moved.host_to_device_bytes == moved.misses * store.row_bytes + moved.cache_fill_bytes
        assert torch.equal(rows.cpu(), graph.x[ids])
    again = store.stats.snapshot()
    store.gather(ids[:100], CUDA)  # rows just read: all in an LRU cache
    if kind == "lru":
        assert (store.stats - again).host_to_device_bytes == 0
