"""The memory estimate of one rank's share of a cooperative global batch (cooperative paper §3.1, Alg. 1; the step
of ``betty_trainer.execution.cooperative.cooperative_backward``).

A share runs like a micro-batch whose layers are joined by exchanges: the rank gathers the input rows it owns,
and before every layer an all-to-all turns the rows it owns into the rows its block reads. The replay is the
micro-batch estimate's (:func:`estimator.estimate.estimate_micro_batch`) with the model's layers replayed one at a
time (``ModelSpec.layer_terms``) and, around each, what an exchange allocates:

- forward: the rows served to the requesters (``served × w``) and the rows received (``src × w``); the served rows
  die once sent, then the received ones are copied in the block's src order (``src × w``, the layer's input) and
  die when the exchange returns. The rows the rank owns stay referenced until the layer has run.
- backward: the gradient rows sent back (``src × w``) and those received (``served × w``); the sent ones die, then
  the owned rows' gradient (``owned × w``) is made and the received ones are summed into it.

A send buffer dies as soon as it is sent because the exchange returns from an all-to-all on the CPU only once
gloo's worker thread has let go of its buffers (``betty_trainer.distributed.exchange``), so the free happens where
the code says (exact to the byte in ``tests/test_cooperative.py``).

The exchange's index tensors (int64: the send order, the serve index and the owned ids) are resident with the
share's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from estimator.counts import INDEX_BYTES, LayerCounts, block_structure_bytes
from estimator.estimate import MemoryEstimate, resident_replay
from estimator.spec import ModelSpec
from estimator.tape import GRAD, HID, OVER

EXCHANGE = "exchange_buffers"
"""The estimate's component for the exchanges' send and receive buffers."""


@dataclass(frozen=True)
class ExchangeCounts:
    """Sizes of one layer boundary's exchange, seen from one rank.

    Attributes:
        owned: ``u``, distinct rows the rank provides (its dst nodes of the layer below, or the input rows it
            gathers).
        served: rows it sends (``Σ recv_counts``: each requester's ids, its own included).
        requested: rows it receives, the block's src nodes (``Σ send_counts``).
    """

    owned: int
    served: int
    requested: int

    @property
    def index_bytes(self) -> int:
        """The exchange's int64 index tensors: send order (``requested``), serve index (``served``), owned ids."""
        return INDEX_BYTES * (self.requested + self.served + self.owned)


def estimate_cooperative_share(layers: Sequence[LayerCounts], exchanges: Sequence[ExchangeCounts], model: ModelSpec,
                               accumulate: bool = False) -> MemoryEstimate:
    """Estimate the memory of one rank's share of a cooperative step (one micro-batch round), itemised.

    Args:
        layers: the share's blocks' :class:`LayerCounts`, input layer first.
        exchanges: the exchange before each block, input layer first (``exchanges[l].requested ==
            layers[l].num_src``).
        model: the model's :class:`ModelSpec` (with ``layer_terms``: a ``LayerStack``).
        accumulate: a round after the step's first (the earlier rounds' gradients are resident).

    Returns:
        A :class:`MemoryEstimate` (bytes); its ``exchange_buffers`` component holds the exchanges' buffers.

    Raises:
        ValueError: counts that do not match the model or each other, or a spec without ``layer_terms``.
    """
    if len(layers) != model.num_layers or len(exchanges) != len(layers):
        raise ValueError(f"a share of {len(layers)} blocks and {len(exchanges)} exchanges for a model of "
                         f"{model.num_layers} layers")
    if model.layer_terms is None:
        raise ValueError("the ModelSpec has no layer_terms: build it from a LayerStack (betty_trainer.memory.spec)")
    replay, step = resident_replay(model, accumulate, block_structure_bytes(layers) +
                                   sum(exchange.index_bytes for exchange in exchanges))
    f, resident = model.dtype_bytes, replay.current

    replay.phase = "forward"
    owned = replay.alloc(exchanges[0].owned * model.widths[0] * f, "input_features")
    backwards = []
    for index, (counts, exchange) in enumerate(zip(layers, exchanges)):
        width = model.widths[index] * f
        served = replay.alloc(exchange.served * width, EXCHANGE)
        received = replay.alloc(exchange.requested * width, EXCHANGE)
        replay.drop(served)
        rows = replay.alloc(exchange.requested * width, "input_features" if index == 0 else HID)
        replay.drop(received)
        out, layer_backward = model.layer_terms(step, index, counts, rows, index > 0, consume_input=index == 0)
        replay.drop(owned)  # the owned rows' variable is reassigned once the layer has run
        owned = out
        backwards.append((layer_backward, exchange, width))
    labels = replay.alloc(layers[-1].num_dst * INDEX_BYTES, "labels")
    loss_backward, scalars = step.loss(layers[-1].num_dst, model.widths[-1], labels)
    predictions = replay.alloc(layers[-1].num_dst * INDEX_BYTES, OVER)  # the correct count, before backward
    hits = replay.alloc(layers[-1].num_dst, OVER)
    replay.drop(predictions, hits)

    replay.phase = "backward"
    grad = loss_backward()
    for layer_backward, exchange, width in reversed(backwards):
        grad = layer_backward(grad)
        if grad is None:  # the input rows take no gradient
            continue
        sent = replay.alloc(exchange.requested * width, EXCHANGE)
        back = replay.alloc(exchange.served * width, EXCHANGE)
        replay.drop(sent)
        owned_grad = replay.alloc(exchange.owned * width, GRAD)
        replay.drop(back, grad)
        grad = owned_grad
    replay.drop(grad, labels, owned, *scalars())  # the share's tensors die before the optimizer step
    replay.phase = "optimizer"
    step.optimizer_step()
    return MemoryEstimate.of(replay, resident)
