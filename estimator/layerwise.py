"""Memory estimate of layer-wise chunked execution (:mod:`betty_trainer.execution.layerwise`).

The same replay as the micro-batch estimate (:mod:`estimator.estimate`), from the same per-layer
terms (each layer's, through ``ModelSpec.layer_terms``), in the executor's order:

- resident: parameters, optimizer state, the accumulated gradients, the batch's blocks and the
  chunks' dst nodes and CSC pointers;
- forward, layer by layer: ``h_l`` (kept), and per chunk its slice (made when it runs:
  :func:`chunk_slice`), its sub-block's src ids (and edge weights), its gathered input rows and the
  layer's forward, replayed without autograd's saved tensors (it runs under ``torch.no_grad``);
- the loss on the logits;
- backward, layer by layer from the output: ``∂L/∂h_{l−1}`` (zeros), and per chunk its slice and sub-block,
  its input rows (requiring grad), the recomputed forward, its rows of ``∂L/∂h_l`` and the
  layer's backward; ``h_l`` is freed before its layer's backward, ``∂L/∂h_l`` after it;
- the optimizer step.

A *projected* layer (GAT, SAGE ``mean``/``gcn`` projecting first: ``layer(block, h) = propagate(block,
W·h)``; ``projections``) is replayed as the executor runs it: ``z = W·dropout(h_{l−1})`` for all its src
rows, one row block per chunk, kept until its layer's backward; each chunk gathers its rows of ``z`` (and,
when the layer ``reads_dst_input``, its dst nodes' input rows with their dropout); in backward ``∂L/∂z`` is
summed over the chunks, then the projection is recomputed block by block and backpropagated. An *affine*
projected layer (SAGE ``mean``/``gcn``: ``ProjectedTerms.affine``) frees ``z`` after its forward; in backward
its chunks take zeros in place of their rows of ``z`` and skip the ReLU, which ``∂L/∂h_l`` takes first from
the stored ``h_l``, one boolean row block at a time. Where the compiled CPU kernels run an affine layer runs off
the whole block instead (:func:`runs_off_whole_block`), in dst row blocks: no slice, sub-block or rows of ``z``;
its dst input rows gathered at the input layer, views above it; its backward recomputes nothing: the src row
blocks' input rows (with their dropout) and the layer's ``projection_backward`` give the parameters' gradients and
the input gradient, ``∂L/∂h_l`` kept until they are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from estimator.counts import INDEX_BYTES, LOCAL_INDEX_BYTES, LayerCounts, block_structure_bytes
from estimator.estimate import MemoryEstimate, model_state_bytes
from estimator.spec import ModelSpec
from estimator.tape import GRAD, HID, OVER, Replay, StepTape


class ProjectedTerms(Protocol):
    """The memory terms of a projected layer (recorded from its code:
    ``betty_trainer.models.recorded_terms.ProjectedLayerTerms``; a :class:`~estimator.spec.ModelSpec` carries them)."""

    width: int  # z's width (columns)
    reads_dst_input: bool  # propagate also reads the chunk's dst input rows (SAGE mean's self term)
    affine: bool  # propagate is affine in z: z is freed after the forward, and backward recomputes from zeros
    runs_rows: bool  # the layer has the row methods below (an affine one then runs off the whole block on the CPU)

    def project(self, tape: StepTape, rows: int, h: int | None, h_grad: bool) -> tuple[int, Callable[[], int | None]]:
        """``W·dropout(h)`` on ``rows`` rows of the layer input ``h`` (a handle for layer 1's gathered rows,
        which input dropout overwrites; ``None`` for a view of the stored ``h_{l−1}``): ``(z, backward)``,
        ``backward()`` taking ``z``'s gradient (a view the caller holds) and returning ``h``'s (or ``None``)."""

    def propagate(self, tape: StepTape, c: LayerCounts, z: int, h_dst: int | None = None,
                  h_grad: bool = False, relu: bool = True) -> tuple[int, Callable[[int], int | None]]:
        """The layer's rest (and, with ``relu``, the stack's ReLU) on a chunk from its rows ``z`` and, when
        ``reads_dst_input``, its dst nodes' input rows ``h_dst`` (gathered features at layer 1, which input
        dropout overwrites; else rows of ``h_{l−1}``, requiring grad with ``h_grad``): ``(output, backward)``,
        ``backward(grad)`` returning ``z``'s gradient (``h_dst``'s stays in the chunk's scope)."""

    def propagate_rows(self, tape: StepTape, rows: int, h_dst: int | None = None) -> int:
        """An affine layer's chunk of ``rows`` dst rows run off the whole block without autograd (where the
        compiled CPU kernels run): the dst input rows' dropout, the layer's rest on ``z`` read in place, and the
        stack's ReLU. Returns the output's handle."""

    def projection_backward(self, tape: StepTape, rows: int, dst_rows: int, h: int | None, h_grad: bool) -> None:
        """An affine layer's backward run off the whole block, on a block of ``rows`` src rows of which ``dst_rows``
        are dst nodes, nothing recomputed: the input rows ``h`` (gathered features at layer 1, which input dropout
        overwrites; ``None`` for a view of ``h_{l−1}``) with their dropout, the parameters' gradients from them,
        and with ``h_grad`` the rows' input gradient (added into ``∂L/∂h_{l−1}``)."""


