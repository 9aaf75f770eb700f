"""A built-in model's memory terms recorded from its code, one layer at a time (issue 24, item 3): the per-layer
event streams the micro-batch, layer-wise and cooperative replays need (Betty §4.4.3), where
:mod:`betty_trainer.memory.recorded` records a custom model's whole step.

:class:`RecordedLayer` records the pieces the executors run of one layer: the stack's ``layer_forward`` (dropout, the
layer, ReLU), and for a projected layer layer-wise execution's projection, propagation, row blocks and projection
backward, and layer 0 from the aggregation cache; each on fake tensors (:meth:`estimator.recorder.Recorder.
record_piece`) instead of a second program written by hand. The harness makes the piece's inputs, the output's
gradient and the seams between them and the rest of a step without recording them, and watches their storages, so
that a recording says which inputs autograd keeps past the forward and where its backward lets them go, where the
output's gradient dies, and which allocation is each input's gradient. :class:`RecordedStack` chains them as the
model's ``forward`` does; :func:`model_terms` keeps one per model structure.

Each configuration (the step accumulating into resident gradients or not, the input requiring grad or not, the block
weighted or not, keeping its transpose or not, autograd recording or not, blocks whose src nodes are all dst nodes)
is recorded at the sizes of :func:`~estimator.recorder.recording_sizes` for one layer and solved exactly
(:func:`~estimator.recorder.solve_allocations`): every allocation's bytes an integer linear function of ``(1, S, D,
E)``. A replay is then one pass over the recorded events (tens per layer).

GAT's attention runs over its edges in chunks, the pool's tensor-path segment max over its edges and the tensor
path's keyed dropout over its rows (:func:`betty_trainer.models.chunks.chunks`), one chunk at the recorded sizes and
several at a real block's: the loop tells its observers where it begins and ends, and what a chunk allocates is
counted for one chunk's items (:func:`_chunked`).

A tape without the compiled kernels (``StepTape.compiled_kernels``: a GPU, or a dtype other than float32) is
answered by recordings of the tensor-op path the GPU runs, made on the CPU under
:func:`~betty_trainer.rng.tensor_path` (its sparse CSR product is an operator, which fake tensors run as they run the
compiled kernels); what a GPU allocates beyond the CPU's (the caching allocator's rounding, cuSPARSE's workspace, a
CUDA sort's buffer, which the recording counts at the CPU's 8 bytes per key) is not in either.

Where it holds and where it does not are otherwise the recorder's (:mod:`estimator.recorder`): no data-dependent
shapes (refused: the LSTM aggregator's in-degree groups, whose hand-written terms are replayed where a stand-in for
the layer ran in a recording of the stack around it: :class:`_StandIn`), and other branches on sizes above the
recorded ones not seen. A backward that multiplies by a block's ``Aᵀ`` (the compiled CSR gather or scatter, called
after the backward began) adds the block's counts to ``StepTape.transposed``, the layers a kept transpose would
serve. The components of an allocation are the phase's: :data:`~estimator.tape.HID` in forward,
:data:`~estimator.tape.GRAD` in backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Block, BlockTranspose
from betty_trainer.models import aggregate, chunks
from betty_trainer.models.capabilities import AffineLayer, WrittenMemoryTerms, projected_layers
from betty_trainer.models.stack import LayerStack
from betty_trainer.rng import tensor_path
from estimator.counts import LayerCounts
from estimator.recorder import (
    KeptRecordings,
    PieceScope,
    Recorder,
    Recording,
    RecordingRefused,
    check_torch,
    counts_vector,
    recording_sizes,
    solve_allocations,
    solve_linear,
)
from estimator.tape import GRAD, HID, StepTape

_INPUT, _GRAD = "free input", "free grad"  # a harness tensor's storage died (inputs: "free input i")
_BACKWARD, _END = "backward", "end"  # the piece's moments
_CHUNKS_BEGIN, _CHUNKS_END = "chunks begin", "chunks end"  # a chunk loop's, followed by its step
_PRODUCT = "a sparse product"  # a call of the compiled CSR gather or scatter
_WRITTEN, _WRITTEN_BACKWARD = "written layer", "written layer backward"  # where a _StandIn ran (see RecordedPiece)
_SCOPE: contextvars.ContextVar[PieceScope] = contextvars.ContextVar("recorded_piece_scope")  # the harness's
_TRANSPOSE_PRODUCTS = (aggregate._csr_gather, aggregate._csr_scatter)  # in backward: a product by Aᵀ


def fake_block(c: LayerCounts) -> Block:
    """A block of counts ``c``, with ``(E,)`` float32 edge weights where ``c.weighted`` and a kept transpose where
    ``c.transposed`` (int16 positions), made of ``torch.empty`` (fake inside a :class:`~estimator.recorder.Recorder`:
    the values are never read)."""
    block = Block(torch.empty(c.num_src, dtype=torch.int64), c.num_dst, torch.empty(c.num_dst + 1, dtype=torch.int64),
                  torch.empty(c.num_edges, dtype=torch.int32), torch.empty(c.num_edges) if c.weighted else None)
    if c.transposed:
        block.transpose = BlockTranspose(torch.empty(c.num_src + 1, dtype=torch.int32),
                                         torch.empty(c.num_edges, dtype=torch.int16),
                                         torch.empty(c.num_edges) if c.weighted else None,
                                         (block.indptr, block.indices, block.edge_weight))
    return block


class _Boundary(torch.autograd.Function):
    """An input of a recorded piece as a non-leaf tensor of its own storage: held only by the harness and by what
    the piece saves; its gradient is kept in ``stash`` (the harness hands it to the caller)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, shape: tuple[int, int], stash: list) -> Tensor:
        ctx.stash = stash
        return anchor.new_empty(shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.stash.append(grad)
        return None, None, None


class _Seam(torch.autograd.Function):
    """A scalar after the layer's output whose backward hands the harness's ``(D, F_out)`` gradient to the layer
    (``stash.pop()``: the engine then holds its only reference)."""

    @staticmethod
    def forward(ctx, out: Tensor, stash: list) -> Tensor:
        ctx.stash = stash
        return out.new_empty(())

    @staticmethod
    def backward(ctx, _grad: Tensor):
        return ctx.stash.pop(), None


@dataclass(frozen=True, eq=False)  # compared by identity: numpy arrays have no single truth value
class RecordedPiece:
    """One configuration of a layer, solved: what its forward and backward allocate and free.

    Attributes:
        coefficients: ``(allocations, 4)`` int64: allocation ``i`` takes ``coefficients[i] · (1, S, D, E)`` bytes.
        forward: the forward's events, ``+i + 1`` allocation ``i``, ``-(i + 1)`` its free (the output's free, which
            is the caller's, left out).
        backward: the backward's events, and ``"free input i"`` / ``"free grad"`` where input ``i`` (kept by
            autograd) and the output's gradient die; empty when autograd did not record.
        output: the output's allocation (``None``: the piece returns nothing).
        transposes: the backward multiplies by the block's ``Aᵀ`` (the compiled CSR gather or scatter), which a
            kept transpose serves (``StepTape.transposed``).
        input_saved: per input, autograd keeps it past the forward (it dies in :attr:`backward`).
        output_saved: autograd keeps the output past the forward (its free is in :attr:`backward`).
        input_grad: per input, the allocation that is its gradient (handed to the caller), or ``None``.
        chunked: the allocations of one chunk of a chunk loop (:func:`_chunked`), counted for one chunk's items,
            as the loop makes and frees them chunk by chunk.

    A layer recorded with a :class:`_StandIn` in place of a layer whose terms are written by hand has a step
    ``("written layer", input, output)`` in :attr:`forward` (the allocation ``input`` that the layer read, ``-1``: the
    piece's input; the stand-in's ``output`` allocation) and ``("written layer backward", grad, grad_input)`` in
    :attr:`backward` (the allocation of the gradient it received, ``-1``: the piece's; the allocation it returned, or
    ``-1``): :meth:`replay` runs the hand-written terms there and their handles stand for those allocations.
    """

    coefficients: np.ndarray
    forward: tuple[int, ...]
    backward: tuple[int | str, ...]
    transposes: bool
    output: int | None
    input_saved: tuple[bool, ...]
    output_saved: bool
    input_grad: tuple[int | None, ...]
    chunked: tuple[tuple[int, int, int, np.ndarray, int], ...] = ()

    @classmethod
    def of(cls, recordings: list[Recording], counts: list[LayerCounts], output: int | None,
           input_grad: tuple[int | None, ...]) -> RecordedPiece:
        """The piece of recordings of one configuration at ``counts`` (one layer's :func:`recording_sizes`).

        Raises:
            RecordingRefused: as :func:`~estimator.recorder.solve_allocations` and :func:`_chunked`.
        """
        vectors = np.array([counts_vector([c]) for c in counts], dtype=np.int64)
        coefficients = solve_allocations(recordings, vectors)
        steps: list[int | str] = []
        marks, events = recordings[0].marks, recordings[0].events
        for position in range(len(events) + 1):
            steps += [name for at, name, _ in marks if at == position]
            steps += [events[position]] if position < len(events) else []
        steps = steps[:steps.index(_END)]
        chunked = _chunked(coefficients, steps, recordings, vectors)
        split = steps.index(_BACKWARD) if _BACKWARD in steps else len(steps)
        forward, backward = steps[:split], steps[split + 1:]
        freed = [f"{_INPUT} {i}" for i in range(len(input_grad))]
        output_freed = None if output is None else -output - 1  # the caller's
        forward, backward = _written_steps(forward), _written_steps(backward)
        # the gradient a written layer received dies where its hand-written terms free it, not where the stand-in let
        # it go (after the backward, as a node without gradients to pass on)
        received = {step[1] for step in backward if isinstance(step, tuple)}
        backward = [e for e in backward if not (isinstance(e, int) and -e - 1 in received
                                                or e == _GRAD and -1 in received)]
        return cls(coefficients, tuple(e for e in forward if isinstance(e, tuple) or isinstance(e, int)
                                       and e != output_freed),
                   tuple(e for e in backward if e in freed or e == _GRAD or not isinstance(e, str)),
                   _PRODUCT in backward, output, tuple(name in backward for name in freed), output_freed in backward,
                   input_grad, chunked)

    def replay(self, tape: StepTape, c: LayerCounts, inputs: Sequence[int | None], written: Callable | None = None):
        """This piece on ``tape`` (the estimate's replay, Betty §4.4.3: allocations in bytes, :meth:`nbytes`) for a
        block of counts ``c`` from the input handles ``inputs`` (the caller holds them): ``(output handle,
        backward)``, ``backward(grad)`` freeing ``grad`` where the engine lets it go and returning each input's
        gradient handle (or ``None``). ``written(tape, c, h)``: the hand-written terms of the layer a stand-in ran
        for, ``(output handle, backward)`` as :class:`~betty_trainer.models.capabilities.WrittenMemoryTerms` gives."""
        r, nbytes, handles = tape.r, self.nbytes(c), {}
        written_backward = []

        def run(event: int, component: str) -> None:
            index = abs(event) - 1
            if event > 0:
                handles[index] = r.alloc(int(nbytes[index]), component)
            else:
                r.drop(handles.pop(index))

        for event in self.forward:
            if isinstance(event, tuple):  # the written layer's forward: its output stands for the stand-in's
                _, read, made = event
                handles[made], layer_backward = written(tape, c, inputs[0] if read < 0 else handles[read])
                written_backward.append(layer_backward)
            else:
                run(event, HID)
        out = None if self.output is None else handles[self.output]
        r.keep(*(handle for handle, saved in zip(inputs, self.input_saved) if saved))
        if self.output_saved:
            r.keep(out)

        def backward(grad: int) -> tuple[int | None, ...]:
            if self.transposes:
                tape.transposed.append(c)  # a product by Aᵀ: a kept transpose would serve it (for the planner)
            for step in self.backward:
                if step == _GRAD:
                    r.drop(grad)
                elif isinstance(step, str):  # "free input i"
                    r.drop(inputs[int(step.split()[-1])])
                elif isinstance(step, tuple):  # the written layer's backward, which frees the gradient it takes
                    _, received, made = step
                    grad_input = written_backward.pop()(grad if received < 0 else handles.pop(received))
                    if made >= 0:
                        handles[made] = grad_input
                else:
                    run(step, GRAD)
            return tuple(None if index is None else handles[index] for index in self.input_grad)

        return out, backward

    def nbytes(self, c: LayerCounts) -> np.ndarray:
        """Each allocation's bytes on a block of counts ``c``: ``(allocations,)`` int64, bytes; one chunk's for the
        :attr:`chunked` allocations."""
        vector = np.array(counts_vector([c]), dtype=np.int64)
        nbytes = self.coefficients @ vector
        for index, base, per_item, items, step in self.chunked:
            nbytes[index] = base + per_item * min(int(items @ vector), step)
        return nbytes


def _chunked(coefficients: np.ndarray, steps: list[int | str], recordings: list[Recording],
             vectors: np.ndarray) -> tuple[tuple[int, int, int, np.ndarray, int], ...]:
    """``(allocation, base, per_item, items, step)`` of each allocation made inside a chunk loop (between the
    ``"chunks begin"`` and ``"chunks end"`` marks :func:`betty_trainer.models.chunks.chunks`' observers make): its
    bytes are ``base + per_item · min(items · (1, S, D, E), step)``, one chunk's, where the recording (one chunk at
    its small sizes) made them for all ``items``. The first chunk is the largest; one that
    outlives the loop is the last chunk's (a variable holding it until the function returns), counted as one
    chunk's too. Not modelled, as in the hand-written terms: a chunk's tensor still held while the next chunk makes
    its own (a variable reassigned in the loop), which adds to the peak only where it exceeds the chunk's own.

    Raises:
        RecordingRefused: a loop's items or an allocation's bytes that are not linear in the counts, proportional to
            the items."""
    begins = [index for index, (_, name, _) in enumerate(recordings[0].marks) if name.startswith(_CHUNKS_BEGIN)]
    totals = np.array([[r.marks[index][2] for index in begins] for r in recordings], dtype=np.int64)
    items, wrong = solve_linear(totals, vectors)
    if wrong is not None:
        raise RecordingRefused("a chunk loop's items are not linear in the node and edge counts")
    chunked, loop, inside = [], -1, False
    for step in steps:
        if isinstance(step, str) and step.startswith(_CHUNKS_BEGIN):
            loop, inside = loop + 1, True
        elif isinstance(step, str) and step.startswith(_CHUNKS_END):
            inside = False
        elif isinstance(step, int) and inside and step > 0:
            index, total = step - 1, items[loop]
            per_item = _proportion(coefficients[index, 1:], total[1:])
            if per_item is None:
                raise RecordingRefused("a chunk loop allocates bytes not proportional to its items")
            chunked.append((index, int(coefficients[index, 0] - per_item * total[0]), per_item, total,
                            int(recordings[0].marks[begins[loop]][1].split()[-1])))
    return tuple(chunked)


def _proportion(values: np.ndarray, base: np.ndarray) -> int | None:
    """The integer ``k`` with ``values == k · base`` (``base`` not all zero), or ``None``."""
    nonzero = np.nonzero(base)[0]
    if not nonzero.size or values[nonzero[0]] % base[nonzero[0]]:
        return None
    k = int(values[nonzero[0]] // base[nonzero[0]])
    return k if np.array_equal(values, k * base) else None


def _written_steps(steps: list) -> list:
    """``steps`` with each stand-in's mark and the allocation made right after it (its output, or its input's
    gradient) merged into one ``(mark, read, made)`` step (see :class:`RecordedPiece`)."""
    merged, position = [], 0
    while position < len(steps):
        step = steps[position]
        if isinstance(step, str) and step.startswith(_WRITTEN):
            name, read, grad = step.rsplit(" ", 2) if step.startswith(_WRITTEN_BACKWARD) else (*step.rsplit(" ", 1), "1")
            if grad == "1" and not (position + 1 < len(steps) and isinstance(steps[position + 1], int)
                                    and steps[position + 1] > 0):
                raise RecordingRefused("a stand-in's tensor was not made where it ran")
            made = steps[position + 1] - 1 if grad == "1" else -1
            merged.append((name, int(read), made))
            position += 2 if grad == "1" else 1
        else:
            merged.append(step)
            position += 1
    return merged


class _WrittenLayer(torch.autograd.Function):
    """A :class:`_StandIn`'s op: a new ``shape`` output, and a new gradient of ``h`` (where it takes one); the
    parameters take none (the hand-written terms make theirs). It marks where it runs, naming the allocations it read
    (``-1``: none of the piece's)."""

    @staticmethod
    def forward(ctx, h: Tensor, shape: tuple[int, int], *parameters: Tensor) -> Tensor:
        scope = _SCOPE.get()
        ctx.scope, ctx.shape = scope, h.shape
        scope.mark(f"{_WRITTEN} {_index(scope, h)}")
        return h.new_empty(shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        wants = ctx.needs_input_grad[0]
        ctx.scope.mark(f"{_WRITTEN_BACKWARD} {_index(ctx.scope, grad)} {int(wants)}")
        return (grad.new_empty(ctx.shape) if wants else None, None) + (None,) * (len(ctx.needs_input_grad) - 2)


def _index(scope: PieceScope, tensor: Tensor) -> int:
    index = scope.index_of(tensor)
    return -1 if index is None else index


class _StandIn(nn.Module):
    """In a recording of the stack around it, a layer whose memory terms are written by hand
    (:class:`~betty_trainer.models.capabilities.WrittenMemoryTerms`): ``(S, F_in)`` → a new ``(D, F_out)`` tensor
    through :class:`_WrittenLayer`, with the layer's parameters as inputs, so that autograd runs its backward."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer, self.width = layer, width

    def forward(self, block: Block, h: Tensor) -> Tensor:
        return _WrittenLayer.apply(h, (block.num_dst, self.width), *self.layer.parameters())


@dataclass(frozen=True)
class _Input:
    """A boundary input of a recorded piece: ``(S, width)`` (``rows="src"``) or ``(D, width)`` (``"dst"``)."""

    rows: str
    width: int

    def shape(self, c: LayerCounts) -> tuple[int, int]:
        return (c.num_src if self.rows == "src" else c.num_dst, self.width)


class RecordedLayer:
    """Layer ``index`` of ``model``'s memory terms from recordings of its code (see the module; the terms feed the
    replay of Betty §4.4.3, :mod:`estimator.tape`, bytes per allocation): the stack's ``layer_forward`` (dropout,
    the layer, ReLU below the output layer), and where layer-wise execution projects the layer its projection and
    propagation as the executor runs them, and layer 0's ``aggregated_forward`` from the aggregation cache; each
    configuration recorded when a replay first asks for it (tens of milliseconds) and kept.

    Args:
        model: the :class:`~betty_trainer.models.stack.LayerStack` (its parameters and buffers are copied as fake
            CPU tensors; the model itself is not touched).
        index: the layer.

    Raises:
        RecordingRefused: from the terms, for a layer or configuration the recorder cannot record exactly (the
            message names why in one line), unless hand-written terms stand in (:meth:`layer_memory_terms`).
    """

    def __init__(self, model: LayerStack, index: int):
        self.model, self.index = model, index
        self._pieces: dict[tuple, RecordedPiece | str] = {}  # a refused configuration: why

    def layer_memory_terms(self, tape: StepTape, c: LayerCounts, h: int, h_grad: bool, consume_input: bool = False):
        """What the stack's ``layer_forward`` allocates on a block of counts ``c`` from the input ``h`` (a handle on
        the tape; ``h_grad``: it requires grad; ``consume_input``: dropout overwrites it in place): ``(output handle,
        backward)``, ``backward(grad)`` returning the handle of ``h``'s gradient or ``None``; it takes over the
        caller's reference to ``h`` unless ``consume_input`` (the stack's ``forward`` holds it until the layer
        returns). A layer the recorder refuses whose class writes its terms by hand
        (:class:`~betty_trainer.models.capabilities.WrittenMemoryTerms`: SAGE's ``lstm`` aggregator) is recorded with a
        :class:`_StandIn` in its place (the stack's dropout and ReLU around it recorded), and replayed from its
        hand-written terms where the stand-in ran."""
        layer, written = self.model.layers[self.index], None
        try:
            piece = self._piece(tape, c, "layer", (h_grad,), consume_input)
        except RecordingRefused:
            if not (isinstance(layer, WrittenMemoryTerms) and layer.memory_terms_written):
                raise
            piece = self._piece(tape, c, "written layer", (h_grad,), consume_input)

            def written(tape: StepTape, c: LayerCounts, hd: int):
                return layer.memory_terms(tape, c, hd, h_grad)

        out, backward = piece.replay(tape, c, [h], written)
        if not consume_input:
            tape.r.drop(h)
        return out, lambda grad: backward(grad)[0]

    def project_terms(self, tape: StepTape, rows: int, h: int | None, h_grad: bool):
        """What layer-wise execution's projection allocates on ``rows`` rows of the layer's input ``h`` (a handle the
        caller holds: gathered features at layer 0, which dropout overwrites; ``None`` for a view of the stored
        ``h_{l−1}``; ``h_grad``: they require grad): the stack's dropout and the layer's ``project``. Returns ``(z
        handle, backward)``, ``backward()`` taking ``z``'s gradient (a view the caller holds) and returning ``h``'s
        handle or ``None``."""
        c = LayerCounts(rows, rows, 0)
        out, backward = self._piece(tape, c, "project", (h_grad,)).replay(tape, c, [h])
        return out, lambda: backward(None)[0]

    def propagate_terms(self, tape: StepTape, c: LayerCounts, z: int, h_dst: int | None = None, h_grad: bool = False,
                        relu: bool = True):
        """What layer-wise execution's chunk of a projected layer allocates on a block of counts ``c`` from its rows
        ``z`` (``(S, projected_width)``, requiring grad where autograd records) and, where the layer
        ``reads_dst_input``, the dst input rows ``h_dst`` (``(D, widths[index])``, handles the caller holds;
        ``h_grad``: they require grad) with the stack's dropout: the layer's ``propagate`` and, with ``relu``, the
        stack's ReLU below the output layer. Returns ``(output handle, backward)``, ``backward(grad)`` returning
        ``z``'s gradient (``h_dst``'s stays live, the chunk's)."""
        inputs, grads = ([z], (tape.r.saving,)) if h_dst is None else ([z, h_dst], (tape.r.saving, h_grad))
        out, backward = self._piece(tape, c, "propagate", grads, relu).replay(tape, c, inputs)
        return out, lambda grad: backward(grad)[0]

    def aggregated_terms(self, tape: StepTape, rows: int, x: int, consume_input: bool = True):
        """What the stack's ``aggregated_forward`` (layer 0 from ``rows`` rows ``x`` of the aggregation cache, a
        handle: dropout, ``forward_aggregated``, ReLU) allocates. Returns ``(output handle, backward)``; it takes over
        the caller's reference to ``x`` unless ``consume_input``, and ``backward(grad)`` returns ``None`` (the rows
        take no gradient)."""
        c = LayerCounts(rows, rows, 0)
        out, backward = self._piece(tape, c, "aggregated", (False,), consume_input).replay(tape, c, [x])
        if not consume_input:
            tape.r.drop(x)
        return out, lambda grad: backward(grad)[0]

    def rows_terms(self, tape: StepTape, rows: int, h_dst: int | None = None) -> int:
        """What layer-wise execution's block of ``rows`` dst rows of an affine layer run off the whole block allocates
        without autograd (:class:`~betty_trainer.models.capabilities.AffineLayer`'s ``propagate_rows`` on the whole
        projection, which the caller holds): the dst input rows' dropout where the layer reads them (``h_dst``:
        gathered features at layer 0, overwritten in place; ``None`` for a view of ``h_{l−1}``), ``propagate_rows``
        and the stack's ReLU below the output layer. Returns the output's handle."""
        c = LayerCounts(rows, rows, 0)
        inputs = [None, h_dst] if self.model.layers[self.index].reads_dst_input else [None]
        return self._piece(tape, c, "propagate_rows", (False,) * len(inputs)).replay(tape, c, inputs)[0]

    def projection_backward_terms(self, tape: StepTape, rows: int, dst_rows: int, h: int | None, h_grad: bool) -> None:
        """What layer-wise execution's backward of an affine layer run off the whole block allocates on a block of
        ``rows`` src rows, of which the first ``dst_rows`` are dst nodes (``AffineLayer.projection_backward``, the
        parameters' gradients resident): the input rows' dropout (``h``: gathered features at layer 0, overwritten in
        place; ``None`` for a view of ``h_{l−1}``), the parameters' gradients from the rows of ``∂L/∂z`` and
        ``∂L/∂h_l`` (views the caller holds) and, with ``h_grad``, the rows' input gradient through the dropout's
        backward (added into ``∂L/∂h_{l−1}``), freed with the block."""
        c = LayerCounts(rows, dst_rows, 0)
        out, _ = self._piece(tape, c, "projection_backward", (False,) * 3, h_grad).replay(tape, c, [h, None, None])
        tape.r.drop(out)

    def _piece(self, tape: StepTape, c: LayerCounts, kind: str, grads: tuple[bool, ...],
               option: bool = False) -> RecordedPiece:
        rows = "square" if c.num_dst == c.num_src else "empty" if c.num_dst == 0 else "fewer"
        key = (kind, tape.accumulating, grads, c.weighted, c.transposed, tape.r.saving, option, tape.compiled_kernels,
               rows)
        if key not in self._pieces:
            try:
                self._pieces[key] = self._record(*key)
            except RecordingRefused as refusal:
                self._pieces[key] = str(refusal)
        piece = self._pieces[key]
        if isinstance(piece, str):
            raise RecordingRefused(piece)  # a new one each time: a kept exception would keep every caller's frames
        return piece

    def _inputs(self, kind: str, count: int) -> list[_Input]:
        """The first ``count`` boundary inputs of a piece of ``kind``."""
        widths, layer = self.model.widths, self.model.layers[self.index]
        width, projected = widths[self.index], getattr(layer, "projected_width", None)
        return {"layer": [_Input("src", width)], "written layer": [_Input("src", width)],
                "project": [_Input("src", width)],
                "aggregated": [_Input("src", self.model.aggregated_width or 0)],
                "propagate": [_Input("src", projected), _Input("dst", width)],
                "propagate_rows": [_Input("src", projected), _Input("dst", width)],
                "projection_backward": [_Input("src", width), _Input("src", projected),
                                        _Input("dst", widths[self.index + 1])]}[kind][:count]

    def _record(self, kind: str, accumulate: bool, grads: tuple[bool, ...], weighted: bool, transposed: bool,
                grad_enabled: bool, option: bool, compiled: bool, rows: str) -> RecordedPiece:
        """Record one configuration at one layer's :func:`~estimator.recorder.recording_sizes`; ``option``: the
        input is consumed (``"layer"``, ``"aggregated"``), the stack's ReLU follows (``"propagate"``), or the input
        rows take a gradient (``"projection_backward"``). ``rows``: ``"square"`` where every src node is a dst node (a
        full graph's blocks, and the row pieces: ``h[:D]`` is then ``h`` itself, which other sizes slice) and
        ``"empty"`` where none is, recorded at those sizes' twins with ``D = S`` or ``D = 0`` (the dst count's
        coefficient 0); ``"fewer"`` otherwise."""
        index, last = self.index, len(self.model.layers) - 1
        layer = self.model.layers[index]
        sizes = [replace(layers[0], transposed=transposed) for layers in recording_sizes(1, (weighted,))]
        if rows != "fewer":  # the dst count's +1 is then the base again
            sizes = [replace(c, num_dst=c.num_src if rows == "square" else 0) for c in sizes]
        found: dict[str, object] = {}
        with (torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(),
              Recorder() as recorder, contextlib.nullcontext() if compiled else tensor_path()):
            model = recorder.fake_module(self.model, "cpu").train()
            fake = model.layers[index]
            if kind == "written layer":
                model.layers[index] = _StandIn(fake, self.model.widths[index + 1])

            def dst_dropped(block: Block, h_dst: Tensor) -> Tensor:
                return model.dropout(h_dst, block.src_nodes[:block.num_dst], index, index == 0)

            def call(block: Block, *tensors: Tensor) -> Tensor | None:
                if kind in ("layer", "written layer"):
                    return model.layer_forward(index, block, *tensors, consume_input=option)
                if kind == "aggregated":
                    return model.aggregated_forward(*tensors, block.src_nodes, consume_input=option)
                if kind == "project":
                    return fake.project(model.dropout(*tensors, block.src_nodes, index, index == 0))
                if kind == "projection_backward":  # as the layer-wise executor's projection_backward runs it
                    x, grad_z, grad_dst = tensors
                    with torch.no_grad():
                        dropped = model.dropout(x, block.src_nodes, index, index == 0)
                    grad = fake.projection_backward(dropped, grad_z, grad_dst, option)
                    del dropped
                    return None if grad is None else model.dropout.backward_(grad, block.src_nodes, index)
                z, *h_dst = tensors
                h_dst = [dst_dropped(block, h) for h in h_dst]
                if kind == "propagate_rows":  # as the executor's rows_forward runs it
                    out = fake.propagate_rows(block, 0, block.num_dst, z, *h_dst)
                    return F.relu(out) if index < last else out
                out = fake.propagate(block, z, *h_dst)
                return F.relu(out) if option and index < last else out

            recordings = []
            for counts in sizes:
                block = fake_block(counts)
                for parameter in model.parameters():
                    parameter.grad = torch.zeros_like(parameter) if accumulate else None
                recordings.append(recorder.record_piece(_harness(call, block, counts, self._inputs(kind, len(grads)),
                                                                 grads, grad_enabled, next(model.parameters()).dtype,
                                                                 found)))
        if found["output"] is None and found["returned"]:
            raise RecordingRefused(f"{type(layer).__name__} returns a tensor it did not make")
        return RecordedPiece.of(recordings, sizes, found["output"], found["input_grad"])


def _harness(call: Callable[..., Tensor | None], block: Block, c: LayerCounts, inputs: list[_Input],
             grads: tuple[bool, ...], grad_enabled: bool, dtype: torch.dtype,
             found: dict[str, object]) -> Callable[[PieceScope], None]:
    """The recorded piece: ``call(block, *inputs)`` from ``dtype`` inputs only it and the harness hold, the harness letting go
    of them and of the output right after it (what autograd keeps then outlives them), and with autograd the
    backward from a gradient only the engine holds; ``found`` receives the output's and the inputs' gradients'
    allocations. Chunk loops are marked (:func:`_chunked`), and the compiled CSR products the backward calls
    (:attr:`RecordedPiece.transposes`)."""

    def piece(scope: PieceScope) -> None:
        token = _SCOPE.set(scope)
        try:
            with chunks.observing(lambda moment, items, step: scope.mark(
                    f"{_CHUNKS_BEGIN if moment == 'begin' else _CHUNKS_END} {step}", items)):
                run(scope)
        finally:
            _SCOPE.reset(token)

    def run(scope: PieceScope) -> None:
        stashes: list[list[Tensor]] = [[] for _ in inputs]
        stash_out: list[Tensor] = []
        tensors = []
        with scope.unrecorded():
            for boundary, wants_grad, stash in zip(inputs, grads, stashes):
                shape = boundary.shape(c)
                tensors.append(_Boundary.apply(torch.empty((), dtype=dtype, requires_grad=True), shape, stash)
                               if wants_grad else torch.empty(shape, dtype=dtype))
        for position in range(len(tensors)):  # no loop variable holding an input
            scope.watch(tensors[position], f"{_INPUT} {position}")
        with torch.set_grad_enabled(grad_enabled):
            out = call(block, *tensors)
        found["output"], found["returned"] = (None, False) if out is None else (scope.index_of(out), True)
        seam = None
        if grad_enabled and out is not None and out.requires_grad:
            with scope.unrecorded():
                seam, seed = _Seam.apply(out, stash_out), torch.ones(())
                stash_out.append(torch.empty_like(out))
            scope.watch(stash_out[0], _GRAD)
        del tensors, out
        if seam is not None:
            scope.mark(_BACKWARD)
            scope.mark_calls(_TRANSPOSE_PRODUCTS, _PRODUCT)
            torch.autograd.backward(seam, seed)
            del seam
        found["input_grad"] = tuple(scope.index_of(stash[0]) if stash else None for stash in stashes)
        if any(stash and index is None for stash, index in zip(stashes, found["input_grad"])):
            raise RecordingRefused("an input's gradient is the output's own (passed through): not an allocation of "
                                   "the piece")
        scope.mark(_END)  # what dies after it (the inputs' gradients, with the harness) is the caller's

    return piece


@dataclass(frozen=True)
class ProjectedLayerTerms:
    """:class:`estimator.layerwise.ProjectedTerms` of a projected layer (:func:`~betty_trainer.models.capabilities.
    projected_layers`): what :func:`~betty_trainer.execution.layerwise.layerwise_backward`'s projection and
    propagation allocate, and an affine layer's row methods, which the executor runs off the whole block without
    autograd, all recorded (:class:`RecordedLayer`)."""

    recorded: RecordedLayer

    @property
    def _layer(self):
        return self.recorded.model.layers[self.recorded.index]

    @property
    def width(self) -> int:
        return self._layer.projected_width

    @property
    def reads_dst_input(self) -> bool:
        return self._layer.reads_dst_input

    @property
    def affine(self) -> bool:  # the class exists only for projected layers
        return self._layer.propagate_is_affine

    @property
    def runs_rows(self) -> bool:
        """Whether the layer can run off the whole block: it implements :class:`~betty_trainer.models.capabilities.
        AffineLayer`'s row methods."""
        return isinstance(self._layer, AffineLayer)

    def project(self, tape: StepTape, rows: int, h: int | None, h_grad: bool):
        return self.recorded.project_terms(tape, rows, h, h_grad)

    def propagate(self, tape: StepTape, c: LayerCounts, z: int, h_dst: int | None = None, h_grad: bool = False,
                  relu: bool = True):
        return self.recorded.propagate_terms(tape, c, z, h_dst, h_grad, relu)

    def propagate_rows(self, tape: StepTape, rows: int, h_dst: int | None = None) -> int:
        return self.recorded.rows_terms(tape, rows, h_dst)

    def projection_backward(self, tape: StepTape, rows: int, dst_rows: int, h: int | None, h_grad: bool) -> None:
        self.recorded.projection_backward_terms(tape, rows, dst_rows, h, h_grad)


class RecordedStack:
    """A built-in model's memory terms (Betty §4.4.3's replay, bytes per allocation), each layer's recorded from its
    code (:class:`RecordedLayer`): what the micro-batch, layer-wise and cooperative estimates replay (a
    :class:`~estimator.spec.ModelSpec`'s ``forward_terms``, ``layer_terms`` and ``projections``). Made by
    :func:`model_terms`.

    Raises:
        RecordingRefused: on a torch the recorder is not tested with (:func:`~estimator.recorder.check_torch`);
            from the terms, as :class:`RecordedLayer`.
    """

    def __init__(self, model: LayerStack):
        check_torch()
        self.model = model
        self.layers = [RecordedLayer(model, index) for index in range(len(model.layers))]
        self.projections = tuple(ProjectedLayerTerms(self.layers[index]) if projected else None
                                 for index, projected in enumerate(projected_layers(model)))

    def memory_terms(self, tape: StepTape, layers: Sequence[LayerCounts], x: int, consume_input: bool = True):
        """What the model's ``forward`` allocates when the training step calls it on blocks of counts ``layers``
        (input layer first; one fewer than the layers when layer 0 reads the aggregation cache) and the input rows
        ``x`` (a handle on the tape: the step's gather, which it hands over, ``consume_input``; or the feature
        store's own rows): per layer :meth:`layer_memory_terms`.

        Returns:
            ``(logits handle, backward)``; ``backward(grad)`` replays the backward from the logits' gradient and
            returns the handle of the input rows' gradient (``None``: they take none).
        """
        h, h_grad, backwards = x, False, []
        first = len(self.layers) - len(layers)  # 1: layer 0 reads the aggregation cache
        if first:
            h, backward = self.layers[0].aggregated_terms(tape, layers[0].num_src, x, consume_input)
            backwards.append(backward)
            h_grad = True
        for index, counts in enumerate(layers, start=first):
            h, backward = self.layer_memory_terms(tape, index, counts, h, h_grad, consume_input and index == 0)
            backwards.append(backward)
            h_grad = True

        def backward(grad: int) -> int | None:
            for layer_backward in reversed(backwards):
                grad = layer_backward(grad)
            return grad

        return h, backward

    def layer_memory_terms(self, tape: StepTape, index: int, counts: LayerCounts, h: int, h_grad: bool,
                           consume_input: bool = False):
        """Layer ``index``'s :meth:`RecordedLayer.layer_memory_terms`."""
        return self.layers[index].layer_memory_terms(tape, counts, h, h_grad, consume_input)


_STACKS: KeptRecordings[RecordedStack] = KeptRecordings()


def model_terms(model: LayerStack) -> RecordedStack:
    """The :class:`RecordedStack` of ``model``, one per process for models of the same module classes, configuration
    (``repr``), and parameter shapes, dtypes and ``requires_grad``: recorded on a meta-device copy (no parameter or
    buffer is kept), each configuration once while it is among the most recently used
    (:class:`~estimator.recorder.KeptRecordings`).

    Raises:
        RecordingRefused: as :class:`RecordedStack`.
    """
    check_torch()  # on every call, cached or not
    key = (tuple(type(module) for module in model.modules()), repr(model),
           tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()))

    def record() -> RecordedStack:
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
        memo.update({id(buffer): torch.empty_like(buffer, device="meta") for buffer in model.buffers()})
        return RecordedStack(copy.deepcopy(model, memo))

    return _STACKS.get(key, record)
