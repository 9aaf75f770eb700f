"""The memory of a training step recorded from the code that runs it, and the closed form fitted to recordings
(issue 24, docs/design.md › Memory estimate).

:class:`Recorder` runs a step (forward, loss, backward, optimizer step: whatever callable it is handed) on fake
tensors (``FakeTensorMode``: shapes, dtypes and storages, no data, no compute) under a recording
``TorchDispatchMode``. Every operator output whose storage is new is an allocation of ``storage.nbytes()`` bytes;
a ``weakref`` callback on that storage (storages keep their Python object while the tensor lives, so the callback
fires when the last tensor or view on it dies: autograd's saved tensors, gradients and optimizer temporaries
included) records its free, as ``torch.distributed._tools.mem_tracker.MemTracker`` does. A Python number passed where
an operator takes a tensor (``x / 3.0``) adds the 0-dim tensors PyTorch makes of it around the operator
(:func:`_wrapped_number_bytes`), which are no operator's output. On fake tensors (a tensor
subclass) the autograd engine sums a tensor's gradients out of place; on real ones it adds in place into the first
where it holds the only reference: the recording makes that sum in place as the engine would
(:meth:`_Recording._sums_in_place`). Replaying the
allocations and frees in order gives the step's peak: the quantity :func:`estimator.measure.measure_peak` measures
on the CPU (bytes requested from torch's CPU allocator, one request per storage).

:func:`solve` turns recordings of one model at a few sizes into a :class:`RecordedModel`'s moments: each allocation's bytes
solved exactly as an integer linear function of the micro-batch's counts (no least squares: a recording more than
the unknowns must agree to the byte), and the peak as the maximum, over the moments right after an allocation,
of the bytes live then: a maximum of linear functions of the counts, evaluated per candidate micro-batch without
recording again.

Exact where every allocation goes through PyTorch's dispatcher and its bytes are linear in the counts. Not
covered, and refused with a :class:`RecordingRefused` that names the cause in one line: data-dependent shapes
(``unique``, ``nonzero``, boolean masks, ``repeat_interleave`` without ``output_size``), sorts of a tensor of
several dimensions (a buffer inside the operator per thread; a one-dimensional sort's is counted, :data:`_SORTS`),
tensor values read by the model (``.item()``, ``.tolist()``, ``.numpy()`` for a numba kernel), and allocation
sequences or sizes that
change with the counts in another way, as far as the recorded sizes show: a branch on a size threshold larger
than they are (e.g. work split into chunks past a million elements) is not caught. Not seen at all: scratch
memory a CPU kernel allocates inside one operator and frees before returning (the profiler sees it; the recorder
only operator outputs), a storage an operator grows in place (``resize_`` of an ``out=`` tensor), and memory
allocated outside torch (``malloc`` in MKL or numba); CPU requests are not rounded (a CUDA caching allocator
rounds to 512 bytes: not modelled here).

Private PyTorch API: ``torch._subclasses.fake_tensor.FakeTensorMode``, ``torch.utils._python_dispatch``,
``torch._C._current_autograd_node``, ``torch._C._storage_Use_Count`` and the name of the engine's Python entry
(``torch.autograd.graph._engine_run_backward``); the recorder is tested on the torch versions in :data:`TESTED_TORCH` and
refuses others.

This module never imports ``betty_trainer``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from estimator.counts import LayerCounts, block_structure_bytes

TESTED_TORCH = ("2.11", "2.13")  # major.minor versions whose FakeTensorMode the recorder is tested with
# BETTY_RECORDER_TRY_TORCH=<major.minor> of the running torch lets the recorder run there, to test a version before it
# joins TESTED_TORCH (benchmarks/device_checks.sh tries the device's)


class RecordingRefused(ValueError):
    """The step cannot be recorded exactly; the message names why in one line."""


@dataclass(frozen=True)
class Recording:
    """The allocations of one recorded step, in order.

    Attributes:
        ops: per allocation, the ATen operator that made it (e.g. ``"aten.mm.default"``).
        nbytes: per allocation, its storage's ``nbytes()`` (bytes).
        events: ``+i + 1`` for allocation ``i``, ``-(i + 1)`` for its free, in the order they happened; an
            allocation still live when the step returned has no free.
        marks: ``(position, name, value)`` per named moment of a piece's recording (:meth:`Recorder.record_piece`):
            the moment came before ``events[position]`` (after every event, at ``len(events)``); ``value``: an
            integer the harness noted there (a count at this size), or ``None``.
    """

    ops: tuple[str, ...]
    nbytes: tuple[int, ...]
    events: tuple[int, ...]
    marks: tuple[tuple[int, str, int | None], ...] = ()

    @property
    def peak_bytes(self) -> int:
        """Most bytes live at once during the step, counting only what the step allocated."""
        current = peak = 0
        for event in self.events:
            current += self.nbytes[abs(event) - 1] if event > 0 else -self.nbytes[-event - 1]
            peak = max(peak, current)
        return peak

    def same_sequence(self, other: Recording) -> bool:
        """Whether ``other`` made the same operators' allocations and frees in the same order, at the same named
        moments (sizes aside)."""
        return (self.ops == other.ops and self.events == other.events
                and [mark[:2] for mark in self.marks] == [mark[:2] for mark in other.marks])


class _Recording(TorchDispatchMode):
    """Records the operators' new storages and, by weakref callbacks, their frees (see the module)."""

    def __init__(self, reads_refused: Callable[[], str | None]):
        super().__init__()
        self.reads_refused = reads_refused
        self.ops: list[str] = []
        self.nbytes: list[int] = []
        self.events: list[int] = []
        self.known: dict[int, weakref.ref] = {}  # id(storage) → weak reference, for the storages recorded
        self._indices: dict[int, int] = {}  # id(storage) → its allocation's index
        self._moved: list[weakref.ref] = []  # references whose storage's death frees nothing (its sum took over)
        self.marks: list[tuple[int, str, int | None]] = []
        self.paused = False
        self.called: dict[Any, str] = {}  # operators whose calls are marked (PieceScope.mark_calls), with the mark
        self.watched: list[weakref.ref] = []  # PieceScope.watch's references (their callbacks mark the deaths)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:  # the harness's own tensors (PieceScope.unrecorded)
            return func(*args, **(kwargs or {}))
        if func in self.called:
            self.marks.append((len(self.events), self.called[func], None))
        if func in _SORTS and sum(n != 1 for n in args[0].shape) > 1:
            raise RecordingRefused(f"{func} of a tensor of several dimensions allocates buffers inside the operator "
                                   "that depend on its threads, which the recorder does not see")
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(t), int(t): no data to read
            node = torch._C._current_autograd_node()  # the backward node running, if any
            where = f"the backward of {node.name()}" if node is not None else self.reads_refused()
            if where is not None:
                raise RecordingRefused(f"{where} reads a tensor's value (.item(), .tolist(), int(t), if t: ...), "
                                       "which a recording without data cannot follow")
            return True if args[0].dtype == torch.bool else 1  # a finite loss, a first optimizer step
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        out = func(*args, **(kwargs or {}))
        if self._sums_in_place(func, args, kwargs):
            self._take_over(args[0].untyped_storage(), out.untyped_storage())
            return out
        tensors = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        scalars = [self._allocated(f"{func} (a Python number as a tensor)", nbytes)
                   for nbytes in _wrapped_number_bytes(func, args, kwargs)]
        for tensor in tensors:
            self._track(tensor.untyped_storage(), str(func), inputs)
        if func in _SORTS:
            scalars.append(self._allocated(f"{func} (its buffer inside the operator)", _SORT_SCRATCH * args[0].numel()))
        self.events.extend(-index - 1 for index in reversed(scalars))
        return out

    def index_of(self, tensor: Tensor) -> int | None:
        """The index of the recorded allocation behind ``tensor``'s storage, or ``None`` (made elsewhere)."""
        return self._index(tensor.untyped_storage())

    def _index(self, storage: torch.UntypedStorage) -> int | None:
        """:meth:`index_of` of a storage (a live one: ``id`` of a dead storage may be reused)."""
        known = self.known.get(id(storage))
        return self._indices[id(storage)] if known is not None and known() is storage else None

    def _sums_in_place(self, func, args: tuple, kwargs: dict | None) -> bool:
        """Whether this is the autograd engine summing two gradients of one tensor into the first, in place, as it
        does on real tensors (``InputBuffer``'s ``accumulate``: ``old.add_(new)`` where it holds the last reference
        to ``old`` and to its storage, which is dense; out of place otherwise). On fake tensors, a tensor subclass,
        the engine always adds out of place (``aten.add.Tensor``), so the recording makes that sum in place itself:
        an ``add`` of two tensors of one shape and dtype called by the engine (no Python code between) with grad mode
        off (not ``create_graph``), whose first is a recorded allocation that is no view, dense and non-overlapping,
        the only tensor on its storage and not the second. Known limit: an ``add`` of two such tensors inside a C++
        backward formula (e.g. ``atan2``'s ``self * self + other * other``) looks the same and is made in place too,
        one temporary under where that moment is the peak; the one-reference test on the tensor itself (the engine's
        ``use_count``) is not visible from Python, so a gradient the engine also holds elsewhere is summed in place
        here and out of place there."""
        if (func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or args[0] is args[1]
                or torch.is_grad_enabled()):  # create_graph: the engine adds out of place
            return False
        old, new = args
        if not (isinstance(old, Tensor) and isinstance(new, Tensor) and old.shape == new.shape
                and old.dtype == new.dtype and self.index_of(old) is not None and not old._is_view()
                and _dense(old)
                and torch._C._storage_Use_Count(old.untyped_storage()._cdata) == 2):
            return False  # 2: the tensor's reference and the one this query makes
        return _called_by_autograd_engine()

    def _take_over(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """``new`` (the out-of-place sum) stands for ``old``'s allocation: ``old``'s death frees nothing, ``new``'s
        frees the allocation."""
        key, index = id(old), self._indices[id(old)]
        self._moved.append(self.known[key])
        self.known[id(new)] = weakref.ref(new, self._freed_by(index))
        self._indices[id(new)] = index

    def _freed_by(self, index: int) -> Callable[[weakref.ref], None]:
        """The weakref callback recording allocation ``index``'s free (unless its storage's sum took it over)."""

        def freed(reference: weakref.ref) -> None:
            if not any(reference is moved for moved in self._moved):
                self.events.append(-index - 1)

        return freed

    def _allocated(self, op: str, nbytes: int) -> int:
        """Record an allocation of ``nbytes`` by ``op`` now; returns its index (its free is the caller's to record)."""
        index = len(self.nbytes)
        self.ops.append(op)
        self.nbytes.append(nbytes)
        self.events.append(index + 1)
        return index

    def _track(self, storage: torch.UntypedStorage, op: str, inputs: set[int]) -> None:
        key = id(storage)
        if key in inputs or self._index(storage) is not None:
            return  # a view, an in-place result or an output seen before
        index = self._allocated(op, storage.nbytes())
        self.known[key] = weakref.ref(storage, self._freed_by(index))
        self._indices[key] = index


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill its storage's span without overlap in some order of its dimensions (what the
    autograd engine asks of a gradient it adds into in place: row-major or any permutation of it)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_TORCH_DIRECTORY = str(Path(torch.__file__).parent)
