"""Dropout keyed by node: masks from a counter-based hash, identical for a node in every micro-batch.

Betty §4.2 argues micro-batch training equals full-batch training; with ordinary
dropout it does not (a node seen by two micro-batches gets two masks, and the RNG
stream depends on the split). Here the mask of element ``(node, feature)`` in
layer ``l`` at step ``t`` is a pure function of ``(seed, t, l, node, feature)``,
so any split of a batch into micro-batches computes exactly the same function.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from betty_trainer.models.chunks import chunks
from betty_trainer.models.operators import kernel_operator
from betty_trainer.rng import (
    MASK32,
    compiled_kernels,
    hash_id_scalar,
    hash_ids,
    jit,
    mix32,
    mix32_scalar,
    mix32_u32,
    mix_key,
    numba,
)

MASK_CHUNK_ELEMENTS = 1 << 16  # elements hashed at once by NodeDropout (1 MiB of int64 transients)
_COLUMN_MULTIPLIER = 0x9E3779B1  # spreads feature indices before their hash


def keyed_bits(seed: int, step: int, layer: int, node_ids: Tensor, num_features: int) -> Tensor:
    """24 random bits per ``(node, feature)`` that depend only on ``(seed, step, layer, node, feature)``.

    The key is mixed into one 32-bit hash per node row and one per feature column
    (MurmurHash3 finaliser), and every element is the finaliser of ``row ⊕ column``,
    computed in place so the ``(N, F)`` work is a handful of passes.

    Args:
        seed, step, layer: non-negative integers keying the stream.
        node_ids: ``(N,)`` int64 global node ids (rows).
        num_features: ``F`` (columns).

    Returns:
        ``(N, F)`` int64 on ``node_ids.device``, uniform on ``[0, 2²⁴)``.
    """
    key = mix_key(seed, step, layer)
    row = hash_ids(key, node_ids)
    col = mix32((torch.arange(num_features, device=node_ids.device) * _COLUMN_MULTIPLIER + key + 1) & MASK32)
    bits = row[:, None] ^ col[None, :]
    bits.bitwise_xor_(bits >> 16)
    bits.mul_(0x85EBCA6B).bitwise_and_(MASK32)
    bits.bitwise_xor_(bits >> 13)
    bits.mul_(0xC2B2AE35).bitwise_and_(MASK32)
    bits.bitwise_xor_(bits >> 16)
    return bits.bitwise_right_shift_(8)


def keyed_uniform(seed: int, step: int, layer: int, node_ids: Tensor, num_features: int) -> Tensor:
    """:func:`keyed_bits` as ``(N, F)`` float32 uniform numbers in ``[0, 1)`` (multiples of 2⁻²⁴)."""
    return keyed_bits(seed, step, layer, node_ids, num_features).to(torch.float32) * (1.0 / (1 << 24))


def apply_keyed_mask(src: Tensor, node_ids: Tensor, seed: int, step: int, layer: int, p: float,
                     inplace: bool = False) -> Tensor:
    """``src ⊙ keep / (1 − p)`` with ``keep = keyed_uniform(…) ≥ p`` (as 24-bit integers), made
    in row chunks of :data:`MASK_CHUNK_ELEMENTS` elements.

    The int64 hash needs 16 bytes per element while it is computed; hashing one chunk
    at a time bounds that transient, and the mask itself never exists whole: beyond
    the result, the memory used is one chunk's hash. On the CPU (float32, numba installed)
    a compiled kernel hashes, masks and scales each element in one pass with no
    temporary at all (:func:`~betty_trainer.rng.compiled_kernels`); both give the same bits.

    The mask is the module's keyed mask (Betty §4.2 made exact under micro-batching;
    see the module docstring), so forward and backward apply the same one.

    Args:
        inplace: write the result over ``src`` (no output tensor is allocated).

    Shapes:
        ``src``: ``(N, F)`` float; ``node_ids``: ``(N,)`` int64 → ``(N, F)`` like ``src``.
    """
    out = src if inplace else torch.empty_like(src)
    threshold = round(p * (1 << 24))
    if compiled_kernels(src.device, src.dtype):
        _keyed_mask(None if inplace else src.detach(), out.detach(), node_ids, mix_key(seed, step, layer), threshold,
                    1.0 / (1.0 - p))
        return out
    for chunk in chunks(src.shape[0], max(1, MASK_CHUNK_ELEMENTS // max(src.shape[1], 1))):
        # the chunk's boolean mask is a temporary of this statement: it dies before the next chunk's hash
        torch.mul(src[chunk], keyed_bits(seed, step, layer, node_ids[chunk], src.shape[1]) >= threshold,
                  out=out[chunk])
        out[chunk].mul_(1.0 / (1.0 - p))
    return out


@jit(parallel=True)
def _keyed_mask_kernel(src, out, node_ids, key, threshold, scale):  # pragma: no cover - compiled
    rows, width = src.shape
    columns = np.empty(width, np.uint32)
    for f in range(width):
        columns[f] = mix32_scalar((np.uint64(f) * np.uint64(_COLUMN_MULTIPLIER) + np.uint64(key) + np.uint64(1))
                                  & np.uint64(MASK32))
    threshold = np.uint32(threshold)
    dropped = np.float32(0.0)
    for r in numba.prange(rows):
        row = np.uint32(hash_id_scalar(key, node_ids[r]))
        for f in range(width):  # 32-bit hashing (mix32_u32): one pass at memory speed
            keep = np.uint32(mix32_u32(np.uint32(row ^ columns[f])) >> np.uint32(8)) >= threshold
            out[r, f] = src[r, f] * (scale if keep else dropped)


_keyed_mask = kernel_operator(
    "keyed_mask(Tensor? src, Tensor(a!) out, Tensor node_ids, int key, int threshold, float scale) -> ()",
    lambda src, out, node_ids, key, threshold, scale: _keyed_mask_kernel(
        out if src is None else src, out, node_ids, key, threshold, np.float32(scale)))


class _KeyedDropout(torch.autograd.Function):
    """Keyed dropout whose backward recomputes the mask from the key instead of keeping it:
    the gradient is the same mask applied to the incoming gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, node_ids: Tensor, seed: int, step: int, layer: int, p: float) -> Tensor:
        ctx.save_for_backward(node_ids)
        ctx.key = (seed, step, layer, p)
        return apply_keyed_mask(h, node_ids, seed, step, layer, p)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (node_ids,) = ctx.saved_tensors
        return apply_keyed_mask(grad, node_ids, *ctx.key), None, None, None, None, None


