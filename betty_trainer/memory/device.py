"""What a CUDA device holds beyond a training step's own tensors: the BLAS workspaces (measured once per process)
and the caching allocator's fragmentation (a margin off the budget) under the allocator setting in effect (which
``import betty_trainer`` asks to be expandable segments: :func:`betty_trainer.process.expandable_cuda_segments`).

On the CPU both are 0: there is no cuBLAS, and torch's CPU allocator hands freed memory back to ``malloc``, so the
live bytes the estimator models are what the process holds (docs/design.md › Memory estimate).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn import functional as F

logger = logging.getLogger(__name__)

MIB = 2**20
EXPANDABLE_MARGIN = (0.06, 64 * MIB)
"""``(fraction of the budget, floor in bytes)`` kept free for fragmentation with expandable segments."""
DEFAULT_MARGIN = (0.6, 256 * MIB)
"""``(fraction of the budget, floor in bytes)`` kept free for fragmentation with the default (fixed-segment)
allocator."""


def expandable_segments(setting: str | None) -> bool:
    """Whether an allocator ``setting`` (``key:value`` pairs separated by commas) turns expandable segments on."""
    pairs = dict(item.split(":", 1) for item in (setting or "").replace(" ", "").split(",") if ":" in item)
    return pairs.get("expandable_segments", "").lower() == "true"


def allocator_margin(budget: int, device: torch.device, setting: str | None) -> int:
    """Bytes of a budget kept free for the CUDA caching allocator's fragmentation, so that the memory it reserves
    (``torch.cuda.max_memory_reserved``) stays within ``budget`` while the bytes the plan estimates
    (``max_memory_allocated``) stay within ``budget − margin``. 0 on the CPU (no caching allocator in between).

    On CUDA: ``max(floor, fraction × budget)`` with :data:`EXPANDABLE_MARGIN` (6%, at least 64 MiB) when
    ``setting`` turns expandable segments on, else :data:`DEFAULT_MARGIN` (60%, at least 256 MiB).

    How they were chosen (``benchmarks/README.md`` › GPU checks on an H200; H200, torch 2.11,
    2026-11-27). If the allocator reserves up to ``(1 + g)`` times what the step allocates, a step planned at
    ``budget − margin`` keeps the reserved memory within the budget when ``margin ≥ g / (1 + g) × budget``.
    With expandable segments, products-scale epochs at 1, 0.5 and 0.25 of the K = 1 peak (K = 2, 3, 7) and one
    K = 1 epoch under ``budget: auto`` reserved at most 3.8%, 3.8%, 4.0% and 5.0% more than their largest
    micro-batch allocated (g ≤ 0.05: 4.8% of the budget), so 6% keeps a point of headroom; on a 100k-node graph
    the reserved memory was at most 30 MiB above the allocated, under the 64 MiB floor. With the default allocator
    the same epochs reserved 1.53× (K = 4) and 2.30× (K = 10) what they allocated, growing with K as each
    micro-batch's differently sized blocks took new segments: 60% covers the 2.30× seen (g / (1 + g) = 57%),
    not a bound, which is why ``import betty_trainer`` asks for expandable segments
    (:func:`betty_trainer.process.expandable_cuda_segments`). ``micro_batch.safety_margin`` replaces this rule
    with a number.

    Args:
        budget: the budget in bytes.
        device: where training runs.
        setting: the allocator setting (:func:`betty_trainer.process.allocator_setting`).
    """
    if device.type != "cuda":
        return 0
    fraction, floor = EXPANDABLE_MARGIN if expandable_segments(setting) else DEFAULT_MARGIN
    return max(floor, int(budget * fraction))


def device_workspace(device: torch.device | str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the device keeps allocated from a model's first training step on beyond the step's own tensors,
    measured once per process, device and dtype (cached); 0 on the CPU.

    The probe (CUDA): synchronise, drop PyTorch's cuBLAS workspaces where this PyTorch can
    (``torch._C._cuda_clearCublasWorkspaces``) and ``empty_cache``, read ``torch.cuda.memory_allocated``; run one
    ``64 × 64`` ``F.linear`` with bias forward and its backward in ``dtype`` (the built-in layers' matmul, as
    ``addmm``); ``empty_cache`` and read it again. The growth is what stays: PyTorch allocates each BLAS workspace
    through the caching allocator (so it counts in ``memory_allocated`` and in every measured peak) and keeps it
    for the life of the process, one per (BLAS handle, stream). Handles are per thread, and a CUDA backward runs
    on autograd's own device thread, so a training step holds two: the forward's (this thread) and the
    backward's, which is why the probe runs a backward too.

    What it captures, per handle and stream (PyTorch's ``aten/src/ATen/cuda/CublasHandlePool.cpp``):

    - the cuBLAS workspace, of the size ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[:SIZE:COUNT…]`` gives
      (Σ SIZE × COUNT KiB); PyTorch's default is ``:4096:2:16:8`` (8 MiB + 128 KiB), and 32 MiB on compute
      capability 9.x (Hopper; recent releases also on later architectures): the ≈ 64 MiB seen on an H100 is two
      of those;
    - the cuBLASLt workspace, ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024 KiB), where the matmul goes through
      cuBLASLt (``addmm`` with a bias may); recent releases can share the cuBLAS workspace instead.

    To shrink it, set those variables before starting, e.g. ``CUBLAS_WORKSPACE_CONFIG=:16:8`` (128 KiB, the
    setting PyTorch documents for deterministic cuBLAS) and ``CUBLASLT_WORKSPACE_SIZE=0``; some matmuls may
    then pick slower kernels. Not captured: the CUDA context and the kernels' code (outside the caching
    allocator; NVML's free memory, read after the probe, already excludes them) and cuDNN's workspaces (the
    built-in models call no cuDNN op).

    Args:
        device: where training runs.
        dtype: the model's parameter dtype.

    Returns:
        Bytes (``≥ 0``).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe(index, dtype)


@functools.cache
def _probe(index: int, dtype: torch.dtype) -> int:
    device = torch.device("cuda", index)
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # workspaces made earlier in this process count as the probe's own
        clear()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    with torch.enable_grad(), torch.cuda.device(device):
        x, weight = (torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        bias = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
        F.linear(x, weight, bias).sum().backward()  # forward on this thread, backward on autograd's device thread
    del x, weight, bias
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    grown = max(torch.cuda.memory_allocated(device) - before, 0)
    logger.info("device workspace on cuda:%d (%s): %d bytes (cuBLAS/cuBLASLt)", index, dtype, grown)
    return grown
