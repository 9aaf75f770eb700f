"""Closed-form memory estimate of one micro-batch training step (Betty §4.4.3, Table 3, Eq. 5).

The estimate follows the tensors the built-in models allocate, op by op, as a
function of the micro-batch's counts (Betty Table 3: N_in, H_in, N_out, E, h, L_i,
B_i) and the model's widths: each op's output, what autograd saves for backward,
the op's own temporaries, and in backward each gradient as it is made and freed.
Each built-in layer's terms are recorded from its own code (``betty_trainer.models.recorded_terms``; the
layers the recorder refuses write theirs by hand, beside their ``forward``) and replayed on the
:class:`estimator.tape.StepTape` this module hands them; this module adds what surrounds the model in a training step
(the gathered features, labels, the loss, the optimizer step). Replaying those
allocations and frees in order gives the peak (docs/design.md: static +
max(forward-live, backward-live)) and what is live at that moment, by component.
No tensor is allocated; the cost is O(layers), or for the LSTM aggregator O(Σ of the
distinct in-degrees), one replayed step per LSTM step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from estimator.counts import INDEX_BYTES, LayerCounts, block_structure_bytes
from estimator.spec import OPTIMIZER_STATES, ModelSpec
from estimator.tape import GRAD, OVER, Replay, StepTape

COMPONENTS = (
    "parameters",
    "optimizer_state",
    "device_workspace",
    "block_structure",
    "input_features",
    "labels",
    "hidden_outputs",
    "dropout_masks",
    "aggregator_intermediates",
    "gradients",
    "framework_overheads",
    "exchange_buffers",  # cooperative minibatching's all-to-all buffers (estimator.cooperative)
)



@dataclass(frozen=True)
class MemoryEstimate:
    """An itemised estimate in bytes.

    Attributes:
        peak_bytes: estimated peak of live bytes during the step (resident included).
        at_peak: bytes per component (:data:`COMPONENTS`) live at the peak; sums to ``peak_bytes``.
        totals: bytes per component allocated at some point in the step (not simultaneously).
        forward_peak_bytes, backward_peak_bytes: the peak within each phase.
        resident_bytes: bytes live before the step (parameters, optimizer state, blocks).
    """

    peak_bytes: int
    at_peak: dict[str, int]
    totals: dict[str, int]
    forward_peak_bytes: int
    backward_peak_bytes: int
    resident_bytes: int

    @classmethod
    def of(cls, replay: Replay, resident_bytes: int) -> MemoryEstimate:
        """The estimate a finished :class:`~estimator.tape.Replay` gives (``resident_bytes``: live before the step)."""
        return cls(
            peak_bytes=replay.peak,
            at_peak={name: replay.at_peak.get(name, 0) for name in COMPONENTS},
            totals={name: replay.totals.get(name, 0) for name in COMPONENTS},
            forward_peak_bytes=replay.phase_peak["forward"],
            backward_peak_bytes=replay.phase_peak["backward"],
            resident_bytes=resident_bytes,
        )


def model_state_bytes(model: ModelSpec) -> dict[str, int]:
    """Bytes live before any micro-batch: ``parameters`` (buffers included), ``optimizer_state``
    (Adam: two moments per parameter plus a 4-byte step counter per parameter tensor) and
    ``device_workspace`` (``model.device_workspace``: the BLAS workspaces a CUDA device keeps, measured; 0 on
    the CPU)."""
    shapes = [numel for layer in model.parameter_numels for numel in layer]
    states = OPTIMIZER_STATES[model.optimizer]
    return {
        "parameters": sum(shapes) * model.dtype_bytes + model.buffer_bytes,
        "optimizer_state": (states * sum(shapes) * model.dtype_bytes + 4 * len(shapes)) if states else 0,
        "device_workspace": model.device_workspace,
    }


def resident_replay(model: ModelSpec, accumulate: bool, structure_bytes: int) -> tuple[Replay, StepTape]:
    """A step's replay and tape with what is resident before the step allocated: the model state
    (:func:`model_state_bytes`), the earlier micro-batches' gradients when ``accumulate``, and ``structure_bytes``
    of the step's blocks (and any index tensors held with them)."""
    replay = Replay()
    step = StepTape(replay, model, accumulate)
    for component, nbytes in model_state_bytes(model).items():
        replay.alloc(nbytes, component)
    if accumulate:  # the earlier micro-batches' gradients
        replay.alloc(model.num_parameters * model.dtype_bytes, GRAD)
    replay.alloc(structure_bytes, "block_structure")
    return replay, step


