"""The work model: estimated multiply-adds of one training step under a plan, which ``micro_batch.mode=auto``
compares to choose between micro-batches and layer-wise chunks."""

from __future__ import annotations

from collections.abc import Sequence

from estimator.spec import ModelSpec
from partition.chunks import Chunk
from partition.slicing import LayerSlice

MASK_COST = 4  # multiply-adds one input element's gather and node-keyed dropout mask cost (hash, compare, scale)


def step_work(spec: ModelSpec, layers: Sequence[Sequence[LayerSlice | Chunk]], layerwise: bool,
              projected_rows: Sequence[int | None] = ()) -> float:
    """Estimated multiply-adds of one training step over ``layers`` (per layer, the slices it runs: a layer-wise
    plan's chunks, or every micro-batch's slice of that layer), which ``micro_batch.mode=auto`` compares.

    Per layer of widths ``a → b`` (a GAT layer's ``b``: its heads' width), from the rows and edges the slices
    hold (a row read by several slices counts in each: the redundancy):

    - the linear maps: ``a·b`` per row they run on: the src rows when the layer projects first (SAGE
      ``mean``/``gcn`` and GCN when ``a > b``, GAT always), else the dst rows; SAGE's self term (every
      aggregator but ``gcn``) on the dst rows; SAGE ``pool``'s ``fc_pool`` (``a·a``) on the src rows;
    - the aggregation: per edge, the width aggregated (``b`` when projected first, else ``a``); SAGE
      ``lstm``: one LSTM step per edge, ``8·a²`` (four gates over the input and the hidden state);
    - the input rows' gather and node-keyed dropout: :data:`MASK_COST` per element (a projected layer: its
      block's src rows at width ``a``, each chunk's rows of ``z`` at width ``b`` and, SAGE ``mean``, each
      chunk's dst input rows at width ``a``).

    Passes: a micro-batch runs a forward and a backward (two more of each linear map above layer 1, one at
    layer 1, whose input takes no gradient); a layer-wise step runs a forward without autograd, the
    recomputed forward and the backward, so one pass more of each term (and one more gather and mask). A
    layer with ``projected_rows`` (layer-wise GAT, and SAGE ``mean``/``gcn`` when it projects first: its
    block's src rows) projects those once per pass, not each chunk's src rows (SAGE's self term still runs
    on each chunk's dst rows).

    Returns:
        Multiply-adds (a relative cost: only ratios between plans are meaningful).
    """
    total = 0.0
    for index, pieces in enumerate(layers):
        a, b = spec.widths[index], spec.widths[index + 1]
        if spec.arch == "gat" and index == len(layers) - 1:
            b *= spec.heads  # the output layer averages its heads after projecting to all of them
        src = sum(piece.num_src for piece in pieces)
        dst = sum(piece.num_dst for piece in pieces)
        edges = sum(int(piece.indptr[-1]) for piece in pieces)  # a slice or a chunk: its CSC pointer
        linear_aggregator = spec.arch != "sage" or spec.aggregator in ("mean", "gcn")
        first = spec.arch == "gat" or (linear_aggregator and a > b)
        linear_rows = src if first else dst
        if index < len(projected_rows) and projected_rows[index] is not None:
            linear_rows = projected_rows[index]
        if spec.arch == "sage" and spec.aggregator != "gcn":
            linear_rows += dst  # fc_self
        linear, aggregate, gather = linear_rows * a * b, edges * (b if first else a), src * a * MASK_COST
        if index < len(projected_rows) and projected_rows[index] is not None:
            # the projection's row blocks (a wide), each chunk's rows of z (b wide), SAGE mean's dst input rows
            self_rows = dst if spec.arch == "sage" and spec.aggregator == "mean" else 0
            gather = (projected_rows[index] * a + src * b + self_rows * a) * MASK_COST
        if spec.arch == "sage" and spec.aggregator == "pool":
            linear += src * a * a  # fc_pool, before the max
        elif spec.arch == "sage" and spec.aggregator == "lstm":
            aggregate = edges * 8 * a * a  # an LSTM step per edge
        backward_linear = 1 if index == 0 else 2
        passes = 1 + backward_linear + (1 if layerwise else 0)
        total += passes * (linear + aggregate) + (2 if layerwise else 1) * gather
    return total
