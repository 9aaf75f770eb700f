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
        num_nodes: nodes of the whole graph (GCN keeps a ``(N,)`` float32 degree buffer).
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
        ValueError: for an unknown arch, aggregator or optimizer, fewer than 2 widths, dropout
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
    num_nodes: int = 0
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

    def parameter_shapes(self, layer: int) -> list[int]:
        """Element counts of the layer's parameter tensors in ``model.parameters()`` order: a layer's
        own parameters (bias; GAT's attention vectors) before those of its submodules."""
        a, b = self.widths[layer], self.widths[layer + 1]
        if self.arch == "gcn":  # bias, linear
            return [b, b * a]
        if self.arch == "gat":  # att_src, att_dst, bias, linear (heads concatenated except in the last layer)
            a = self.layer_dims(layer)[0]
            last = layer == self.num_layers - 1
            return [self.heads * b, self.heads * b, b if last else self.heads * b, self.heads * b * a]
        neigh_self = [b * a] if self.aggregator == "gcn" else [b * a, b * a]
        extra = {"pool": [a * a, a], "lstm": [4 * a * a, 4 * a * a, 4 * a]}.get(self.aggregator, [])
        return [b] + extra + neigh_self  # bias, fc_pool / lstm, fc_neigh, fc_self

    @property
    def buffer_bytes(self) -> int:
        """Bytes of non-parameter model state (GCN's per-node degree normalisation)."""
        return 4 * self.num_nodes if self.arch == "gcn" else 0

    @property
    def num_parameters(self) -> int:
        return sum(sum(self.parameter_shapes(layer)) for layer in range(self.num_layers))
