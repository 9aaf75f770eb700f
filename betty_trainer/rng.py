"""Counter-based randomness: random numbers that are pure functions of a key and an id.

Every random choice the trainer makes that must not depend on how work is split
(dropout masks per node, sampled neighbours per dst node, LABOR's per-vertex
variates) comes from here rather than from a generator's stream: the value drawn
for id ``i`` under key ``(seed, epoch, step, …)`` is the same whether ``i`` is
processed alone, in a micro-batch, in a different order or on another rank.
The mixing function is MurmurHash3's 32-bit finaliser (Appleby, MurmurHash3,
``fmix32``), applied to int64 tensors holding 32-bit values, so it runs with
plain tensor ops on any device.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np
import torch
from torch import Tensor

try:
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def mix32(x: Tensor | int) -> Tensor | int:
    """MurmurHash3's 32-bit finaliser on values in ``[0, 2³²)`` held in int64 (tensor or int).

    Returns:
        Same type as ``x``; tensors keep their shape and device, dtype int64.
    """
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def mix_key(seed: int | Tensor, *parts: int | Tensor) -> int | Tensor:
    """Fold a seed (up to 64 bits) and non-negative integer parts (each up to 64 bits) into one 32-bit key.

    Any of them may be an int64 tensor (values below 2⁶³), the keys of several batches at once (the bulk
    samplers); tensors broadcast.

    Returns:
        An int in ``[0, 2³²)``, or an int64 tensor of such keys when an argument is a tensor; different part
        sequences give unrelated keys.
    """
    key = mix32((seed & MASK32) ^ 0x3C6EF372)
    for part in (seed >> 32, *(half for p in parts for half in (p & MASK32, p >> 32))):
        key = mix32(key ^ (part & MASK32))
        key = (key + _GOLDEN) & MASK32
    return key


def hash_ids(key: int | Tensor, ids: Tensor) -> Tensor:
    """One 32-bit hash per id under ``key``.

    Args:
        key: a 32-bit key from :func:`mix_key`, or an int64 tensor of such keys broadcasting with ``ids``
            (one key per id: the bulk sampler hashes the rows of several batches at once).
        ids: any-shape int64 (or int32) ids, e.g. global node ids.

    Returns:
        int64 tensor like ``ids``, values in ``[0, 2³²)``.
    """
    ids = ids.long()
    return mix32(mix32((ids & MASK32) ^ key) ^ ((ids >> 32) & MASK32))


def uniforms(key: int | Tensor, ids: Tensor) -> Tensor:
    """``(hash + ½) / 2³²`` of each id under ``key`` (:func:`hash_ids`): float64 in ``(0, 1)``, never 0 or 1
    (callers take logs), shaped like ``ids``."""
    return (hash_ids(key, ids).double() + 0.5) * (1.0 / 2**32)


# ---------------------------------------------------------------- the same hashes in numba kernels (CPU)


def jit(function=None, **options):
    """numba's ``njit`` (compiled on first call, cached on disk) when numba is installed, else the plain
    Python function (correct, slow). The CPU kernels of sampling and dropout are built with it."""
    if function is None:
        return lambda f: jit(f, **options)
    return function if numba is None else numba.njit(cache=True, nogil=True, **options)(function)


_TENSOR_PATH = contextvars.ContextVar("tensor_path", default=False)


def compiled_kernels(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the compiled CPU kernels (keyed dropout; the sparse aggregation's CSR product and its
    transpose; the segment max) run on tensors of this device and dtype: CPU, float32, numba
    installed, outside :func:`tensor_path`. Elsewhere the same results come from tensor ops (which also run on
    GPUs)."""
    return (numba is not None and not _TENSOR_PATH.get() and torch.device(device).type == "cpu"
            and dtype == torch.float32)


@contextlib.contextmanager
def tensor_path():
    """Inside the block (this thread or task), :func:`compiled_kernels` is false everywhere: the CPU runs the tensor
    ops a GPU runs (how the memory recorder records a GPU's path: ``betty_trainer.models.recorded_terms``)."""
    token = _TENSOR_PATH.set(True)
    try:
        yield
    finally:
        _TENSOR_PATH.reset(token)


_U32 = np.uint64(MASK32)


@jit(inline="always")
def mix32_scalar(x):
    """:func:`mix32` on one ``np.uint64`` (inside numba kernels)."""
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & _U32
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & _U32
    return x ^ (x >> np.uint64(16))


@jit(inline="always")
def mix32_u32(x):
    """:func:`mix32` on one ``np.uint32`` (inside numba kernels): the same bits as :func:`mix32_scalar`, in 32-bit
    arithmetic (each product cast back to ``uint32``, as numba widens it), which LLVM can vectorise where 64-bit
    products cannot be (no 64-bit lane multiply in AVX2)."""
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x85EBCA6B))
    x = np.uint32(x ^ (x >> np.uint32(13)))
    x = np.uint32(x * np.uint32(0xC2B2AE35))
    return np.uint32(x ^ (x >> np.uint32(16)))


@jit(inline="always")
def hash_id_scalar(key, node):
    """:func:`hash_ids` for one non-negative id (inside numba kernels); ``np.uint64`` in ``[0, 2³²)``."""
    v = np.uint64(node)
    return mix32_scalar(mix32_scalar((v & _U32) ^ np.uint64(key)) ^ ((v >> np.uint64(32)) & _U32))


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (numpy ``SeedSequence``), e.g. ``(seed, epoch)``."""
    return int(np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))
