"""The estimate of a candidate plan, answered in one call: what the K search (``partition.make_split``) and the
layer-wise chunk search (``partition.chunks.search_chunks``) ask of the estimator while they search.

:class:`PeakEstimator` holds a model's description, the closed form's :class:`~estimator.spec.ModelSpec` or a
custom model's recorded or calibrated estimate (:class:`CustomEstimate`), and
answers a micro-batch's peak (itemised, for the closed form), the work the planner compares plans by and, for the closed form,
:meth:`PeakEstimator.layerwise`: one batch's layer-wise chunkings (their peak and the floor below which no
chunking goes). The searches hand it structures (blocks, layer slices, chunks); it counts them
(:func:`~estimator.counts.counts_of`) and replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from estimator.cooperative import ExchangeCounts, estimate_cooperative_share
from estimator.counts import LayerCounts, counts_of, reads_in_place
from estimator.estimate import MemoryEstimate, estimate_micro_batch, model_state_bytes, replay_micro_batch
from estimator.layerwise import estimate_layerwise, layerwise_floor, runs_off_whole_block
from estimator.spec import ModelSpec
from estimator.work import step_work


class CustomEstimate(Protocol):
    """A custom model's micro-batch estimate: a :class:`~estimator.recorder.RecordedModel`, a
    :class:`~estimator.calibrate.CalibratedModel`, or a set of recordings by pattern of edge-weighted blocks
    (``betty_trainer.memory.recorded.WeightedEstimates``)."""

    @property
    def resident_bytes(self) -> int:
        """Bytes live before any micro-batch."""

    def estimate(self, layers: Sequence[LayerCounts], accumulate: bool = True) -> int:
        """Peak bytes of a micro-batch's training step with counts ``layers``."""


class PeakEstimator:
    """Estimated peaks of one model's training steps, whatever the plan.

    Args:
        model: the closed form's :class:`~estimator.spec.ModelSpec` (a built-in model) or a custom model's
            :class:`CustomEstimate` (micro-batches only: recorded or measured micro-batch steps say nothing of
            layer-wise chunks).

    Attributes:
        spec: the :class:`ModelSpec`, or ``None`` for a custom model.
        calibrated: the custom model's :class:`CustomEstimate`, or ``None`` for a built-in one.
    """

    def __init__(self, model: ModelSpec | CustomEstimate):
        self.spec = model if isinstance(model, ModelSpec) else None
        self.calibrated = None if isinstance(model, ModelSpec) else model

    @property
    def closed_form(self) -> bool:
        """Whether the estimate is the closed form (itemised, layer-wise, the work model): a built-in model."""
        return self.spec is not None

    def state_bytes(self) -> dict[str, int]:
        """Bytes every estimate holds resident by term (:func:`~estimator.estimate.model_state_bytes`); empty for a
        custom model, whose estimate counts them as one."""
        return model_state_bytes(self.spec) if self.spec is not None else {}

    @property
    def resident_bytes(self) -> int:
        """Bytes live before any micro-batch (parameters, optimizer state, buffers, the device's workspaces)."""
        if self.spec is not None:
            return sum(model_state_bytes(self.spec).values())
        return self.calibrated.resident_bytes

    def itemised(self, structures: Sequence[Any], accumulate: bool = False,
                 weighted: Sequence[bool] | None = None) -> MemoryEstimate:
        """Itemised estimate of one micro-batch's training step (the closed form); ``accumulate``: an earlier
        micro-batch of the batch ran before it; ``weighted``: per layer, whether the blocks carry edge weights
        (read from the structures when ``None``; see :func:`~estimator.counts.counts_of`). The input rows are read
        in place where the model's feature store hands them out and the input layer is a block of nodes
        ``0 … n − 1`` (:func:`~estimator.counts.reads_in_place`)."""
        return estimate_micro_batch(counts_of(structures, weighted), self.spec, accumulate, self._in_place(structures))

    def _in_place(self, structures: Sequence[Any]) -> bool:
        """Whether the step of a micro-batch of ``structures`` reads its input rows in place (see :meth:`itemised`)."""
        return self.spec.features_in_place and bool(structures) and reads_in_place(structures[0])

    def peak(self, structures: Sequence[Any], accumulate: bool = False, weighted: Sequence[bool] | None = None) -> int:
        """Estimated peak bytes of one micro-batch's training step: the closed form, the recorded one, or the
        calibrated fit (of accumulating steps, less the measured saving of a batch's first micro-batch). Arguments
        as :meth:`itemised`'s."""
        if self.calibrated is not None:
            return self.calibrated.estimate(counts_of(structures, weighted), accumulate)
        return self.itemised(structures, accumulate, weighted).peak_bytes

    def transposed_layers(self, structures: Sequence[Any], weighted: Sequence[bool] | None = None) -> list[bool]:
        """Per layer of a micro-batch of ``structures`` (its blocks, input layer first), whether its step multiplies
        by a block's ``Aᵀ`` on the CPU kernels: the layers a kept transpose serves
        (``betty_trainer.models.aggregate.keep_transposes``), read off the closed form's replay (the tape's
        ``transposed``). All ``False`` where the compiled kernels do not run, and for a custom model (no closed
        form)."""
        layers = counts_of(structures, weighted)
        if self.spec is None or not self.spec.compiled_kernels:
            return [False] * len(layers)
        _, tape, _ = replay_micro_batch(layers, self.spec, False, self._in_place(structures))
        return [any(c is t for t in tape.transposed) for c in layers]

    def micro_batch_work(self, micro_batches: Sequence[Sequence[Any]]) -> float:
        """The work of running ``micro_batches`` (per micro-batch, the sizes of its layers: ``num_src``, ``num_dst``,
        ``num_edges``), in multiply-adds (:func:`~estimator.work.step_work`; closed form only)."""
        return step_work(self.spec, [list(layer) for layer in zip(*micro_batches)], False)

    def cooperative_share(self, structures: Sequence[Any], exchanges: Sequence[ExchangeCounts],
                          accumulate: bool = False) -> MemoryEstimate:
        """Itemised estimate of one rank's share of a cooperative step, one micro-batch round: its blocks'
        ``structures`` with the ``exchanges`` before them (:func:`estimator.cooperative.estimate_cooperative_share`;
        closed form only)."""
        return estimate_cooperative_share(counts_of(structures), exchanges, self.spec, accumulate)

    def layerwise(self, blocks: Sequence[Any]) -> LayerwiseEstimate:
        """The estimates of ``blocks`` run layer by layer, whatever the chunking (closed form only)."""
        return LayerwiseEstimate(self.spec, counts_of(blocks))


