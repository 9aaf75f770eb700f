"""The feature store: where node features live and how a batch's input rows reach the device
(docs/design.md › Seams, Feature store; › Feature store and GPU node cache).

Training never indexes a raw feature tensor: it asks a :class:`FeatureStore` for the rows
of a micro-batch's input nodes on the device the model runs on, and the store counts what
that cost. :class:`HostFeatureStore` keeps the features in host memory (pinned where CUDA is
present) and stages each gather in a reusable pinned buffer, so the host→device copy is
truly asynchronous (a copy from pageable memory is synchronous whatever ``non_blocking``
says). The GPU node cache (static, LRU or GNS §3.2) and macro-batch gathering plug in behind
the same ``gather``: :mod:`betty_trainer.data.cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from estimator.counts import leading_range

STAGING_GROWTH = 1.5  # a staging buffer that is too small is replaced by one this many times larger (or the request)


@dataclass
class TransferStats:
    """What a feature store's gathers cost, counted since the store was made.

    Attributes:
        hits: requested rows served from device memory (a device cache, or a macro-batch staged
            there) without a transfer of their own.
        misses: requested rows read from the store's own storage (every row, without a cache); with
            macro-batch gathering, a staged row read from the host counts once, at its first request.
        host_to_device_bytes: bytes copied from the storage device to the target device
            (``rows × row bytes`` of the misses when the two differ, 0 when they are the same), plus
            the bytes of cache fills when the cache lies on another device than the storage; the
            figure PCIe-saving features are judged on.
        cache_fill_bytes: bytes read from the storage to fill a device cache (a static cache's
            fill, a GNS cache refresh; whether or not they crossed devices), and of macro-batch
            rows fetched but never requested. Bytes read from the storage in all:
            ``misses × row bytes + cache_fill_bytes``.
        gather_seconds: host wall time spent in ``gather`` and in cache fills (seconds; with CUDA
            this includes the synchronisations a gather needs, not the asynchronous copies'
            completion). Not compared by ``==``: it is a measurement, not a count.
    """

    hits: int = 0
    misses: int = 0
    host_to_device_bytes: int = 0
    cache_fill_bytes: int = 0
    gather_seconds: float = field(default=0.0, compare=False)

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0.0 before any request."""
        requested = self.hits + self.misses
        return self.hits / requested if requested else 0.0

    def snapshot(self) -> TransferStats:
        """A copy of the counters now (subtract two snapshots for the cost of what ran between them)."""
        return replace(self)

    def __sub__(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


@runtime_checkable
class FeatureStore(Protocol):
    """Node features behind one call, ``gather(node_ids, device)``, with transfer statistics and the
    per-batch hooks the training loop calls (docs/design.md › Seams › FeatureStore).

    Implementations return ``(len(node_ids), F)`` rows on ``device`` in the order of
    ``node_ids``, as a new tensor the caller owns (the training step lets input dropout
    overwrite it), and add what the gather cost to ``stats``. (A plain :class:`HostFeatureStore` also
    hands out its own rows ``0 … n − 1`` as a read-only view, :func:`hands_out_rows`, which a built-in
    model's training step reads in place.) The training step, measurement,
    calibration and evaluation take a store, never a raw tensor (wrap one in :class:`HostFeatureStore`).

    The planner leaves :attr:`max_device_bytes` of the budget to the store. The loop calls, per round of
    batches, ``prefetch(nodes)`` before its batches (the union of their
    input nodes when they are staged together, BatchGNN §3; ``None`` otherwise) and ``release()`` after
    them, and ``begin_batch(key)`` before each batch. A store with nothing to do there inherits the no-op
    hooks by subclassing this protocol (as :class:`HostFeatureStore` does).
    """

    stats: TransferStats

    @property
    def row_bytes(self) -> int:
        """Bytes of one node's features (``F × itemsize``)."""
        ...

    def gather(self, node_ids: Tensor, device: torch.device | str) -> Tensor:
        """``(len(node_ids), F)`` features of ``node_ids`` (int64, any device) on ``device``."""
        ...

    @property
    def device_bytes(self) -> int:
        """Device bytes the store holds now between gathers (a cache, a staged macro-batch); 0 by default."""
        return 0

    @property
    def max_device_bytes(self) -> int:
        """The most device bytes the store holds between gathers over a run: what the memory plan leaves
        room for beside a training step (the planner reads it); 0 by default."""
        return 0

    def begin_batch(self, key: object) -> None:
        """The batch keyed ``key`` (a :class:`~betty_trainer.sampling.base.SampleKey`) runs next."""

    def prefetch(self, node_ids: Tensor | None) -> None:
        """The next batches read ``node_ids`` (``(u,)`` int64, duplicates allowed); ``None``: no hint."""

    def release(self) -> None:
        """The batches :meth:`prefetch` announced have run."""


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name the same device (``cuda`` is the current CUDA device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    if a.type != "cuda":
        return {a.index, b.index} <= {None, 0}
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def is_file_backed(tensor: Tensor) -> bool:
    """Whether ``tensor``'s storage lies in a memory-mapped *file* (e.g. ``torch.from_numpy`` of an
    ``np.memmap`` or of ``np.load(mmap_mode=...)``), read on demand by the kernel's page cache.

    Such a matrix may be larger than RAM, so a store must not copy it (pinning copies).
    Decided from ``/proc/self/maps`` (Linux); ``False`` elsewhere, for CUDA tensors and for
    empty tensors.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    address = tensor.untyped_storage().data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                if low <= address < high:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return path.startswith("/") and not path.startswith("/dev/") and fields[4] != "0"
    except OSError:
        return False
    return False


def transfer_bytes(rows: int, row_bytes: int, source: torch.device | str, target: torch.device | str) -> int:
    """Bytes a gather of ``rows`` rows of ``row_bytes`` bytes each moves from ``source`` to
    ``target``: ``rows × row_bytes`` when they are different devices, else 0."""
    return 0 if same_device(source, target) else rows * row_bytes


class HostFeatureStore(FeatureStore):
    """Features in host memory, gathered through a reusable (pinned) staging buffer.

    A gather to the storage's own device returns ``x[node_ids]`` (a new tensor; nothing is
    staged or counted as moved). A gather to another device selects the rows into a staging
    buffer (pinned when ``pin``), then copies it with ``non_blocking=True``: from pinned
    memory the copy is asynchronous with respect to the host, and the buffer is not written
    again before a CUDA event recorded after the copy has completed. The buffer grows when a
    gather needs more rows (to :data:`STAGING_GROWTH` times its size, or the request) and is
    reused by every smaller gather.

    A memory-mapped ``x`` (:func:`is_file_backed`: features cached on disk, possibly larger
    than RAM) is never copied: its rows are read on demand by the gathers, through the page
    cache, and only the staging buffer is pinned.

    Args:
        x: ``(N, F)`` features (float32 or float16), normally on the CPU; a tensor already on
            a GPU is gathered there (``index_select``) and copied if another device asks.
        pin: pin the staging buffer, and ``x`` (a copy of it, unless it is pinned already or
            memory-mapped from a file). Default: ``torch.cuda.is_available()``. Pinning needs
            CUDA; ``x`` must be on the CPU.
        in_place: hand out views of ``x`` (:meth:`view`) where :meth:`views_rows`; ``False``: every read is a
            gather (the memory recorder's store: its fake batches say nothing of their node ids).

    Attributes:
        x: the stored features.
        memory_mapped: ``x`` is a file mapping, read on demand (and never pinned).
        stats: the :class:`TransferStats` of every gather so far.

    Raises:
        ValueError: if ``x`` is not two-dimensional.
        RuntimeError: from torch, if ``pin`` is set without CUDA.
    """

    def __init__(self, x: Tensor, pin: bool | None = None, in_place: bool = True):
        if x.dim() != 2:
            raise ValueError(f"features must be (N, F), got shape {tuple(x.shape)}")
        self.pinned = (torch.cuda.is_available() if pin is None else pin) and x.device.type == "cpu"
        self.memory_mapped = is_file_backed(x)
        self.x = x.pin_memory() if self.pinned and not x.is_pinned() and not self.memory_mapped else x
        self.stats = TransferStats()
        self.in_place = in_place
        self._staging: Tensor | None = None  # flat buffer of ``capacity`` elements
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy out of the staging buffer

    @property
    def row_bytes(self) -> int:
        """Bytes of one node's features (``F × itemsize``)."""
        return self.x.shape[1] * self.x.element_size()

    @property
    def staging_rows(self) -> int:
        """Rows the staging buffer holds now (0 before the first gather to another device)."""
        return 0 if self._staging is None else self._staging.numel() // max(self.x.shape[1], 1)

    def gather(self, node_ids: Tensor, device: torch.device | str) -> Tensor:
        """``(len(node_ids), F)`` rows of ``x`` on ``device``, in the order of ``node_ids``.

        Args:
            node_ids: ``(n,)`` int64 node ids in ``[0, N)``, on any device.
            device: the target device.

        Returns:
            A new tensor (never a view of the store or of the staging buffer).

        Raises:
            IndexError: from torch, for ids outside ``[0, N)``.
        """
        started = time.perf_counter()
        device = torch.device(device)
        ids = node_ids.to(self.x.device)
        moved = transfer_bytes(ids.numel(), self.row_bytes, self.x.device, device)
        if moved == 0:
            rows = self.x.index_select(0, ids)
        elif self.x.device.type != "cpu":
            rows = self.x.index_select(0, ids).to(device)
        else:
            rows = self._stage(ids).to(device, non_blocking=self.pinned)
            if self.pinned and device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(device))
        self.stats.misses += ids.numel()
        self.stats.host_to_device_bytes += moved
        self.stats.gather_seconds += time.perf_counter() - started
        return rows

    def views_rows(self, device: torch.device | str) -> bool:
        """Whether :meth:`view` hands out ``x``'s own rows on ``device``: ``True`` for a training step on the CPU
        with the features in host memory (unless made with ``in_place=False``); there the first ``n`` rows are
        a view of ``x`` and a copy of them buys nothing (on Amazon Computers a 42 MB copy and 15–30 ms of a
        120 ms full-graph step, page faults included: ``benchmarks/README.md`` › versus_dgl.py)."""
        return self.in_place and torch.device(device).type == "cpu" and self.x.device.type == "cpu"

    def view(self, node_ids: Tensor, device: torch.device | str) -> Tensor | None:
        """``x[:n]``, ``(n, F)`` in ``x``'s dtype (a view, no copy; the caller must only read it) for ``node_ids``
        (``(n,)`` int64) ``0 … n − 1`` in order (:func:`~estimator.counts.leading_range`) on the CPU
        (:meth:`views_rows`), counted as ``n`` misses with no bytes moved, as a gather to the CPU is; ``None``
        otherwise. Raises nothing. Callers ask :func:`hands_out_rows` first."""
        if not self.views_rows(device) or not leading_range(node_ids):
            return None
        self.stats.misses += node_ids.numel()
        return self.x[: node_ids.numel()]

    def _stage(self, ids: Tensor) -> Tensor:
        """``x[ids]`` written into the staging buffer; returns the ``(n, F)`` view of it."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the buffer has finished
            self._copied = None
        width = self.x.shape[1]
        needed = ids.numel() * width
        if self._staging is None or self._staging.numel() < needed:
            capacity = max(needed, int(STAGING_GROWTH * (0 if self._staging is None else self._staging.numel())))
            self._staging = torch.empty(capacity, dtype=self.x.dtype, pin_memory=self.pinned)
        staged = self._staging[:needed].view(ids.numel(), width)
        torch.index_select(self.x, 0, ids, out=staged)
        return staged

    def __repr__(self) -> str:
        n, f = self.x.shape
        return (f"HostFeatureStore(nodes={n}, features={f}, dtype={self.x.dtype}, pinned={self.pinned}, "
                f"memory_mapped={self.memory_mapped})")


def hands_out_rows(features: FeatureStore, device: torch.device | str) -> bool:
    """Whether a training step on ``device`` may read ``features``' rows ``0 … n − 1`` in place
    (:meth:`HostFeatureStore.view`) instead of gathering them: a plain :class:`HostFeatureStore` whose
    :meth:`~HostFeatureStore.views_rows`. Any other store gathers: a cache or staged macro-batch, a store of the
    user's own, or a subclass of the host store, which may do more in its ``gather``. The step and the planner's
    estimate (``ModelSpec.features_in_place``) both ask this."""
    return type(features) is HostFeatureStore and features.views_rows(device)


def require_store(features: object) -> FeatureStore:
    """``features`` if it is a :class:`FeatureStore`; the public entry points of the step and of evaluation
    check their argument with it, so a raw tensor (which the API took before) gets a clear error.

    Raises:
        TypeError: ``features`` is not a store (the message says how to wrap an ``(N, F)`` tensor).
    """
    if not isinstance(features, FeatureStore):
        raise TypeError(f"features must be a FeatureStore, got {type(features).__name__}; wrap an (N, F) tensor x "
                        "as HostFeatureStore(x)")
    return features