_SORTS = frozenset({torch.ops.aten.sort.default, torch.ops.aten.sort.stable, torch.ops.aten.sort.values,
                    torch.ops.aten.sort.values_stable})
"""The operators known to allocate a tensor of the step's size inside themselves, freed before they return, which no
operator returns: CPU's sort (``sort``, ``argsort``, ``msort``; stable or not) of ``n`` keys along their one
dimension holds :data:`_SORT_SCRATCH` bytes per key beside its values and int64 positions, whatever the keys' dtype
(measured with the profiler, torch 2.13: ``n · (itemsize + 8 + 8)`` bytes at its peak for float16/32/64, int16/32/64
and bool keys, ``n`` from 1 to 10⁶; ``tests/test_recorder.py``). The recording adds it as an allocation made after
the outputs and freed when the operator returns. Sorting a tensor of several dimensions along one holds a buffer per
row that a thread sorts at once (8 bytes per key of a row for each thread): refused. A CUDA sort's buffer (cub's
radix sort) is another size: not modelled (the recorder records CPU steps)."""

_SORT_SCRATCH = 8
"""Bytes per key that CPU's sort holds inside itself (:data:`_SORTS`)."""


def _called_by_autograd_engine() -> bool:
    """Whether the operator being dispatched was called by the autograd engine itself: the first frame outside
    PyTorch's own Python code, walking out from the dispatch, is the engine's entry (``_engine_run_backward``), not a
    custom ``Function``'s backward or other Python code."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_engine_run_backward":
            return True
        if frame.f_code.co_filename != __file__ and not frame.f_code.co_filename.startswith(_TORCH_DIRECTORY):
            return False
        frame = frame.f_back
    return False


_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_WRAPPING = frozenset({"add", "sub", "mul", "div", "rsub", "remainder"})  # their .Scalar overloads wrap the number too
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})  # and theirs


def _wrapped_number_bytes(func, args: tuple, kwargs: dict | None) -> list[int]:
    """Bytes of the CPU tensors a call makes around ``func`` for the Python numbers it is given, which no operator
    returns: each number becomes a 0-dim tensor of its default dtype (8 bytes for a float or an int), made before the
    operator's output and freed after it, and, where the computation's dtype (``torch.result_type`` of the tensor and
    the number) differs, a copy in that dtype (4 bytes for float32), made inside the operator before its output.
    PyTorch's argument parser makes the first for a number passed where the schema takes a tensor (``x / 3.0`` is
    ``aten.div.Tensor(x, 3.0)``; ``copy_`` then copies without the second); the ``.Scalar`` overloads of the binary
    arithmetic operators and of the comparisons make both themselves for their ``other`` (``1.0 - x`` is
    ``aten.rsub.Scalar``, ``x >= 5`` is ``aten.ge.Scalar``; ``alpha`` is no tensor). Measured with ``torch.profiler``
    (torch 2.13, CPU) on float32, float16, float64, int64 and int32 tensors: ``tests/test_recorder.py``. Adam's
    ``sqrt(v) / bias_correction2_sqrt`` is one of them, where a step whose peak is the optimizer's update puts it.

    Not counted: the number autograd keeps for the backward of ``mul`` and ``div`` by it (8 bytes, freed with the
    backward node, which the dispatcher does not see); the copy an elementwise operator makes of a tensor operand
    whose dtype is not the computation's (``int_tensor / 2`` and ``bool_tensor == 1`` copy the tensor); and the
    numbers of other overloads that wrap them the same way (``remainder.Scalar_Tensor``, ``div.Scalar_mode``,
    ``fmod.Scalar``, the bitwise ``.Scalar`` operators: 12 bytes each on float32)."""
    schema = func._schema
    base = schema.name.split("::")[-1].rstrip("_")
    wraps = func._overloadname == "Scalar" and (base in _WRAPPING or base in _COMPARISONS)
    given = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments
                                                 if kwargs and a.name in kwargs]
    numbers = [value for argument, value in given if type(value) in _NUMBER_DTYPES
               and (isinstance(argument.type, torch._C.TensorType) or (wraps and argument.name == "other"))]
    if not numbers:
        return []
    tensor = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)), None)
    sizes = []
    for value in numbers:
        wrapped = _NUMBER_DTYPES[type(value)]
        sizes.append(wrapped.itemsize)
        computed = torch.result_type(tensor, value) if tensor is not None else wrapped
        if computed != wrapped and base != "copy":
            sizes.append(computed.itemsize)
    return sizes


def check_torch() -> None:
    """Whether the running torch is one the recorder is tested with (:data:`TESTED_TORCH`, or the version
    ``BETTY_RECORDER_TRY_TORCH`` names).

    Raises:
        RecordingRefused: another version (the recorder uses private PyTorch API).
    """
    version = ".".join(torch.__version__.split(".")[:2])
    if version not in TESTED_TORCH and os.environ.get("BETTY_RECORDER_TRY_TORCH") != version:
        raise RecordingRefused(f"the recorder is tested with torch {', '.join(TESTED_TORCH)}, not {torch.__version__}")


class Recorder:
    """A fake-tensor world to record training steps in: ``with Recorder() as recorder:`` make the step's tensors
    with :meth:`fake` and :meth:`fake_module` (or torch factories, which make fake tensors inside the block), then
    :meth:`record` the step.

    Raises:
        RecordingRefused: on entering, under a torch version not in :data:`TESTED_TORCH` (unless
            ``BETTY_RECORDER_TRY_TORCH`` names it).
    """

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> Recorder:
        check_torch()
        self._scope.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # an address is never used
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # logs the errors a refusal names anyway
        self._scope.callback(fake_log.setLevel, fake_log.level)
        fake_log.setLevel(logging.CRITICAL)
        self._scope.enter_context(self.mode)
        return self

    def __exit__(self, *exc: object) -> None:
        self._scope.close()

    def fake(self, tensor: Tensor, device: torch.device | str | None = None) -> Tensor:
        """A fake tensor with ``tensor``'s shape, dtype and strides (no data), on ``tensor``'s device or on
        ``device`` (a meta tensor's fake on the CPU, say)."""
        if device is None or tensor.device == torch.device(device):
            return self.mode.from_tensor(tensor, static_shapes=True)
        with self.mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)

    def fake_module(self, module: nn.Module, device: torch.device | str | None = None) -> nn.Module:
        """A copy of ``module`` whose parameters and buffers are fake (tied ones stay tied; no real tensor is
        copied), on their devices or on ``device``; anything else is deep-copied."""
        memo: dict[int, Any] = {}
        for parameter in module.parameters():
            memo[id(parameter)] = nn.Parameter(self.fake(parameter.detach(), device), parameter.requires_grad)
        for buffer in module.buffers():
            memo[id(buffer)] = self.fake(buffer, device)
        return copy.deepcopy(module, memo)

    def record(self, step: Callable[[], object], reads_refused: Callable[[], str | None] = lambda: None) -> Recording:
        """Run ``step()`` once on fake tensors and return what it allocated and freed.

        A read of a tensor's value returns ``True`` for a bool and ``1`` otherwise (a loss checked finite, an
        optimizer's step count), unless it happens in backward or ``reads_refused()`` names the code running
        (e.g. ``"the forward of M"``).

        Raises:
            RecordingRefused: a refused read, a data-dependent output shape, an operator fake tensors do not
                support, or any exception of the step (data asked of a fake tensor by ``.numpy()``: a kernel
                outside the dispatcher; or a bug, which calibration then names); the message names the operator
                or the exception.
        """
        recording = _Recording(reads_refused)
        _run(recording, step)
        return Recording(tuple(recording.ops), tuple(recording.nbytes), tuple(recording.events))

    def record_piece(self, piece: Callable[[PieceScope], object]) -> Recording:
        """Run ``piece(scope)`` once on fake tensors and return what it allocated and freed, with the moments it
        named (:attr:`Recording.marks`): a piece of a step (one layer's forward and backward, say) whose inputs,
        output and gradients the harness makes and lets go of through ``scope`` (:class:`PieceScope`). A read of
        a tensor's value is refused wherever it happens.

        Raises:
            RecordingRefused: as :meth:`record`.
        """
        recording = _Recording(lambda: "the piece")
        _run(recording, lambda: piece(PieceScope(recording)))
        return Recording(tuple(recording.ops), tuple(recording.nbytes), tuple(recording.events), tuple(recording.marks))


