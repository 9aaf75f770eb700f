"""Register-held row sums for the compiled aggregation kernels (``betty_trainer.models.aggregate``): LLVM vector
intrinsics that numba kernels call, and the CPU's prefetch hints.

numba compiles a row's sum ``acc[f] += x[f]`` over an output row in memory, which LLVM cannot keep in registers
across a row's edges (the output may alias the rows read), so every pass over the edges loads and stores the sum.
The accumulator here is a stack array of ``<16 x float>`` vectors that nothing else can address: LLVM promotes it to
registers for the whole row, as a hand-written SpMM keeps its accumulators (libxsmm's, in DGL's CPU ``copy_u_sum``).
Each lane adds the same products in the same order as the scalar loop, so the bits do not change. The scatters hold
a dst row's scaled gradient the same way while they add it into each of its edges' src rows.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from betty_trainer.rng import numba

LANES = 16
"""float32 lanes of one accumulator vector: one AVX-512 register (two on AVX2; LLVM splits the vector)."""

SOURCE_KEY = zlib.crc32(Path(__file__).read_bytes())
"""A digest of this file, for the kernels built on it to hold in their closures: numba's disk cache keys a kernel by
its own file's time stamp and its closure's values, so this makes a change here compile them anew."""

if numba is None:  # pragma: no cover - numba is a declared dependency
    def vectors(count):
        """A float32 accumulator of ``count`` vectors (the compiled form's stack array); the calls below use its
        first ``count`` vectors, as the compiled ones do."""
        return np.zeros(count * LANES, np.float32)

    def zero_vectors(count, acc):
        acc[:count * LANES] = 0

    def add_four_rows(count, acc, flat, b0, b1, b2, b3, c0, c1, c2, c3):
        n = count * LANES
        acc[:n] += (c0 * flat[b0:b0 + n] + c1 * flat[b1:b1 + n]) + (c2 * flat[b2:b2 + n] + c3 * flat[b3:b3 + n])

    def add_row(count, acc, flat, b0, c0):
        acc[:count * LANES] += c0 * flat[b0:b0 + count * LANES]

    def store_vectors(count, acc, out, base, scale):
        out[base:base + count * LANES] = acc[:count * LANES] * scale

    def load_vectors(count, acc, rows, base, scale):
        acc[:count * LANES] = rows[base:base + count * LANES] * scale

    def add_into_row(count, acc, out, base, c0):
        out[base:base + count * LANES] += c0 * acc[:count * LANES]

    def prefetch(array, index):
        """Nothing: a hint only the compiled kernels give."""

    prefetch_for_write = prefetch_to_l2 = prefetch
else:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils, errors
    from numba.extending import intrinsic

    _FLOAT = ir.FloatType()
    _VECTOR = ir.VectorType(_FLOAT, LANES)
    _I32 = ir.IntType(32)

    def _count(count) -> int:
        """The vector count a call is compiled for: it must be a compile-time constant (a literal, or a closure
        variable of the kernel's factory), as it sizes the stack array and unrolls the vectors."""
        if not isinstance(count, types.IntegerLiteral):
            raise errors.RequireLiteralValue("the vector count of a register-held sum is a compile-time constant")
        return count.literal_value

    def _slots(builder, acc, count: int):
        """Pointers to the ``count`` vectors of the stack array ``acc`` (an ``i8*``)."""
        array = builder.bitcast(acc, ir.ArrayType(_VECTOR, count).as_pointer())
        return [builder.gep(array, [_I32(0), _I32(j)]) for j in range(count)]

    def _splat(builder, value):
        """``value`` (a float) in every lane."""
        lane = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, _I32(0))
        return builder.shuffle_vector(lane, ir.Constant(_VECTOR, ir.Undefined),
                                      ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))

    def _vector_at(context, builder, array_type, array, base, j: int):
        """A ``<16 x float>*`` to elements ``base + 16·j …`` of a C-contiguous float32 array (unaligned)."""
        data = context.make_array(array_type)(context, builder, array).data
        return builder.bitcast(builder.gep(data, [builder.add(base, ir.Constant(base.type, j * LANES))]),
                               _VECTOR.as_pointer())

    def _slots_and_row(context, builder, signature, arguments, count: int):
        """Per vector ``j`` of an intrinsic ``(count, acc, array, base, …)``: the accumulator's slot and a pointer to
        ``array[base + 16·j …]``."""
        return [(slot, _vector_at(context, builder, signature.args[2], arguments[2], arguments[3], j))
                for j, slot in enumerate(_slots(builder, arguments[1], count))]

    @intrinsic(prefer_literal=True)
    def vectors(typing_context, count):
        """A stack array of ``count`` ``<16 x float>`` vectors (its values undefined until :func:`zero_vectors` or
        :func:`load_vectors`),
        allocated once in the calling function's entry block: a thread's accumulator for one row tile, reused for
        every row it sums."""
        n = _count(count)

        def codegen(context, builder, signature, arguments):  # pragma: no cover - compiled
            return builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(_VECTOR, n)), ir.IntType(8).as_pointer())
        return types.voidptr(count), codegen

    @intrinsic(prefer_literal=True)
    def zero_vectors(typing_context, count, acc):
        """``acc[:] = 0``."""
        n = _count(count)

        def codegen(context, builder, signature, arguments):  # pragma: no cover - compiled
            for slot in _slots(builder, arguments[1], n):
                builder.store(ir.Constant(_VECTOR, None), slot)
            return context.get_dummy_value()
        return types.void(count, acc), codegen

    @intrinsic(prefer_literal=True)
    def add_four_rows(typing_context, count, acc, flat, b0, b1, b2, b3, c0, c1, c2, c3):
        """``acc += (c0·x0 + c1·x1) + (c2·x2 + c3·x3)``, ``xi = flat[bi : bi + 16·count]``: four edges' rows in one
        pass over the sum (a coefficient of a constant 1 folds away)."""
        n = _count(count)

        def codegen(context, builder, signature, arguments):  # pragma: no cover - compiled
            factors = [_splat(builder, c) for c in arguments[7:11]]
            for j, slot in enumerate(_slots(builder, arguments[1], n)):
                x = [builder.fmul(factors[i], builder.load(
                    _vector_at(context, builder, signature.args[2], arguments[2], arguments[3 + i], j), align=4))
                    for i in range(4)]
                pair_sum = builder.fadd(builder.fadd(x[0], x[1]), builder.fadd(x[2], x[3]))
                builder.store(builder.fadd(builder.load(slot), pair_sum), slot)
            return context.get_dummy_value()
        return types.void(count, acc, flat, b0, b1, b2, b3, c0, c1, c2, c3), codegen

    def _one_row_intrinsic(update, doc: str):
        """An intrinsic ``(count, acc, array, base, factor)`` that runs ``update(builder, slot, row, factor)`` for each
        of the ``count`` accumulator vectors, ``row`` pointing at ``array[base + 16·j …]``, ``factor`` in every
        lane."""
        @intrinsic(prefer_literal=True)
        def one_row(typing_context, count, acc, array, base, factor):
            n = _count(count)

            def codegen(context, builder, signature, arguments):  # pragma: no cover - compiled
                lanes = _splat(builder, arguments[4])
                for slot, row in _slots_and_row(context, builder, signature, arguments, n):
                    update(builder, slot, row, lanes)
                return context.get_dummy_value()
            return types.void(count, acc, array, base, factor), codegen
        one_row.__doc__ = doc
        return one_row

    add_row = _one_row_intrinsic(
        lambda builder, slot, row, factor: builder.store(
            builder.fadd(builder.load(slot), builder.fmul(factor, builder.load(row, align=4))), slot),
        "``add_row(count, acc, flat, b0, c0)``: ``acc += c0·flat[b0 : b0 + 16·count]``.")
    store_vectors = _one_row_intrinsic(
        lambda builder, slot, row, factor: builder.store(builder.fmul(builder.load(slot), factor), row, align=4),
        "``store_vectors(count, acc, out, base, scale)``: ``out[base : base + 16·count] = acc · scale``.")
    load_vectors = _one_row_intrinsic(
        lambda builder, slot, row, factor: builder.store(builder.fmul(builder.load(row, align=4), factor), slot),
        "``load_vectors(count, acc, rows, base, scale)``: ``acc = rows[base : base + 16·count] · scale``.")
    add_into_row = _one_row_intrinsic(
        lambda builder, slot, row, factor: builder.store(
            builder.fadd(builder.load(row, align=4), builder.fmul(factor, builder.load(slot))), row, align=4),
        "``add_into_row(count, acc, out, base, c0)``: ``out[base : base + 16·count] += c0·acc``.")

    def _prefetch_intrinsic(write: int, locality: int):
        """``llvm.prefetch`` of ``array``'s element ``index`` (C-contiguous), for a read (``write`` 0) or a write (1),
        of temporal ``locality`` 3 (high: into L1, x86 ``prefetcht0``) or 1 (low: ``prefetcht2``, which x86 cores
        bring into L2, not L1), data cache."""
        @intrinsic
        def prefetch(typing_context, array, index):
            def codegen(context, builder, signature, arguments):  # pragma: no cover - compiled
                data = context.make_array(signature.args[0])(context, builder, arguments[0]).data
                byte_pointer = ir.IntType(8).as_pointer()
                function = builder.module.declare_intrinsic(
                    "llvm.prefetch", [byte_pointer], ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32]))
                address = builder.bitcast(builder.gep(data, [arguments[1]]), byte_pointer)
                builder.call(function, [address, _I32(write), _I32(locality), _I32(1)])
                return context.get_dummy_value()
            return types.void(array, index), codegen
        return prefetch

    prefetch, prefetch_for_write = _prefetch_intrinsic(0, 3), _prefetch_intrinsic(1, 3)
    prefetch_to_l2 = _prefetch_intrinsic(0, 1)
