"""A layer's memory terms recorded from its code (betty_trainer.models.recorded_terms, issue 24 item 3) against the
hand-written ones: the micro-batch, layer-wise and cooperative estimates, replayed with each layer's recorded terms
in place of its ``memory_terms``, equal to the byte the estimates from the hand-written terms."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from betty_trainer.config import load_config
from betty_trainer.memory.spec import spec_of
from betty_trainer.models import build_model
from betty_trainer.models.recorded_terms import RecordedLayer, RecordedStack
from estimator.cooperative import ExchangeCounts, estimate_cooperative_share
from estimator.counts import LayerCounts
from estimator.estimate import estimate_micro_batch, replay_micro_batch
from estimator.layerwise import estimate_layerwise
from estimator.recorder import RecordingRefused

MODELS = {"sage-mean": ["model.arch=sage", "model.aggregator=mean"],
          "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
          "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
          "gcn": ["model.arch=gcn"], "gin": ["model.arch=gin"], "gat": ["model.arch=gat"]}
GRAPH = SimpleNamespace(num_features=100, num_classes=7, in_degrees=lambda: torch.ones(5000, dtype=torch.int64))


def built(name: str, hidden: int, dropout: float, num_layers: int = 2):
    config = load_config(None, [*MODELS[name], f"model.num_layers={num_layers}", f"model.hidden={hidden}",
                                f"model.dropout={dropout}", "optim.weight_decay=0.0005"])
    torch.manual_seed(0)
    return build_model(config.model, GRAPH), config


@contextlib.contextmanager
def recorded(model, config, level: str, compiled: bool = True):
    """The model's spec, with (``level="layer"``) every layer's ``memory_terms`` (and ``propagate_terms``, where it
    projects first) answered by its :class:`RecordedLayer`, or (``"stack"``) the stack's ``layer_memory_terms``
    (dropout, layer and ReLU) by :class:`RecordedStack`, inside the block."""
    if level == "stack":
        model.layer_memory_terms = RecordedStack(model).layer_memory_terms
        replaced = [(model, "layer_memory_terms")]
    else:
        replaced = [(layer, name) for layer in model.layers
                    for name in ("memory_terms",) + (("propagate_terms",) if getattr(layer, "projected_width", None)
                                                      else ())]
        layers = [RecordedLayer(model, index) for index in range(len(model.layers))]
        for owner, name in replaced:
            setattr(owner, name, getattr(layers[list(model.layers).index(owner)], name))
    try:
        yield the_spec(model, config, compiled)
    finally:
        for owner, name in replaced:
            delattr(owner, name)


def the_spec(model, config, compiled: bool):
    """The model's spec on the CPU, or (``compiled=False``) as a GPU runs it: the tensor-op path."""
    spec = spec_of(model, config, "cpu")
    return spec if compiled else dataclasses.replace(spec, compiled_kernels=False)


def batch_counts(weighted: bool, scale: int = 1, transposed: bool = False) -> list[LayerCounts]:
    return [LayerCounts(3000 * scale, 800 * scale, 12000 * scale, weighted=weighted, transposed=transposed),
            LayerCounts(800 * scale, 150 * scale, 3100 * scale, weighted=weighted, transposed=transposed)]


# GAT's attention runs in edge chunks (ATTENTION_CHUNK_ELEMENTS) on these blocks, at 256 columns and at 16 at the
# larger scale: one chunk at the recorded sizes
CASES = [(name, hidden) for name in MODELS for hidden in (16, 256)]


# (transposed, compiled): kept transposes serve the compiled kernels only; compiled=False is a GPU's tensor-op path
PATHS = {"compiled": (False, True), "kept-transposes": (True, True), "tensor-path": (False, False)}
# on the tensor path the aggregation's backward sorts (argsort: buffers inside the operator) and the pool's
# segment max reads the degrees for its chunks: refused, so only GAT is recorded there
TENSOR_PATH = "inside the operator|reads a tensor's value"


@pytest.mark.parametrize("level", ["layer", "stack"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize(("name", "hidden"), CASES)
def test_the_micro_batch_estimate_with_recorded_layers_equals_the_hand_written_one(name, hidden, dropout, weighted,
                                                                                   path, level):
    """A batch's first micro-batch and a later one (accumulating), at two sizes (one solve serves both): the
    compiled CPU kernels, with and without kept transposes, and the tensor-op path a GPU runs; and the layers whose
    backward multiplies by ``Aᵀ`` (``StepTape.transposed``, what the planner keeps transposes for) are the same."""
    model, config = built(name, hidden, dropout)
    transposed, compiled = PATHS[path]
    if not compiled and name != "gat":
        with recorded(model, config, level, compiled) as spec, pytest.raises(RecordingRefused, match=TENSOR_PATH):
            estimate_micro_batch(batch_counts(weighted), spec)
        return
    for scale in (1, 3):
        layers = batch_counts(weighted, scale, transposed)

        def estimates(spec, layers: list[LayerCounts] = layers) -> tuple:
            tape = replay_micro_batch(layers, spec)[1]
            return (*(estimate_micro_batch(layers, spec, accumulate=a).peak_bytes for a in (False, True)),
                    [any(c is t for t in tape.transposed) for c in layers])

        written = estimates(the_spec(model, config, compiled))
        with recorded(model, config, level, compiled) as spec:
            assert estimates(spec) == written, (name, hidden, dropout, weighted, scale)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "tensor-path"])
@pytest.mark.parametrize("level", ["layer", "stack"])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize(("name", "hidden"), CASES)
def test_the_layerwise_and_cooperative_estimates_with_recorded_layers_equal_the_hand_written_ones(name, hidden, dropout,
                                                                                                  level, compiled):
    """Layer-wise: the chunks' forward without autograd and their recomputed forward and backward (a layer the
    executor projects: ``propagate`` on its chunks' rows of ``z``); cooperative: one rank's share, its layers joined
    by exchanges."""
    model, config = built(name, hidden, dropout, num_layers=3)
    layers = [LayerCounts(5000, 3000, 20000), *batch_counts(False)]
    chunks = [[LayerCounts(1800, 700, 5200), LayerCounts(2100, 900, 6100)],
              [LayerCounts(1400, 300, 4000), LayerCounts(1500, 500, 8000)],
              [LayerCounts(500, 70, 1500), LayerCounts(520, 80, 1600)]]
    exchanges = [ExchangeCounts(2400, 2600, 5000), ExchangeCounts(1500, 1700, 3000), ExchangeCounts(400, 500, 800)]

    def estimates(spec) -> tuple[int, ...]:
        return (estimate_layerwise(layers, chunks, spec, spec.projections).peak_bytes,
                *(estimate_cooperative_share(layers, exchanges, spec, accumulate=a).peak_bytes for a in (False, True)))

    if not compiled and name != "gat":
        with recorded(model, config, level, compiled) as spec, pytest.raises(RecordingRefused, match=TENSOR_PATH):
            estimates(spec)
        return
    written = estimates(the_spec(model, config, compiled))
    with recorded(model, config, level, compiled) as spec:
        assert estimates(spec) == written


def test_the_lstm_aggregator_is_refused_in_one_line():
    """Its in-degree groups sort the degrees and have data-dependent shapes."""
    config = load_config(None, ["model.arch=sage", "model.aggregator=lstm", "model.num_layers=2", "model.hidden=16"])
    lstm = build_model(config.model, GRAPH)
    with recorded(lstm, config, "layer") as spec, pytest.raises(RecordingRefused, match="inside the operator") as refused:
        estimate_micro_batch(batch_counts(False), spec)
    assert "\n" not in str(refused.value)


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
