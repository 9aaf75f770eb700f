"""Message aggregation over a block's in-edges without per-edge feature tensors: weighted sums and
means as one sparse matmul, max with its argmax, attention-weighted sums in edge chunks, LSTM over
in-degree groups, and edge softmax."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from betty_trainer.data.block import Block, BlockTranspose
from betty_trainer.models.chunks import chunks
from betty_trainer.models.lstm import LSTM, lstm_terms
from betty_trainer.models.operators import kernel_operator, tensor_operator
from betty_trainer.models.vectors import (
    LANES,
    SOURCE_KEY,
    add_four_rows,
    add_into_row,
    add_row,
    load_vectors,
    prefetch,
    prefetch_for_write,
    prefetch_to_l2,
    store_vectors,
    vectors,
    zero_vectors,
)
from betty_trainer.rng import compiled_kernels, jit, numba
from estimator.counts import INDEX_BYTES, LOCAL_INDEX_BYTES, SHORT_POSITIONS_MAX_DST, LayerCounts
from estimator.tape import AGG, GRAD, OVER, SharedGradient, StepTape


class _SparseAggregate(torch.autograd.Function):
    """``out = diag(row_scale)·A·diag(col_scale)·h_src + diag(self_scale)·h_src[:num_dst]``, with ``A`` the
    block's ``(num_dst, num_src)`` adjacency holding ``values`` (one per edge, CSC order; ones when ``None``),
    as one sparse-dense matmul. Every scale is optional.

    Nothing of size ``E × F`` is made, and no per-edge float for mean, sum or GCN weighting: a mean is the
    unweighted sum with its rows scaled by ``1/deg`` afterwards. Forward is a CSR SpMM on the block's own CSC
    pointer (a block's CSC over dst is the CSR of ``A``); backward is ``diag(col_scale)·Aᵀ·diag(row_scale)·grad``
    (:func:`_transposed_matmul`: on the CPU a gather on ``Aᵀ``'s CSR where the block keeps it
    (:func:`keep_transposes`), else a scatter along the block's own CSR up to :data:`SCATTER_MAX_WIDTH` columns,
    else a gather on ``Aᵀ``'s CSR built for the call, ``E + num_src + 1`` int32, plus ``E`` floats with values).
    Autograd keeps the given ``values``, ``row_scale``, ``col_scale`` and ``self_scale`` (``E``, ``num_dst``,
    ``num_src`` and ``num_dst`` floats, the ones passed); the block is already resident.
    """

    @staticmethod
    def forward(ctx, h_src: Tensor, block: Block, values: Tensor | None, row_scale: Tensor | None,
                col_scale: Tensor | None, self_scale: Tensor | None) -> Tensor:
        ctx.block, ctx.own_values = block, values is None or values is block.edge_weight
        ctx.save_for_backward(values, row_scale, col_scale, self_scale)
        out = _csr_matmul(block.indptr, block.indices, h_src, values, row_scale, col_scale)
        if self_scale is not None:
            out.addcmul_(h_src[: block.num_dst], self_scale.unsqueeze(1))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        block = ctx.block
        values, row_scale, col_scale, self_scale = ctx.saved_tensors
        grad_src = _transposed_matmul(block, grad, values, row_scale, col_scale, ctx.own_values)
        if self_scale is not None:
            grad_src[: block.num_dst].addcmul_(grad, self_scale.unsqueeze(1))
        return grad_src, None, None, None, None, None


def _transposed_matmul(block: Block, grad: Tensor, values: Tensor | None, row_scale: Tensor | None,
                       col_scale: Tensor | None, own_values: bool) -> Tensor:
    """``diag(col_scale)·Aᵀ·diag(row_scale)·grad``: ``(num_dst, F)`` → ``(num_src, F)``, every src row summing its
    edges in dst order. On the CPU (float32): where the block keeps its transpose (:func:`keep_transposes`) and
    ``values`` are none or the block's own weights (``own_values``, told by the forward), :func:`_csr_matmul` on
    it, the two scales swapping sides; else up to :data:`SCATTER_MAX_WIDTH` columns a compiled kernel scatters each
    dst row's gradient along its edges, building nothing (threads take disjoint column blocks, so the bits do not
    depend on their number); otherwise :func:`_csr_matmul` on ``Aᵀ``'s CSR built for this call (:func:`_transpose`)
    and freed after it."""
    compiled, kept = compiled_kernels(grad.device, grad.dtype), block.kept_transpose
    if compiled and kept is not None and own_values:
        return _csr_matmul(kept.pointer, kept.positions, grad, None if values is None else kept.values, col_scale,
                           row_scale)
    if compiled and grad.shape[1] <= SCATTER_MAX_WIDTH:
        out = grad.new_zeros(block.num_src, grad.shape[1])
        _csr_scatter(block.indptr, block.indices, _in_dtype(values, grad.dtype), _in_dtype(row_scale, grad.dtype),
                     _in_dtype(col_scale, grad.dtype), grad.contiguous(), out, _column_step(grad.shape[1]))
        return out
    pointer, positions, transposed = _transpose(block, values, grad.dtype)
    return _csr_matmul(pointer, positions, grad, transposed, col_scale, row_scale)


def _transpose(block: Block, values: Tensor | None, dtype: torch.dtype,
               positions_dtype: torch.dtype = torch.int32) -> tuple[Tensor, Tensor, Tensor | None]:
    """CSR of ``Aᵀ`` (``num_src × num_dst``) for a product in ``dtype``: pointer, dst positions and the values
    in that order (``None`` without values), each src row's edges in dst order. Where the compiled kernels run
    (:func:`~betty_trainer.rng.compiled_kernels`) a counting sort writes an int32 pointer and ``positions_dtype``
    positions (int16 needs fewer than ``2¹⁵`` dst nodes); elsewhere a stable argsort of the src ids (int64)."""
    device = block.indices.device
    if compiled_kernels(device, dtype):
        pointer = torch.empty(block.num_src + 1, dtype=torch.int32)
        positions = torch.empty(block.num_edges, dtype=positions_dtype)
        transposed = None if values is None else torch.empty(block.num_edges, dtype=dtype)
        _counting_transpose(block.indptr, block.indices, _in_dtype(values, dtype), pointer, positions, transposed)
        return pointer, positions, transposed
    order = torch.argsort(block.indices, stable=True)
    pointer = torch.zeros(block.num_src + 1, dtype=torch.int64, device=device)
    # each src row's count, then the running sum, in place (bincount's output shape is the data's to fake tensors)
    pointer[1:].index_add_(0, block.indices, pointer.new_ones(()).expand(block.num_edges))
    pointer.cumsum_(0)
    return pointer, block.edge_dst()[order], None if values is None else values[order]


def keep_transposes(blocks: Sequence[Block], keep: Sequence[bool]) -> None:
    """Give each block of ``blocks`` whose ``keep`` is true its transpose to keep (:class:`~betty_trainer.data.block.
    BlockTranspose`: :func:`_transpose`'s CSR of ``Aᵀ``, its dst positions int16 up to
    :data:`~estimator.counts.SHORT_POSITIONS_MAX_DST` dst nodes and int32 above, with the block's edge weights in its
    order; made once and then kept), and take it from the others. A kept transpose makes the backward of the block's
    sparse aggregation a gather (:func:`_transposed_matmul`) at :func:`~estimator.counts.kept_transpose_bytes` held
    with the block (``4·(num_src + 1) + 2·E`` for a block of fewer than ``2¹⁵`` dst nodes, ``+ 4·E`` weighted): for
    blocks the run trains on step after step (the planner's choice: ``betty_trainer.memory.planner``), whose
    aggregation backward runs on the CPU.

    Raises:
        ValueError: a block not on the CPU (the compiled kernels read the transpose there only).
    """
    for block, wanted in zip(blocks, keep, strict=True):
        if not wanted:
            block.transpose = None
        elif block.kept_transpose is None:
            if not compiled_kernels(block.indices.device, torch.float32):
                raise ValueError(f"a block on {block.indices.device} keeps no transpose: the CPU kernels read it")
            positions = torch.int16 if block.num_dst <= SHORT_POSITIONS_MAX_DST else torch.int32
            block.transpose = BlockTranspose(*_transpose(block, block.edge_weight, torch.float32, positions),
                                             (block.indptr, block.indices, block.edge_weight))


@jit
def _counting_transpose_kernel(indptr, indices, values, pointer, positions, transposed):  # pragma: no cover - compiled
    pointer[:] = 0
    for e in range(indices.shape[0]):  # row sizes, then their prefix sums: pointer[s] = start of row s
        pointer[indices[e] + 1] += 1
    for s in range(1, pointer.shape[0]):
        pointer[s] += pointer[s - 1]
    for d in range(indptr.shape[0] - 1):  # edges in dst order; pointer[s] serves as row s's cursor
        for e in range(indptr[d], indptr[d + 1]):
            slot = pointer[indices[e]]
            positions[slot] = d
            if values is not None:  # pruned when compiled without values
                transposed[slot] = values[e]
            pointer[indices[e]] = slot + 1
    for s in range(pointer.shape[0] - 2, 0, -1):  # each cursor ended at the next row's start: shift back
        pointer[s] = pointer[s - 1]
    pointer[0] = 0


_counting_transpose = kernel_operator(
    "counting_transpose(Tensor indptr, Tensor indices, Tensor? values, Tensor(a!) pointer, Tensor(b!) positions, "
    "Tensor(c!)? transposed) -> ()", _counting_transpose_kernel)


def _in_dtype(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``tensor`` in ``dtype`` (itself when it is already) for a compiled kernel, or ``None`` (the kernel compiles
    without it)."""
    return None if tensor is None else tensor.to(dtype)


def _csr_matmul(indptr: Tensor, indices: Tensor, dense: Tensor, values: Tensor | None = None,
                row_scale: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
    """``diag(row_scale)·M·diag(col_scale)·dense`` for the CSR matrix ``M`` = ``(indptr, indices, values)``
    (ones without ``values``) of shape ``(len(indptr) − 1, len(dense))``; each scale is optional. On the CPU
    (float32) a compiled kernel sums each row's edges in order, four at a time, in registers, a tile of
    :data:`VECTOR_TILE` columns at a time (:func:`_scaled_row_sum`), rows in parallel, and scales the sum: the
    result is the only tensor allocated. Elsewhere the
    sparse library's product (``addmm`` with ``beta=0`` ignores its zero input) on int32 copies of the pointer
    and of int64 indices (the int32 CSR that cuSPARSE and MKL take; a block's own indices are int32 already),
    with an ``(E,)`` coefficient tensor (``values·col_scale[indices]``, or ones) unless ``values`` serve as they
    are, then the rows scaled in place. Not differentiable (both paths read ``dense`` detached): the callers are
    autograd functions whose backward is another product (no double backward through the aggregation)."""
    rows = indptr.shape[0] - 1
    if compiled_kernels(dense.device, dense.dtype):
        out = dense.new_empty(rows, dense.shape[1])
        _csr_gather(indptr, indices, _in_dtype(values, dense.dtype), _in_dtype(row_scale, dense.dtype),
                    _in_dtype(col_scale, dense.dtype), dense.detach().contiguous(), out)
        return out
    if col_scale is not None:
        coefficients = col_scale.to(dense.dtype).index_select(0, indices)
        if values is not None:
            coefficients.mul_(values)
    else:
        coefficients = dense.new_ones(indices.shape[0]) if values is None else values.to(dense.dtype)
    pointer, positions, zero = indptr.int(), indices.int(), dense.new_zeros(())
    out = dense.new_empty(rows, dense.shape[1])
    _sparse_product(pointer, positions, coefficients, dense.detach(), zero, out)
    return out if row_scale is None else out.mul_(row_scale.to(dense.dtype).unsqueeze(1))


def _sparse_csr_product(pointer: Tensor, positions: Tensor, coefficients: Tensor, dense: Tensor, zero: Tensor,
                        out: Tensor) -> None:
    """``out = M·dense`` for the int32 CSR matrix ``M`` = ``(pointer, positions, coefficients)`` of shape ``(len(out),
    len(dense))``: the sparse library's product (MKL on the CPU, cuSPARSE on a GPU; ``addmm`` with ``beta=0``
    ignores ``zero``, a 0-dim tensor expanded as its input), written into ``out``."""
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the CSR × dense product used here is stable
        warnings.simplefilter("ignore", UserWarning)
        matrix = torch.sparse_csr_tensor(pointer, positions, coefficients, (out.shape[0], dense.shape[0]),
                                         check_invariants=False)
    torch.addmm(zero.expand_as(out), matrix, dense, beta=0, out=out)


_sparse_product = tensor_operator(
    "sparse_csr_product(Tensor pointer, Tensor positions, Tensor coefficients, Tensor dense, Tensor zero, "
    "Tensor(a!) out) -> ()", _sparse_csr_product)


VECTOR_TILE = 128
"""The columns of a row the compiled gathers sum at once in registers (:mod:`betty_trainer.models.vectors`): eight
``<16 x float>`` accumulators, eight AVX-512 registers (sixteen on AVX2) of the 32 (16); a wider row is summed one tile
at a time, its edges read once per tile. Measured (``benchmarks/README.md`` › aggregation.py › Sums held in
registers, the raw forward gather, ``sum`` / ``gcn``): at 256 columns, tiles of 128 took 0.79–0.89 / 0.86–0.99× the
time of the kernel before on Amazon Computers and 0.88–0.93 / 0.83× on the 30k-node SBM, as tiles of 256 did with
AVX-512 (0.87 / 0.86 and 0.93 / 0.83); with code for AVX2 tiles of 128 took 0.78 / 0.88× where tiles of 64 took
0.93 / 1.01× and tiles of 256 0.90 / 0.95×."""

TILE_VECTORS = VECTOR_TILE // LANES

PREFETCH_MIN_COLUMNS = 33
"""The narrowest rows the compiled gathers prefetch (:data:`PREFETCH_EDGES`): float32 rows longer than two cache
lines. On rows of 16 and 32 columns the prefetch cost 1–8% of the time."""

PREFETCH_EDGES = 4
"""How many edges ahead the compiled gather asks the CPU to fetch the src rows it will read (the next pass of four
edges: their first two cache lines from the tile's first column, the hardware prefetcher following a row once it is
read). Measured (``benchmarks/README.md`` › aggregation.py, the raw CSR gather with a row scale, one thread, against
the kernel before the prefetch, both compiled in one process, 21 interleaved rounds, on the 30k-node SBM and Amazon
Computers): 0.92× and 0.90× the time at 64 columns, 0.88× and 0.87× at 128, 0.80× and 0.88× at 256, 0.87× and 0.86×
at 47; in a stand-alone kernel 2 edges ahead gained less (0.92–0.98× at 256 and 64 columns) and 8 or 16 less
again."""

FAR_PREFETCH_EDGES = 16
"""How many edges ahead the compiled gather also asks for the src rows' tile into L2 (its vectors' lines; a hint of
low temporal locality, :func:`~betty_trainer.models.vectors.prefetch_to_l2`), on rows of
:data:`FAR_PREFETCH_MIN_COLUMNS` columns or more, so that more rows are on their way from memory at once than the
L1's miss buffers hold. Measured (``benchmarks/README.md`` › aggregation.py › Tiles asked for into L2, the raw
unweighted CSR gather, one thread, interleaved in one process, against the gather with :data:`PREFETCH_EDGES` alone):
0.81–0.84× the time at 128 and 256 columns on the 30k-node SBM, 0.88–0.93× on Amazon Computers; 12, 24 or 32 edges
ahead, or the hint of locality 2 (``prefetcht1``), gained about as much, and the hint that bypasses the caches
(``prefetchnta``) lost (1.03–1.29×)."""

FAR_PREFETCH_MIN_COLUMNS = 65
"""The narrowest rows the compiled gathers ask for into L2 (:data:`FAR_PREFETCH_EDGES`): wider than four cache lines.
At 64 columns the hint took 0.82–0.99× the time on the 30k-node SBM but 1.05–1.16× on Amazon Computers, whose
neighbourhoods' rows are mostly in the caches already; at 16 and 32 columns it took 1.3–2.1×."""


@jit(inline="always")
def _row_layout(width: int) -> tuple[int, int, int]:
    """How the compiled gathers sum a row of ``width`` columns: ``(tiles, vectors, tail)``, ``tiles`` whole tiles of
    :data:`VECTOR_TILE` columns, then a tile of ``vectors`` (0–7) vectors of :data:`LANES` columns, both in registers,
    and columns ``tail … width − 1`` (fewer than :data:`LANES`) by the scalar loop. Read by the kernels
    (:func:`_scaled_row_sum`) and, for their key, in Python (:func:`_gather_key`)."""
    tiles, rest = divmod(width, VECTOR_TILE)
    return tiles, rest // LANES, width - rest % LANES


def _gather_key(width: int) -> tuple[int, bool, bool]:
    """What a compiled gather over rows of ``width`` columns is compiled for: the vectors of its last, partial tile
    (:func:`_row_layout`; the stack array's size, a constant), whether it prefetches (:data:`PREFETCH_MIN_COLUMNS`)
    and whether it also asks for the tiles into L2 (:data:`FAR_PREFETCH_MIN_COLUMNS`); the width itself is read from
    the arrays, so at most 14 gathers are compiled."""
    return _row_layout(width)[1], width >= PREFETCH_MIN_COLUMNS, width >= FAR_PREFETCH_MIN_COLUMNS


def _make_gather_kernel(vectors_left: int, prefetch: bool, far: bool):
    vectors_source = SOURCE_KEY

    @jit(parallel=True)
    def gather_kernel(indptr, indices, values, row_scale, col_scale, dense, out):  # pragma: no cover - compiled
        if vectors_source < 0:  # never (a crc32): held so that a change to the vector intrinsics recompiles
            return
        width = dense.shape[1]
        flat, out_flat = dense.reshape(-1), out.reshape(-1)  # the rows as one array: the vectors' addresses
        for row in numba.prange(indptr.shape[0] - 1):
            scale = np.float32(1.0)
            if row_scale is not None:
                scale = row_scale[row]
            _scaled_row_sum(indptr, indices, values, col_scale, dense, flat, row, out_flat, row * width, scale, width,
                            vectors_left, prefetch, far)
    return gather_kernel


_gather_kernels = functools.cache(_make_gather_kernel)


def _check_arrays(dense: np.ndarray, out: np.ndarray, **factors: np.ndarray | None) -> None:
    """What the compiled gathers (and scatters: ``dense`` their gradient) address as raw float32 vectors
    (:mod:`betty_trainer.models.vectors`): ``dense`` and ``out`` C-contiguous float32 (``out`` writable), every given
    factor array (by name) float32.

    Raises:
        ValueError: any of these does not hold (the vectors would read the bytes as float32 rows all the same).
    """
    arrays = {"dense": dense, "out": out} | {name: a for name, a in factors.items() if a is not None}
    wrong = [name for name, a in arrays.items() if a.dtype != np.float32]
    if wrong:
        raise ValueError(f"the compiled aggregation kernels take float32 arrays; {', '.join(wrong)} "
                         f"{'is' if len(wrong) == 1 else 'are'} not")
    if not (dense.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("the compiled aggregation kernels read C-contiguous rows and write a C-contiguous, writable "
                         "out (their rows addressed as one array)")


def _gather_kernel(indptr, indices, values, row_scale, col_scale, dense, out) -> None:
    """``out = diag(row_scale)·M·diag(col_scale)·dense`` (numpy arrays, ``dense`` and ``out`` C-contiguous;
    :func:`_csr_matmul`), by the kernel compiled for ``dense``'s column count's :func:`_gather_key`.

    Raises:
        ValueError: an array is not float32, or ``dense`` or ``out`` not C-contiguous (:func:`_check_arrays`).
    """
    _check_arrays(dense, out, values=values, row_scale=row_scale, col_scale=col_scale)
    _gather_kernels(*_gather_key(dense.shape[1]))(indptr, indices, values, row_scale, col_scale, dense, out)


_csr_gather = kernel_operator(
    "csr_gather(Tensor indptr, Tensor indices, Tensor? values, Tensor? row_scale, Tensor? col_scale, Tensor dense, "
    "Tensor(a!) out) -> ()", _gather_kernel)


@jit(inline="always")
def _prefetch_rows(indices, edge, flat, width, first, write=False):  # pragma: no cover - compiled
    """Ask the CPU to fetch, from the rows ``indices[edge … edge + 3]`` (those that exist) of a C-contiguous matrix of
    ``width`` columns flattened to ``flat``, the two cache lines from column ``first`` on, to be read or (``write``)
    written: a hint, which never faults (an address past the row is fetched or not, never read) and changes no
    value."""
    for q in range(4):
        if edge + q < indices.shape[0]:
            base = indices[edge + q] * width + first
            if write:
                prefetch_for_write(flat, base)
                prefetch_for_write(flat, base + 16)
            else:
                prefetch(flat, base)
                prefetch(flat, base + 16)


@jit(inline="always")
def _prefetch_tiles(indices, edge, flat, width, first, count):  # pragma: no cover - compiled
    """Ask the CPU to bring into L2 (:func:`~betty_trainer.models.vectors.prefetch_to_l2`) the cache lines where the
    ``count`` vectors of :data:`LANES` columns from column ``first`` start (every line of them where rows are 64-byte
    aligned, ``width`` a multiple of 16; else all but one), in the rows ``indices[edge … edge + 3]`` (those that
    exist) of a C-contiguous matrix of ``width`` columns flattened to ``flat``: a hint, as :func:`_prefetch_rows`."""
    for q in range(4):
        if edge + q < indices.shape[0]:
            base = indices[edge + q] * width + first
            for line in range(count):
                prefetch_to_l2(flat, base + line * LANES)


@jit(inline="always")
def _scaled_row_sum(indptr, indices, values, col_scale, dense, flat, row, out, base, scale, width, vectors_left,
                    prefetch, far):  # pragma: no cover - compiled
    """``out[base + f] = scale · Σ_{e in row} coefficient_e · dense[indices[e], f]`` for ``f < width`` over CSR row
    ``row`` (``flat``, ``out``: ``dense`` and the output as one array each), in edge order, four edges at a time:
    the row's tiles in registers (:func:`_tile_sum`, by :func:`_row_layout` of ``width``; ``vectors_left``, its
    partial tile's vectors, and the prefetch flags are constants of the kernel), its last ``width − tail`` columns by
    the scalar loop (:func:`_columns_sum`)."""
    tiles, _, tail = _row_layout(width)
    acc = vectors(TILE_VECTORS)
    for tile in range(tiles):
        first = tile * VECTOR_TILE
        _tile_sum(indptr, indices, values, col_scale, flat, width, row, acc, first, TILE_VECTORS, prefetch, far)
        store_vectors(TILE_VECTORS, acc, out, base + first, scale)
    if vectors_left:
        first = tiles * VECTOR_TILE
        _tile_sum(indptr, indices, values, col_scale, flat, width, row, acc, first, vectors_left, prefetch, far)
        store_vectors(vectors_left, acc, out, base + first, scale)
    if tail < width:
        out_row = out[base:base + width]
        _columns_sum(indptr, indices, values, col_scale, dense, row, out_row, tail, width)
        for f in range(tail, width):
            out_row[f] *= scale


@jit(inline="always")
def _tile_sum(indptr, indices, values, col_scale, flat, width, row, acc, first, count, prefetch,
              far):  # pragma: no cover - compiled
    """``acc = Σ_{e in row} coefficient_e · dense[indices[e], first : first + 16·count]`` in registers (``count``
    vectors of :data:`LANES`, a constant), four edges a pass, asking for the src rows :data:`PREFETCH_EDGES` edges
    ahead with ``prefetch``, and with ``far`` for their tiles into L2 :data:`FAR_PREFETCH_EDGES` edges ahead."""
    zero_vectors(count, acc)
    e, end = indptr[row], indptr[row + 1]
    while e + 3 < end:
        if prefetch:
            _prefetch_rows(indices, e + PREFETCH_EDGES, flat, width, first)
        if far:
            _prefetch_tiles(indices, e + FAR_PREFETCH_EDGES, flat, width, first, count)
        add_four_rows(count, acc, flat, np.int64(indices[e]) * width + first,
                      np.int64(indices[e + 1]) * width + first, np.int64(indices[e + 2]) * width + first,
                      np.int64(indices[e + 3]) * width + first, _coefficient(values, col_scale, indices, e),
                      _coefficient(values, col_scale, indices, e + 1), _coefficient(values, col_scale, indices, e + 2),
                      _coefficient(values, col_scale, indices, e + 3))
        e += 4
    while e < end:
        add_row(count, acc, flat, np.int64(indices[e]) * width + first, _coefficient(values, col_scale, indices, e))
        e += 1


@jit(inline="always")
def _columns_sum(indptr, indices, values, col_scale, dense, row, acc, first, last):  # pragma: no cover - compiled
    """``acc[f] = Σ_{e in row} coefficient_e · dense[indices[e], f]`` for ``first ≤ f < last`` (a row's last columns,
    fewer than a vector), as :func:`_tile_sum` adds them, in scalar code."""
    for f in range(first, last):
        acc[f] = 0.0
    e, end = indptr[row], indptr[row + 1]
    while e + 3 < end:
        a, b, c, d = dense[indices[e]], dense[indices[e + 1]], dense[indices[e + 2]], dense[indices[e + 3]]
        ca, cb = _coefficient(values, col_scale, indices, e), _coefficient(values, col_scale, indices, e + 1)
        cc, cd = _coefficient(values, col_scale, indices, e + 2), _coefficient(values, col_scale, indices, e + 3)
        for f in range(first, last):
            acc[f] += (ca * a[f] + cb * b[f]) + (cc * c[f] + cd * d[f])
        e += 4
    while e < end:
        a, ca = dense[indices[e]], _coefficient(values, col_scale, indices, e)
        for f in range(first, last):
            acc[f] += ca * a[f]
        e += 1


@jit
def _coefficient(values, col_scale, indices, edge):  # pragma: no cover - compiled
    """Edge ``edge``'s factor in the compiled kernels: its value times its src node's column scale (each 1 when
    not given; the branches on ``None`` are pruned when compiled, and a factor of 1 folds away)."""
    coefficient = np.float32(1.0)
    if values is not None:
        coefficient = values[edge]
    if col_scale is not None:
        coefficient = coefficient * col_scale[indices[edge]]
    return coefficient


SCATTER_MAX_WIDTH = 128
"""The widest gradient the compiled backward scatters along the block's own CSR (:func:`_scatter_kernel`) where the
block keeps no transpose; a wider one is gathered on ``Aᵀ``'s CSR, built for the call. Measured one thread each
(``benchmarks/aggregation.py``, both kernels in scalar code then): at width 64 the scatter takes 0.8× the transpose and
gather on Amazon Computers and the same on a 30k-node SBM; at 256, 1.0–1.3× (the scatter's read-modify-write of every
edge's src row costs more than a transpose then). A gather on a kept transpose beats both (``benchmarks/README.md`` ›
aggregation.py). Building nothing, the scatter also keeps the step's memory at the block's own."""

SCATTER_PREFETCH_EDGES = 8
"""How many edges ahead the compiled scatter asks the CPU to fetch the src rows of the gradient it will add into (the
first two cache lines of each of four rows, from its column block on; :data:`PREFETCH_EDGES` is the gather's).
Measured (``benchmarks/README.md`` › aggregation.py, a scatter of whole rows, one thread, in one process,
interleaved): 0.80–0.88× the time at 64 and 128 columns on the 30k-node SBM and Amazon Computers, 0.86–0.94× at 16
and 32 columns on the SBM and 0.87–1.04× on Amazon Computers; 4 edges ahead gained less at 32 and 128 columns. Blocks
of 64 columns or more are asked for to be written (the rows are added into): 0.91–0.94× the read hint's time at 64
columns, 0.97–1.00× at 128; at 32 columns the write hint took 1.01–1.07×, so narrower blocks keep the read hint (the
vectors of a block count; its scalar columns, fewer than 16, keep the read hint). Measured on the scalar kernel, before
the row was held in registers."""

SCATTER_FAR_PREFETCH_EDGES = 32
"""How many edges ahead the compiled scatter also asks for the src rows' column block into L2 (its vectors' lines:
:func:`_prefetch_tiles`, as the gather's :data:`FAR_PREFETCH_EDGES`), for blocks of :data:`SCATTER_FAR_MIN_COLUMNS`
columns or more. Measured (``benchmarks/README.md`` › aggregation.py › Tiles asked for into L2, a scatter of whole rows,
one thread, interleaved in one process, against the scatter with :data:`SCATTER_PREFETCH_EDGES` alone): 0.57–0.78×
the time at 64 and 128 columns on the 30k-node SBM (0.67–0.68× at 256, layer-wise's rows scattering any width),
0.83–0.89× at 128 on Amazon Computers, 0.86–1.08× at 64 and 0.96–1.02× at 256; 24 edges ahead gained less, 48 and 64
as much."""

SCATTER_FAR_MIN_COLUMNS = 64
"""The narrowest column block the compiled scatter asks for into L2 (:data:`SCATTER_FAR_PREFETCH_EDGES`): four cache
lines; at 16 and 32 columns the hint took 1.07–1.56× the time."""

SCATTER_COLUMNS = 16
"""The narrowest column block a thread of the compiled backward scatters (64 bytes of float32: a cache line)."""


def _column_step(width: int) -> int:
    """The column block of each thread of :func:`_scatter_kernel`: ``width`` shared among numba's threads, in
    multiples of :data:`SCATTER_COLUMNS` (one block, the whole width, on one thread)."""
    share = -(-width // numba.get_num_threads())
    return max(SCATTER_COLUMNS, -(-share // SCATTER_COLUMNS) * SCATTER_COLUMNS)


@jit(inline="always")
def _column_blocks(width: int, step: int) -> tuple[int, int]:
    """``(blocks, last)``: ``width`` columns in ``blocks`` blocks of ``step`` columns but the last, of ``last``
    (:func:`_block_layout`; the scatter kernels' threads take one block each)."""
    blocks = -(-width // step)
    return blocks, width - (blocks - 1) * step


def _block_layout(width: int, step: int) -> tuple[int, int, int, int]:
    """How the compiled scatters share ``width`` columns among threads: ``(blocks, last, vectors, last_vectors)``,
    ``blocks`` column blocks of ``step`` columns but the last, of ``last``; each block's first ``vectors`` (the last
    block's ``last_vectors``) vectors of :data:`LANES` columns held in registers, the rest (fewer than 16) by the
    scalar loop. With one block ``vectors`` is ``last_vectors`` (no full block runs), so that widths share kernels."""
    blocks, last = _column_blocks(width, step)
    return blocks, last, step // LANES if blocks > 1 else last // LANES, last // LANES


def _make_scatter_kernel(step_vectors: int, last_vectors: int):
    vectors_source = SOURCE_KEY

    @jit(parallel=True)
    def scatter_kernel(indptr, indices, values, row_scale, col_scale, grad, out, step):  # pragma: no cover
        if vectors_source < 0:  # never (a crc32): held so that a change to the vector intrinsics recompiles
            return
        blocks, last = _column_blocks(grad.shape[1], step)
        for block in numba.prange(blocks):  # each vector count a constant of its call (the stack array's size)
            if block < blocks - 1:
                _scatter_columns(indptr, indices, values, row_scale, col_scale, grad, out, block * step, step,
                                 step_vectors)
            else:
                _scatter_columns(indptr, indices, values, row_scale, col_scale, grad, out, block * step, last,
                                 last_vectors)
    return scatter_kernel


_scatter_kernels = functools.cache(_make_scatter_kernel)


def _check_scatter_arrays(grad: np.ndarray, out: np.ndarray, **factors: np.ndarray | None) -> None:
    """:func:`_check_arrays` for a scatter (``grad`` read, ``out`` added into), and ``out`` as wide as ``grad``.

    Raises:
        ValueError: as :func:`_check_arrays`; ``out`` of another width.
    """
    _check_arrays(grad, out, **factors)
    if out.ndim != 2 or out.shape[1] != grad.shape[1]:
        raise ValueError(f"the compiled scatters add rows of {grad.shape[1]} columns into rows as wide, not "
                         f"{out.shape[1:]}")


def _scatter_kernel(indptr, indices, values, row_scale, col_scale, grad, out, step) -> None:
    """``out += diag(col_scale)·Mᵀ·diag(row_scale)·grad`` (numpy arrays, ``grad`` and ``out`` C-contiguous;
    :func:`_transposed_matmul`), threads taking blocks of ``step`` columns, by the kernel compiled for the blocks' vector
    counts (:func:`_block_layout`).

    Raises:
        ValueError: an array is not float32 or not C-contiguous, or ``out`` of another width
            (:func:`_check_scatter_arrays`).
    """
    _check_scatter_arrays(grad, out, values=values, row_scale=row_scale, col_scale=col_scale)
    _scatter_kernels(*_block_layout(grad.shape[1], step)[2:])(indptr, indices, values, row_scale, col_scale, grad,
                                                            out, step)


_csr_scatter = kernel_operator(
    "csr_scatter(Tensor indptr, Tensor indices, Tensor? values, Tensor? row_scale, Tensor? col_scale, Tensor grad, "
    "Tensor(a!) out, int step) -> ()", _scatter_kernel)


@jit(inline="always")
def _scatter_columns(indptr, indices, values, row_scale, col_scale, grad, out, first, count,
                     vector_count):  # pragma: no cover - compiled
    """Columns ``[first, first + count)`` of :func:`_scatter_kernel`: every dst row's (scaled) gradient added to its
    edges' src rows (``out``, zeros), in edge order, then the src rows scaled; the first ``vector_count`` vectors of
    the block in registers (:func:`_add_along_row`), the rest by the scalar loop (:func:`_scatter_row`)."""
    width, last = out.shape[1], first + count
    tail = first + vector_count * LANES
    acc, scaled = vectors(vector_count), np.empty(last - tail, dtype=grad.dtype)
    flat, grad_flat = out.reshape(-1), grad.reshape(-1)  # the rows as one array: the vectors' addresses
    for d in range(indptr.shape[0] - 1):
        scale = np.float32(1.0)
        if row_scale is not None:
            scale = row_scale[d]
        if vector_count:
            load_vectors(vector_count, acc, grad_flat, d * width + first, scale)
            _add_along_row(indptr, indices, values, d, acc, flat, width, first, vector_count)
        if tail < last:
            for f in range(last - tail):
                scaled[f] = grad[d, tail + f] * scale
            _scatter_row(indptr, indices, values, d, scaled, out, flat, tail, last - tail)
    if col_scale is not None:
        for s in range(out.shape[0]):
            target = out[s, first:last]
            scale = col_scale[s]
            for f in range(count):
                target[f] *= scale


@jit(inline="always")
def _add_along_row(indptr, indices, values, d, acc, flat, width, first, count):  # pragma: no cover - compiled
    """``out[indices[e], first : first + 16·count] += value_e · acc`` along CSR row ``d``'s edges, in edge order
    (``flat``: ``out`` as one array; ``acc``: the row's scaled gradient in ``count`` registers), asking for the rows
    :data:`SCATTER_PREFETCH_EDGES` edges ahead, four at a time, and from :data:`SCATTER_FAR_MIN_COLUMNS` columns for
    their blocks into L2 :data:`SCATTER_FAR_PREFETCH_EDGES` edges ahead."""
    e, end = indptr[d], indptr[d + 1]
    while e < end:
        if (e - indptr[d]) % 4 == 0:
            _prefetch_rows(indices, e + SCATTER_PREFETCH_EDGES, flat, width, first, count * LANES >= 64)
            if count * LANES >= SCATTER_FAR_MIN_COLUMNS:
                _prefetch_tiles(indices, e + SCATTER_FAR_PREFETCH_EDGES, flat, width, first, count)
        add_into_row(count, acc, flat, np.int64(indices[e]) * width + first, _coefficient(values, None, indices, e))
        e += 1


@jit(inline="always")
def _scatter_row(indptr, indices, values, d, scaled, out, flat, first, count):  # pragma: no cover - compiled
    """``out[indices[e], first:first + count] += value_e · scaled`` along CSR row ``d``'s edges, in edge order, four at a
    time (one pass over ``scaled`` per four src rows), asking for the rows :data:`SCATTER_PREFETCH_EDGES` edges ahead
    (``flat``: ``out`` as one array)."""
    e, end, last = indptr[d], indptr[d + 1], first + count
    while e + 3 < end:
        _prefetch_rows(indices, e + SCATTER_PREFETCH_EDGES, flat, out.shape[1], first, count >= 64)
        a, b = out[indices[e], first:last], out[indices[e + 1], first:last]
        c, g = out[indices[e + 2], first:last], out[indices[e + 3], first:last]
        va, vb = _coefficient(values, None, indices, e), _coefficient(values, None, indices, e + 1)
        vc, vg = _coefficient(values, None, indices, e + 2), _coefficient(values, None, indices, e + 3)
        for f in range(count):
            a[f] += va * scaled[f]
            b[f] += vb * scaled[f]
            c[f] += vc * scaled[f]
            g[f] += vg * scaled[f]
        e += 4
    while e < end:
        a, va = out[indices[e], first:last], _coefficient(values, None, indices, e)
        for f in range(count):
            a[f] += va * scaled[f]
        e += 1


def aggregate_rows(block: Block, begin: int, end: int, z: Tensor, self_loop: bool) -> Tensor:
    """Dst rows ``[begin, end)`` of SAGE's mean (``self_loop=False``: ``mean_{s→d} z_s``, weighted by the block's edge
    weights) or GCN-style mean (``self_loop``: ``(z_d + Σ w_e z_s) / (Σ w_e + 1)``) aggregation, read off the
    whole block, without autograd: an affine layer's row block in layer-wise execution
    (``betty_trainer.execution.layerwise``). Each row sums the block's own CSR row, reading ``z`` at the block's
    src positions, so no chunk slice, sub-block or gathered rows of ``z`` are made; its scale (``1/deg``, or
    ``1/Σ w_e``; plus one with the self loop; 0 for a row without in-edges) is computed in the kernel. The rows'
    sums equal :func:`mean_neighbours`' (and ``SAGEConv``'s ``gcn``) on the same rows, edge for edge. Source: the
    mean and GCN aggregators of GraphSAGE (Hamilton et al. 2017, §3.3); layer-by-layer execution as in ROC and
    NeutronStar, here without the per-chunk gather.

    Args:
        block: the layer's block (CSC over its dst nodes; float32 edge weights or none).
        begin, end: the rows, ``R = end − begin`` dst positions.
        z: ``(num_src, F)`` float32 rows of the block's src nodes, on the CPU.
        self_loop: add each dst node's own row of ``z`` (dst positions are src positions) and count it.

    Returns:
        ``(R, F)`` float32, the only tensor allocated.

    Raises:
        ValueError: where the compiled kernels do not run (:func:`~betty_trainer.rng.compiled_kernels`).
    """
    _require_compiled(z)
    out = z.new_empty(end - begin, z.shape[1])
    _rows_gather(block.indptr, block.indices, _in_dtype(block.edge_weight, z.dtype), begin, self_loop,
                 z.detach().contiguous(), out)
    return out


def aggregate_rows_transpose_(block: Block, begin: int, grad: Tensor, out: Tensor, self_loop: bool) -> None:
    """Add the transpose of :func:`aggregate_rows` applied to ``grad`` into ``out`` (``∂L/∂z``), in place:
    every row's scaled gradient along its in-edges to their src rows (and, with ``self_loop``, to its own),
    building nothing (threads take disjoint column blocks, so the bits do not depend on their number).

    Args:
        block, self_loop: as :func:`aggregate_rows`'s.
        begin: the first row; ``grad``'s rows are rows ``[begin, begin + R)``.
        grad: ``(R, F)`` float32 gradient of the rows' output.
        out: ``(num_src, F)`` float32 sink, contiguous, on the CPU.

    Raises:
        ValueError: where the compiled kernels do not run, or ``out`` is not contiguous.
    """
    _require_compiled(grad)
    if not out.is_contiguous():
        raise ValueError("aggregate_rows_transpose_ adds into a contiguous out (rows of the compiled scatter's "
                         "prefetch are addressed in one flat array); pass out.contiguous() and copy back")
    _rows_scatter(block.indptr, block.indices, _in_dtype(block.edge_weight, grad.dtype), begin, self_loop,
                  grad.contiguous(), out, _column_step(grad.shape[1]))


def _require_compiled(tensor: Tensor) -> None:
    if not compiled_kernels(tensor.device, tensor.dtype):
        raise ValueError(f"aggregating rows in place runs the compiled CPU kernels: float32 on the CPU with numba, "
                         f"not {tensor.dtype} on {tensor.device}")


@jit(inline="always")
def _rows_scale(indptr, values, row, self_loop):  # pragma: no cover - compiled
    """Row ``row``'s factor in :func:`aggregate_rows`: ``1 / (deg + self_loop)`` (``Σ w_e`` for ``deg`` with
    values), 0 for a row whose total is 0."""
    total = np.float32(indptr[row + 1] - indptr[row])
    if values is not None:
        total = np.float32(0.0)
        for e in range(indptr[row], indptr[row + 1]):
            total += values[e]
    if self_loop:
        total += np.float32(1.0)
    return np.float32(1.0) / total if total != 0 else np.float32(0.0)


def _make_rows_gather_kernel(vectors_left: int, prefetch: bool, far: bool):
    vectors_source = SOURCE_KEY

    @jit(parallel=True)
    def rows_gather_kernel(indptr, indices, values, begin, self_loop, dense, out):  # pragma: no cover - compiled
        if vectors_source < 0:  # never (a crc32): held so that a change to the vector intrinsics recompiles
            return
        width = dense.shape[1]
        flat, out_flat = dense.reshape(-1), out.reshape(-1)  # the rows as one array: the vectors' addresses
        for i in numba.prange(out.shape[0]):
            row = begin + i
            scale = _rows_scale(indptr, values, row, self_loop)
            _scaled_row_sum(indptr, indices, values, None, dense, flat, row, out_flat, i * width, scale, width,
                            vectors_left, prefetch, far)
            if self_loop:
                acc, own = out[i], dense[row]
                for f in range(width):
                    acc[f] += own[f] * scale
    return rows_gather_kernel


_rows_gather_kernels = functools.cache(_make_rows_gather_kernel)


def _rows_gather_kernel(indptr, indices, values, begin, self_loop, dense, out) -> None:
    """:func:`aggregate_rows` on numpy arrays (``dense`` and ``out`` C-contiguous), by the kernel compiled for
    ``dense``'s column count's :func:`_gather_key`.

    Raises:
        ValueError: an array is not float32, or ``dense`` or ``out`` not C-contiguous (:func:`_check_arrays`).
    """
    _check_arrays(dense, out, values=values)
    _rows_gather_kernels(*_gather_key(dense.shape[1]))(indptr, indices, values, begin, self_loop, dense, out)


_rows_gather = kernel_operator(
    "rows_gather(Tensor indptr, Tensor indices, Tensor? values, int begin, bool self_loop, Tensor dense, "
    "Tensor(a!) out) -> ()", _rows_gather_kernel)


def _make_rows_scatter_kernel(step_vectors: int, last_vectors: int):
    vectors_source = SOURCE_KEY

    @jit(parallel=True)
    def rows_scatter_kernel(indptr, indices, values, begin, self_loop, grad, out, step):  # pragma: no cover
        if vectors_source < 0:  # never (a crc32): held so that a change to the vector intrinsics recompiles
            return
        blocks, last = _column_blocks(grad.shape[1], step)
        for block in numba.prange(blocks):
            if block < blocks - 1:
                _rows_scatter_columns(indptr, indices, values, begin, self_loop, grad, out, block * step, step,
                                      step_vectors)
            else:
                _rows_scatter_columns(indptr, indices, values, begin, self_loop, grad, out, block * step, last,
                                      last_vectors)
    return rows_scatter_kernel


_rows_scatter_kernels = functools.cache(_make_rows_scatter_kernel)


def _rows_scatter_kernel(indptr, indices, values, begin, self_loop, grad, out, step) -> None:
    """:func:`aggregate_rows_transpose_` on numpy arrays (``grad`` and ``out`` C-contiguous), threads taking blocks of
    ``step`` columns, by the kernel compiled for the blocks' vector counts (:func:`_block_layout`).

    Raises:
        ValueError: as :func:`_check_scatter_arrays`.
    """
    _check_scatter_arrays(grad, out, values=values)
    _rows_scatter_kernels(*_block_layout(grad.shape[1], step)[2:])(indptr, indices, values, begin, self_loop,
                                                                 grad, out, step)


@jit(inline="always")
def _rows_scatter_columns(indptr, indices, values, begin, self_loop, grad, out, first, count,
                          vector_count):  # pragma: no cover - compiled
    """Columns ``[first, first + count)`` of :func:`_rows_scatter_kernel`, the first ``vector_count`` vectors in
    registers (as :func:`_scatter_columns`)."""
    width, last = out.shape[1], first + count
    tail = first + vector_count * LANES
    acc, scaled = vectors(vector_count), np.empty(last - tail, dtype=grad.dtype)
    flat, grad_flat = out.reshape(-1), grad.reshape(-1)  # the rows as one array: the vectors' addresses
    for i in range(grad.shape[0]):
        row = begin + i
        scale = _rows_scale(indptr, values, row, self_loop)
        if vector_count:
            load_vectors(vector_count, acc, grad_flat, i * width + first, scale)
            _add_along_row(indptr, indices, values, row, acc, flat, width, first, vector_count)
            if self_loop:
                add_into_row(vector_count, acc, flat, row * width + first, np.float32(1.0))
        if tail < last:
            for f in range(last - tail):
                scaled[f] = grad[i, tail + f] * scale
            _scatter_row(indptr, indices, values, row, scaled, out, flat, tail, last - tail)
            if self_loop:
                own = out[row, tail:last]
                for f in range(last - tail):
                    own[f] += scaled[f]


_rows_scatter = kernel_operator(
    "rows_scatter(Tensor indptr, Tensor indices, Tensor? values, int begin, bool self_loop, Tensor grad, "
    "Tensor(a!) out, int step) -> ()", _rows_scatter_kernel)


def aggregate(block: Block, h_src: Tensor, values: Tensor | None = None, self_scale: Tensor | None = None,
              row_scale: Tensor | None = None, col_scale: Tensor | None = None) -> Tensor:
    """``out_d = row_scale_d · Σ_{e=(s→d)} values_e · col_scale_s · h_s (+ self_scale_d · h_d)``: the linear
    aggregation every built-in sum/mean/GCN layer is, as one sparse matmul (DGL's ``update_all(u_mul_e, sum)``,
    PyG's SpMM). A weighting that depends only on the edge's ends is a row and a column scale, so no per-edge
    array is made for it.

    Args:
        block: the block (``indptr``/``indices`` CSC over its dst nodes).
        h_src: ``(num_src, F)`` src features.
        values: optional ``(E,)`` per-edge coefficients in the block's CSC edge order (no gradient; ones when
            ``None``).
        self_scale: optional ``(num_dst,)`` coefficient of each dst node's own row of ``h_src``.
        row_scale: optional ``(num_dst,)`` factor of each dst node's sum (finite: a row without edges stays 0).
        col_scale: optional ``(num_src,)`` factor of each src node's row inside the sum.

    Returns:
        ``(num_dst, F)``, dtype of ``h_src``. Autograd keeps the given ``values`` and scales only.
    """
    return _SparseAggregate.apply(h_src, block, values, row_scale, col_scale, self_scale)


def edge_weight(block: Block, dtype: torch.dtype) -> Tensor | None:
    """The block's ``(E,)`` edge weights in ``dtype`` (the block's own tensor when it is float32 already), or
    ``None`` for an unweighted block: the ``values`` of :func:`aggregate`."""
    return None if block.edge_weight is None else block.edge_weight.to(dtype)


def mean_neighbours(block: Block, h_src: Tensor) -> Tensor:
    """Mean of src features over each dst node's in-edges; weighted by ``block.edge_weight``
    (normalised by the weight sum) when the block has weights. Isolated dst nodes get zeros.

    One sparse matmul: the (weighted) sum, each row then scaled by :func:`mean_scale`, so no ``(E, F)``
    tensor, no per-edge coefficient and no ``(num_dst, F)`` intermediate is made (:func:`aggregate`).

    Shapes:
        ``(num_src, F)`` → ``(num_dst, F)``.
    """
    return aggregate(block, h_src, edge_weight(block, h_src.dtype), row_scale=mean_scale(block, h_src.dtype))


def mean_scale(block: Block, dtype: torch.dtype) -> Tensor:
    """``(num_dst,)`` factor of each dst row's (weighted) sum that makes it a mean: ``1/deg(d)``, or
    ``1 / Σ_{e→d} w_e`` on a weighted block; 0 for a row without in-edges."""
    total = block.in_degrees().to(dtype) if block.edge_weight is None else weight_totals(block, dtype)
    return total.reciprocal_().nan_to_num_(posinf=0.0)


def weight_totals(block: Block, dtype: torch.dtype) -> Tensor:
    """``(num_dst,)``: the sum of each dst node's in-edge weights ``Σ_{e→d} w_e`` (a weighted block's
    estimate of its true in-degree: with importance weights ``1/p`` (LABOR, GNS), ``E[Σ w] = |N(d)|``)."""
    total = torch.zeros(block.num_dst, dtype=dtype, device=block.edge_weight.device)
    return total.index_add_(0, block.edge_dst(), block.edge_weight.to(dtype))


def max_neighbours(block: Block, h_src: Tensor) -> Tensor:
    """Element-wise max of src features over each dst node's in-edges (GraphSAGE's pool aggregator,
    Hamilton et al. 2017, Eq. 3), keeping only the position of each maximum for backward.

    Isolated dst nodes get zeros. Edge weights are not used. Where several edges tie for a maximum,
    the first in the block's edge order takes the gradient (the same edge in a micro-batch as in the
    full batch). No ``(E, F)`` tensor is kept: autograd keeps a ``(num_dst, F)`` int32 argmax; the
    forward makes at most one chunk of :data:`MAX_CHUNK_ELEMENTS` gathered values at a time, then ``(num_dst, F)``
    temporaries (none on the CPU, where a compiled kernel scans each row).

    Shapes:
        ``(num_src, F)`` → ``(num_dst, F)``.
    """
    return _SegmentMax.apply(h_src, block)


MAX_CHUNK_ELEMENTS = 1 << 20  # gathered (edge, feature) values max_neighbours' tensor path makes at once (4 MiB)


class _SegmentMax(torch.autograd.Function):
    """Segment max over each dst row's edges with its argmax (a src position, or ``num_src`` for an
    isolated row, whose gradient lands in a discarded extra row); backward scatters the gradient to
    the argmax rows."""

    @staticmethod
    def forward(ctx, h_src: Tensor, block: Block) -> Tensor:
        out = h_src.new_empty(block.num_dst, h_src.shape[1])
        argmax = torch.empty(block.num_dst, h_src.shape[1], dtype=torch.int32, device=h_src.device)
        if compiled_kernels(h_src.device, h_src.dtype):
            _segment_max(block.indptr, block.indices, h_src.detach(), out, argmax)
        else:
            _segment_max_chunks(block, h_src, out, argmax)
        ctx.save_for_backward(argmax)
        ctx.num_src = block.num_src
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (argmax,) = ctx.saved_tensors
        grad_src = grad.new_zeros(ctx.num_src + 1, grad.shape[1])
        if compiled_kernels(grad.device, grad.dtype):
            _scatter_max_grad(argmax, grad.contiguous(), grad_src)
        else:
            grad_src.scatter_add_(0, argmax.long(), grad)
        return grad_src[: ctx.num_src], None


def _segment_max_chunks(block: Block, h_src: Tensor, out: Tensor, argmax: Tensor) -> None:
    """Tensor-op segment max and first argmax over the block's edges, :data:`MAX_CHUNK_ELEMENTS` gathered values at
    a time (:func:`~betty_trainer.models.chunks.chunks`): a first pass merges each chunk's values into ``out``
    (``scatter_reduce_`` ``amax``, which keeps a NaN); a second takes, per dst row and column, the first edge whose
    value is the maximum (``amin`` of edge positions, int32, into ``argmax``); then the positions become src
    positions, and rows without edges get 0 and ``num_src``. Every temporary is a chunk's, or ``(num_dst, F)`` at the
    end. Blocks of fewer than ``2³¹`` edges (int32 positions, as the block's own indices are)."""
    edges, step = block.num_edges, max(1, MAX_CHUNK_ELEMENTS // max(h_src.shape[1], 1))
    if edges == 0:
        out.zero_()
        argmax.fill_(block.num_src)
        return
    out.fill_(float("-inf"))
    argmax.fill_(edges)  # no edge yet
    for chunk in chunks(edges, step):
        index, gathered = _edge_values(block, h_src, chunk)
        out.scatter_reduce_(0, index, gathered, "amax")
        del index, gathered
    for chunk in chunks(edges, step):
        index, gathered = _edge_values(block, h_src, chunk)
        positions = torch.arange(chunk.start, chunk.stop, dtype=torch.int32, device=h_src.device).unsqueeze(1)
        peak = out.gather(0, index)
        first = torch.where((gathered == peak) | (gathered.isnan() & peak.isnan()), positions, edges)  # a NaN too
        del peak
        argmax.scatter_reduce_(0, index, first, "amin")
        del index, gathered, positions, first
    isolated = (block.indptr[1:] == block.indptr[:-1]).unsqueeze(1)
    out.masked_fill_(isolated, 0)
    argmax.copy_(torch.where(isolated, block.num_src, block.indices[argmax.clamp_(max=edges - 1)]))


def _edge_values(block: Block, h_src: Tensor, chunk: slice) -> tuple[Tensor, Tensor]:
    """The edges ``chunk``'s dst positions, expanded over the columns (an ``(C, F)`` int64 view of ``C``), and their
    src rows of ``h_src`` ``(C, F)``."""
    edge_ids = torch.arange(chunk.start, chunk.stop, dtype=block.indptr.dtype, device=h_src.device)
    dst = torch.searchsorted(block.indptr, edge_ids, right=True).sub_(1)
    return dst.unsqueeze(1).expand(-1, h_src.shape[1]), h_src.index_select(0, block.indices[chunk])


@jit(parallel=True)
def _segment_max_kernel(indptr, indices, h, out, argmax):  # pragma: no cover - compiled
    width = h.shape[1]
    for d in numba.prange(indptr.shape[0] - 1):
        start, end = indptr[d], indptr[d + 1]
        if start == end:
            for f in range(width):
                out[d, f] = 0.0
                argmax[d, f] = h.shape[0]
            continue
        first = indices[start]
        for f in range(width):
            out[d, f] = h[first, f]
            argmax[d, f] = first
        for e in range(start + 1, end):
            s = indices[e]
            for f in range(width):
                if h[s, f] > out[d, f]:
                    out[d, f] = h[s, f]
                    argmax[d, f] = s


_segment_max = kernel_operator(
    "segment_max(Tensor indptr, Tensor indices, Tensor h, Tensor(a!) out, Tensor(b!) argmax) -> ()",
    _segment_max_kernel)


@jit
def _scatter_max_grad_kernel(argmax, grad, grad_src):  # pragma: no cover - compiled
    for d in range(argmax.shape[0]):
        for f in range(argmax.shape[1]):
            grad_src[argmax[d, f], f] += grad[d, f]


_scatter_max_grad = kernel_operator("scatter_max_grad(Tensor argmax, Tensor grad, Tensor(a!) grad_src) -> ()",
                                    _scatter_max_grad_kernel)


def in_degree_groups(block: Block) -> list[tuple[int, Tensor]]:
    """The dst nodes grouped by in-degree: ``(L_i, dst positions with in-degree L_i)``, ``L_i`` ascending.

    These are the ``(L_i, B_i)`` buckets of Betty §4.4.3, Eq. 5 (an LSTM aggregator
    runs once per bucket on a dense ``(B_i, L_i, F)`` tensor). Degree-0 nodes form
    a group too when present.

    Returns:
        One ``(length, dst)`` pair per distinct in-degree; ``dst`` is ``(B_i,)`` int64, ascending.
    """
    degrees = block.in_degrees()
    order = torch.argsort(degrees, stable=True)
    lengths, counts = torch.unique_consecutive(degrees[order], return_counts=True)
    return list(zip(lengths.tolist(), order.split(counts.tolist())))


def lstm_neighbours(block: Block, h_src: Tensor, lstm: LSTM) -> Tensor:
    """Final hidden state of ``lstm`` run over each dst node's in-neighbour features in CSC edge order.

    Dst nodes are grouped by in-degree (:func:`in_degree_groups`) so the LSTM runs
    once per distinct degree on a dense ``(B_i, L_i, F)`` batch (Betty §4.4.3, Eq. 5;
    DGL's degree bucketing). Isolated dst nodes get zeros. Edge weights are not used.

    Args:
        block: the block.
        h_src: ``(num_src, F)`` src features.
        lstm: an :class:`~betty_trainer.models.lstm.LSTM` with input size ``F``.

    Returns:
        ``(num_dst, lstm.hidden_size)``, the final hidden state per dst node.
    """
    out = torch.zeros(block.num_dst, lstm.hidden_size, dtype=h_src.dtype, device=h_src.device)
    rows, finals = [], []
    for length, dst in in_degree_groups(block):
        if length == 0:
            continue
        edges = block.indptr[dst].unsqueeze(1) + torch.arange(length, device=dst.device)
        sequences = h_src.index_select(0, block.indices[edges].flatten()).view(len(dst), length, -1)
        rows.append(dst)
        finals.append(lstm(sequences.unbind(1)))
    if not rows:
        return out
    return out.index_copy_(0, torch.cat(rows), torch.cat(finals))


class _EdgeSoftmax(torch.autograd.Function):
    """:func:`edge_softmax` keeping only its result for backward: ``∂L/∂s_e = α_e·(∂L/∂α_e − Σ_{e'→d} α_e'·∂L/∂α_e')``
    over the edges into ``e``'s dst node ``d``, the softmax's Jacobian applied in one pass, where autograd through
    its pieces would keep the exponentials and the gathered per-dst sums (two more ``(E, H)`` tensors) and make
    five ``(E, H)`` temporaries in backward."""

    @staticmethod
    def forward(ctx, scores: Tensor, edge_dst: Tensor, num_dst: int) -> Tensor:
        index = edge_dst.unsqueeze(1).expand_as(scores)
        peak = torch.zeros(num_dst, scores.shape[1], dtype=scores.dtype, device=scores.device)
        peak.scatter_reduce_(0, index, scores, "amax", include_self=False)
        alpha = (scores - peak.index_select(0, edge_dst)).exp_()
        total = torch.zeros_like(peak).index_add_(0, edge_dst, alpha)
        del peak
        alpha.div_(total.index_select(0, edge_dst))
        ctx.num_dst = num_dst
        ctx.save_for_backward(alpha, edge_dst)
        return alpha

    @staticmethod
    def backward(ctx, grad: Tensor):
        alpha, edge_dst = ctx.saved_tensors
        grad_scores = alpha * grad
        sums = grad_scores.new_zeros(ctx.num_dst, grad_scores.shape[1]).index_add_(0, edge_dst, grad_scores)
        if torch.is_grad_enabled():  # autograd records this backward (create_graph): out of place, differentiable
            return grad_scores - alpha * sums.index_select(0, edge_dst), None, None
        grad_scores.addcmul_(alpha, sums.index_select(0, edge_dst), value=-1)
        return grad_scores, None, None


def edge_softmax(scores: Tensor, edge_dst: Tensor, num_dst: int) -> Tensor:
    """Softmax of edge scores over each dst node's in-edges (vectorised; GAT's Eq. 3, Veličković et al. 2018).

    Subtracts the per-dst max (a constant for the gradient, which is the softmax's own), exponentiates, and
    divides by the per-dst sum, in place on one ``(E, H)`` tensor, which is the result and all autograd keeps
    (with ``edge_dst``); backward makes one ``(E, H)`` gradient and one ``(E, H)`` temporary.

    Args:
        scores: ``(E, H)`` scores, one column per attention head.
        edge_dst: ``(E,)`` int64 dst position of every edge.
        num_dst: number of dst nodes.

    Returns:
        ``(E, H)`` weights; those of one dst node sum to 1 in every column.
    """
    return _EdgeSoftmax.apply(scores, edge_dst, num_dst)


ATTENTION_CHUNK_ELEMENTS = 1 << 20  # (edge, head, feature) products made at once by attention_aggregate (4 MiB)


class _AttentionAggregate(torch.autograd.Function):
    """``out_d = Σ_{e=(s→d)} α_e ⊙ z_s`` per head, edges taken in chunks of
    :data:`ATTENTION_CHUNK_ELEMENTS` products, so no ``(E, H, F)`` message tensor exists beyond one
    chunk and none is kept: backward rebuilds each chunk's products from ``z`` and ``α`` (both kept
    by the layer anyway) for ``∂z`` and ``∂α``. Every dst node receives its edges' terms in edge
    order, whatever the chunking, so a micro-batch sums exactly as the full batch does."""

    @staticmethod
    def forward(ctx, z: Tensor, alpha: Tensor, edge_src: Tensor, edge_dst: Tensor, num_dst: int) -> Tensor:
        ctx.save_for_backward(z, alpha, edge_src, edge_dst)
        out = z.new_zeros(num_dst, *z.shape[1:])
        for chunk in _edge_chunks(edge_src.numel(), z[0].numel(), z.device):
            src, dst = edge_src[chunk], edge_dst[chunk]
            out.index_add_(0, dst, z.index_select(0, src).mul_(alpha[chunk].unsqueeze(-1)))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        z, alpha, edge_src, edge_dst = ctx.saved_tensors
        grad_z = torch.zeros_like(z) if ctx.needs_input_grad[0] else None
        grad_alpha = torch.empty_like(alpha) if ctx.needs_input_grad[1] else None
        for chunk in _edge_chunks(edge_src.numel(), z[0].numel(), z.device):
            src, dst = edge_src[chunk], edge_dst[chunk]
            grad_messages = grad.index_select(0, dst)
            if grad_alpha is not None:
                grad_alpha[chunk] = (grad_messages * z.index_select(0, src)).sum(-1)
            if grad_z is not None:
                grad_z.index_add_(0, src, grad_messages.mul_(alpha[chunk].unsqueeze(-1)))
        return grad_z, grad_alpha, None, None, None


def _edge_chunks(num_edges: int, row_elements: int, device: torch.device):
    """Consecutive edge slices of at most :data:`ATTENTION_CHUNK_ELEMENTS` // ``row_elements`` edges
    (:func:`~betty_trainer.models.chunks.chunks`)."""
    return chunks(num_edges, max(1, ATTENTION_CHUNK_ELEMENTS // max(row_elements, 1)))


def attention_aggregate(z: Tensor, alpha: Tensor, edge_src: Tensor, edge_dst: Tensor, num_dst: int) -> Tensor:
    """Attention-weighted sum of src features per dst node and head (GAT, Veličković et al. 2018, Eq. 4):
    ``out[d, k] = Σ_{e=(s→d)} alpha[e, k] · z[s, k]``, without an ``(E, H, F)`` message tensor.

    Args:
        z: ``(num_src, H, F)`` src features per head.
        alpha: ``(E, H)`` attention coefficients.
        edge_src, edge_dst: ``(E,)`` int64 local src and dst position of every edge.
        num_dst: dst nodes.

    Returns:
        ``(num_dst, H, F)``. Autograd keeps ``z``, ``alpha`` and the edge ends (no per-edge features).
    """
    return _AttentionAggregate.apply(z, alpha, edge_src, edge_dst, num_dst)

# ----- memory terms written by hand (estimator.tape) -----------------------------------------------
# The recorder (betty_trainer.models.recorded_terms) refuses the LSTM's in-degree groups (their sizes depend on the
# data); the estimate replays these instead. tests/test_estimator.py checks them against measured peaks.


def in_degree_groups_terms(tape: StepTape, c: LayerCounts) -> int:
    """in_degree_groups: degrees, a stable argsort (kept: the groups are views of it), the sorted
    degrees and unique_consecutive's two outputs. Returns the argsort's handle."""
    r, d = tape.r, c.num_dst
    degrees = r.alloc(d * INDEX_BYTES, OVER)
    values, indices, order = (r.alloc(d * INDEX_BYTES, OVER) for _ in range(3))
    r.drop(values, indices)
    scratch = [r.alloc(d * INDEX_BYTES, OVER) for _ in range(3)]  # degrees[order], lengths, counts
    r.drop(degrees, *scratch)
    return order


def lstm_neighbours_terms(tape: StepTape, c: LayerCounts, hd: int, a: int, hd_grad: bool):
    """lstm_neighbours: per in-degree group, gather the ``(B, L, a)`` sequences and run the LSTM;
    then ``index_copy_`` the final states into a zero ``(D, a)``. Returns (out, backward)."""
    r, f = tape.r, tape.f
    d = c.num_dst
    active = sum(rows for _, rows in c.degree_histogram)
    out = r.alloc(d * a * f, AGG)  # zeros, filled in place
    order = in_degree_groups_terms(tape, c)
    steps = sum(length for length, _ in c.degree_histogram)  # each LSTM step uses W_ih and b once
    grads = {"W_ih": SharedGradient(r, steps, tape.accumulating),
             "W_hh": SharedGradient(r, steps - len(c.degree_histogram), tape.accumulating),
             "b": SharedGradient(r, steps, tape.accumulating, out_of_place_at=2)}  # as the profiler shows
    groups, finals, edges, seq = [], [], None, None
    for length, rows in c.degree_histogram:
        starts, steps = r.alloc(rows * INDEX_BYTES, OVER), r.alloc(length * INDEX_BYTES, OVER)
        new_edges = r.alloc(rows * length * INDEX_BYTES, OVER)
        r.drop(starts, steps, edges)
        edges = new_edges
        index = r.alloc(rows * length * LOCAL_INDEX_BYTES, AGG)  # indices[edges]: int32 local positions
        previous, seq = seq, r.alloc(rows * length * a * f, AGG)
        if hd_grad:
            r.save(index)  # IndexSelectBackward keeps the index
        r.drop(index, previous)  # a group's `sequences` lives until the next group's replaces it
        final, lstm_bwd = lstm_terms(tape, seq, rows, length, a, a, grads)
        groups.append((rows, length, index, lstm_bwd))
        finals.append(final)
    rows_cat, finals_cat = r.alloc(active * INDEX_BYTES, AGG), r.alloc(active * a * f, AGG)
    r.save(rows_cat, finals_cat)  # IndexCopyBackward keeps the index and the source
    r.drop(rows_cat, finals_cat, *finals, order, edges, seq)

    def backward(grad: int, grad_h: int | None) -> int | None:
        """``grad_h``: the gradient ``h`` already has (from the self term), which every group's
        gather gradient is added into."""
        source = r.alloc(active * a * f, GRAD)  # IndexCopyBackward: grad.index_select
        r.drop(grad, rows_cat, finals_cat)
        for position, (rows, length, index, lstm_bwd) in reversed(list(enumerate(groups))):
            # each group's final state's gradient is a view of it; the last group processed frees it
            grad_x = lstm_bwd(source, hd_grad, position == 0)
            if not hd_grad:
                continue
            stacked = r.alloc(rows * length * a * f, GRAD)  # UnbindBackward: stack
            r.drop(*grad_x)
            grad_h = tape.accumulate(grad_h, r.alloc(c.num_src * a * f, GRAD))  # IndexSelectBackward
            r.drop(stacked, index)
        if not groups:
            r.drop(source)
        return grad_h

    return out, backward
