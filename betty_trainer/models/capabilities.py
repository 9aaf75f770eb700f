"""What a layer declares it can do, as protocols: its memory terms (every built-in layer), and the projection that
lets layer-wise execution compute ``W·h`` once per pass instead of once per chunk (GAT, SAGE ``mean``/``gcn``
projecting first). Execution and the estimate ask these protocols instead of probing a layer's attributes.

- :class:`LayerMemoryTerms`: ``memory_terms`` beside ``forward``, what the closed-form estimate replays
  (:mod:`estimator.estimate`);
- :class:`ProjectedLayer`: ``project``/``propagate`` and their memory terms, ``projected_width``, and the two
  promises ``reads_dst_input`` and ``propagate_is_affine`` (:func:`projected_layers`, :func:`affine_layers`);
- :class:`ProjectedLayerTerms`: a projected layer's terms as layer-wise execution runs them, the
  :class:`estimator.layerwise.ProjectedTerms` the layer-wise estimate replays (:func:`projected_terms`);
- :func:`estimator_spec`: all of it, as the :class:`~estimator.spec.ModelSpec` the estimator reads.

A layer's work terms (its multiply-adds per pass) are declared beside its code too, as its architecture's
:attr:`~betty_trainer.models.registry.Architecture.work` (:func:`estimator.work.step_work`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.models.dropout import dropout_terms, keyed_mask_terms
from betty_trainer.models.registry import Architecture
from betty_trainer.models.stack import LayerStack
from betty_trainer.rng import compiled_kernels
from estimator.counts import LayerCounts
from estimator.spec import ModelSpec, adam_uses_foreach
from estimator.tape import StepTape

Terms = tuple[int, Callable]  # (output handle on the tape, backward)


@runtime_checkable
class LayerMemoryTerms(Protocol):
    """A layer whose memory the closed form estimates: what its ``forward(block, h)`` allocates, op by op."""

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

    def project_terms(self, tape: StepTape, rows: int, hd: int, hd_grad: bool) -> Terms:
        """What ``project`` allocates on ``rows`` rows: ``(z handle, backward)``."""
        ...

    def propagate_terms(self, tape: StepTape, c: LayerCounts, z: int, *args) -> Terms:
        """What ``propagate`` allocates from the rows ``z`` (and the dst input rows' handle when
        ``reads_dst_input``): ``(output handle, backward)``."""
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
    layer's input and returns the input rows' gradient; ``propagate_rows_terms`` and ``projection_backward_terms``
    are what they allocate (``models.sage.SAGEConv`` documents the forms).
    """

    def propagate_rows(self, block: Block, rows: Tensor, z: Tensor, *args) -> Tensor: ...

    def propagate_rows_backward(self, block: Block, rows: Tensor, grad: Tensor, grad_z: Tensor) -> None: ...

    def projection_backward(self, x: Tensor, grad_z: Tensor, grad_dst: Tensor, input_grad: bool) -> Tensor | None: ...

    def propagate_rows_terms(self, tape: StepTape, rows: int, *args) -> int: ...

    def projection_backward_terms(self, tape: StepTape, rows: int, dst_rows: int, input_grad: bool) -> int | None: ...


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


