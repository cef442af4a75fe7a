"""LLVM IR of 16-lane vector code, and the score and value products of a tile of unpacked rows.

The toolkit of the vector intrinsics (:func:`vec_helpers`: constants, loads and stores of
``<16 x float>``, ``llvm.fma``, the ``vpermps`` table lookup of AVX-512 or AVX2, prefetches,
lane sums; :func:`array_args`, :func:`c_f32`; the loops over blocks of query heads
:func:`g_blocks_any`, and the bodies of a tile's scores and weighted sums, :func:`emit_scores` and
:func:`emit_row_values`) and the two products of a tile whose rows are float32 values already:
:func:`tile_scores` and :func:`tile_values`, with :func:`rows_scores_loop` and
:func:`rows_values_loop`, the plain loops they are checked against. The same products straight
from packed codes are in :mod:`.ir_codes`, :mod:`.simd3`, :mod:`.simd_int2`, :mod:`.simd_signs`
and :mod:`.simd_lanes`; the online softmax of a tile in :mod:`.ir_softmax`.
"""

from __future__ import annotations

import types

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .cpu_features import HAVE_AVX512

__all__ = [
    "PREFETCH_ROWS",
    "vec_helpers",
    "array_args",
    "c_f32",
    "g_blocks_any",
    "emit_scores",
    "emit_row_values",
    "scores_codegen",
    "tile_scores",
    "tile_values",
    "rows_scores_loop",
    "rows_values_loop",
]


#: Rows ahead of the current one whose codes are prefetched (one tile): the codes stream from
#: memory while the previous tile is scored.
PREFETCH_ROWS = 64


