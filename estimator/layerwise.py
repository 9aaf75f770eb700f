"""Memory estimate of layer-wise chunked execution (issue 10; :mod:`betty_trainer.training.layerwise`).

The same replay as the micro-batch estimate (:mod:`estimator.estimate`), from the same per-layer
terms (each layer's ``memory_terms``, through ``ModelSpec.layer_terms``), in the executor's order:

- resident: parameters, optimizer state, the accumulated gradients, the batch's blocks and the
  chunks' slices;
- forward, layer by layer: ``h_l`` (kept), and per chunk its sub-block's src ids (and edge
  weights), its gathered input rows and the layer's forward, replayed without autograd's saved
  tensors (it runs under ``torch.no_grad``);
- the loss on the logits;
- backward, layer by layer from the output: ``∂L/∂h_{l−1}`` (zeros), and per chunk its sub-block,
  its input rows (requiring grad), the recomputed forward, its rows of ``∂L/∂h_l`` and the
  layer's backward; ``h_l`` is freed before its layer's backward, ``∂L/∂h_l`` after it;
- the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

from estimator.counts import INDEX_BYTES, LayerCounts, block_structure_bytes
from estimator.estimate import MemoryEstimate, model_state_bytes
from estimator.spec import ModelSpec
from estimator.tape import GRAD, HID, OVER, Replay, StepTape


def chunk_structure_bytes(chunks: Sequence[Sequence[LayerCounts]]) -> int:
    """Bytes of the chunks' slices (``partition.slicing.LayerSlice``: int64 src positions, CSC pointer,
    indices and edge ids), ``8·Σ (S + D + 1 + 2E)`` over every chunk of every layer."""
    return sum((c.num_src + c.num_dst + 1 + 2 * c.num_edges) * INDEX_BYTES for layer in chunks for c in layer)


def estimate_layerwise(layers: Sequence[LayerCounts], chunks: Sequence[Sequence[LayerCounts]],
                       model: ModelSpec) -> MemoryEstimate:
    """Estimate the peak of one layer-wise training step (all chunks of all layers), itemised.

    Args:
        layers: the whole batch's :class:`LayerCounts`, input layer first.
        chunks: per layer, the counts of each chunk's one-layer sub-block (``partition.chunks``).
        model: the model (:class:`ModelSpec` with ``layer_terms``).

    Returns:
        A :class:`~estimator.estimate.MemoryEstimate` (bytes). The accumulated gradients are
        counted as resident from the start (the first chunk's backward makes them: an upper
        bound by at most one gradient's bytes before then).

    Raises:
        ValueError: layer counts that do not match the model, or a spec without ``layer_terms``.
    """
    if len(layers) != model.num_layers or len(chunks) != model.num_layers:
        raise ValueError(f"{len(layers)} layers and {len(chunks)} chunked layers for a model of {model.num_layers}")
    if model.layer_terms is None:
        raise ValueError("the ModelSpec has no layer_terms: build it from the model (betty_trainer.memory.plan.spec_of)")
    replay = Replay()
    tape = StepTape(replay, model, accumulate=True)
    f, widths = model.dtype_bytes, model.widths
    for component, nbytes in model_state_bytes(model).items():
        replay.alloc(nbytes, component)
    replay.alloc(model.num_parameters * f, GRAD)
    replay.alloc(block_structure_bytes(layers) + chunk_structure_bytes(chunks), "block_structure")
    resident = replay.current

    def chunk_inputs(index: int, c: LayerCounts) -> tuple[int, int]:
        """The sub-block's src ids (and gathered edge weights), then the gathered input rows."""
        block = replay.alloc(c.num_src * INDEX_BYTES + (4 * c.num_edges if c.weighted else 0), "block_structure")
        rows = replay.alloc(c.num_src * widths[index] * f, "input_features" if index == 0 else HID)
        return block, rows

    replay.phase, replay.saving = "forward", False  # torch.no_grad: autograd saves nothing
    stored = []
    for index, pieces in enumerate(chunks):
        out = replay.alloc(layers[index].num_dst * widths[index + 1] * f, HID)
        for c in pieces:
            mark = replay.mark()
            block, rows = chunk_inputs(index, c)
            model.layer_terms(tape, index, c, rows, False, consume_input=index == 0)
            replay.release_since(mark)  # the chunk's rows are copied into h_l; nothing of it survives
        stored.append(out)

    replay.saving = True
    outputs, classes = layers[-1].num_dst, widths[-1]
    labels = replay.alloc(outputs * INDEX_BYTES, "labels")
    loss_bwd = tape.cross_entropy(outputs, classes, labels)
    replay.phase = "backward"
    grad_out = loss_bwd()
    predictions, hits = replay.alloc(outputs * INDEX_BYTES, OVER), replay.alloc(outputs, OVER)
    replay.drop(predictions, hits, labels, stored[-1])  # logits and labels die here, ∂L/∂logits stays
    for index in range(model.num_layers - 1, -1, -1):
        if index < model.num_layers - 1:
            replay.drop(stored[index])  # h_l: the chunks' recompute makes what their backward needs
        grad_in = replay.alloc(layers[index].num_src * widths[index] * f, GRAD) if index > 0 else None
        for c in chunks[index]:
            mark = replay.mark()
            block, rows = chunk_inputs(index, c)
            out, backward = model.layer_terms(tape, index, c, rows, index > 0, consume_input=index == 0)
            # at layer 1 the executor hands the gathered rows over (no reference left once the recomputed
            # forward returns): only what autograd saved of them (r.save in the terms) stays live
            replay.drop(rows if index == 0 else None)
            grad = replay.alloc(c.num_dst * widths[index + 1] * f, GRAD)  # its rows of ∂L/∂h_l
            replay.keep(out, grad)  # the caller holds both while out.backward(grad) runs
            backward(grad)
            tape.settle()
            replay.release_since(mark)  # rows.grad is added into ∂L/∂h_{l−1}; the chunk is freed
        replay.drop(grad_out)
        grad_out = grad_in
    replay.phase = "optimizer"
    tape.optimizer_step()
    return MemoryEstimate.of(replay, resident)