class LayerwiseEstimate:
    """The closed form of one batch run layer by layer (:mod:`estimator.layerwise`), for any chunking of it: its
    layers counted once, however many chunkings a search estimates.

    Args:
        spec: the model (its ``layer_terms`` and ``projections``).
        layers: the batch's :class:`LayerCounts`, input layer first.
    """

    def __init__(self, spec: ModelSpec, layers: Sequence[LayerCounts]):
        self.spec, self.layers = spec, list(layers)

    def _counts(self, structures: Sequence[Any], counts: LayerCounts) -> list[LayerCounts]:
        return counts_of(structures, [counts.weighted] * len(structures))  # a chunk carries its block's weights

    def peak(self, chunks: Sequence[Sequence[Any]], host_outputs: bool) -> int:
        """Estimated peak bytes of the step in ``chunks`` (per layer, its chunks' structures) with the hidden
        layers' outputs on the device, or in host memory (``host_outputs``)."""
        pieces = [self._counts(layer, counts) for layer, counts in zip(chunks, self.layers)]
        return estimate_layerwise(self.layers, pieces, self.spec, self.spec.projections, host_outputs).peak_bytes

    def floor(self, largest: Sequence[Any], host_outputs: bool) -> int:
        """Bytes below which no chunking goes (:func:`estimator.layerwise.layerwise_floor`), from ``largest``:
        per layer, the one-node chunk of a dst node whose in-edges no chunking splits."""
        pieces = [self._counts([piece], counts)[0] for piece, counts in zip(largest, self.layers)]
        return layerwise_floor(self.layers, pieces, self.spec, self.spec.projections, host_outputs)

    @property
    def ranged(self) -> list[bool]:
        """Per layer, whether its chunks' dst sets do not matter, only their number
        (:func:`~estimator.layerwise.runs_off_whole_block`): a chunk search splits such a layer by ``range``."""
        return runs_off_whole_block(self.spec, self.spec.projections)

    def work(self, chunks: Sequence[Sequence[Any]]) -> float:
        """The work of the step in ``chunks``, in multiply-adds (:func:`~estimator.work.step_work`): a projected
        layer projects its block's src rows once per pass, and a layer run off the whole block reads each edge and
        row of its block once per pass, whatever its chunks, and recomputes nothing."""
        projections = self.spec.projections or [None] * len(self.layers)
        rows = [counts.num_src if terms is not None else None for counts, terms in zip(self.layers, projections)]
        pieces = [[counts] if ranged else layer for layer, counts, ranged in zip(chunks, self.layers, self.ranged)]
        return step_work(self.spec, pieces, True, rows, [not ranged for ranged in self.ranged])