def estimate_micro_batch(layers: Sequence[LayerCounts], model: ModelSpec, accumulate: bool = False,
                         input_in_place: bool = False) -> MemoryEstimate:
    """Estimate the memory of one training step of a micro-batch, itemised (Betty §4.4.3).

    The step is the one :func:`betty_trainer.execution.micro_batches.measure_training_step` measures:
    gather input features and labels, forward, cross-entropy, backward, the accuracy
    count, optimizer step. Resident before it: parameters, optimizer state (Adam:
    2 × parameters + a step counter per tensor), the device's workspaces (CUDA) and the blocks' structure. A batch's
    first micro-batch allocates the parameter gradients as backward computes them
    (``accumulate=False``); the later ones (``accumulate=True``) start with them resident
    and add each new gradient into them, which costs more.

    With the aggregation cache (``model.aggregated_width``; BatchGNN §3) the micro-batch has no layer-0 block: its
    input rows are the cache's rows of ``layers[0]``'s src nodes, and layer 0 runs on them row by row.

    Args:
        layers: the micro-batch's :class:`LayerCounts`, input layer first (one per block: ``model.num_blocks``).
        model: the model (:class:`ModelSpec`).
        accumulate: estimate a micro-batch after the first of its batch.
        input_in_place: the step reads the input rows in place instead of gathering them (its input nodes are
            ``0 … n − 1`` and ``model.features_in_place``: :func:`estimator.counts.reads_in_place`): no
            ``input_features`` bytes, and input dropout into a new tensor.

    Returns:
        A :class:`MemoryEstimate` (bytes).

    Raises:
        ValueError: if the number of layers differs from the model's blocks.
    """
    replay, _, resident = replay_micro_batch(layers, model, accumulate, input_in_place)
    return MemoryEstimate.of(replay, resident)


def replay_micro_batch(layers: Sequence[LayerCounts], model: ModelSpec, accumulate: bool = False,
                       input_in_place: bool = False) -> tuple[Replay, StepTape, int]:
    """:func:`estimate_micro_batch`'s replayed step: ``(replay, tape, resident bytes)`` (the tape's ``transposed``:
    the layers whose aggregation's backward multiplies by ``Aᵀ``). Arguments and errors as there."""
    if len(layers) != model.num_blocks:
        raise ValueError(f"the micro-batch has {len(layers)} layers but the model takes {model.num_blocks} blocks")
    if model.forward_terms is None:
        raise ValueError("the ModelSpec has no forward_terms: build it from the model (betty_trainer.memory.spec.spec_of)")
    replay, step = resident_replay(model, accumulate, block_structure_bytes(layers))
    f, resident = model.dtype_bytes, replay.current

    replay.phase = "forward"
    x = replay.alloc(0 if input_in_place else layers[0].num_src * model.input_width * f, "input_features")
    if input_in_place:
        replay.keep(x)  # the step keeps the store's rows while the model holds them as its input: two references
    labels = replay.alloc(layers[-1].num_dst * INDEX_BYTES, "labels")
    logits, forward_bwd = model.forward_terms(step, layers, x, not input_in_place)
    loss_bwd, scalars = step.loss(layers[-1].num_dst, model.widths[-1], labels)

    replay.phase = "backward"
    grad = forward_bwd(loss_bwd())
    predictions = replay.alloc(layers[-1].num_dst * INDEX_BYTES, OVER)  # (logits.argmax(1) == y).sum()
    hits = replay.alloc(layers[-1].num_dst, OVER)
    replay.drop(predictions, hits)
    replay.drop(grad, x, labels, logits, *scalars())  # the micro-batch's tensors die before the optimizer step
    replay.phase = "optimizer"
    step.optimizer_step()
    return replay, step, resident
