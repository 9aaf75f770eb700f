"""What the estimator needs to know about a model: its kind, widths, dtype and optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ARCHS = ("sage", "gcn", "gat")
SAGE_AGGREGATORS = ("mean", "gcn", "pool", "lstm")
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
        arch: ``sage``, ``gcn`` or ``gat``.
        widths: ``(F_in, hidden, …, C)``: ``L + 1`` widths for ``L`` layers.
        aggregator: SAGE aggregator (``mean``, ``gcn``, ``pool``, ``lstm``).
        heads: GAT attention heads (hidden layers concatenate them, the last averages).
        dropout: drop probability (``0`` allocates no masks).
        dtype_bytes: bytes per feature element (4 for float32).
        optimizer: ``adam``, ``adamw`` or ``sgd`` (plain SGD, no momentum).
        parameter_numels: per layer, the element count of each parameter tensor in
            ``model.parameters()`` order, read off the model instance (``L`` tuples).
        buffer_bytes: bytes of the model's non-parameter state (GCN's per-node degree normalisation).
        weight_decay: the optimizer adds weight decay to the gradients (a temporary per update).
        mask_chunk_elements: elements the model's keyed dropout hashes at once
            (``betty_trainer.models.dropout.MASK_CHUNK_ELEMENTS``); required when ``dropout > 0``.
        attention_chunk_elements: (edge, head, feature) products GAT's attention aggregation makes at
            once (``betty_trainer.models.aggregate.ATTENTION_CHUNK_ELEMENTS``); required for ``gat``.
        max_chunk_elements: gathered values the pool aggregator's tensor path makes at once
            (``betty_trainer.models.aggregate.MAX_CHUNK_ELEMENTS``); required for ``pool``.
        compiled_kernels: the compiled CPU kernels run (``betty_trainer.rng.compiled_kernels``): keyed
            dropout allocates nothing but its output, and the aggregation's backward builds ``Aᵀ`` by a
            counting sort into int32 arrays; else both are tensor ops (GPU), with their temporaries.
        foreach: Adam runs its multi-tensor (``foreach``) path, as PyTorch chooses by default on CUDA
            (:func:`adam_uses_foreach`); else its single-tensor path (the CPU default).

    Raises:
        ValueError: for an unknown arch, aggregator or optimizer, fewer than 2 widths, parameter counts
            for another number of layers, dropout
            without ``mask_chunk_elements``, GAT without ``attention_chunk_elements`` or pool without
            ``max_chunk_elements``.
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
    mask_chunk_elements: int | None = None
    attention_chunk_elements: int | None = None
    max_chunk_elements: int | None = None
    compiled_kernels: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"the estimator knows no model arch {self.arch!r}; built-in: {ARCHS}")
        if self.arch == "sage" and self.aggregator not in SAGE_AGGREGATORS:
            raise ValueError(f"unknown SAGE aggregator {self.aggregator!r}; built-in: {SAGE_AGGREGATORS}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"the estimator knows no optimizer {self.optimizer!r}; known: {tuple(OPTIMIZER_STATES)}")
        if len(self.widths) < 2:
            raise ValueError("a model needs at least one layer (two widths)")
        if len(self.parameter_numels) != self.num_layers:
            raise ValueError(f"parameter_numels gives {len(self.parameter_numels)} layers for {self.num_layers}")
        if self.arch == "gat" and not self.attention_chunk_elements:
            raise ValueError("a GAT needs attention_chunk_elements (its attention aggregation's chunk size)")
        if self.aggregator == "pool" and self.arch == "sage" and not self.max_chunk_elements:
            raise ValueError("a pool aggregator needs max_chunk_elements (its tensor path's chunk size)")
        if self.dropout > 0 and not self.mask_chunk_elements:
            raise ValueError("a model with dropout needs mask_chunk_elements (its keyed dropout's chunk size)")

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1

    def layer_dims(self, layer: int) -> tuple[int, int]:
        """``(input width, output width)`` of a layer, heads included (GAT hidden layers concatenate)."""
        a, b = self.widths[layer], self.widths[layer + 1]
        if self.arch == "gat" and layer > 0:
            a *= self.heads
        if self.arch == "gat" and layer < self.num_layers - 1:
            b *= self.heads
        return a, b

    @property
    def num_parameters(self) -> int:
        return sum(sum(layer) for layer in self.parameter_numels)
