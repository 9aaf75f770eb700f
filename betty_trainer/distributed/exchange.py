"""The all-to-all of one layer boundary of a cooperative batch (cooperative paper §3.1, Alg. 1).

When rank ``p`` has sampled block ``l`` for the seeds it owns, the block's src nodes ``S̃_p`` lie on every
rank. The ranks send each src id to its owner (``all_to_all_single``); each owner ``q`` deduplicates what it
received into ``S_q`` (sorted ids), the nodes whose rows it will provide: the dst nodes of its block ``l − 1``,
or for the input block the input nodes whose features it loads. That exchange is recorded as an
:class:`Exchange`, and "the same communication pattern used during cooperative sampling is used to send and
receive input and intermediate layer embeddings before each GNN layer invocation" (§3.1): :func:`exchange_rows`
moves the rows of ``S_q`` to the ranks that asked, and its backward sends the gradients of those rows back and
sums them at the owner, so autograd runs through it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from betty_trainer.errors import TrainingError

logger = logging.getLogger(__name__)


@dataclass
class ExchangeTraffic:
    """Bytes one rank sent to the other ranks through its exchanges (its own rows, which stay, are not counted).

    Attributes:
        id_bytes: sampled ids sent to their owners (8 bytes each).
        row_bytes: feature and embedding rows sent to the ranks that asked, and their gradients sent back.
    """

    id_bytes: int = 0
    row_bytes: int = 0

    @property
    def total(self) -> int:
        """All bytes sent to other ranks."""
        return self.id_bytes + self.row_bytes


@dataclass
class Exchange:
    """One layer boundary's all-to-all, seen from one rank.

    Attributes:
        order: ``(n,)`` int64 positions of this rank's requested ids (a block's src nodes) sorted by owner,
            stably: the order they are sent in, and the rows come back in.
        send_counts: ids this rank requests from each rank (``P`` ints; rows it receives in the forward).
        recv_counts: ids each rank requests from this rank (``P`` ints; rows it sends in the forward).
        serve_index: ``(Σ recv_counts,)`` int64 position in :attr:`owned` of each id requested from this
            rank, grouped by requesting rank.
        owned: ``(u,)`` int64 ascending ids this rank provides the rows of (``S_q``).
        group: the process group the ids went over (``None``: the default group).
        row_group: the process group rows and their gradients go over (``None``: ``group``); NCCL on CUDA while
            the ids, on the CPU, go over gloo.
        traffic: where the bytes sent to other ranks are counted (``None``: not counted).
    """

    order: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    serve_index: Tensor
    owned: Tensor
    group: dist.ProcessGroup | None = None
    row_group: dist.ProcessGroup | None = None
    traffic: ExchangeTraffic | None = None

    @property
    def rows_group(self) -> dist.ProcessGroup | None:
        """The group rows move over: :attr:`row_group`, else :attr:`group`."""
        return self.row_group if self.row_group is not None else self.group

    def count(self, rows: int, row_bytes: int) -> None:
        """Add ``rows`` rows of ``row_bytes`` bytes sent to other ranks to :attr:`traffic`."""
        if self.traffic is not None:
            self.traffic.row_bytes += rows * row_bytes

    @property
    def rows_received(self) -> int:
        """Rows this rank receives from other ranks in one forward exchange."""
        rank = dist.get_rank(self.group)
        return sum(count for q, count in enumerate(self.send_counts) if q != rank)


@contextmanager
def collective(what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the collectives of ``what``; a failure of the process group (a rank that died or left: gloo raises at
    once when its connection closes, NCCL when the group's timeout expires) becomes one
    :class:`~betty_trainer.errors.TrainingError` naming this rank and ``what``.

    Raises:
        TrainingError: a collective inside failed.
    """
    try:
        yield
    except RuntimeError as error:  # torch.distributed's DistError and backend errors are RuntimeErrors
        if isinstance(error, TrainingError):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrainingError(f"rank {dist.get_rank(group)}: {what} failed; another rank died or left the group "
                            f"({first[:200]})") from error


