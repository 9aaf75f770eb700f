"""Ground-truth peak memory of one step: the number every estimator accuracy claim is checked against.

docs/design.md › Memory estimate: on a GPU the peak is ``torch.cuda.max_memory_allocated``;
on CPU it is the peak of live bytes replayed from ``torch.profiler``'s memory events
of the real step.

On CPU the replay reads the profiler's raw allocation records
(``prof.profiler.kineto_results.experimental_event_tree()``, nodes tagged
``_EventType.Allocation``, shown as ``"[memory]"``): one record per call of torch's
CPU allocator, with ``alloc_size`` (bytes, ``+`` allocation, ``−`` free), ``ptr``
and ``start_time_ns``. The per-operator figures of ``prof.events()`` are not used:
the inclusive ``cpu_memory_usage`` counts an allocation once for every enclosing
operator (``a.float()`` = ``aten::to`` → ``aten::_to_copy`` → ``aten::empty_strided``
counts its output three times), and the self figure ``self_cpu_memory_usage`` is a
net sum per operator, blind to temporaries freed inside the operator (e.g. the
``log_softmax`` output inside ``cross_entropy`` without autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

CUDA_METHOD = "cuda.max_memory_allocated"
CPU_METHOD = "profiler.cpu_allocations"


@dataclass(frozen=True)
class MeasuredPeak:
    """The measured memory peak of one step.

    Args:
        peak_bytes: most bytes live at once during the step, resident bytes included.
        resident_bytes: bytes already live when the step started (the part of
            ``peak_bytes`` the step did not allocate).
        device: the device measured, e.g. ``"cpu"`` or ``"cuda:0"``.
        method: :data:`CUDA_METHOD` or :data:`CPU_METHOD`.
    """

    peak_bytes: int
    resident_bytes: int
    device: str
    method: str


def measure_peak(
    step: Callable[[], object],
    device: torch.device | str,
    resident: Iterable[torch.Tensor] = (),
) -> MeasuredPeak:
    """Run ``step()`` once and return the peak number of bytes live during it on ``device``.

    CUDA: ``torch.cuda.max_memory_allocated(device)`` after resetting the peak
    statistics (synchronised before and after the step). ``resident_bytes`` is
    ``torch.cuda.memory_allocated(device)`` before the step — everything the caching
    allocator had handed out, so ``resident`` is not needed and not read.
    Bytes are those of allocated blocks (rounded up to 512 bytes by the allocator),
    not the memory the caching allocator reserves.

    CPU: the step runs under ``torch.profiler.profile(profile_memory=True)`` and its
    allocation records are replayed in time order. A free counts only if its address
    was allocated during the step, so the peak is
    ``resident_bytes + max_t Σ(allocations − frees up to t)``, with
    ``resident_bytes`` the total ``nbytes`` of the distinct storages of ``resident``
    (deduplicated by ``untyped_storage().data_ptr()``). Bytes are those requested
    from torch's CPU allocator.

    CPU blind spots: memory allocated outside torch's CPU allocator (``malloc`` by
    MKL/oneDNN scratch pads, ``std::vector`` buffers, Python objects), allocations made
    on threads the profiler does not follow (a ``threading.Thread`` started by the
    step), and frees of memory allocated before the step (the profiler reports them
    only for blocks it saw allocated), so a step that frees a resident tensor is
    measured as if it kept it: the figure is then an upper bound.

    Args:
        step: a callable run exactly once; its return value is dropped.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (a :class:`torch.device` or string).
        resident: CPU only: the tensors live before the step that belong in the peak
            (parameters, gradients, optimizer state, inputs already allocated).

    Returns:
        A :class:`MeasuredPeak` (bytes).

    Raises:
        ValueError: for a device other than CPU or CUDA, or, on CPU, a ``resident``
            tensor that is not on the CPU.
        RuntimeError: on CPU, if a torch profiler is already running (profilers do
            not nest); whatever ``step()`` raises propagates.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(step, device)
    if device.type == "cpu":
        return _measure_cpu(step, resident)
    raise ValueError(f"cannot measure memory on device {str(device)!r}: use cpu, cuda or cuda:N")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total ``nbytes`` (bytes) of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    sizes = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(sizes.values())


def _measure_cuda(step: Callable[[], object], device: torch.device) -> MeasuredPeak:
    torch.cuda.synchronize(device)
    resident_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device)
    name = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return MeasuredPeak(peak_bytes, resident_bytes, name, CUDA_METHOD)


def _measure_cpu(step: Callable[[], object], resident: Iterable[torch.Tensor]) -> MeasuredPeak:
    resident = list(resident)
    for tensor in resident:
        if tensor.device.type != "cpu":
            raise ValueError(f"resident tensor on {tensor.device} while measuring cpu; pass only CPU tensors")
    resident_bytes = storage_bytes(resident)
    if torch._C._autograd._profiler_enabled():
        raise RuntimeError("measure_peak cannot run inside another torch profiler; stop that profiler first")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return MeasuredPeak(resident_bytes + _peak_live_bytes(prof), resident_bytes, "cpu", CPU_METHOD)


def _peak_live_bytes(prof: profile) -> int:
    """Peak of the running sum of CPU bytes allocated and not yet freed during the profiled region."""
    records = []
    pending = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while pending:  # pre-order walk, so records with equal timestamps keep the order they were made in
        node = pending.pop()
        pending.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            records.append(node)
    records.sort(key=lambda node: node.start_time_ns)

    live: dict[int, int] = {}  # address → bytes, blocks allocated during the region and not yet freed
    current = peak = 0
    for node in records:
        size, address = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size > 0:
            current += size - live.pop(address, 0)  # an address holds one block: a reuse means a free went unseen
            live[address] = size
            peak = max(peak, current)
        else:
            current -= live.pop(address, 0)  # frees of blocks allocated before the region are not ours
    return peak
