"""The work model: estimated multiply-adds of one training step under a plan, which ``micro_batch.mode=auto``
compares to choose between micro-batches and layer-wise chunks. Each built-in architecture writes its layer's
work beside the layer's code (a function of :class:`LayerSize` returning :class:`Work`); the
:class:`~estimator.spec.ModelSpec` carries it as ``layer_work``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from estimator.spec import ModelSpec


@dataclass(frozen=True)
class LayerSize:
    """One layer's size in one training step, summed over the pieces that run it (every micro-batch's slice
    of the layer, or a layer-wise plan's chunks): what a work function (:attr:`Architecture.work`) reads.

    Attributes:
        index: the layer (0 = input layer).
        last: it is the output layer.
        a: input width.
        b: output width.
        src: src rows (a row read by several pieces counts in each: the redundancy).
        dst: dst rows.
        edges: edges.
        projected: layer-wise, the block's src rows the layer projects once per pass (GAT, SAGE
            ``mean``/``gcn`` projecting first); ``None`` when each piece runs the whole layer.
    """

    index: int
    last: bool
    a: int
    b: int
    src: int
    dst: int
    edges: int
    projected: int | None = None

    def gathered(self, z_width: int, dst_input: bool = False) -> int:
        """Input elements the pieces gather (each gathered element is also dropout-masked): the src rows at
        width ``a``; a projected layer (``projected`` set): the projection's rows at width ``a``, each piece's
        rows of ``z`` at ``z_width`` and, when the layer reads its dst nodes' input (``dst_input``, SAGE
        ``mean``'s self term), each piece's dst rows at width ``a``."""
        if self.projected is None:
            return self.src * self.a
        return self.projected * self.a + self.src * z_width + (self.dst * self.a if dst_input else 0)


@dataclass(frozen=True)
class Work:
    """One layer's multiply-adds in one pass (:attr:`Architecture.work`'s result).

    Attributes:
        linear: the linear maps' multiply-adds.
        aggregate: the neighbour aggregation's.
        gathered: input elements gathered and dropout-masked (:meth:`LayerSize.gathered`).
    """

    linear: int
    aggregate: int
    gathered: int


MASK_COST = 4  # multiply-adds one input element's gather and node-keyed dropout mask cost (hash, compare, scale)


def step_work(spec: ModelSpec, layers: Sequence[Sequence[Any]], layerwise: bool,
              projected_rows: Sequence[int | None] = (), recomputes: Sequence[bool] = ()) -> float:
    """Estimated multiply-adds of one training step over ``layers`` (per layer, the pieces it runs: a layer-wise
    plan's chunks, or every micro-batch's slice of that layer, or their sizes: anything with ``num_src``,
    ``num_dst`` and ``num_edges``), which ``micro_batch.mode=auto`` compares.

    Per layer, from the rows and edges the slices hold (a row read by several slices counts in each: the
    redundancy), the architecture's own work function (``spec.layer_work``: its
    ``betty_trainer.models.registry.Architecture.work``, beside the layer's code) gives the multiply-adds of its
    linear maps and its aggregation in one pass, and the input elements gathered, each costing :data:`MASK_COST`
    (gather and node-keyed dropout mask).

    Passes: a micro-batch runs a forward and a backward (two more of each linear map above layer 1, one at
    layer 1, whose input takes no gradient); a layer-wise step runs a forward without autograd, the
    recomputed forward and the backward, so one pass more of each term (and one more gather and mask), except a
    layer whose ``recomputes`` entry is false (an affine layer run off the whole block: no recompute). A
    layer with ``projected_rows`` (layer-wise GAT, and SAGE ``mean``/``gcn`` when it projects first: its
    block's src rows) projects those once per pass, not each chunk's src rows. With the aggregation cache
    (``spec.aggregated_width``, one layer fewer in ``layers``) layer 0 is one linear map of each cached row.

    Returns:
        Multiply-adds (a relative cost: only ratios between plans are meaningful).
    """
    work = spec.layer_work
    total = 0.0
    num_layers = len(spec.widths) - 1
    first = num_layers - len(layers)  # 1: layer 0 reads the aggregation cache, one linear map per row
    if first:
        rows = sum(piece.num_src for piece in layers[0])
        # a forward and the weights' gradient; each row gathered (and masked) once
        total += 2 * rows * spec.aggregated_width * spec.widths[1] + rows * spec.aggregated_width * MASK_COST
    for index, pieces in enumerate(layers, start=first):
        size = LayerSize(index, index == num_layers - 1, spec.widths[index], spec.widths[index + 1],
                         src=sum(piece.num_src for piece in pieces), dst=sum(piece.num_dst for piece in pieces),
                         edges=sum(piece.num_edges for piece in pieces),
                         projected=projected_rows[index] if index < len(projected_rows) else None)
        layer = work(spec, size)
        backward_linear = 1 if index == 0 else 2
        recomputed = layerwise and (recomputes[index] if index < len(recomputes) else True)
        passes = 1 + backward_linear + (1 if recomputed else 0)
        total += passes * (layer.linear + layer.aggregate) + (2 if layerwise else 1) * layer.gathered * MASK_COST
    return total