class NodeDropout(nn.Module):
    """Inverted dropout whose mask is keyed by global node id (see module docstring).

    The mask is never stored: forward makes it chunk by chunk, and backward makes it
    again from the key, so dropout keeps no ``(N, F)`` mask for backward and its
    forward needs only its output beyond the input.

    Args:
        p: drop probability in ``[0, 1)``. Default ``0.5``.

    Shapes:
        ``h``: ``(N, F)``; ``node_ids``: ``(N,)`` int64 → ``(N, F)``.

    The key ``(seed, step)`` is set for the whole model with :func:`set_dropout_key`;
    in eval mode or with ``p == 0`` the module is the identity.

    Raises:
        ValueError: if ``p`` is outside ``[0, 1)``.
    """

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.seed = 0
        self.step = 0

    def forward(self, h: Tensor, node_ids: Tensor, layer: int, inplace: bool = False) -> Tensor:
        """Drop ``h``'s elements by the keyed mask of ``layer``; with ``inplace`` (allowed only when
        ``h`` needs no gradient: input features) ``h`` itself is overwritten and returned."""
        if not self.training or self.p == 0.0:
            return h
        if inplace and not h.requires_grad:
            return apply_keyed_mask(h, node_ids, self.seed, self.step, layer, self.p, inplace=True)
        return _KeyedDropout.apply(h, node_ids, self.seed, self.step, layer, self.p)

    def backward_(self, grad: Tensor, node_ids: Tensor, layer: int) -> Tensor:
        """:meth:`forward`'s backward without autograd, in place on ``grad`` (its output's gradient, ``(N, F)``
        float, of the rows of ``node_ids``, ``(N,)`` int64 global node ids, under layer ``layer``'s key): the same
        keyed mask and scale, as the dropout is diagonal (what ``_KeyedDropout.backward`` computes). Returns
        ``grad``."""
        if not self.training or self.p == 0.0:
            return grad
        return apply_keyed_mask(grad, node_ids, self.seed, self.step, layer, self.p, inplace=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def set_dropout_key(model: nn.Module, seed: int, step: int) -> None:
    """Set the ``(seed, step)`` key of every :class:`NodeDropout` in ``model``; call once per batch."""
    for module in model.modules():
        if isinstance(module, NodeDropout):
            module.seed, module.step = seed, step