class PieceScope:
    """What :meth:`Recorder.record_piece`'s harness uses: tensors made without recording them, named moments, and
    the moment a storage the harness made dies."""

    def __init__(self, recording: _Recording):
        self._recording = recording

    @contextlib.contextmanager
    def unrecorded(self):
        """Operators run in this block are not recorded (the harness's inputs, seeds and seams); frees of recorded
        storages still are."""
        paused, self._recording.paused = self._recording.paused, True
        try:
            yield
        finally:
            self._recording.paused = paused

    def mark(self, name: str, value: int | None = None) -> None:
        """The moment ``name``, now, with an integer noted there (e.g. a loop's count at this size)."""
        self._recording.marks.append((len(self._recording.events), name, value))

    def mark_calls(self, operators: Sequence[Any], name: str) -> None:
        """Mark ``name`` wherever one of ``operators`` (``OpOverload`` objects) is called from now on."""
        self._recording.called.update(dict.fromkeys(operators, name))

    def watch(self, tensor: Tensor, name: str) -> None:
        """Mark ``name`` when ``tensor``'s storage dies (the last tensor or view on it, saved ones included)."""
        self._recording.watched.append(weakref.ref(tensor.untyped_storage(), lambda _: self.mark(name)))

    def index_of(self, tensor: Tensor) -> int | None:
        """The index of the recorded allocation behind ``tensor``'s storage (``None``: not made in the piece)."""
        return self._recording.index_of(tensor)