def plan_exchange(requested: Tensor, owners: Tensor, group: dist.ProcessGroup | None = None,
                  row_group: dist.ProcessGroup | None = None, traffic: ExchangeTraffic | None = None) -> Exchange:
    """Send ``requested`` ids to their owners and record the pattern (a collective: every rank of ``group``
    calls it, in the same order).

    Args:
        requested: ``(n,)`` int64 global ids whose rows this rank needs (a block's src nodes), on the CPU.
        owners: ``(N,)`` int64 rank of every vertex (:func:`~betty_trainer.distributed.ownership.vertex_owners`),
            the same on every rank.
        group: the process group of the ids (its backend moves CPU tensors: gloo).
        row_group, traffic: kept on the :class:`Exchange` (rows' group; where bytes sent are counted, the ids'
            here).

    Returns:
        The :class:`Exchange`; its ``owned`` are the distinct ids other ranks (and this one) asked this rank for.

    Raises:
        TrainingError: the all-to-all failed (:func:`collective`).
    """
    world = dist.get_world_size(group)
    owner = owners[requested]
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=world)
    recv = torch.empty_like(send)
    with collective("the all-to-all of sampled ids", group):
        dist.all_to_all_single(recv, send, group=group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        received = torch.empty(sum(recv_counts), dtype=torch.int64)
        dist.all_to_all_single(received, requested[order].contiguous(), recv_counts, send_counts, group=group)
    owned, serve_index = torch.unique(received, return_inverse=True)
    if traffic is not None:
        traffic.id_bytes += 8 * (requested.numel() - send_counts[dist.get_rank(group)])
    return Exchange(order, send_counts, recv_counts, serve_index, owned, group, row_group, traffic)


RELEASE_WAIT_S = 10.0
"""Longest a CPU exchange waits for gloo's worker thread to let go of its buffers (it does within microseconds; a
machine loaded far past its cores can hold that thread off for longer)."""


def _references(tensor: Tensor) -> tuple[int, int]:
    """Reference counts of ``tensor``'s TensorImpl and of its storage (private but stable APIs): a holder of the
    tensor raises the first, a holder of a view of it (or of its storage) only the second."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _all_to_all(output: Tensor, input: Tensor, output_counts: list[int], input_counts: list[int],
                group: dist.ProcessGroup | None) -> None:
    """``all_to_all_single`` that returns, on the CPU, only once the backend has let go of ``output`` and ``input``.

    gloo's worker thread holds both tensors until it drops its work item, a moment after the collective completes;
    under load that moment can come after the caller has moved on, so a buffer the caller frees would die later
    than the caller (and the memory estimate, ``estimator.cooperative``) says. Waiting for the tensors' and their
    storages' reference counts to fall back (at most :data:`RELEASE_WAIT_S`; past it a warning says the step's
    memory may exceed its estimate) makes every free happen where the code says. On CUDA, NCCL keeps the tensors
    until its stream is done with them and the caching allocator orders the reuse: no wait.
    """
    held = _references(output) + _references(input)
    dist.all_to_all_single(output, input, output_counts, input_counts, group=group)
    if output.device.type != "cpu":
        return
    deadline = time.monotonic() + RELEASE_WAIT_S
    while any(now > before for now, before in zip(_references(output) + _references(input), held, strict=True)):
        if time.monotonic() >= deadline:
            logger.warning("the backend still held an all-to-all's buffers %.0f s after it completed: this step's "
                           "host memory may exceed its estimate until it lets go", RELEASE_WAIT_S)
            return
        time.sleep(0)  # yield to the worker thread


def _row_bytes(rows: Tensor) -> int:
    return math.prod(rows.shape[1:]) * rows.element_size()


class _ExchangeRows(torch.autograd.Function):
    """Rows of the owned nodes → rows of the requested ids; backward: the reverse all-to-all, summed."""

    @staticmethod
    def forward(ctx, rows: Tensor, exchange: Exchange) -> Tensor:
        ctx.exchange, ctx.num_owned = exchange, rows.shape[0]
        served = rows[exchange.serve_index.to(rows.device)].contiguous()
        received = rows.new_empty((sum(exchange.send_counts), *rows.shape[1:]))
        with collective("the all-to-all of rows", exchange.rows_group):
            _all_to_all(received, served, exchange.send_counts, exchange.recv_counts, exchange.rows_group)
        exchange.count(served.shape[0] - exchange.recv_counts[dist.get_rank(exchange.group)], _row_bytes(rows))
        del served  # sent (and let go of by the backend: _all_to_all), before the output is made
        out = torch.empty_like(received)
        out[exchange.order.to(rows.device)] = received
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        exchange = ctx.exchange
        sent = grad[exchange.order.to(grad.device)].contiguous()
        back = grad.new_empty((sum(exchange.recv_counts), *grad.shape[1:]))
        with collective("the all-to-all of row gradients", exchange.rows_group):
            _all_to_all(back, sent, exchange.recv_counts, exchange.send_counts, exchange.rows_group)
        exchange.count(sent.shape[0] - exchange.send_counts[dist.get_rank(exchange.group)], _row_bytes(grad))
        del sent  # as in forward
        rows = grad.new_zeros((ctx.num_owned, *grad.shape[1:]))
        rows.index_add_(0, exchange.serve_index.to(grad.device), back)
        return rows, None


def exchange_rows(rows: Tensor, exchange: Exchange) -> Tensor:
    """The rows of this rank's requested ids, from their owners' rows (a collective; autograd-aware).

    Args:
        rows: ``(len(exchange.owned), …)`` rows of :attr:`Exchange.owned`, in that order.
        exchange: the boundary's :class:`Exchange`.

    Returns:
        ``(n, …)`` rows of the ids :func:`plan_exchange` was given, in their order. Its gradient flows back to
        ``rows`` on the owners (gradients of an id requested by several ranks are summed).

    Raises:
        TrainingError: the all-to-all (forward or backward) failed because a rank died or left (:func:`collective`).

    Source: the cooperative paper's Alg. 1, the all-to-alls of the forward and backward passes.
    """
    return _ExchangeRows.apply(rows, exchange)