@dataclass(frozen=True)
class ProjectedLayerTerms:
    """:class:`estimator.layerwise.ProjectedTerms` of layer ``index`` of ``model``: what
    :func:`~betty_trainer.execution.layerwise.layerwise_backward`'s projection and propagation allocate, from the
    layer's ``project_terms`` and ``propagate_terms`` and the stack's node-keyed dropout and ReLU."""

    model: LayerStack
    index: int

    @property
    def width(self) -> int:
        return self.model.layers[self.index].projected_width

    @property
    def reads_dst_input(self) -> bool:
        return self.model.layers[self.index].reads_dst_input

    @property
    def affine(self) -> bool:  # the class exists only for projected layers
        return self.model.layers[self.index].propagate_is_affine

    @property
    def runs_rows(self) -> bool:
        """Whether the layer can run off the whole block: it implements :class:`AffineLayer`'s row methods."""
        return isinstance(self.model.layers[self.index], AffineLayer)

    def _dropped(self, tape: StepTape, rows: int, h: int | None, h_grad: bool):
        """The stack's node-keyed dropout on ``rows`` input rows ``h``: ``(dropped, backward or None)``."""
        width_in = self.model.widths[self.index]
        if self.model.dropout.p == 0:
            return h, None
        if self.index == 0:  # the gathered rows, overwritten in place
            keyed_mask_terms(tape, rows, width_in)
            return h, None
        return dropout_terms(tape, h, rows, width_in, h_grad)  # rows of h_{l−1}: into a new tensor

    def project(self, tape: StepTape, rows: int, h: int | None, h_grad: bool):
        hd, dropout_bwd = self._dropped(tape, rows, h, h_grad)
        z, project_bwd = self.model.layers[self.index].project_terms(tape, rows, hd, h_grad)
        if hd is not h:
            tape.r.drop(hd)  # the dropout's output: only autograd keeps it

        def backward() -> int | None:
            grad = project_bwd(None, free_grad=False)  # z's gradient is a view of ∂L/∂z
            return dropout_bwd(grad) if grad is not None and dropout_bwd is not None else grad

        return z, backward

    def propagate(self, tape: StepTape, c: LayerCounts, z: int, h_dst: int | None = None, h_grad: bool = False,
                  relu: bool = True):
        layer = self.model.layers[self.index]
        dropout_bwd = None
        if h_dst is None:
            out, propagate_bwd = layer.propagate_terms(tape, c, z)
        else:
            hd, dropout_bwd = self._dropped(tape, c.num_dst, h_dst, h_grad)
            out, propagate_bwd = layer.propagate_terms(tape, c, z, hd, h_grad)
            if hd is not h_dst:
                tape.r.drop(hd)  # the dropout's output: only autograd keeps it
        relu_bwd = None
        if relu and self.index < len(self.model.layers) - 1:
            out, relu_bwd = tape.relu(out, c.num_dst, self.model.widths[self.index + 1])

        def backward(grad: int) -> int | None:
            grads = propagate_bwd(relu_bwd(grad) if relu_bwd is not None else grad)
            if h_dst is None:
                return grads
            grad_z, grad_hd = grads  # the dst input rows' gradient stays in the chunk's scope (added into ∂L/∂h)
            if grad_hd is not None and dropout_bwd is not None:
                dropout_bwd(grad_hd)
            return grad_z

        return out, backward


    def propagate_rows(self, tape: StepTape, rows: int, h_dst: int | None = None) -> int:
        """An affine layer's block of ``rows`` dst rows without autograd (``propagate_rows``): the dst input rows'
        dropout (``h_dst``: their gathered features at the input layer, ``None`` for a view of ``h_{l−1}``) when
        the layer reads them, the layer's ``propagate_rows_terms`` and the stack's ReLU. Returns the output."""
        layer = self.model.layers[self.index]
        hd = self._dropped(tape, rows, h_dst, False)[0] if self.reads_dst_input else None
        out = layer.propagate_rows_terms(tape, rows, hd)
        if hd is not h_dst:
            tape.r.drop(hd)  # the dropout's output
        if self.index < len(self.model.layers) - 1:
            out = tape.relu(out, rows, self.model.widths[self.index + 1])[0]
        return out

    def projection_backward(self, tape: StepTape, rows: int, dst_rows: int, h: int | None, h_grad: bool) -> None:
        """An affine layer's backward on a block of ``rows`` src rows of which ``dst_rows`` are dst nodes, run off
        the whole block (``projection_backward``): the input rows' dropout (``h``: gathered features at the input
        layer, overwritten in place; ``None`` for a view of ``h_{l−1}``, dropped into a new tensor), the layer's
        ``projection_backward_terms`` and, with ``h_grad``, the dropout's backward in place on the input rows'
        gradient, which is added into ``∂L/∂h_{l−1}``; all of it freed at the block's end."""
        r = tape.r
        hd = self._dropped(tape, rows, h, False)[0]
        grad = self.model.layers[self.index].projection_backward_terms(tape, rows, dst_rows, h_grad)
        if grad is not None and self.model.dropout.p > 0:
            keyed_mask_terms(tape, rows, self.model.widths[self.index])  # NodeDropout.backward_, in place
        r.drop(grad)
        if hd is not h:
            r.drop(hd)


def projected_terms(model: LayerStack) -> list[ProjectedLayerTerms | None]:
    """Per layer, the :class:`ProjectedLayerTerms` of a layer :func:`projected_layers` projects, else ``None``
    (what :func:`estimator.layerwise.estimate_layerwise` takes as ``projections``)."""
    return [ProjectedLayerTerms(model, index) if projected else None
            for index, projected in enumerate(projected_layers(model))]


def estimator_spec(model: LayerStack, architecture: Architecture, *, optimizer: str, weight_decay: bool,
                   device: torch.device | str, device_workspace: int, aggregation_cache: bool = False) -> ModelSpec:
    """What a built-in model declares to the estimator (:class:`~estimator.spec.ModelSpec`): its architecture's
    name and work terms, its widths, aggregator, heads and dropout, its parameter tensors (in
    ``model.parameters()`` order) and buffers read off the instance, its memory terms (each layer's
    ``memory_terms`` beside its ``forward``, which the estimate replays) and its projected layers' terms
    (:func:`projected_terms`); with the training's ``optimizer`` (and ``weight_decay``) on the foreach or
    single-tensor path PyTorch picks for ``device``, the kernels dropout and aggregation use there, and the
    ``device_workspace`` bytes the caller measured; with ``aggregation_cache``, layer 0 reads the input-feature
    aggregation cache (its ``aggregated_width``: :attr:`~estimator.spec.ModelSpec.aggregated_width`). The spec counts
    a gather of the input rows (:attr:`~estimator.spec.ModelSpec.features_in_place` is ``False``: an upper bound);
    ``make_planner`` sets what the run's feature store does.
    """
    first = model.layers[0]
    parameter = next(model.parameters())
    return ModelSpec(
        architecture.name, model.widths,
        aggregator=getattr(first, "aggregator", "mean"), heads=getattr(first, "heads", 1), dropout=model.dropout.p,
        dtype_bytes=parameter.element_size(), optimizer=optimizer,
        parameter_numels=tuple(tuple(p.numel() for p in layer.parameters()) for layer in model.layers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        weight_decay=weight_decay, foreach=adam_uses_foreach(device),
        compiled_kernels=compiled_kernels(device, parameter.dtype), device_workspace=device_workspace,
        aggregated_width=model.aggregated_width if aggregation_cache else None,
        forward_terms=model.memory_terms, layer_terms=model.layer_memory_terms,
        projections=tuple(projected_terms(model)), layer_work=architecture.work)