def _run(recording: _Recording, step: Callable[[], object]) -> None:
    """``step()`` under ``recording``, what it raises named as :meth:`Recorder.record` says."""
    try:
        with recording:
            step()
    except RecordingRefused:
        raise
    except DynamicOutputShapeException as error:
        raise RecordingRefused(f"{error.func} has an output shape that depends on the data") from None
    except DataDependentOutputException as error:
        raise RecordingRefused(f"{error.func} reads tensor data") from None
    except UnsupportedOperatorException as error:
        raise RecordingRefused(f"{error.func} has no fake-tensor implementation") from None
    except Exception as error:  # noqa: BLE001 - whatever the step raises on fake tensors is named
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecordingRefused(f"the step failed on fake tensors ({type(error).__name__}: {first}); does it "
                               "compute outside PyTorch's operators (.numpy(), a numba or C kernel)?") from None


def distinct_storage_bytes(tensors: Sequence[Tensor]) -> int:
    """Total ``nbytes`` of the distinct storages behind ``tensors`` (bytes; fake ones included, told apart by
    storage identity, not by address: every fake storage is at address 0)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


RECORDINGS_KEPT = 64
"""Recordings a process keeps per cache (:class:`KeptRecordings`): a sweep over many model configurations in one
process holds at most this many of each kind."""

R = TypeVar("R")


class KeptRecordings(Generic[R]):
    """Recordings kept for the process by key, each made once while it is among the ``kept`` most recently used
    (the least recently used dropped first), so that a long process that meets many configurations keeps a bounded
    number: the cache of ``betty_trainer.memory.recorded.record_model`` and of
    ``betty_trainer.models.recorded_terms.model_terms``.

    Args:
        kept: the most recordings kept, ≥ 1.

    Raises:
        ValueError: ``kept < 1``.
    """

    def __init__(self, kept: int = RECORDINGS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"kept must be at least 1, got {kept}")
        self.kept = kept
        self._items: OrderedDict[Hashable, R] = OrderedDict()  # in order of use, the most recent last

    def get(self, key: Hashable, record: Callable[[], R]) -> R:
        """The recording of ``key``, made by ``record()`` where it is not kept (dropping the least recently used
        where ``kept`` are); now the most recently used. Whatever ``record`` raises propagates, nothing kept."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        recording = record()
        while len(self._items) >= self.kept:
            self._items.popitem(last=False)
        self._items[key] = recording
        return recording

    def clear(self) -> None:
        """Drop every recording (the next :meth:`get` of any key records)."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def counts_vector(layers: Sequence[LayerCounts]) -> tuple[int, ...]:
    """``(1, S_0, D_0, E_0, D_1, E_1, …)``: the counts the closed form is linear in. A layer's src count is the
    previous layer's dst count (``S_{l+1} = D_l``: blocks chain), so only the input layer's is its own."""
    return (1, layers[0].num_src, *(n for c in layers for n in (c.num_dst, c.num_edges)))


@dataclass(frozen=True, eq=False)  # compared by identity: numpy arrays have no single truth value
class RecordedModel:
    """A model's recorded step as a closed form: per moment that may be the peak, the bytes live then as integer
    coefficients of :func:`counts_vector` (see the module).

    Attributes:
        num_layers: blocks the model takes.
        resident_bytes: bytes live before a step, block structure aside: parameters, buffers, optimizer state and
            the earlier micro-batches' gradients (a batch's later micro-batches hold them).
        first_saving_bytes: bytes of the gradients a batch's first micro-batch does not hold before its step.
        accumulating: ``(moments, 2L + 2)`` int64: a later micro-batch's step, with the gradients resident.
        first: the same for a batch's first micro-batch, which allocates the gradients in its backward.
        allocations: allocations per recorded step (both kinds of step; for reports).
        weighted: per block (input layer first), whether the recorded blocks carried ``(E,)`` float32 edge weights
            (LABOR, GNS and LADIES batches do): a step on blocks weighted otherwise runs other operators, so the
            closed form holds only for micro-batches of this pattern.
    """

    num_layers: int
    resident_bytes: int
    first_saving_bytes: int
    accumulating: np.ndarray
    first: np.ndarray
    allocations: int
    weighted: tuple[bool, ...]

    def step_bytes(self, layers: Sequence[LayerCounts], accumulate: bool = True) -> int:
        """Peak bytes the step adds above the resident bytes and the block structure.

        Raises:
            ValueError: if the number of layers differs from the model's, or the blocks' edge weights from the
                recorded ones' (:attr:`weighted`).
        """
        if len(layers) != self.num_layers:
            raise ValueError(f"the micro-batch has {len(layers)} layers but the model was recorded with {self.num_layers}")
        if tuple(layer.weighted for layer in layers) != self.weighted:
            raise ValueError(f"the micro-batch's blocks carry edge weights {[layer.weighted for layer in layers]}, "
                             f"the recorded ones {list(self.weighted)}: record the model with that pattern")
        moments = self.accumulating if accumulate else self.first
        return max(0, int((moments @ np.array(counts_vector(layers), dtype=np.int64)).max()))

    def estimate(self, layers: Sequence[LayerCounts], accumulate: bool = True) -> int:
        """Peak bytes of a training step of the micro-batch with counts ``layers`` (input layer first), as
        :func:`estimator.measure.measure_peak` measures it on the CPU: resident + block structure + step, less
        ``first_saving_bytes`` for a batch's first micro-batch (``accumulate=False``).

        Raises:
            ValueError: as :meth:`step_bytes`.
        """
        resident = self.resident_bytes - (0 if accumulate else self.first_saving_bytes)
        return resident + block_structure_bytes(layers) + self.step_bytes(layers, accumulate)


def recording_sizes(num_layers: int, weighted: Sequence[bool] = ()) -> list[list[LayerCounts]]:
    """The sizes a model is recorded at: a base, the base with each count of :func:`counts_vector` one larger
    (what solves the coefficients), and the base doubled (what checks them). Every count is distinct from the
    others (``D_l < S_l``, no count 0 or 1), so no size takes a branch the others do not. ``weighted``: per block,
    whether it carries edge weights (none by default)."""
    dst = [5 * 3 ** (num_layers - 1 - layer) + 2 for layer in range(num_layers)]  # 7 at the output, ×3 per layer in
    base = [3 * dst[0] + 4] + [value for layer in range(num_layers) for value in (dst[layer], 4 * dst[layer] + 3)]
    bumped = [base[:index] + [value + 1] + base[index + 1:] for index, value in enumerate(base)]
    pattern = tuple(weighted) or (False,) * num_layers
    return [_layers(values, pattern) for values in [base, *bumped, [2 * value for value in base]]]


def _layers(values: Sequence[int], weighted: Sequence[bool]) -> list[LayerCounts]:
    """The :class:`LayerCounts` of ``(S_0, D_0, E_0, D_1, E_1, …)``, block ``l`` edge-weighted where ``weighted[l]``."""
    dst, edges = values[1::2], values[2::2]
    src = [values[0], *dst[:-1]]
    return [LayerCounts(s, d, e, weighted=w) for s, d, e, w in zip(src, dst, edges, weighted)]


def solve(recordings: Sequence[Recording], sizes: Sequence[Sequence[LayerCounts]]) -> np.ndarray:
    """The closed form of recordings made at :func:`recording_sizes`: the ``(moments, 2L + 2)`` int64 coefficients
    of the bytes live right after each allocation (duplicate moments dropped).

    Raises:
        RecordingRefused: as :func:`solve_allocations`.
    """
    coefficients = solve_allocations(recordings, np.array([counts_vector(layers) for layers in sizes], dtype=np.int64),
                                     _describe(sizes[-1]))
    live = np.zeros(coefficients.shape[1], dtype=np.int64)
    moments = []
    for event in recordings[0].events:
        live = live + coefficients[event - 1] if event > 0 else live - coefficients[-event - 1]
        if event > 0:
            moments.append(live)
    return np.unique(np.array(moments, dtype=np.int64).reshape(-1, coefficients.shape[1]), axis=0)


def solve_allocations(recordings: Sequence[Recording], vectors: np.ndarray, checked_at: str = "") -> np.ndarray:
    """Each allocation's bytes as an exact integer linear function of the counts: ``(allocations, k)`` int64
    coefficients of recordings made at ``vectors`` ``(k + 1, k)`` (a base whose first entry is the constant 1, the
    base with each later entry one larger in turn, then a check, e.g. the base doubled). Each coefficient is the
    difference a count's +1 makes, and together they must reproduce every recording, the check included, to the byte.

    Raises:
        RecordingRefused: recordings whose operators, order of allocations and frees, or named moments differ, or an
            allocation whose bytes are not an integer linear function of the counts (both name the operator;
            ``checked_at`` describes the check's counts in the message).
    """
    base, *bumped, check = recordings
    for recording in recordings[1:]:
        if not recording.same_sequence(base):
            where = next((f"at {a}" for a, b in zip(recording.ops, base.ops) if a != b), "in the order of frees")
            raise RecordingRefused(f"the step allocates differently at different sizes ({where}): its memory is "
                                   "not a function of the node and edge counts alone")
    nbytes = np.array([r.nbytes for r in recordings], dtype=np.int64)  # (recordings, allocations)
    coefficients, wrong = solve_linear(nbytes, vectors)
    if wrong is not None:
        raise RecordingRefused(f"{base.ops[wrong]} allocates bytes that are not linear in the node and edge "
                               f"counts ({nbytes[-1, wrong]} bytes at {checked_at or tuple(vectors[-1])})")
    return coefficients


def solve_linear(values: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Integer coefficients ``(n, k)`` int64 of ``n`` integer quantities (bytes, or a loop's items) measured at
    :func:`solve_allocations`' ``vectors`` (``values``: ``(k + 1, n)`` int64), and the first quantity they do not
    reproduce (``None``: all, to the unit)."""
    coefficients = np.empty((values.shape[1], vectors.shape[1]), dtype=np.int64)
    coefficients[:, 1:] = (values[1:-1] - values[0]).T
    coefficients[:, 0] = values[0] - coefficients[:, 1:] @ vectors[0, 1:]
    wrong = np.nonzero((vectors @ coefficients.T != values).any(axis=0))[0]
    return coefficients, (int(wrong[0]) if wrong.size else None)


def _describe(layers: Sequence[LayerCounts]) -> str:
    return "src/dst/edges per layer " + ", ".join(f"{c.num_src}/{c.num_dst}/{c.num_edges}" for c in layers)
