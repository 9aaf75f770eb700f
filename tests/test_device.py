"""The device's fixed costs and the allocator's margin (betty_trainer.memory.device) and the budget's terms
(betty_trainer.memory.budget), on the CPU: what a CUDA device would add is 0 here, and the CUDA arithmetic is
checked with NVML's reading injected. tests/test_cuda.py measures them on a GPU."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from betty_trainer import make_sbm, process
from betty_trainer.config import load_config
from betty_trainer.errors import ConfigError
from betty_trainer.memory import budget as budget_module
from betty_trainer.memory.budget import resolve_budget
from betty_trainer.memory.device import (
    DEFAULT_MARGIN,
    EXPANDABLE_MARGIN,
    allocator_margin,
    device_workspace,
    expandable_segments,
)
from betty_trainer.memory.spec import model_spec
from betty_trainer.process import (
    ALLOC_CONF,
    ALLOC_CONF_NEW,
    EXPANDABLE_SEGMENTS,
    allocator_setting,
    expandable_cuda_segments,
)
from estimator import COMPONENTS, estimate_micro_batch
from estimator.counts import LayerCounts
from estimator.spec import ModelSpec
from estimator.tape import GRAD, Replay, StepTape

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
MIB = 2**20


def test_the_cpu_has_no_device_workspace_and_the_estimate_names_it():
    graph = make_sbm(num_nodes=300, num_features=16, avg_degree=5, train_per_class=10, num_val=20, num_test=20)
    spec = model_spec(load_config(None, ["model.hidden=8"]), graph, "cpu")
    assert device_workspace("cpu") == 0 and spec.device_workspace == 0
    layers = [LayerCounts(num_src=120, num_dst=40, num_edges=300), LayerCounts(num_src=40, num_dst=10, num_edges=90)]
    estimate = estimate_micro_batch(layers, spec)
    assert "device_workspace" in COMPONENTS and estimate.at_peak["device_workspace"] == 0
    with_workspace = estimate_micro_batch(layers, dataclasses.replace(spec, device_workspace=5 * MIB))
    assert with_workspace.at_peak["device_workspace"] == 5 * MIB, "resident: live at the peak"
    assert with_workspace.peak_bytes == estimate.peak_bytes + 5 * MIB
    assert with_workspace.resident_bytes == estimate.resident_bytes + 5 * MIB


@pytest.mark.parametrize("setting, expandable", [
    ("expandable_segments:True", True), ("max_split_size_mb:128, expandable_segments:true", True),
    ("expandable_segments:False", False), ("max_split_size_mb:128", False), (None, False)])
def test_the_margin_follows_the_allocator_setting(setting, expandable):
    assert expandable_segments(setting) is expandable
    fraction, floor = EXPANDABLE_MARGIN if expandable else DEFAULT_MARGIN
    for budget in (100 * MIB, 80 * 2**30):
        assert allocator_margin(budget, CUDA, setting) == max(floor, int(fraction * budget))
        assert allocator_margin(budget, torch.device("cpu"), setting) == 0
    assert allocator_margin(80 * 2**30, CUDA, setting) <= 80 * 2**30 * (0.06 if expandable else 0.6)


def test_importing_betty_trainer_asks_for_expandable_segments_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    monkeypatch.delenv(ALLOC_CONF_NEW, raising=False)
    assert expandable_cuda_segments() == EXPANDABLE_SEGMENTS == os.environ[ALLOC_CONF]  # CUDA not initialised here
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:False")
    assert expandable_cuda_segments() == "expandable_segments:False", "the user's setting is kept"
    monkeypatch.delenv(ALLOC_CONF)
    monkeypatch.setenv(ALLOC_CONF_NEW, "max_split_size_mb:64")
    assert expandable_cuda_segments() == "max_split_size_mb:64"
    assert ALLOC_CONF not in os.environ
    monkeypatch.setenv(ALLOC_CONF, EXPANDABLE_SEGMENTS)  # both set: PyTorch reads PYTORCH_ALLOC_CONF first
    assert allocator_setting() == "max_split_size_mb:64"
    monkeypatch.delenv(ALLOC_CONF)
    monkeypatch.delenv(ALLOC_CONF_NEW)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: the allocator has read its setting
    assert expandable_cuda_segments() is None and ALLOC_CONF not in os.environ


def test_a_fresh_process_gets_expandable_segments_from_the_import():
    environment = {key: value for key, value in os.environ.items() if key not in (ALLOC_CONF, ALLOC_CONF_NEW)}
    code = "import os, betty_trainer; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == EXPANDABLE_SEGMENTS


def test_budget_terms_on_the_cpu_and_an_injected_nvml_reading(monkeypatch):
    config = load_config(None, ["micro_batch.budget=64MiB"]).micro_batch
    terms = resolve_budget(config, torch.device("cpu"), feature_store_bytes=4 * MIB)
    assert (terms.device_bytes, terms.allocator_margin, terms.step_bytes) == (64 * MIB, 0, 60 * MIB)
    assert resolve_budget(load_config(None, []).micro_batch, torch.device("cpu")).step_bytes is None
    explicit = load_config(None, ["micro_batch.budget=64MiB", "micro_batch.safety_margin=8MiB"]).micro_batch
    assert resolve_budget(explicit, torch.device("cpu")).step_bytes == 56 * MIB, "a margin given is a margin kept"
    with_sampler = resolve_budget(config, torch.device("cpu"), feature_store_bytes=4 * MIB, sampler_bytes=8 * MIB)
    assert (with_sampler.sampler_bytes, with_sampler.step_bytes) == (8 * MIB, 52 * MIB)
    with pytest.raises(ConfigError, match=rf"the bulk sampler on the GPU \({60 * MIB} bytes\).*sampling.bulk_memory"):
        resolve_budget(config, torch.device("cpu"), feature_store_bytes=4 * MIB, sampler_bytes=60 * MIB)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_budget(load_config(None, ["micro_batch.budget=auto"]).micro_batch, torch.device("cpu"))
    with pytest.raises(ConfigError, match="takes all of the 67108864-byte micro_batch.budget"):
        resolve_budget(load_config(None, ["micro_batch.budget=64MiB", "micro_batch.safety_margin=64MiB"]).micro_batch,
                       torch.device("cpu"))

    monkeypatch.setenv(ALLOC_CONF, EXPANDABLE_SEGMENTS)
    monkeypatch.setattr(budget_module, "_nvml_free", lambda device: 10 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300 * MIB)
    auto = resolve_budget(load_config(None, ["micro_batch.budget=auto"]).micro_batch, CUDA, feature_store_bytes=MIB)
    held = 10 * 2**30 + 300 * MIB
    assert (auto.nvml_free, auto.process_reserved, auto.device_bytes) == (10 * 2**30, 300 * MIB, held)
    assert auto.allocator_margin == allocator_margin(held, CUDA, EXPANDABLE_SEGMENTS) == int(EXPANDABLE_MARGIN[0] * held)
    assert auto.step_bytes == held - auto.allocator_margin - MIB
    sampled = resolve_budget(load_config(None, ["micro_batch.budget=auto"]).micro_batch, CUDA, feature_store_bytes=MIB,
                             sampler_bytes=3 * MIB)  # a bulk sampler's structure and draw on the GPU
    assert sampled.step_bytes == auto.step_bytes - 3 * MIB and sampled.report()["sampler_bytes"] == 3 * MIB
    assert auto.report()["step_bytes"] == auto.step_bytes and auto.report()["allocator"] == EXPANDABLE_SEGMENTS


def test_a_gradient_summed_into_a_dense_one_is_added_in_place():
    """StepTape.accumulate (the LSTM's hand-written terms): in place into the first gradient, the second freed."""
    replay = Replay()
    tape = StepTape(replay, ModelSpec("sage", (4, 4), parameter_numels=((16,),)), accumulate=False)
    first, second = replay.alloc(1000, GRAD), replay.alloc(600, GRAD)
    total = tape.accumulate(first, second)
    assert total == first and replay.current == 1000 and replay.peak == 1600
    assert tape.accumulate(total, replay.alloc(10, GRAD)) == total, "the next sum adds into it in place"


@pytest.mark.parametrize("through_a_view", [False, True])
def test_autograd_adds_into_a_gradient_through_a_view_out_of_place(through_a_view):
    """What the recorder's in-place sums follow (``_Recording._sums_in_place``: no view), measured: a gradient that
    arrives first through a view's backward is summed with the next one out of place (aten::add); a dense one in
    place (aten::add_). Which arrives first follows the forward's order (autograd runs the nodes made last first)."""
    z = torch.randn(1000, 64, requires_grad=True) * 1.0  # a layer's output, as GAT's z
    dense = (z * 3).sum()  # as GAT's score products: made first, so their backward runs last
    used = z.view(1000, 4, 16) if through_a_view else z  # as GAT's z.view(-1, H, F), made after them
    loss = dense + (used * 2).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = {event.name for event in prof.events()} & {"aten::add", "aten::add_"}
    assert names == ({"aten::add"} if through_a_view else {"aten::add_"})


def test_train_warns_once_where_cuda_came_before_the_import(monkeypatch, caplog):
    monkeypatch.setattr(process, "_ALLOCATOR_TOO_LATE", True)
    with caplog.at_level("WARNING", logger="betty_trainer.process"):
        process.warn_default_allocator("cpu")  # a CPU run has no CUDA allocator: nothing to say
        assert not caplog.records
        process.warn_default_allocator("cuda")
        process.warn_default_allocator("cuda")
    assert len(caplog.records) == 1 and "expandable_segments:True" in caplog.records[0].getMessage()
