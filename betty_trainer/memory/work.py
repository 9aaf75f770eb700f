"""The work model: estimated multiply-adds of one training step under a plan, which ``micro_batch.mode=auto``
compares to choose between micro-batches and layer-wise chunks."""

from __future__ import annotations

from collections.abc import Sequence

from betty_trainer.models.registry import ARCHITECTURES, LayerSize
from estimator.spec import ModelSpec
from partition.chunks import Chunk
from partition.slicing import LayerSlice

MASK_COST = 4  # multiply-adds one input element's gather and node-keyed dropout mask cost (hash, compare, scale)


def step_work(spec: ModelSpec, layers: Sequence[Sequence[LayerSlice | Chunk]], layerwise: bool,
              projected_rows: Sequence[int | None] = ()) -> float:
    """Estimated multiply-adds of one training step over ``layers`` (per layer, the slices it runs: a layer-wise
    plan's chunks, or every micro-batch's slice of that layer), which ``micro_batch.mode=auto`` compares.

    Per layer, from the rows and edges the slices hold (a row read by several slices counts in each: the
    redundancy), the architecture's own work function (:attr:`~betty_trainer.models.registry.Architecture.work`,
    beside the layer's code) gives the multiply-adds of its linear maps and its aggregation in one pass, and the
    input elements gathered, each costing :data:`MASK_COST` (gather and node-keyed dropout mask).

    Passes: a micro-batch runs a forward and a backward (two more of each linear map above layer 1, one at
    layer 1, whose input takes no gradient); a layer-wise step runs a forward without autograd, the
    recomputed forward and the backward, so one pass more of each term (and one more gather and mask). A
    layer with ``projected_rows`` (layer-wise GAT, and SAGE ``mean``/``gcn`` when it projects first: its
    block's src rows) projects those once per pass, not each chunk's src rows.

    Returns:
        Multiply-adds (a relative cost: only ratios between plans are meaningful).
    """
    work = ARCHITECTURES[spec.arch].work
    total = 0.0
    for index, pieces in enumerate(layers):
        size = LayerSize(index, index == len(layers) - 1, spec.widths[index], spec.widths[index + 1],
                         src=sum(piece.num_src for piece in pieces), dst=sum(piece.num_dst for piece in pieces),
                         edges=sum(int(piece.indptr[-1]) for piece in pieces),  # a slice or a chunk: its CSC pointer
                         projected=projected_rows[index] if index < len(projected_rows) else None)
        layer = work(spec, size)
        backward_linear = 1 if index == 0 else 2
        passes = 1 + backward_linear + (1 if layerwise else 0)
        total += passes * (layer.linear + layer.aggregate) + (2 if layerwise else 1) * layer.gathered * MASK_COST
    return total
