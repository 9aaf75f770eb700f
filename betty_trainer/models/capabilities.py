"""What a layer declares it can do, as protocols: the projection that lets layer-wise execution compute ``W·h``
once per pass instead of once per chunk (GAT, SAGE ``mean``/``gcn`` projecting first), and memory terms written by
hand where the recorder refuses a layer. Execution and the estimate ask these protocols instead of probing a
layer's attributes.

- :class:`WrittenMemoryTerms`: ``memory_terms`` beside ``forward``, which the closed-form estimate replays where the
  recorder (:mod:`betty_trainer.models.recorded_terms`) refuses the layer;
- :class:`ProjectedLayer`: ``project``/``propagate``, ``projected_width``, and the two promises
  ``reads_dst_input`` and ``propagate_is_affine`` (:func:`projected_layers`, :func:`affine_layers`);
- :class:`AffineLayer`: the row methods that run an affine layer off the whole block (:func:`whole_block_layers`).

A layer's work terms (its multiply-adds per pass) are declared beside its code too, as its architecture's
:attr:`~betty_trainer.models.registry.Architecture.work` (:func:`estimator.work.step_work`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.models.stack import LayerStack
from estimator.counts import LayerCounts
from estimator.tape import StepTape

Terms = tuple[int, Callable]  # (output handle on the tape, backward)


@runtime_checkable
class WrittenMemoryTerms(Protocol):
    """A layer whose memory terms are also written by hand, op by op, for the configurations the recorder refuses
    (:mod:`betty_trainer.models.recorded_terms`; SAGE's ``lstm`` aggregator, whose in-degree groups have
    data-dependent sizes): what its ``forward(block, h)`` allocates.

    Attributes:
        memory_terms_written: this instance's terms are written (SAGE: with the ``lstm`` aggregator only); the
            recorder's refusal of another stands.
    """

    @property
    def memory_terms_written(self) -> bool: ...

    def memory_terms(self, tape: StepTape, c: LayerCounts, hd: int, hd_grad: bool) -> Terms:
        """What ``forward`` allocates on a block of counts ``c`` from the input ``hd`` (a handle on the tape;
        ``hd_grad``: it requires grad): ``(output handle, backward)``, ``backward(grad)`` returning the handle
        of ``hd``'s gradient, or ``None``."""
        ...


@runtime_checkable
class ProjectedLayer(Protocol):
    """A layer that splits into a row-wise projection and the rest: ``layer(block, h) == propagate(block,
    project(h))``, or with ``reads_dst_input`` ``propagate(block, project(h), block.dst_rows(h))``.

    Attributes:
        projected_width: columns of ``project``'s output; ``None`` when this instance does not project first
            (a SAGE layer whose ``F_in ≤ F_out``), and layer-wise execution runs it whole.
        reads_dst_input: ``propagate`` also reads the dst nodes' input rows (SAGE ``mean``'s ``W_self·h_d``).
        propagate_is_affine: ``propagate`` is ``A·z`` plus terms without ``z``, ``A`` from the block alone and
            nothing learnable applied to ``A·z``, so no gradient reads ``z``'s values (a promise: a layer that
            makes it wrongly gets a wrong gradient layer-wise).
    """

    @property
    def projected_width(self) -> int | None: ...

    @property
    def reads_dst_input(self) -> bool: ...

    @property
    def propagate_is_affine(self) -> bool: ...

    def project(self, h: Tensor) -> Tensor:
        """``z`` row by row: ``(rows, F_in)`` → ``(rows, projected_width)``."""
        ...

    def propagate(self, block: Block, z: Tensor, *args) -> Tensor:
        """The rest of ``forward`` from ``z`` ``(num_src, projected_width)`` (and the dst input rows when
        ``reads_dst_input``) → ``(num_dst, F_out)``."""
        ...



@runtime_checkable
class AffineLayer(ProjectedLayer, Protocol):
    """A :class:`ProjectedLayer` whose ``propagate_is_affine`` is true also runs a chunk's dst rows off the whole
    block (layer-wise execution, where the compiled CPU kernels run: no chunk slice, no gathered rows of ``z``),
    and backpropagates without recomputing its forward.

    ``propagate_rows(block, rows, z, *args)`` is ``propagate``'s rows ``rows`` without autograd, ``z`` the whole
    projection; ``propagate_rows_backward(block, rows, grad, grad_z)`` adds ``z``'s gradient into ``grad_z`` by the
    aggregation's transpose from the rows' output gradient, reading no value of ``z``;
    ``projection_backward(x, grad_z, grad_dst, input_grad)`` adds the parameters' gradients from rows of the
    layer's input and returns the input rows' gradient (``models.sage.SAGEConv`` documents the forms). What they
    allocate is recorded (:class:`~betty_trainer.models.recorded_terms.RecordedLayer`).
    """

    def propagate_rows(self, block: Block, rows: Tensor, z: Tensor, *args) -> Tensor: ...

    def propagate_rows_backward(self, block: Block, rows: Tensor, grad: Tensor, grad_z: Tensor) -> None: ...

    def projection_backward(self, x: Tensor, grad_z: Tensor, grad_dst: Tensor, input_grad: bool) -> Tensor | None: ...


def projected_layers(model: LayerStack) -> list[bool]:
    """Per layer, whether layer-wise execution projects its src rows once per pass: the layer is a
    :class:`ProjectedLayer` whose ``projected_width`` is not ``None``, and the model applies its layers as the stack
    does (neither ``apply_layer`` nor ``layer_forward`` overridden). Such a layer's chunks gather rows of ``z``
    instead of recomputing ``W·h`` for each chunk's src rows (a src row read by several chunks is projected once,
    not once per chunk, in forward and in backward)."""
    plain = type(model).apply_layer is LayerStack.apply_layer and type(model).layer_forward is LayerStack.layer_forward
    return [plain and isinstance(layer, ProjectedLayer) and layer.projected_width is not None
            for layer in model.layers]


def affine_layers(model: LayerStack) -> list[bool]:
    """Per layer, whether it is projected (:func:`projected_layers`) and ``propagate_is_affine``
    (:class:`ProjectedLayer`). Layer-wise execution frees such a layer's ``z`` after its forward (not keeping it
    through the later layers and the loss), recomputes its chunks in backward from zeros in place of ``z``'s rows,
    and, below the output layer, applies the stack's ReLU backward to ``∂L/∂h_l`` from the stored ``h_l``, as
    ``h_l = ReLU(·)`` is positive exactly where its input is."""
    return [projected and layer.propagate_is_affine for projected, layer in zip(projected_layers(model), model.layers)]


def whole_block_layers(model: LayerStack) -> list[bool]:
    """Per layer, whether layer-wise execution can run it off the whole block where the compiled CPU kernels run:
    an affine layer (:func:`affine_layers`) that implements :class:`AffineLayer`'s row methods."""
    return [affine and isinstance(layer, AffineLayer) for affine, layer in zip(affine_layers(model), model.layers)]
