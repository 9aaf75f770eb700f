"""A device node cache and macro-batch gathering in front of the host feature store
(docs/design.md › Feature store and GPU node cache).

:class:`CachedFeatureStore` wraps a :class:`~betty_trainer.data.feature_store.HostFeatureStore`
and serves ``gather(node_ids, device)`` from three places, in this order:

1. a **staged macro-batch** (BatchGNN §3): the rows of the union of the input nodes of several
   consecutive mini-batches (or of the micro-batches of one batch), gathered once by
   :meth:`CachedFeatureStore.prefetch` and kept on the device until :meth:`~CachedFeatureStore.release`;
2. the **node cache**: ``capacity`` rows resident on the device, chosen by ``kind``:

   * ``static``: the ``capacity`` nodes of highest degree (out-degree: the neighbour lists holding them),
     filled once at the first gather
     (PaGraph's policy; GNS §2.2 discusses it);
   * ``lru``: the ``capacity`` most recently read nodes. Recency has gather granularity: every row
     of one gather is read "at the same time"; after a gather the cache holds the ``capacity`` nodes
     of largest ``(last gather that read it, node id)``, so ties are broken by node id. Misses enter
     the cache from the rows just copied (no extra transfer);
   * ``gns``: the global node cache of GNS (§3.1–3.2) *is* the cache: :meth:`begin_batch` asks
     ``node_source(key)`` (``GNSSampler.cache_nodes``) for the batch's cached node set, and when it
     changed (a refresh, every ``P`` batches) copies the new set onto the device (rows already
     resident are moved on the device; only the others are read from the host);
3. the **host**: the remaining rows (the misses), read from the host store (pinned staging, a
   non-blocking copy, when CUDA is present; see :class:`HostFeatureStore`).

On CPU the same code runs: the "device" is the CPU and the cache is a plain tensor, so every
counter is exercised by the tests (``host_to_device_bytes`` is then 0: nothing crosses devices;
``misses × row bytes + cache_fill_bytes`` are the bytes a GPU run would move).

The lookup table is an ``(N,)`` int32 ``slot`` array on the device (4 bytes per node, next to
``capacity × F`` feature elements): GraphBolt's GPU cache uses a hash table instead, which is
smaller for huge ``N``; the array keeps the lookup one ``index_select``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore, TransferStats, same_device, transfer_bytes
from betty_trainer.data.graph import Graph
from betty_trainer.errors import ConfigError

CacheKind = Literal["none", "static", "lru", "gns"]
CACHE_KINDS: tuple[str, ...] = get_args(CacheKind)  # what features.cache.kind may name
FILL_CHUNK_ROWS = 65536  # a cache fill reads the host in chunks of this many rows (bounds the pinned staging buffer)


class CacheSizeError(ConfigError, ValueError):
    """A ``features.cache.size`` that gives no rows: a :class:`~betty_trainer.errors.ConfigError` (the CLI
    prints its one line) that is also a ``ValueError``, so the config's field validator reports it under the
    key like its other rules."""


@dataclass(frozen=True)
class NodeSource:
    """Where a ``gns`` cache takes its node set from: the sampler's node cache (GNS §3.1).

    Attributes:
        nodes: ``key -> (|C|,)`` int64 ascending ids of the nodes the batch ``key`` samples with
            (``GNSSampler.cache_nodes``).
        size: the most nodes a set holds (``|C|``): the rows the store's plan leaves room for.
    """

    nodes: Callable[[Any], Tensor]
    size: int


def ceil_fraction(fraction: float, count: int) -> int:
    """``⌈fraction · count⌉`` computed exactly on the decimal ``fraction`` is written as (``repr``), not on
    its binary float: ``0.07 · 100`` is ``7.000000000000001`` in floats, whose ceiling would be 8.

    Args:
        fraction: a finite float (a configured fraction such as ``0.07``).
        count: the number it is a fraction of (``N``).

    Returns:
        The int ``⌈Fraction(repr(fraction)) · count⌉``.
    """
    return math.ceil(Fraction(repr(float(fraction))) * count)


def cache_capacity(size: float | int | str, num_nodes: int, row_bytes: int) -> int:
    """Rows a cache of ``size`` holds: a fraction of the nodes (a float in ``(0, 1]``), a node
    count (an int ≥ 1) or, given as a string with a unit (``"64MiB"``), bytes; at most ``num_nodes``.

    Args:
        size: the configured size (``features.cache.size``).
        num_nodes: ``N``.
        row_bytes: bytes of one node's features (``F × itemsize``), for a size in bytes.

    Returns:
        The capacity in rows (``⌈fraction · N⌉`` by :func:`ceil_fraction`, the count, or
        ``⌊bytes / row_bytes⌋``), in ``[1, N]`` (0 only when ``N = 0``).

    Raises:
        CacheSizeError: (a ``ValueError``) a non-positive size, a fraction above 1 given as a float, an
            unreadable string, or a size in bytes below one row (``"0B"``, ``"100B"`` for 400-byte rows, or a
            fraction written as a string, ``'0.1'``, which reads as 0 bytes).
    """
    if isinstance(size, bool):
        raise CacheSizeError(f"features.cache.size must be a fraction of the nodes, a node count or bytes, "
                             f"got {size!r}")
    if isinstance(size, str):
        from pydantic import ByteSize, TypeAdapter, ValidationError

        try:
            number = int(TypeAdapter(ByteSize).validate_python(size.strip()))
        except ValidationError:
            raise CacheSizeError(f"features.cache.size {size!r} is not a size in bytes such as '64MiB'") from None
        if number < 1:
            raise CacheSizeError(f"features.cache.size {size!r} reads as 0 bytes: give a size such as '64MiB', a node "
                                 f"count, or a fraction of the nodes unquoted (0.1, not '0.1')")
        rows = number // max(row_bytes, 1)
        if rows < 1:
            raise CacheSizeError(f"features.cache.size {size!r} is {number} bytes, less than one {row_bytes}-byte "
                                 f"feature row: give at least '{row_bytes}B', a node count or a fraction of the nodes")
        return min(num_nodes, rows)
    if isinstance(size, float):
        if not 0 < size <= 1:
            raise CacheSizeError(f"features.cache.size given as a fraction must be in (0, 1], got {size}")
        return min(num_nodes, ceil_fraction(size, num_nodes))
    if size < 1:
        raise CacheSizeError(f"features.cache.size given as a node count must be at least 1, got {size}")
    return min(num_nodes, int(size))


def device_bytes_bound(kind: CacheKind, cache_rows: int, num_nodes: int, row_bytes: int, stage_rows: int = 0) -> int:
    """The most device bytes a :class:`CachedFeatureStore` holds between gathers: what a memory plan
    leaves room for beside a training step (the budget is what is left after it).

    Held: a cache's ``(N,)`` int32 slot table (none for kind ``none``); a ``static`` cache's rows with their
    int64 node ids, an ``lru`` cache's with their ids and int64 stamps; a ``gns`` cache's rows with its int64
    node set; when macro-batches are staged
    (``stage_rows > 0``), their ``(N,)`` int32 table and up to ``stage_rows`` rows with their int64 ids
    and bool "not yet requested" flags. A ``gns`` refresh briefly holds the old and the new rows: it
    runs between training steps, so it is not counted.

    Args:
        kind: the cache kind (``"none"``: no cache, only staged macro-batches).
        cache_rows: the cache's rows (:func:`cache_capacity`; for ``gns`` the sampler's cache size).
        num_nodes: ``N``.
        row_bytes: bytes of one node's features.
        stage_rows: the most rows a staged macro-batch holds (0 without macro-batches).

    Returns:
        Bytes; equal to :attr:`CachedFeatureStore.device_bytes` once the cache is full and a macro-batch
        of ``stage_rows`` rows is staged.
    """
    held = 0 if kind == "none" else 4 * num_nodes
    if kind == "lru":
        held += cache_rows * (row_bytes + 16)
    elif kind in ("static", "gns"):
        held += cache_rows * (row_bytes + 8)
    if stage_rows:
        held += 4 * num_nodes + stage_rows * (row_bytes + 8 + 1)
    return held


class CachedFeatureStore(FeatureStore):
    """A device node cache and macro-batch staging in front of a host store (see the module docstring).

    Args:
        host: the host store the misses are read from (its own ``stats`` keep counting its gathers).
        device: where the cache lives and the rows are served (the training device).
        kind: ``"none"`` (no cache; macro-batch staging only), ``"static"``, ``"lru"`` or ``"gns"``.
        capacity: cached rows (``static``, ``lru``); for ``gns`` the most nodes a node set holds (the
            sampler's cache size: the set decides what is cached, this bounds :attr:`max_device_bytes`);
            ignored by ``none``.
        degrees: ``(N,)`` degrees, for ``static`` (the highest are cached; ties by lower node id):
            ``Graph.out_degrees``, how many neighbour lists hold each node.
        node_source: for ``gns``: ``key -> (|C|,) int64`` the cached node set of the batch ``key``
            (``GNSSampler.cache_nodes``).
        stage_budget: the most bytes of rows a staged macro-batch holds (``features.macro_batch_budget``),
            counted in :attr:`max_device_bytes`; ``None``: staging is not bounded, nor counted.

    Attributes:
        stats: :class:`TransferStats` of every gather and fill through this store.
        capacity: the cache's rows (for ``gns``, the size of the current node set).

    Raises:
        ValueError: an unknown ``kind``, a negative capacity, ``static`` without ``degrees`` or
            ``gns`` without ``node_source``.
    """

    def __init__(self, host: HostFeatureStore, device: torch.device | str, kind: CacheKind = "lru",
                 capacity: int = 0, *, degrees: Tensor | None = None,
                 node_source: Callable[[Any], Tensor] | None = None, stage_budget: int | None = None) -> None:
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {', '.join(CACHE_KINDS)}; got {kind!r}")
        if capacity < 0:
            raise ValueError(f"cache capacity must be non-negative, got {capacity}")
        if kind == "static" and degrees is None:
            raise ValueError("a static cache needs the nodes' degrees")
        if kind == "gns" and node_source is None:
            raise ValueError("a gns cache needs node_source (GNSSampler.cache_nodes)")
        self.host = host
        self.device = torch.device(device)
        self.kind = kind
        self.stats = TransferStats()
        num_nodes, width = host.x.shape
        self.num_nodes = num_nodes
        self.capacity = 0 if kind in ("none", "gns") else min(int(capacity), num_nodes)
        self._planned_rows = min(int(capacity), num_nodes) if kind != "none" else 0
        self._stage_budget = stage_budget
        self._degrees = degrees
        self._node_source = node_source
        # the (N,) slot table serves lookups into a cache (none without one); stamps order an LRU cache only
        self._slot = torch.full((num_nodes if kind != "none" else 0,), -1, dtype=torch.int32, device=self.device)
        self._rows = torch.empty((self.capacity, width), dtype=host.x.dtype, device=self.device)
        self._node = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self._stamp = torch.full((self.capacity if kind == "lru" else 0,), -1, dtype=torch.int64, device=self.device)
        self._clock = 0
        self._filled = kind != "static"
        self._cached_set: Tensor | None = None  # gns: the node set resident now
        self._stage_table: Tensor | None = None  # (N,) int32 row of each staged node, -1 elsewhere
        self._stage_rows: Tensor | None = None
        self._stage_nodes: Tensor | None = None
        self._stage_owed: Tensor | None = None  # staged rows read from the host and not yet requested

    @property
    def row_bytes(self) -> int:
        """Bytes of one node's features (``F × itemsize``)."""
        return self.host.row_bytes

    @property
    def cached_nodes(self) -> Tensor:
        """``(c,)`` int64 ids of the nodes resident in the cache now, ascending."""
        if self.kind == "gns":
            return torch.empty(0, dtype=torch.int64, device=self.device) if self._cached_set is None \
                else self._cached_set
        return torch.sort(self._node[self._node >= 0]).values

    @property
    def device_bytes(self) -> int:
        """Device bytes the store holds now: the cache's rows and bookkeeping (``(N,)`` int32 slot table,
        ``capacity`` node ids and stamps), and a staged macro-batch's rows and table: what a memory plan
        must leave room for besides the model's activations."""
        held = [self._rows, self._slot, self._node, self._stamp, self._cached_set, self._stage_table,
                self._stage_rows, self._stage_nodes, self._stage_owed]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    @property
    def max_device_bytes(self) -> int:
        """The most device bytes this store holds between gathers (:func:`device_bytes_bound` of its kind,
        capacity and staging budget): what the planner subtracts from the budget."""
        row_bytes = self.row_bytes
        stage_rows = 0 if self._stage_budget is None else min(self.num_nodes, self._stage_budget // max(row_bytes, 1))
        return device_bytes_bound(self.kind, self._planned_rows, self.num_nodes, row_bytes, stage_rows)

    # --- batch hooks -----------------------------------------------------------------------------------------

    def begin_batch(self, key: Any) -> None:
        """Tell the store which batch comes next: a ``gns`` cache takes the batch's node set
        (``node_source(key)``), refilling the device copy when it changed; rows already on the device (in
        the old set or in a staged macro-batch) are copied there, only the others are read from the host.
        Other kinds do nothing."""
        if self.kind != "gns":
            return
        nodes = self._node_source(key).to(self.device).long()
        if self._cached_set is not None and (nodes is self._cached_set or torch.equal(nodes, self._cached_set)):
            return
        started = time.perf_counter()
        width = self.host.x.shape[1]
        rows = torch.empty((nodes.numel(), width), dtype=self.host.x.dtype, device=self.device)
        old_slot = self._slot[nodes]
        resident = old_slot >= 0
        rows[resident] = self._rows[old_slot[resident].long()]  # already on the device: no transfer
        if self._stage_nodes is not None:  # rows of a staged macro-batch are on the device too
            staged = self._stage_table[nodes].long()
            from_stage = ~resident & (staged >= 0)
            rows[from_stage] = self._stage_rows[staged[from_stage]]
            resident = resident | from_stage
        self._read_host_into(rows, torch.nonzero(~resident).squeeze(1), nodes[~resident])
        if self._cached_set is not None:
            self._slot[self._cached_set] = -1
        self._slot[nodes] = torch.arange(nodes.numel(), dtype=torch.int32, device=self.device)
        self._rows, self._cached_set, self.capacity = rows, nodes, nodes.numel()
        self.stats.gather_seconds += time.perf_counter() - started

    def prefetch(self, node_ids: Tensor | None) -> None:
        """Gather the rows of ``node_ids`` (the union of the input nodes of a macro-batch, BatchGNN §3)
        onto the device once; until :meth:`release`, gathers of these nodes are served from them.
        ``None`` stages nothing.

        Rows found in the cache are copied on the device; the others are read from the host now
        (their bytes are counted now, their misses at their first request). An LRU cache admits the
        rows read. A previous stage is dropped first.

        Args:
            node_ids: ``(u,)`` int64 node ids (duplicates are read once).
        """
        self.release()
        if node_ids is None:
            return
        started = time.perf_counter()
        self._ensure_filled()
        nodes = torch.unique(node_ids.to(self.device).long())
        self._stage_nodes = nodes
        self._stage_rows, missed = self._serve(nodes, count=False)
        self._stage_owed = missed
        if self._stage_table is None:  # allocated once, reset entry by entry: no (N,) allocation per stage
            self._stage_table = torch.full((self.num_nodes,), -1, dtype=torch.int32, device=self.device)
        self._stage_table[nodes] = torch.arange(nodes.numel(), dtype=torch.int32, device=self.device)
        self.stats.gather_seconds += time.perf_counter() - started

    def release(self) -> None:
        """Drop the staged macro-batch (its rows read from the host and never requested count as
        ``cache_fill_bytes``: they were moved, but served nothing)."""
        if self._stage_owed is not None:
            unused = int(self._stage_owed.sum())
            self.stats.cache_fill_bytes += unused * self.row_bytes
        if self._stage_nodes is not None:
            self._stage_table[self._stage_nodes] = -1
        self._stage_rows = self._stage_nodes = self._stage_owed = None

    @property
    def staged_rows(self) -> int:
        """Rows of the staged macro-batch (0 when none)."""
        return 0 if self._stage_nodes is None else self._stage_nodes.numel()

    # --- gathers ---------------------------------------------------------------------------------------------

    def gather(self, node_ids: Tensor, device: torch.device | str) -> Tensor:
        """``(len(node_ids), F)`` rows on ``device``, in the order of ``node_ids``.

        Served from the staged macro-batch, then the cache, then the host (see the module
        docstring); on a device other than the cache's, straight from the host store.

        Args:
            node_ids: ``(n,)`` int64 ids in ``[0, N)``, any device.
            device: the target device.

        Returns:
            A new tensor (never a view of the cache or the stage).

        Raises:
            IndexError: from torch, for ids outside ``[0, N)``.
        """
        started = time.perf_counter()
        if not same_device(device, self.device):
            rows = self.host.gather(node_ids, device)
            count = node_ids.numel()
            self.stats.misses += count
            self.stats.host_to_device_bytes += transfer_bytes(count, self.row_bytes, self.host.x.device, device)
        else:
            self._ensure_filled()
            ids = node_ids.to(self.device).long()
            if self._stage_nodes is None:
                rows, _ = self._serve(ids, count=True)
            else:
                rows = self._serve_staged(ids)
        self.stats.gather_seconds += time.perf_counter() - started
        return rows

    def _serve_staged(self, ids: Tensor) -> Tensor:
        position = self._stage_table[ids].long()
        staged = position >= 0
        if bool(staged.all()):
            rows = self._stage_rows[position]
        else:
            rows = torch.empty((ids.numel(), self.host.x.shape[1]), dtype=self.host.x.dtype, device=self.device)
            outside = torch.nonzero(~staged).squeeze(1)
            rows[outside], _ = self._serve(ids[outside], count=True)
            position = position[staged]
            rows[staged] = self._stage_rows[position]
        owed = torch.unique(position[self._stage_owed[position]])  # first requests of rows read from the host
        self._stage_owed[owed] = False
        first = owed.numel()
        self.stats.misses += first
        self.stats.hits += position.numel() - first
        return rows

    def _serve(self, ids: Tensor, *, count: bool) -> tuple[Tensor, Tensor]:
        """Rows of ``ids`` (on the cache's device) from the cache and the host; with ``count`` their
        hits and misses are counted. Returns the rows and a bool mask of those read from the host."""
        if self.capacity > 0:
            slot = self._slot[ids]
            missed = slot < 0
            rows = self._rows.index_select(0, slot.clamp(min=0).long())  # miss rows are overwritten below
            where = torch.nonzero(missed).squeeze(1)
        else:
            missed = torch.ones(ids.numel(), dtype=torch.bool, device=self.device)
            rows = torch.empty((ids.numel(), self.host.x.shape[1]), dtype=self.host.x.dtype, device=self.device)
            where = torch.arange(ids.numel(), device=self.device)
        miss_ids = ids[where]
        fetched = self._read_host(miss_ids)
        rows.index_copy_(0, where, fetched)
        misses = miss_ids.numel()
        self.stats.host_to_device_bytes += transfer_bytes(misses, self.row_bytes, self.host.x.device, self.device)
        if count:
            self.stats.misses += misses
            self.stats.hits += ids.numel() - misses
        if self.kind == "lru" and self.capacity > 0:
            self._clock += 1
            self._stamp[slot[~missed].long()] = self._clock
            self._admit(miss_ids, fetched)
        return rows, missed

    def _read_host(self, ids: Tensor) -> Tensor:
        """``x[ids]`` on the cache's device through the host store (pinned staging, non-blocking copy)."""
        if ids.numel() == 0:
            return torch.empty((0, self.host.x.shape[1]), dtype=self.host.x.dtype, device=self.device)
        return self.host.gather(ids, self.device)

    def _read_host_into(self, rows: Tensor, where: Tensor, ids: Tensor) -> None:
        """``rows[where] = x[ids]`` in chunks of :data:`FILL_CHUNK_ROWS`, counted as a cache fill."""
        for start in range(0, ids.numel(), FILL_CHUNK_ROWS):
            part = ids[start:start + FILL_CHUNK_ROWS]
            rows[where[start:start + FILL_CHUNK_ROWS]] = self._read_host(part)
        self.stats.cache_fill_bytes += ids.numel() * self.row_bytes
        self.stats.host_to_device_bytes += transfer_bytes(ids.numel(), self.row_bytes, self.host.x.device,
                                                          self.device)

    def _ensure_filled(self) -> None:
        """A static cache is filled with the top-degree nodes at its first use."""
        if self._filled:
            return
        self._filled = True
        if self.capacity == 0:
            return
        started = time.perf_counter()
        degrees = self._degrees.to(self.device)
        # highest degree first, ties by lower node id: a stable sort of the negated degrees
        nodes = torch.sort(torch.argsort(-degrees.long(), stable=True)[: self.capacity]).values
        self._read_host_into(self._rows, torch.arange(nodes.numel(), device=self.device), nodes)
        self._node[: nodes.numel()] = nodes
        self._slot[nodes] = torch.arange(nodes.numel(), dtype=torch.int32, device=self.device)
        self._degrees = None
        self.stats.gather_seconds += time.perf_counter() - started

    def _admit(self, miss_ids: Tensor, fetched: Tensor) -> None:
        """LRU: the cache keeps the ``capacity`` largest ``(stamp, node)`` among its entries and the
        misses just read (stamped with the current gather)."""
        if miss_ids.numel() == 0:
            return
        # one row per distinct node without sorting: the misses' slots are -1, so they can briefly hold
        # ``-2 - position``; a node's position is its own iff no later duplicate overwrote it
        positions = torch.arange(miss_ids.numel(), device=self.device)
        self._slot[miss_ids] = (-2 - positions).to(torch.int32)
        winner = -2 - self._slot[miss_ids].long()
        self._slot[miss_ids] = -1
        source = positions[winner == positions]
        nodes = miss_ids[source]
        n = self.num_nodes
        old_key = torch.where(self._node >= 0, self._stamp * n + self._node, -1)
        new_key = self._clock * n + nodes
        chosen = torch.topk(torch.cat([old_key, new_key]), self.capacity, sorted=False).indices
        keep_old = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        keep_old[chosen[chosen < self.capacity]] = True
        incoming = chosen[chosen >= self.capacity] - self.capacity
        free = torch.nonzero(~keep_old).squeeze(1)  # as many as ``incoming``
        evicted = self._node[free]
        self._slot[evicted[evicted >= 0]] = -1
        new_nodes = nodes[incoming]
        self._node[free] = new_nodes
        self._stamp[free] = self._clock
        self._rows[free] = fetched[source[incoming]]
        self._slot[new_nodes] = free.to(torch.int32)

    def __repr__(self) -> str:
        return (f"CachedFeatureStore(kind={self.kind!r}, capacity={self.capacity}, device={self.device}, "
                f"host={self.host!r})")


def make_feature_store(graph: Graph, device: torch.device | str, kind: CacheKind = "none",
                       size: float | int | str = 0.1, *, macro_batch: bool = False, stage_budget: int | None = None,
                       node_source: NodeSource | None = None, host: HostFeatureStore | None = None) -> FeatureStore:
    """The feature store a run gathers its input rows from (docs/design.md › Feature store and GPU node cache).

    ``kind="none"`` without macro-batches is the host store itself; otherwise a :class:`CachedFeatureStore` over
    it: ``static`` caches the ``size`` nodes of highest out-degree (:meth:`Graph.out_degrees`: the most often
    sampled as neighbours), ``lru`` the most recently read ones, ``gns`` the node sets of ``node_source`` (the
    sampler's node cache, GNS §3.1).

    Args:
        graph: the graph whose ``x`` the store serves.
        device: the training device (where the cache lives).
        kind: ``none``, ``static``, ``lru`` or ``gns`` (``features.cache.kind``).
        size: the cache's size for ``static`` and ``lru`` (:func:`cache_capacity`: a fraction of the nodes, a
            node count or bytes such as ``"64MiB"``).
        macro_batch: batches stage their input rows on the device (BatchGNN §3; ``features.macro_batch > 0``).
        stage_budget: the most bytes a staged macro-batch holds (``features.macro_batch_budget``), or ``None``.
        node_source: the sampler's node cache (``Sampler.node_cache``), for ``gns``.
        host: the host store to wrap; default ``HostFeatureStore(graph.x, pin=<device is CUDA>)``.

    Raises:
        ConfigError: ``gns`` without a node source (the sampler keeps no node cache), or a ``size`` that gives
            no rows (:class:`CacheSizeError`).
    """
    device = torch.device(device)
    host = host if host is not None else HostFeatureStore(graph.x, pin=device.type == "cuda")
    if kind == "none" and not macro_batch:
        return host
    stage_budget = stage_budget if macro_batch else None
    if kind == "gns":
        if node_source is None:
            raise ConfigError("features.cache.kind=gns caches the GNS sampler's node set and this sampler keeps "
                              "none; use sampling.sampler=gns or another features.cache.kind")
        return CachedFeatureStore(host, device, "gns", node_source.size, node_source=node_source.nodes,
                                  stage_budget=stage_budget)
    capacity = 0 if kind == "none" else cache_capacity(size, graph.num_nodes, host.row_bytes)
    return CachedFeatureStore(host, device, kind, capacity, degrees=graph.out_degrees() if kind == "static" else None,
                              stage_budget=stage_budget)