def runs_off_whole_block(model: ModelSpec, projections: Sequence[ProjectedTerms | None] | None) -> list[bool]:
    """Per layer, whether layer-wise execution runs it off the whole block: an affine projected layer where the
    compiled CPU kernels run (``betty_trainer.execution.layerwise``). Its chunks' dst sets do not matter then: it
    runs in as many contiguous dst row blocks (:func:`row_blocks`), reading no chunk slice."""
    projections = projections if projections is not None else [None] * model.num_layers
    return [terms is not None and terms.affine and terms.runs_rows and model.compiled_kernels for terms in projections]


def row_blocks(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[begin, end)`` row ranges covering ``num_rows`` rows, sizes within one
    (a projected layer's row blocks, in the executor and in the estimate)."""
    bounds = [num_rows * i // parts for i in range(parts + 1)]
    return [(begin, end) for begin, end in zip(bounds[:-1], bounds[1:]) if end > begin]


def chunk_structure_bytes(chunks: Sequence[Sequence[LayerCounts]]) -> int:
    """Bytes the chunks keep for the whole step (``partition.chunks.Chunk``: int64 dst positions and CSC
    pointer), ``8·Σ (2D + 1)`` over every chunk of every layer."""
    return sum((2 * c.num_dst + 1) * INDEX_BYTES for layer in chunks for c in layer)


def chunk_slice(replay: Replay, block: LayerCounts, c: LayerCounts) -> None:
    """What running a chunk of counts ``c`` of a block of counts ``block`` allocates before its input rows,
    on the replay: its slice (``partition.slicing.slice_block_compiled``: an int32 scratch label per src
    node of the block, freed at once, then the chunk's int64 CSC pointer and edge ids, int32 local indices and
    int64 src positions), then its sub-block (``Block.restrict``: the gathered float32 edge weights and the int64 src
    ids); the edge ids die with the slice. The rest lives until the chunk ends (the executor holds the
    sub-block until then)."""
    label = replay.alloc(block.num_src * (4 if block.num_src < 2**31 else INDEX_BYTES), "block_structure")
    replay.alloc((c.num_dst + 1) * INDEX_BYTES, "block_structure")
    edge_ids = replay.alloc(c.num_edges * INDEX_BYTES, "block_structure")
    replay.alloc(c.num_edges * LOCAL_INDEX_BYTES + c.num_src * INDEX_BYTES, "block_structure")
    replay.drop(label)
    replay.alloc(c.num_src * INDEX_BYTES + (4 * c.num_edges if c.weighted else 0), "block_structure")
    replay.drop(edge_ids)


def estimate_layerwise(layers: Sequence[LayerCounts], chunks: Sequence[Sequence[LayerCounts]],
                       model: ModelSpec, projections: Sequence[ProjectedTerms | None] | None = None,
                       host_outputs: bool = False) -> MemoryEstimate:
    """Estimate the peak of one layer-wise training step (all chunks of all layers), itemised.

    Args:
        layers: the whole batch's :class:`LayerCounts`, input layer first.
        chunks: per layer, the counts of each chunk's one-layer sub-block (``partition.chunks``).
        model: the model (:class:`ModelSpec` with ``layer_terms``).
        projections: per layer, the :class:`ProjectedTerms` of a layer the executor projects once per pass
            (``ModelSpec.projections``), else ``None``; default: none is.
        host_outputs: the hidden layers' outputs ``h_l`` are kept in host memory (``LayerChunks.host_outputs``):
            not counted on the device; a chunk's rows of ``h_{l−1}`` are copied to the device (as gathered
            rows are anyway) and a projected layer's row blocks too (device-resident, they are views).

    Returns:
        A :class:`~estimator.estimate.MemoryEstimate` (bytes). The accumulated gradients are
        counted as resident from the start (the first chunk's backward makes them: an upper
        bound by at most one gradient's bytes before then).

    Raises:
        ValueError: layer counts that do not match the model, or a spec without ``layer_terms``.
    """
    return _replay_layerwise(layers, chunks, lambda index, rows: row_blocks(rows, len(chunks[index])),
                             chunk_structure_bytes(chunks), model, projections, host_outputs)


def layerwise_floor(layers: Sequence[LayerCounts], largest: Sequence[LayerCounts], model: ModelSpec,
                    projections: Sequence[ProjectedTerms | None] | None = None, host_outputs: bool = False) -> int:
    """A lower bound (bytes) on :func:`estimate_layerwise`'s peak at every chunking of these layers, found
    without partitioning: what no number of chunks per layer can go below.

    Every chunking of layer ``l`` has a chunk holding the dst node whose one-node chunk is ``largest[l]`` (its
    in-edges cannot be split), and a chunk's terms grow with its counts (the tests check the bound against REG,
    METIS and range chunkings of every built-in model), so the replay with that one chunk per layer bounds each
    chunk loop's peak from below. One dst node per chunk is estimated at exactly the bound plus
    ``8·Σ_l (D_l − 1)`` (the pointer entries of the chunks past each layer's first), so the bound is met
    within that. The rest takes its least value over chunkings:
    the chunks' structure as one chunk per layer (``8·(2D + 1)``), and a projected layer's row blocks (and the
    ReLU step's) as at ``D_l`` chunks, the most a layer can have: one block of the largest such block's rows
    is replayed (each block's allocations are freed before the next's). The replay's cost does not grow with
    the graph (one chunk and one row block per layer); the counts it is given do.

    Args:
        layers: the whole batch's :class:`LayerCounts`, input layer first.
        largest: per layer, the counts of one dst node's one-node chunk (any dst node's gives a bound; the
            planner takes a node of largest in-degree).
        model, projections, host_outputs: as :func:`estimate_layerwise`'s.

    Raises:
        ValueError: as :func:`estimate_layerwise`.
    """
    structure = sum((2 * c.num_dst + 1) * INDEX_BYTES for c in layers)

    def least_blocks(index: int, rows: int) -> list[tuple[int, int]]:
        return [(0, -(-rows // max(layers[index].num_dst, 1)))]

    return _replay_layerwise(layers, [[c] for c in largest], least_blocks, structure, model, projections,
                             host_outputs).peak_bytes


def _replay_layerwise(layers: Sequence[LayerCounts], chunks: Sequence[Sequence[LayerCounts]],
                      blocks: Callable[[int, int], list[tuple[int, int]]], chunk_structure: int, model: ModelSpec,
                      projections: Sequence[ProjectedTerms | None] | None, host_outputs: bool) -> MemoryEstimate:
    """:func:`estimate_layerwise`'s replay, with the row blocks of layer ``index``'s ``rows`` rows
    (``blocks(index, rows)``: :func:`row_blocks` at the chunk count) and the chunks' structure bytes given
    apart from the chunks replayed."""
    if len(layers) != model.num_layers or len(chunks) != model.num_layers:
        raise ValueError(f"{len(layers)} layers and {len(chunks)} chunked layers for a model of {model.num_layers}")
    if model.layer_terms is None:
        raise ValueError("the ModelSpec has no layer_terms: build it from the model (betty_trainer.memory.spec.spec_of)")
    replay = Replay()
    tape = StepTape(replay, model, accumulate=True)
    for component, nbytes in model_state_bytes(model).items():
        replay.alloc(nbytes, component)
    replay.alloc(model.num_parameters * model.dtype_bytes, GRAD)
    replay.alloc(block_structure_bytes(layers) + chunk_structure, "block_structure")
    resident = replay.current
    step = _LayerwiseReplay(replay, tape, model, layers, chunks, blocks, host_outputs,
                            list(projections) if projections is not None else [None] * model.num_layers)
    replay.phase, replay.saving = "forward", False  # torch.no_grad: autograd saves nothing
    stored, projected = step.forward()
    replay.saving = True
    grad_out = step.loss(stored)
    for index in range(model.num_layers - 1, -1, -1):
        grad_out = step.backward(index, grad_out, stored, projected)
    replay.phase = "optimizer"
    tape.optimizer_step()
    return MemoryEstimate.of(replay, resident)


@dataclass
class _LayerwiseReplay:
    """:func:`_replay_layerwise`'s step, replayed as the executor (``betty_trainer.execution.layerwise``) runs
    it: the tape and replay it allocates on, and the layers, chunks, row blocks and projections it reads."""

    replay: Replay
    tape: StepTape
    model: ModelSpec
    layers: Sequence[LayerCounts]
    chunks: Sequence[Sequence[LayerCounts]]
    blocks: Callable[[int, int], list[tuple[int, int]]]
    host_outputs: bool
    projections: list[ProjectedTerms | None]
    whole_block: list[bool] = field(init=False)  # per layer: run off the whole block (runs_off_whole_block)

    def __post_init__(self) -> None:
        self.whole_block = runs_off_whole_block(self.model, self.projections)

    def forward(self) -> tuple[list[int | None], list[int | None]]:
        """Layers 1 … L without autograd: each layer's kept output ``h_l`` (``None`` when it is in host memory)
        and each projected, non-affine layer's kept ``z`` (``None`` for the others), as replay handles."""
        replay, model, f = self.replay, self.model, self.model.dtype_bytes
        stored, projected = [], []
        for index in range(len(self.chunks)):
            z_all = None
            if self.projections[index] is not None:
                z_all = replay.alloc(self.layers[index].num_src * self.projections[index].width * f, HID)
                self.projection(index, grad=False)
            on_host = self.host_outputs and index < model.num_layers - 1
            out = None
            for position, c in enumerate(self.pieces(index)):
                mark = replay.mark()
                if z_all is not None:
                    self.propagated(index, c, grad=False)
                else:
                    rows = self.chunk_inputs(index, c)
                    model.layer_terms(self.tape, index, c, rows, False, consume_input=index == 0)
                replay.release_since(mark)  # the chunk's rows are copied into h_l; nothing of it survives
                if position == 0 and not on_host:  # h_l is made beside the first chunk's output rows
                    first = replay.alloc(c.num_dst * model.widths[index + 1] * f, HID)
                    out = replay.alloc(self.layers[index].num_dst * model.widths[index + 1] * f, HID)
                    replay.drop(first)
            stored.append(out)
            if z_all is not None and self.projections[index].affine:  # its backward does not read z
                replay.drop(z_all)
                z_all = None
            projected.append(z_all)
        return stored, projected

    def loss(self, stored: list[int | None]) -> int:
        """The loss of the logits ``stored[-1]`` and its backward; returns ``∂L/∂logits`` (the logits, the labels
        and the predictions die here)."""
        replay, outputs = self.replay, self.layers[-1].num_dst
        labels = replay.alloc(outputs * INDEX_BYTES, "labels")
        loss_bwd, scalars = self.tape.loss(outputs, self.model.widths[-1], labels)
        replay.phase = "backward"
        grad_out = loss_bwd()
        predictions, hits = replay.alloc(outputs * INDEX_BYTES, OVER), replay.alloc(outputs, OVER)
        replay.drop(predictions, hits, labels, stored[-1], *scalars())  # logits and labels die here, ∂L/∂logits stays
        return grad_out

    def backward(self, index: int, grad_out: int, stored: list[int | None], projected: list[int | None]) -> int | None:
        """Layer ``index``'s backward from ``grad_out`` (``∂L/∂h_l``): its chunks recomputed and backpropagated,
        then a projected layer's projection; returns ``∂L/∂h_{l−1}`` (``None`` at the input layer)."""
        replay, widths, f = self.replay, self.model.widths, self.model.dtype_bytes
        projection = self.projections[index]
        if index < self.model.num_layers - 1:
            if projection is not None and projection.affine:  # ReLU's backward on ∂L/∂h_l, in place
                for begin, end in self.blocks(index, self.layers[index].num_dst):
                    replay.drop(replay.alloc((end - begin) * widths[index + 1], OVER))  # the block's boolean mask
            replay.drop(stored[index])  # h_l: the chunks' recompute makes what their backward needs
        grad_in = replay.alloc(self.layers[index].num_src * widths[index] * f, GRAD) if index > 0 else None
        z_all = projected[index]
        grad_z = (replay.alloc(self.layers[index].num_src * projection.width * f, GRAD)
                  if projection is not None else None)
        if not self.whole_block[index]:
            for c in self.chunks[index]:
                self.chunk_backward(index, c)
        else:  # the transpose into ∂L/∂z allocates nothing; the gradients from ∂L/∂z and ∂L/∂h_l, nothing recomputed
            self.projection(index, grad=True)
        replay.drop(grad_out)
        if projection is not None:
            replay.drop(z_all)
            if not self.whole_block[index]:
                self.projection(index, grad=True)
            replay.drop(grad_z)
        return grad_in

    def pieces(self, index: int) -> Sequence[LayerCounts]:
        """What layer ``index`` runs a piece at a time: its chunks' counts, or, for a layer run off the whole block
        (:attr:`whole_block`), one ``(rows, rows, 0)`` per dst row block (:attr:`blocks`, as many as its chunks)."""
        if not self.whole_block[index]:
            return self.chunks[index]
        return [LayerCounts(end - begin, end - begin, 0)
                for begin, end in self.blocks(index, self.layers[index].num_dst)]

    def dst_inputs(self, index: int, rows: int) -> int | None:
        """A row block of a layer run off the whole block: its dst input rows' handle when it gathers them (features
        at the input layer; ``None`` for a view of the stored ``h_{l−1}``, or when the layer does not read them)."""
        if not self.projections[index].reads_dst_input or index > 0:
            return None
        return self.replay.alloc(rows * self.model.widths[0] * self.model.dtype_bytes, "input_features")

    def chunk_backward(self, index: int, c: LayerCounts) -> None:
        """One chunk of layer ``index`` recomputed with autograd and backpropagated from its rows of ``∂L/∂h_l``."""
        replay = self.replay
        mark = replay.mark()
        if self.projections[index] is not None:
            out, backward = self.propagated(index, c, grad=True)
        else:
            rows = self.chunk_inputs(index, c)
            out, backward = self.model.layer_terms(self.tape, index, c, rows, index > 0, consume_input=index == 0)
            # at layer 1 the executor hands the gathered rows over (no reference left once the recomputed
            # forward returns): only what autograd saved of them (r.save in the terms) stays live
            replay.drop(rows if index == 0 else None)
        grad = replay.alloc(c.num_dst * self.model.widths[index + 1] * self.model.dtype_bytes, GRAD)  # of ∂L/∂h_l
        replay.keep(out, grad)  # the caller holds both while out.backward(grad) runs
        backward(grad)
        self.tape.settle()
        replay.release_since(mark)  # rows.grad is added into ∂L/∂h_{l−1} (or ∂L/∂z); the chunk is freed

    def chunk_inputs(self, index: int, c: LayerCounts) -> int:
        """The chunk's slice and sub-block, then its gathered input rows (rows of ``h_{l−1}`` stay held by the
        executor until the chunk ends, whatever the layer drops)."""
        replay = self.replay
        chunk_slice(replay, self.layers[index], c)
        rows = replay.alloc(c.num_src * self.model.widths[index] * self.model.dtype_bytes,
                            "input_features" if index == 0 else HID)
        if index > 0:
            replay.keep(rows)
        return rows

    def projection(self, index: int, grad: bool) -> None:
        """A projected layer's row blocks: forward (into the kept ``z``), or recomputed and backpropagated (a layer
        run off the whole block: backpropagated without recomputing, ``ProjectedTerms.projection_backward``)."""
        replay, width = self.replay, self.model.widths[index] * self.model.dtype_bytes
        num_dst = self.layers[index].num_dst
        for begin, end in self.blocks(index, self.layers[index].num_src):
            mark = replay.mark()
            rows = None  # a view of the stored h_{l−1} on the device
            if index == 0 or self.host_outputs:  # gathered features, or rows copied from host memory
                rows = replay.alloc((end - begin) * width, "input_features" if index == 0 else HID)
            if grad and self.whole_block[index]:
                dst_rows = max(0, min(end, num_dst) - begin)
                self.projections[index].projection_backward(self.tape, end - begin, dst_rows, rows, index > 0)
                replay.release_since(mark)
                continue
            z, backward = self.projections[index].project(self.tape, end - begin, rows, grad and index > 0)
            if grad:
                backward()
                self.tape.settle()
            replay.release_since(mark)  # z is copied into the kept z (forward), its input rows' gradient into ∂L/∂h

    def propagated(self, index: int, c: LayerCounts, grad: bool):
        """A projected layer's chunk: its slice and sub-block, its gathered rows of z (zeros in an affine layer's
        backward; and its dst input rows, when the layer reads them), the layer's rest (without the stack's ReLU
        in an affine layer's backward: ``∂L/∂h_l`` has it applied already)."""
        replay, terms, f = self.replay, self.projections[index], self.model.dtype_bytes
        if not grad and self.whole_block[index]:  # c: a row block's counts
            return terms.propagate_rows(self.tape, c.num_dst, self.dst_inputs(index, c.num_dst)), None
        chunk_slice(replay, self.layers[index], c)
        rows = replay.alloc(c.num_src * terms.width * f, HID)
        relu = not (grad and terms.affine)
        if not terms.reads_dst_input:
            return terms.propagate(self.tape, c, rows, relu=relu)
        h_dst = replay.alloc(c.num_dst * self.model.widths[index] * f, "input_features" if index == 0 else HID)
        return terms.propagate(self.tape, c, rows, h_dst, grad and index > 0, relu)
