"""The process-wide settings ``import betty_trainer`` makes before torch loads: the OpenMP threads' wait policy,
torch's CPU allocator's huge pages and the CUDA caching allocator's expandable segments. Each is an environment
variable the user may set first, which is then left as it is. This module imports no torch
(``betty_trainer/__init__.py`` runs it before anything that does).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
"""The environment variable torch's CPU allocator reads once, at the process's first CPU allocation: ``1`` backs
allocations of 2 MiB or more with transparent huge pages (``madvise(MADV_HUGEPAGE)`` on 2 MiB-aligned memory, Linux
only)."""

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The environment variable PyTorch's CUDA caching allocator reads its settings from when CUDA initialises."""
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"
"""The newer name of :data:`ALLOC_CONF` (recent PyTorch reads either); a user who set it is left alone too."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""What :func:`expandable_cuda_segments` sets :data:`ALLOC_CONF` to when the user has set neither variable."""

WAIT_POLICY = "OMP_WAIT_POLICY"
"""The environment variable every OpenMP runtime reads once, when it loads: ``PASSIVE`` puts a thread to sleep when
its parallel region ends, where the default spins for a while first."""

_TORCH_FIRST = "torch" in sys.modules and WAIT_POLICY not in os.environ
"""Whether torch (and its OpenMP runtime) was loaded before ``import betty_trainer`` with no wait policy set: then
:func:`passive_openmp` came too late for torch's runtime (:func:`warn_spinning_openmp`)."""


_ALLOCATOR_TOO_LATE = False
"""Whether CUDA was initialised before ``import betty_trainer`` with neither allocator variable set, so that
:func:`expandable_cuda_segments` came too late (:func:`warn_default_allocator`)."""


def configure_process() -> None:
    """Make this module's settings (:func:`passive_openmp`, :func:`use_huge_pages`, :func:`expandable_cuda_segments`);
    ``import betty_trainer`` calls it first, the package's one import-time effect beyond definitions, deliberate: no
    later point comes before torch loads, before the process's first tensor and before CUDA initialises."""
    passive_openmp()
    use_huge_pages()
    expandable_cuda_segments()


def passive_openmp() -> str:
    """Let OpenMP threads sleep when a parallel region ends, unless the user chose: sets ``OMP_WAIT_POLICY=PASSIVE``
    when it is unset.

    A betty_trainer process runs two OpenMP runtimes, each with a pool of one thread per core: torch's (its bundled
    ``libgomp``, for its CPU operators and MKL) and numba's (``libgomp`` of the system, for the compiled kernels:
    keyed dropout, the sparse aggregation, sampling). With the default policy each pool's threads spin after every
    parallel region, so on a machine with few cores the two pools spin against each other and against the thread
    doing the work. Measured on 2 cores, 20 steps of each in fresh processes (one process CPU time per step):
    GAT on Cora (heads 4, hidden 64) took 0.047–0.93 s a step with the default policy, process to process (bimodal:
    some processes spin at 0.83–0.93 s throughout), and 0.042–0.044 s with ``PASSIVE``; full-batch GraphSAGE on
    Amazon Computers 0.094–0.37 s against 0.071–0.085 s (``benchmarks/README.md`` › openmp_wait.py). A sleeping
    thread takes a few microseconds more to wake for the next region. Each runtime reads the variable when it
    loads (torch's at ``import torch``), so this has no effect on torch's runtime in a process that imported torch
    before betty_trainer (:func:`warn_spinning_openmp` says so); set ``OMP_WAIT_POLICY`` yourself (``ACTIVE`` keeps
    the spinning) to choose.

    Returns:
        The variable's value in effect.
    """
    return os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def warn_spinning_openmp() -> None:
    """Warn, once per process, where torch was imported before betty_trainer without ``OMP_WAIT_POLICY`` set, so that
    torch's OpenMP threads spin (:func:`passive_openmp`): ``train`` calls it."""
    global _TORCH_FIRST
    if _TORCH_FIRST:
        _TORCH_FIRST = False
        logger.warning("torch was imported before betty_trainer, so its OpenMP threads spin after every operator and "
                       "compete with numba's (steps can run several times slower on few cores): import betty_trainer "
                       "first, or set OMP_WAIT_POLICY=PASSIVE before starting Python")


