"""What the estimator needs to know about a model: its kind, widths, dtype, optimizer, and the memory terms
its layers declare beside their code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0}


def adam_uses_foreach(device: torch.device | str) -> bool:
    """Whether ``torch.optim.Adam(params)`` with ``foreach=None`` takes its multi-tensor path for
    parameters on ``device``: asks PyTorch's own default rule (``_default_to_fused_or_foreach``:
    foreach on CUDA and other devices with foreach kernels, single-tensor on CPU)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    probe = [torch.empty(0, device=device)]
    return bool(_default_to_fused_or_foreach(probe, differentiable=False, use_fused=False)[1])


@dataclass(frozen=True)
class ModelSpec:
    """A built-in model, described for the estimator (Betty Table 3: h, n, NP_GNN, NP_Agg).

    Attributes:
        arch: the model's architecture, a name the caller gives (the estimate replays ``forward_terms`` and
            never reads it).
        widths: ``(F_in, hidden, …, C)``: ``L + 1`` widths for ``L`` layers, as the layers' inputs and
            outputs have them (a GAT hidden layer's concatenated heads: ``hidden × heads``).
        aggregator: the layers' aggregator, for an architecture that has a choice (SAGE's ``mean``, ``gcn``,
            ``pool``, ``lstm``).
        heads: GAT attention heads (hidden layers concatenate them, the last averages).
        dropout: drop probability (``0`` allocates no masks).
        dtype_bytes: bytes per feature element (4 for float32).
        optimizer: ``adam``, ``adamw`` or ``sgd`` (plain SGD, no momentum).
        parameter_numels: per layer, the element count of each parameter tensor in
            ``model.parameters()`` order, read off the model instance (``L`` tuples).
        buffer_bytes: bytes of the model's non-parameter state (GCN's per-node degree normalisation).
        weight_decay: the optimizer adds weight decay to the gradients (a temporary per update).
        compiled_kernels: the compiled CPU kernels run (``betty_trainer.rng.compiled_kernels``): keyed
            dropout allocates nothing but its output, and the aggregation's backward builds ``Aᵀ`` by a
            counting sort into int32 arrays; else both are tensor ops (GPU), with their temporaries.
        foreach: Adam runs its multi-tensor (``foreach``) path, as PyTorch chooses by default on CUDA
            (:func:`adam_uses_foreach`); else its single-tensor path (the CPU default).
        device_workspace: bytes the device keeps allocated from the first training step on beyond the step's
            tensors (CUDA's BLAS workspaces, measured by ``betty_trainer.memory.device.device_workspace``; 0 on
            the CPU), resident in every estimate.
        aggregated_width: layer 0 reads the input-feature aggregation cache's rows, this many columns each
            (BatchGNN §3; the layer's ``aggregated_width``): a micro-batch has ``L − 1`` blocks (layers 1 … L − 1)
            and its input rows are ``blocks[0]``'s src nodes at this width; ``None``: no cache, ``L`` blocks.
        features_in_place: the training step reads a micro-batch's input rows in place when its input nodes are
            ``0 … n − 1`` in order (the run's feature store says so: ``betty_trainer.data.feature_store.
            hands_out_rows``, a plain host store on the CPU), instead of gathering them: no input tensor, and input
            dropout writes a new tensor; the estimate of such a micro-batch (:func:`estimator.counts.reads_in_place`)
            follows. ``False`` (the default) counts a gather: an upper bound for such a micro-batch.
        forward_terms: ``(tape, layers, x, consume_input) -> (logits, backward)``: the model's forward written as
            memory terms on an :class:`estimator.tape.StepTape` (a built-in model's, recorded from its code:
            ``betty_trainer.models.recorded_terms.RecordedStack.memory_terms``); the estimate replays it. Not
            compared: two specs of equal fields describe the same model.
        layer_terms: ``(tape, index, counts, h, h_grad, consume_input) -> (out, backward)``: one layer's
            forward (dropout, the layer, ReLU) as memory terms (``RecordedStack.layer_memory_terms``), for
            the layer-wise estimate (:mod:`estimator.layerwise`). Not compared.
        projections: per layer, the :class:`~estimator.layerwise.ProjectedTerms` of a layer that layer-wise
            execution projects once per pass, else ``None`` (``RecordedStack.projections``);
            ``None``: no layer is. Not compared.
        layer_work: ``(spec, LayerSize) -> Work``: one layer's multiply-adds per pass, written beside the
            layer's code (:func:`estimator.work.step_work`). Not compared.

    Raises:
        ValueError: for an unknown optimizer, fewer than 2 widths, parameter counts
            for another number of layers.
    """

    arch: str
    widths: tuple[int, ...]
    aggregator: str = "mean"
    heads: int = 1
    dropout: float = 0.0
    dtype_bytes: int = 4
    optimizer: str = "adam"
    parameter_numels: tuple[tuple[int, ...], ...] = ()
    buffer_bytes: int = 0
    weight_decay: bool = False
    foreach: bool = False
    compiled_kernels: bool = False
    device_workspace: int = 0
    aggregated_width: int | None = None
    features_in_place: bool = False
    forward_terms: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    layer_terms: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    projections: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)
    layer_work: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"the estimator knows no optimizer {self.optimizer!r}; known: {tuple(OPTIMIZER_STATES)}")
        if len(self.widths) < 2:
            raise ValueError("a model needs at least one layer (two widths)")
        if len(self.parameter_numels) != self.num_layers:
            raise ValueError(f"parameter_numels gives {len(self.parameter_numels)} layers for {self.num_layers}")

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1

    @property
    def num_blocks(self) -> int:
        """Blocks of a micro-batch: ``L``, or ``L − 1`` when layer 0 reads the aggregation cache."""
        return self.num_layers - (self.aggregated_width is not None)

    @property
    def input_width(self) -> int:
        """Columns of a gathered input row: ``F``, or the aggregation cache's ``aggregated_width``."""
        return self.widths[0] if self.aggregated_width is None else self.aggregated_width

    @property
    def num_parameters(self) -> int:
        return sum(sum(layer) for layer in self.parameter_numels)
