"""A built-in model's memory terms recorded from its code (betty_trainer.models.recorded_terms, issue 24 item 3): the
estimate replays them (tests/test_estimator.py, tests/test_layerwise.py and tests/test_cooperative.py measure it to
the byte); here, the tensor-op path a GPU runs against its measured peak, the hand-written terms that stand in where
the recorder refuses a layer, and the per-process cache."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from betty_trainer import plan_micro_batches, sample_batch
from betty_trainer.config import load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.execution.micro_batches import measure_training_step
from betty_trainer.memory.spec import model_spec, spec_of
from betty_trainer.models import build_model, recorded_terms, set_dropout_key
from betty_trainer.models.recorded_terms import RecordedLayer, RecordedStack, model_terms
from betty_trainer.models.stack import LayerStack
from betty_trainer.rng import tensor_path
from estimator.counts import LayerCounts, counts_of
from estimator.estimate import estimate_micro_batch
from estimator.recorder import KeptRecordings, RecordingRefused
from estimator.tape import Replay, StepTape

MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"],
          "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
          "gcn": ["model.arch=gcn"], "gin": ["model.arch=gin"], "gat": ["model.arch=gat"]}
GRAPH = SimpleNamespace(num_features=100, num_classes=7, in_degrees=lambda: torch.ones(5000, dtype=torch.int64))


def built(name: str, hidden: int, dropout: float, num_layers: int = 2, graph=GRAPH):
    config = load_config(None, [*MODELS.get(name, name.split()), f"model.num_layers={num_layers}",
                                f"model.hidden={hidden}", f"model.dropout={dropout}", "optim.weight_decay=0.0005"])
    torch.manual_seed(0)
    return build_model(config.model, graph), config


def batch_counts(weighted: bool = False, scale: int = 1) -> list[LayerCounts]:
    return [LayerCounts(3000 * scale, 800 * scale, 12000 * scale, weighted=weighted),
            LayerCounts(800 * scale, 150 * scale, 3100 * scale, weighted=weighted)]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_tensor_op_path_is_estimated_to_the_measured_peak(cora64, name, dropout):
    """What a GPU runs (argsort transposes, chunked dropout hashing, SAGE pool's segment max over edge chunks), run on
    the CPU under ``tensor_path()``, K = 2 (the second micro-batch accumulates), against
    the estimate replaying the terms recorded on that path. Narrow features and hidden rows, so that the aggregation
    backward's sort (its buffer inside the operator, 8 bytes per edge) is near the peak."""
    model, config = built(name, 16, dropout, graph=cora64)
    set_dropout_key(model, 0, 0)
    optimizer = torch.optim.Adam(model.parameters(), weight_decay=config.optim.weight_decay)
    batch = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, 2, "reg", 0)
    features = HostFeatureStore(cora64.x, pin=False)
    with tensor_path():
        spec = dataclasses.replace(spec_of(model, config, "cpu"), compiled_kernels=False, features_in_place=True)
        measure_training_step(model, optimizer, micro_batches[0], features, cora64.y, "cpu")  # Adam's state exists
        for index, micro_batch in enumerate(micro_batches):
            estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0).peak_bytes
            measured = measure_training_step(model, optimizer, micro_batch, features, cora64.y, "cpu",
                                             num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
            assert 0 <= measured - estimate <= 16, (index, estimate, measured)  # scalars inside operators


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "tensor-path"])
def test_the_lstm_aggregator_is_recorded_around_its_hand_written_terms(cora64, compiled):
    """The LSTM aggregator (in-degree groups of data-dependent sizes): the recorder refuses the layer in one line, so
    the stack around it is recorded with a stand-in in its place and the layer's hand-written terms are replayed
    where the stand-in ran; the step's estimate is the measured peak (K = 2, the second micro-batch accumulating;
    tensor path: within the scalars made inside operators)."""
    model, config = built("model.arch=sage model.aggregator=lstm", 16, 0.5, graph=cora64)
    spec = dataclasses.replace(spec_of(model, config, "cpu"), compiled_kernels=compiled, features_in_place=True)
    with pytest.raises(RecordingRefused, match="depends on the data") as refused:
        RecordedLayer(model, 0)._piece(StepTape(Replay(), spec, False), batch_counts()[0], "layer", (False,))
    assert "\n" not in str(refused.value)
    set_dropout_key(model, 0, 0)
    optimizer = torch.optim.Adam(model.parameters(), weight_decay=config.optim.weight_decay)
    batch = sample_batch(cora64, cora64.train_idx, [5, 10], torch.Generator().manual_seed(0))
    micro_batches = plan_micro_batches(batch, 2, "reg", 0)
    features = HostFeatureStore(cora64.x, pin=False)
    with contextlib.nullcontext() if compiled else tensor_path():
        measure_training_step(model, optimizer, micro_batches[0], features, cora64.y, "cpu")  # Adam's state exists
        for index, micro_batch in enumerate(micro_batches):
            estimate = estimate_micro_batch(counts_of(micro_batch.blocks), spec, accumulate=index > 0).peak_bytes
            measured = measure_training_step(model, optimizer, micro_batch, features, cora64.y, "cpu",
                                             num_outputs=batch.output_nodes.numel(), accumulate=index > 0).peak_bytes
            assert 0 <= measured - estimate <= (0 if compiled else 16), (index, estimate, measured)