def use_huge_pages() -> str:
    """Ask torch's CPU allocator for transparent huge pages in this process, unless the user chose: sets
    ``THP_MEM_ALLOC_ENABLE=1`` when it is unset.

    torch's CPU allocator takes every tensor from ``malloc`` and hands it back on free, and glibc maps a large
    block afresh each time (above its mmap threshold, and after ``malloc_trim``), so each step's large tensors
    page-fault in 4 KiB pages the kernel zeroes one by one. With huge pages a 2 MiB page takes one fault: a full-batch
    GraphSAGE step on Amazon Computers (one thread) went from 0.151 to 0.123 s, with the same peak resident memory
    (``benchmarks/README.md`` › versus_dgl.py with huge pages). It changes no tensor and no byte the estimator counts.
    torch reads the variable once, at the process's first CPU allocation (of any size, torch 2.13), so it has no
    effect in a process that made a CPU tensor before importing betty_trainer; it has none either where the kernel's
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``. Set ``THP_MEM_ALLOC_ENABLE=0`` before starting
    to keep 4 KiB pages.

    Returns:
        The variable's value in effect.
    """
    return os.environ.setdefault(HUGE_PAGES, "1")


def expandable_cuda_segments() -> str | None:
    """Ask PyTorch's CUDA caching allocator for expandable segments in this process, unless the user chose: sets
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither it nor ``PYTORCH_ALLOC_CONF`` is set and CUDA
    is not initialised yet.

    The allocator reads the variable once, when CUDA initialises; after that a change has no effect, so none is made
    (``train`` on CUDA warns: :func:`warn_default_allocator`) and the default allocator stays, with the planner's
    larger margin for it (:func:`betty_trainer.memory.device.allocator_margin`). With expandable segments the
    allocator maps memory in pages into a range it can grow instead of caching segments of fixed sizes, PyTorch's
    documented remedy for fragmentation when allocation sizes change from step to step (PyTorch docs › CUDA
    semantics › Optimizing memory usage with ``PYTORCH_CUDA_ALLOC_CONF``), as micro-batches' do. Measured on an H200
    (torch 2.11, 2026-11-27): with the default allocator, one products-scale epoch at K = 10 reserved up to 2.3× the
    1.18 GiB its micro-batches allocated, because each micro-batch's differently sized blocks took new segments
    (``benchmarks/README.md`` › GPU checks on an H200). Set by import, not by ``train``: a program that
    touches CUDA before calling ``train`` (a notebook, a benchmark measuring first) would otherwise get the default
    allocator. To keep it, set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`` (or any other setting) before
    ``import betty_trainer``, or ``PYTORCH_ALLOC_CONF`` at any time before CUDA starts: PyTorch reads it before
    ``PYTORCH_CUDA_ALLOC_CONF`` (``c10/core/AllocatorConfig.h``), and so does the margin
    (:func:`allocator_setting`). Child processes inherit the variable.

    Returns:
        The setting in effect (``None``: PyTorch's defaults).
    """
    if ALLOC_CONF in os.environ or ALLOC_CONF_NEW in os.environ:
        return allocator_setting()
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        global _ALLOCATOR_TOO_LATE
        _ALLOCATOR_TOO_LATE = True
        return None
    os.environ[ALLOC_CONF] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


def allocator_setting() -> str | None:
    """The caching allocator's settings as this process's environment gives them, in PyTorch's order
    (``c10/core/AllocatorConfig.h``: ``PYTORCH_ALLOC_CONF`` first, ``PYTORCH_CUDA_ALLOC_CONF`` for backward
    compatibility), or ``None`` for PyTorch's defaults. Read from the environment: a variable changed after CUDA
    initialised is reported though the allocator never read it."""
    return os.environ.get(ALLOC_CONF_NEW, os.environ.get(ALLOC_CONF))


def warn_default_allocator(device_type: str) -> None:
    """Warn, once per process, where a run trains on CUDA but CUDA was initialised before ``import betty_trainer``
    with no allocator setting, so the default allocator runs and the planner keeps its larger margin
    (:func:`expandable_cuda_segments`): ``train`` calls it."""
    global _ALLOCATOR_TOO_LATE
    if _ALLOCATOR_TOO_LATE and device_type == "cuda":
        _ALLOCATOR_TOO_LATE = False
        logger.warning("CUDA was initialised before betty_trainer was imported, so the CUDA caching allocator runs "
                       "without expandable segments and the plan keeps the default allocator's larger margin of "
                       "the budget free for its fragmentation: import betty_trainer before touching CUDA, or set "
                       "%s=%s before starting "
                       "Python", ALLOC_CONF, EXPANDABLE_SEGMENTS)