def vec_helpers():
    """The building blocks of the vector intrinsics' LLVM code, as one namespace.

    ``ir``, ``cgutils``, the types ``f32``, ``i64``, ``v16`` (``<16 x float>``) and functions of an
    IR builder: ``const`` (an i64), ``vload`` / ``vstore`` (sixteen float32 at an element offset),
    ``fma_fn`` (``llvm.fma`` on ``v16``), ``perm_fn`` (the 16-entry table lookup), ``prefetch``,
    ``row_ptr``, ``hsum`` / ``reduce_many`` (lane sums), ``splat``, ``shuf`` and ``g_blocks``
    (query heads in blocks of four, two, one).
    """
    from llvmlite import ir
    from numba.core import cgutils

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    v16 = ir.VectorType(f32, 16)

    def const(x):
        return ir.Constant(i64, x)

    def shuf(builder, a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(idx)), idx))

    def vload(builder, base, off):
        return builder.load(builder.bitcast(builder.gep(base, [off]), v16.as_pointer()), align=4)

    def vstore(builder, val, base, off):
        builder.store(val, builder.bitcast(builder.gep(base, [off]), val.type.as_pointer()), align=4)

    def declared(builder, name, ret, params):
        """The LLVM intrinsic ``name`` of the builder's module, declared on first use."""
        fn = builder.module.globals.get(name)
        return fn if fn is not None else ir.Function(builder.module, ir.FunctionType(ret, params), name)

    def fma_fn(builder):
        return declared(builder, "llvm.fma.v16f32", v16, [v16, v16, v16])

    def perm_fn(builder):
        """``perm(table, idx)``: sixteen float32 of a 16-entry table register picked by the low
        four bits of sixteen int32 indices (``vpermps``).

        With AVX-512 one instruction; with AVX2 each half of the indices looks up both halves
        of the table (8-lane ``vpermps``, which reads the low three bits) and bit 3 picks one.
        """
        v16i32 = ir.VectorType(i32, 16)
        if HAVE_AVX512:
            fn = declared(builder, "llvm.x86.avx512.permvar.sf.512", v16, [v16, v16i32])
            return lambda table, idx: builder.call(fn, [table, idx])
        v8, v8i32 = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
        fn8 = declared(builder, "llvm.x86.avx2.permps", v8, [v8, v8i32])
        low, high = list(range(8)), list(range(8, 16))
        eight = ir.Constant(v8i32, [8] * 8)
        zero = ir.Constant(v8i32, [0] * 8)

        def perm(table, idx):
            t_lo, t_hi = shuf(builder, table, table, low), shuf(builder, table, table, high)
            out = []
            for half in (low, high):
                i8 = shuf(builder, idx, idx, half)
                upper = builder.icmp_signed("!=", builder.and_(i8, eight), zero)
                out.append(builder.select(upper, builder.call(fn8, [t_hi, i8]), builder.call(fn8, [t_lo, i8])))
            return shuf(builder, out[0], out[1], low + high)

        return perm

    def prefetch(builder, ptr, locality=3):
        """Prefetch the cache line at byte pointer ``ptr`` for reading (``locality`` 3: into L1, 1: L2)."""
        i8p = ir.IntType(8).as_pointer()
        fn = declared(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, i32, i32, i32])
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])

    def row_ptr(builder, data, stride, t, ahead=False):
        """Byte pointer to row ``t`` of a 2-D array (``data``, row ``stride`` in bytes); with
        ``ahead``, the row :data:`PREFETCH_ROWS` further on is prefetched."""
        row = builder.gep(data, [builder.mul(t, stride)])
        if ahead:
            prefetch(builder, builder.gep(row, [builder.mul(const(PREFETCH_ROWS), stride)]))
        return row

    def hsum(builder, v):
        n = 16
        while n > 1:
            v = builder.fadd(shuf(builder, v, v, list(range(n // 2))), shuf(builder, v, v, list(range(n // 2, n))))
            n //= 2
        return builder.extract_element(v, ir.Constant(i32, 0))

    def reduce_many(builder, vs):
        """<n x float>: the lane sums of the n = len(vs) <16 x float> (n a power of two <= 16), in
        order. A transposing reduction: each level adds the halves of every input's partial
        sums while merging two vectors into one, so 16 inputs take 30 two-source shuffles and
        15 adds (four reductions of four: 40 and 20)."""
        n = len(vs)
        if n & (n - 1) or not 1 <= n <= 16:
            raise ValueError(f"reduce_many takes 1, 2, 4, 8 or 16 vectors, received {n}")
        m, k = 16, 1  # lanes per input in each vector, inputs per vector (m * k == 16)
        while len(vs) > 1:
            lo = [base + j * m + t for base in (0, 16) for j in range(k) for t in range(m // 2)]
            hi = [i + m // 2 for i in lo]
            vs = [builder.fadd(shuf(builder, x, y, lo), shuf(builder, x, y, hi)) for x, y in zip(vs[0::2], vs[1::2])]
            m, k = m // 2, 2 * k
        v = vs[0]
        while m > 1:  # fewer than 16 inputs: the rest of the halving within the one vector
            lo = [j * m + t for j in range(k) for t in range(m // 2)]
            v = builder.fadd(shuf(builder, v, v, lo), shuf(builder, v, v, [i + m // 2 for i in lo]))
            m //= 2
        return v

    def splat(builder, x):
        v = builder.insert_element(ir.Constant(v16, ir.Undefined), x, ir.Constant(i32, 0))
        return shuf(builder, v, v, [0] * 16)

    def g_blocks(builder, g_n, emit):
        """``emit(g0, gb)`` for query heads in blocks of four, then two, then one (``g0`` an IR value)."""
        n4 = builder.udiv(g_n, const(4))
        with cgutils.for_range(builder, n4) as lp:
            emit(builder.mul(lp.index, const(4)), 4)
        rest = builder.sub(g_n, builder.mul(n4, const(4)))
        g2 = builder.mul(n4, const(4))
        with cgutils.if_unlikely(builder, builder.icmp_unsigned(">=", rest, const(2))):
            emit(g2, 2)
        with cgutils.if_unlikely(builder, builder.icmp_unsigned("==", builder.urem(rest, const(2)), const(1))):
            emit(builder.sub(g_n, const(1)), 1)

    return types.SimpleNamespace(
        ir=ir,
        cgutils=cgutils,
        f32=f32,
        i64=i64,
        v16=v16,
        const=const,
        vload=vload,
        vstore=vstore,
        fma_fn=fma_fn,
        perm_fn=perm_fn,
        prefetch=prefetch,
        row_ptr=row_ptr,
        hsum=hsum,
        reduce_many=reduce_many,
        splat=splat,
        g_blocks=g_blocks,
        shuf=shuf,
    )


def array_args(context, builder, sig, args, which):
    """``[(data pointer, shape tuple)]`` of the array arguments at positions ``which`` of an intrinsic."""
    from numba.core import cgutils

    out = []
    for i in which:
        a = context.make_array(sig.args[i])(context, builder, args[i])
        out.append((a.data, cgutils.unpack_tuple(builder, a.shape)))
    return out


def c_f32(*tys) -> bool:
    """Whether every Numba type of ``tys`` is a C-contiguous float32 array (the intrinsics' typing checks)."""
    return all(isinstance(t, nbt.Array) and t.dtype == nbt.float32 and t.layout == "C" for t in tys)


def g_blocks_any(builder, h, g_n, emit):
    """``emit(g0, gb)`` for query heads in blocks of four, then one block of the 1-3 left."""
    n4 = builder.udiv(g_n, h.const(4))
    with h.cgutils.for_range(builder, n4) as lp:
        emit(builder.mul(lp.index, h.const(4)), 4)
    g0 = builder.mul(n4, h.const(4))
    rest = builder.sub(g_n, g0)
    for gb in (1, 2, 3):
        with h.cgutils.if_unlikely(builder, builder.icmp_unsigned("==", rest, h.const(gb))):
            emit(g0, gb)


def emit_scores(builder, h, nt, s, s_w, accs, rows_of, fill):
    """Per block of ``gb`` query heads from ``g0`` (``emit(g0, gb)``, returned): rows of a tile
    ``rows_of(gb)`` at a time, ``fill(g0, gb, r0, n)`` adding row ``r0 + i``'s products for head
    ``g0 + gi`` into ``accs[gi · n + i]`` (zeroed here), four rows' lane sums stored at once;
    the rows left over one at a time. ``s[g, r]`` gets the score of row ``r`` for head ``g``."""

    def emit(g0, gb):
        rows = rows_of(gb)  # accumulators: gb x rows <= 16
        ngrp = builder.udiv(nt, h.const(rows))
        with h.cgutils.for_range(builder, ngrp) as lp:
            r0 = builder.mul(lp.index, h.const(rows))
            for a in accs[: gb * rows]:
                builder.store(h.ir.Constant(h.v16, None), a)
            fill(g0, gb, r0, rows)
            n_acc = gb * rows
            span = n_acc if n_acc in (8, 16) else 4  # accumulators summed in one transposing reduction
            run = min(span, rows)  # sums of one head, stored together
            for a0 in range(0, n_acc, span):
                sums = h.reduce_many(builder, [builder.load(a) for a in accs[a0 : a0 + span]])
                for j in range(0, span, run):
                    gi, i = divmod(a0 + j, rows)
                    part = sums if run == span else h.shuf(builder, sums, sums, list(range(j, j + run)))
                    srow = builder.add(builder.mul(builder.add(g0, h.const(gi)), s_w), r0)
                    h.vstore(builder, part, s, builder.add(srow, h.const(i)))
        done = builder.mul(ngrp, h.const(rows))
        with h.cgutils.for_range(builder, builder.sub(nt, done)) as lp:  # the last rows, one at a time
            r = builder.add(done, lp.index)
            for a in accs[:gb]:
                builder.store(h.ir.Constant(h.v16, None), a)
            fill(g0, gb, r, 1)
            for gi in range(gb):
                at = builder.add(builder.mul(builder.add(g0, h.const(gi)), s_w), r)
                builder.store(h.hsum(builder, builder.load(accs[gi])), builder.gep(s, [at]))

    return emit


def emit_row_values(builder, h, g_n, d, nt, w, w_w, acc, row_source):
    """``acc[g, :] += Σ_{r < nt} w[g, r] · row_r`` for every query head (blocks of
    :func:`g_blocks_any`), channels 64 at a time: four 16-channel chunks times the block's heads
    of accumulators stay in registers over the rows. ``row_source(r)`` (``r`` an IR value) is
    called once per row and returns ``chunk(c)``: the <16 x float> of channels ``16c .. 16c + 15``
    of row ``r`` (``c`` an IR value)."""
    fma = h.fma_fn(builder)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

    def emit(g0, gb):
        with h.cgutils.for_range(builder, builder.udiv(d, h.const(64))) as lc:
            c0 = builder.mul(lc.index, h.const(4))  # first chunk of the 64 channels
            offs = [
                [
                    builder.add(
                        builder.mul(builder.add(g0, h.const(gi)), d),
                        builder.mul(builder.add(c0, h.const(k)), h.const(16)),
                    )
                    for k in range(4)
                ]
                for gi in range(gb)
            ]
            for gi in range(gb):
                for k in range(4):
                    builder.store(h.vload(builder, acc, offs[gi][k]), accs[4 * gi + k])
            with h.cgutils.for_range(builder, nt) as lr:
                r = lr.index
                chunk = row_source(r)
                wv = [
                    h.splat(
                        builder,
                        builder.load(builder.gep(w, [builder.add(builder.mul(builder.add(g0, h.const(gi)), w_w), r)])),
                    )
                    for gi in range(gb)
                ]
                for k in range(4):
                    x = chunk(builder.add(c0, h.const(k)))
                    for gi in range(gb):
                        a = accs[4 * gi + k]
                        builder.store(builder.call(fma, [wv[gi], x, builder.load(a)]), a)
            for gi in range(gb):
                for k in range(4):
                    h.vstore(builder, builder.load(accs[4 * gi + k]), acc, offs[gi][k])

    g_blocks_any(builder, h, g_n, emit)


# ---- scores and weighted sums of a tile of unpacked rows, in 16-lane vectors ----------------
#
# Both take C-contiguous float32 arrays and a head_dim ``d`` that is a multiple of 64 (four
# vectors); they are generic LLVM vector code (``llvm.fma`` on <16 x float>), kept on the same
# condition as the code lookups of :mod:`.ir_codes` (:data:`~.cpu_features.HAVE_PERMPS`), where
# they were measured. The query heads of a KV group are taken four (then two, then one) at a time
# so that one load of a row feeds four multiply-adds; accumulators stay in registers for a whole tile.


def scores_codegen(context, builder, sig, args):
    """LLVM code of :func:`tile_scores` (also of ``arraykv.ops.numba.lowrank_fused``'s score tiles)."""
    h = vec_helpers()
    (buf, (_, width)), (qr, (g_n, d)), (s, (_, s_w)) = array_args(context, builder, sig, args, (0, 2, 3))
    nt = args[1]
    fma = h.fma_fn(builder)
    nch = builder.udiv(d, h.const(16))
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]
    qs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(4)]

    def fill(g0, gb, r0, n_rows):
        with h.cgutils.for_range(builder, nch) as lc:
            off = builder.mul(lc.index, h.const(16))
            for gi in range(gb):
                builder.store(
                    h.vload(builder, qr, builder.add(builder.mul(builder.add(g0, h.const(gi)), d), off)), qs[gi]
                )
            for i in range(n_rows):
                x = h.vload(builder, buf, builder.add(builder.mul(builder.add(r0, h.const(i)), width), off))
                for gi in range(gb):
                    a = accs[gi * n_rows + i]
                    builder.store(builder.call(fma, [x, builder.load(qs[gi]), builder.load(a)]), a)

    h.g_blocks(builder, g_n, emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 16 // gb if gb > 1 else 8, fill))
    return context.get_dummy_value()


def _values_codegen(context, builder, sig, args):
    h = vec_helpers()
    (buf, (_, width)), (w, (_, w_w)), (acc, (g_n, d)) = array_args(context, builder, sig, args, (0, 2, 3))
    nt = args[1]
    fma = h.fma_fn(builder)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

    def emit(g0, gb):
        with h.cgutils.for_range(builder, builder.udiv(d, h.const(64))) as lc:
            c0 = builder.mul(lc.index, h.const(64))
            rows = [builder.mul(builder.add(g0, h.const(gi)), d) for gi in range(gb)]
            for gi in range(gb):
                for k in range(4):
                    builder.store(
                        h.vload(builder, acc, builder.add(rows[gi], builder.add(c0, h.const(16 * k)))), accs[4 * gi + k]
                    )
            with h.cgutils.for_range(builder, nt) as lr:
                r = lr.index
                wv = [
                    h.splat(
                        builder,
                        builder.load(builder.gep(w, [builder.add(builder.mul(builder.add(g0, h.const(gi)), w_w), r)])),
                    )
                    for gi in range(gb)
                ]
                base = builder.add(builder.mul(r, width), c0)
                for k in range(4):
                    x = h.vload(builder, buf, builder.add(base, h.const(16 * k)))
                    for gi in range(gb):
                        a = accs[4 * gi + k]
                        builder.store(builder.call(fma, [wv[gi], x, builder.load(a)]), a)
            for gi in range(gb):
                for k in range(4):
                    h.vstore(
                        builder,
                        builder.load(accs[4 * gi + k]),
                        acc,
                        builder.add(rows[gi], builder.add(c0, h.const(16 * k))),
                    )

    h.g_blocks(builder, g_n, emit)
    return context.get_dummy_value()


@intrinsic
def tile_scores(typingctx, buf, nt, qr, s):
    """``s[g, r] = Σ_j qr[g, j] · buf[r, j]`` for ``r < nt`` (every row of ``qr``).

    ``buf`` (rows, width), ``qr`` (G, d), ``s`` (G, ≥ nt): C-contiguous float32, ``d`` a multiple
    of 16, ``nt ≤ rows``, ``width ≥ d``. Nothing is checked at run time: the caller's tile
    buffers have these shapes by construction.
    """
    if not (c_f32(buf, qr, s) and isinstance(nt, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, qr, s), scores_codegen


@intrinsic
def tile_values(typingctx, buf, nt, w, acc):
    """``acc[g, j] += Σ_{r < nt} w[g, r] · buf[r, j]`` (every row of ``acc``).

    ``buf`` (rows, width), ``w`` (G, ≥ nt), ``acc`` (G, d): C-contiguous float32, ``d`` a
    multiple of 64, ``nt ≤ rows``, ``width ≥ d``; not checked at run time.
    """
    if not (c_f32(buf, w, acc) and isinstance(nt, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, w, acc), _values_codegen


@nb.njit
def rows_scores_loop(rows, nt, qr, s):
    """``s[g, r] = Σ_j qr[g, j] · rows[r, j]`` for ``r < nt``: the loop the score tiles are checked against."""
    for g in range(qr.shape[0]):
        for r in range(nt):
            x = np.float32(0.0)
            for j in range(qr.shape[1]):
                x += qr[g, j] * rows[r, j]
            s[g, r] = x


@nb.njit
def rows_values_loop(rows, nt, w, acc):
    """``acc[g, j] += Σ_{r < nt} w[g, r] · rows[r, j]``: the loop the value tiles are checked against."""
    for g in range(acc.shape[0]):
        for r in range(nt):
            for j in range(acc.shape[1]):
                acc[g, j] += w[g, r] * rows[r, j]
