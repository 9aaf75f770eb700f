"""One rank's share of a cooperative global batch (cooperative paper §3.1, Alg. 1): what
:class:`~betty_trainer.sampling.cooperative.CooperativeSampler` samples and
:func:`~betty_trainer.execution.cooperative.cooperative_backward` runs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from betty_trainer.data.block import Block
from betty_trainer.distributed.exchange import Exchange
from estimator.cooperative import ExchangeCounts


@dataclass
class CooperativeBatch:
    """One rank's share of a cooperative global batch: its blocks and the exchange before each.

    Unlike a :class:`~betty_trainer.data.block.Batch`, block ``l``'s dst nodes are not block ``l + 1``'s src
    nodes: they are the nodes this rank owns among them; ``exchanges[l + 1]`` moves their rows to the ranks
    whose block ``l + 1`` reads them.

    Attributes:
        blocks: ``L`` blocks, input layer first; block ``l``'s dst nodes are owned by this rank.
        exchanges: ``L`` exchanges; ``exchanges[l]`` delivers the rows of ``blocks[l].src_nodes`` from their
            owners. ``exchanges[0].owned`` are the input nodes whose features this rank loads;
            ``exchanges[l].owned`` equals ``blocks[l − 1].dst_nodes`` for ``l ≥ 1``.
        seeds: ``(B,)`` int64 seeds of the global batch (of this round) the share belongs to, the same on every rank.
        key: the global batch's sample key (a ``SampleKey``).
    """

    blocks: list[Block]
    exchanges: list[Exchange]
    seeds: Tensor
    key: object

    @property
    def input_nodes(self) -> Tensor:
        """``(n,)`` int64 ids of the input nodes this rank loads the features of (it owns them)."""
        return self.exchanges[0].owned

    @property
    def output_nodes(self) -> Tensor:
        """``(b,)`` int64 ids of the global batch's seeds this rank owns and computes the logits of."""
        return self.blocks[-1].dst_nodes

    def exchange_counts(self) -> list[ExchangeCounts]:
        """Each exchange's rows owned, served and requested, for the share's memory estimate
        (:meth:`estimator.peaks.PeakEstimator.cooperative_share`, with :attr:`blocks`)."""
        return [ExchangeCounts(exchange.owned.numel(), sum(exchange.recv_counts), sum(exchange.send_counts))
                for exchange in self.exchanges]