def test_model_terms_are_recorded_once_per_model_structure():
    """Two instances of one configuration share their recordings; another width, dropout or frozen parameters (no
    gradients to make) get their own. The cache keeps a meta-device copy, no parameter of the instance."""
    first, _ = built("gcn", 16, 0.5)
    twin, _ = built("gcn", 16, 0.5)
    assert model_terms(first) is model_terms(twin)
    assert model_terms(first) is not model_terms(built("gcn", 32, 0.5)[0])
    assert model_terms(first) is not model_terms(built("gcn", 16, 0.0)[0])
    frozen, _ = built("gcn", 16, 0.5)
    frozen.layers[0].requires_grad_(False)
    assert model_terms(first) is not model_terms(frozen)
    assert all(p.device.type == "meta" for p in model_terms(first).model.parameters())


def test_model_terms_keep_the_most_recently_used_configurations(monkeypatch):
    """A process keeps the recordings of at most ``KeptRecordings.kept`` configurations, dropping the least recently
    used: a configuration used again stays, one not used since is recorded anew."""
    recorded = []
    monkeypatch.setattr(recorded_terms, "_STACKS", KeptRecordings(2))
    monkeypatch.setattr(recorded_terms, "RecordedStack", lambda model: recorded.append(model) or RecordedStack(model))
    first, second, third = (built("gcn", width, 0.5)[0] for width in (8, 12, 16))
    kept = model_terms(first)
    model_terms(second)
    assert model_terms(first) is kept and len(recorded) == 2  # used again: now the most recent
    model_terms(third)  # drops second's, the least recently used
    assert model_terms(first) is kept and len(recorded) == 3 and len(recorded_terms._STACKS) == 2
    model_terms(second)  # recorded anew, in place of third's
    model_terms(third)  # recorded anew, in place of first's
    assert len(recorded) == 5 and model_terms(first) is not kept and len(recorded) == 6
    with pytest.raises(ValueError, match="at least 1"):
        KeptRecordings(0)


@pytest.mark.parametrize(("mode", "width"), [(torch.no_grad, 23), (torch.inference_mode, 21)],
                         ids=["no_grad", "inference_mode"])
def test_an_estimate_first_asked_for_without_grad_is_recorded_with_autograd(mode, width):
    """A configuration recorded while the caller runs under ``torch.no_grad()`` or ``torch.inference_mode()`` (an
    evaluation loop, say) records the training step all the same: the same estimate as one asked for with grad."""
    model, config = built("sage-mean", width, 0.5)  # a width no other test records
    layers = batch_counts()
    with mode():
        quiet = estimate_micro_batch(layers, model_spec(config, GRAPH)).peak_bytes
    terms = RecordedStack(model)  # recorded now, with grad
    spec = dataclasses.replace(model_spec(config, GRAPH), forward_terms=terms.memory_terms,
                               layer_terms=terms.layer_memory_terms)
    assert quiet == estimate_micro_batch(layers, spec).peak_bytes


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_on_the_meta_device_is_estimated_as_its_instance(name):
    """``model_spec`` describes a model built on the meta device, ``spec_of`` an instance: the same estimates."""
    model, config = built(name, 32, 0.5)
    layers = batch_counts()
    assert (estimate_micro_batch(layers, model_spec(config, GRAPH)).peak_bytes
            == estimate_micro_batch(layers, spec_of(model, config, "cpu")).peak_bytes)


def test_a_piece_that_passes_the_output_s_gradient_to_an_input_is_refused():
    """``out = 2·z[:D] + hd``: ``hd``'s gradient is the output's own, no allocation of the piece to hand over."""
    from betty_trainer.models.recorded_terms import _harness, _Input, fake_block
    from estimator.recorder import Recorder

    c = LayerCounts(25, 7, 31)
    with Recorder() as recorder, pytest.raises(RecordingRefused, match="the output's own") as refused:
        block = fake_block(c)
        recorder.record_piece(_harness(lambda block, z, hd: z[: block.num_dst] * 2 + hd, block, c,
                                       [_Input("src", 4), _Input("dst", 4)], (True, True), True, torch.float32, {}))
    assert "\n" not in str(refused.value)


def test_a_layer_stack_of_layers_without_hand_written_terms_fails_where_the_recorder_refuses_it():
    """A layer the recorder refuses and that writes no terms by hand: the refusal reaches the caller, in one line."""

    class Sorting(torch.nn.Module):
        def __init__(self, a: int, b: int):
            super().__init__()
            self.linear = torch.nn.Linear(a, b)

        def forward(self, block, h):
            return self.linear(h[: block.num_dst].sort(dim=1).values)

    model = LayerStack([8, 4], Sorting, 0.0)
    spec = SimpleNamespace(dtype_bytes=4, compiled_kernels=True)  # what a tape reads of a ModelSpec
    replay = Replay()
    with pytest.raises(RecordingRefused, match="several dimensions") as refused:
        model_terms(model).layer_memory_terms(StepTape(replay, spec, False), 0, LayerCounts(30, 10, 40),
                                              replay.alloc(30 * 8 * 4, "input_features"), False)
    assert "\n" not in str(refused.value)
