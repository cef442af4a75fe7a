"""Packed 3-bit codes to centroid values sixteen at a time (Numba, ``vpermps``).

Three-bit codes do not split into bit planes of whole bytes the way 4- and 2-bit codes do
(:mod:`arraykv.ops.numba.ir_codes`): eight codes share three bytes. Sixteen codes are six bytes,
though, so chunk ``c`` of a row (channels ``16c .. 16c + 15``, in channel order) is the 48-bit
word at byte ``6c``: one byte shuffle puts the two bytes holding code ``k`` (bytes ``3k >> 3``
and the next) in 32-bit lane ``k``, one variable shift by ``3k & 7`` brings the code to bit 0,
and ``vpermps`` looks the sixteen up in the codebook register, reading four index bits: the
bit above each code does not matter because the table repeats the eight centroids.
:func:`tile_scores_codes_3` and :func:`tile_values_codes_3` are the tile products of
:mod:`arraykv.ops.numba.ir_tiles` read this way (rows of ``d`` codes, ``d`` a multiple of 64, in
channel order: the queries and value sums need no permutation); their ``*_loop`` versions are
the plain loops they are checked against.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .ir_tiles import (
    array_args,
    c_f32,
    emit_row_values,
    emit_scores,
    g_blocks_any,
    rows_scores_loop,
    rows_values_loop,
    vec_helpers,
)

__all__ = [
    "tile_scores_codes_3",
    "tile_values_codes_3",
    "tile_scores_codes_3_loop",
    "tile_values_codes_3_loop",
    "rows_3_loop",
]


def _source3(context, builder, h, sig, args):
    """``(row_ptr(t, prefetch), chunk(row, c))``: the code rows of ``args[0]`` and the centroid
    values of chunk ``c`` (an i64 IR value) of a row, from the 16-float table ``args[3]``."""
    ir = h.ir
    i16, i32 = ir.IntType(16), ir.IntType(32)
    v16i32 = ir.VectorType(i32, 16)
    c_arr = context.make_array(sig.args[0])(context, builder, args[0])
    stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
    tab_arr = context.make_array(sig.args[3])(context, builder, args[3])
    table = builder.load(builder.bitcast(tab_arr.data, h.v16.as_pointer()), align=4)
    perm = h.perm_fn(builder)
    i8 = ir.IntType(8)
    v8i8 = ir.VectorType(i8, 8)
    # lane k's code is bits [3k, 3k + 3) of the 48-bit word: its two bytes (3k >> 3, one more;
    # byte 6 and 7 of the word are zero) gathered into the lane's low half by one byte shuffle,
    # then shifted right by 3k & 7; the bits left above the code do not matter, since the
    # table repeats a codebook of 8 centroids (table16) and vpermps reads the low four bits
    gather = ir.Constant(
        ir.VectorType(i32, 64), [b for k in range(16) for b in ((3 * k) >> 3, ((3 * k) >> 3) + 1, 8, 8)]
    )
    shifts = ir.Constant(v16i32, [(3 * k) & 7 for k in range(16)])
    zero8 = ir.Constant(v8i8, [0] * 8)

    def row_ptr(t, prefetch=False):
        return h.row_ptr(builder, c_arr.data, stride, t, ahead=prefetch)

    def chunk(row, c):
        at = builder.gep(row, [builder.mul(c, h.const(6))])  # six bytes: no read past the row
        lo = builder.zext(builder.load(builder.bitcast(at, i32.as_pointer()), align=1), h.i64)
        hi = builder.zext(
            builder.load(builder.bitcast(builder.gep(at, [h.const(4)]), i16.as_pointer()), align=1), h.i64
        )
        word = builder.or_(lo, builder.shl(hi, ir.Constant(h.i64, 32)))
        pairs = builder.shuffle_vector(builder.bitcast(word, v8i8), zero8, gather)
        idx = builder.lshr(builder.bitcast(pairs, v16i32), shifts)
        return perm(table, idx)

    return row_ptr, chunk


def _scores3_codegen(context, builder, sig, args):
    h = vec_helpers()
    t0, nt = args[1], args[2]
    (qr, (g_n, d)), (s, (_, s_w)) = array_args(context, builder, sig, args, (4, 5))
    row_ptr, chunk = _source3(context, builder, h, sig, args)
    fma = h.fma_fn(builder)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

    def fill(g0, gb, r0, n_rows):  # n_rows (python int) rows from row r0 (relative to t0)
        rows = [row_ptr(builder.add(t0, builder.add(r0, h.const(i))), prefetch=True) for i in range(n_rows)]
        with h.cgutils.for_range(builder, builder.udiv(d, h.const(16))) as lc:
            off = builder.mul(lc.index, h.const(16))
            qv = [
                h.vload(builder, qr, builder.add(builder.mul(builder.add(g0, h.const(gi)), d), off)) for gi in range(gb)
            ]
            for i in range(n_rows):
                x = chunk(rows[i], lc.index)
                for gi in range(gb):
                    a = accs[gi * n_rows + i]
                    builder.store(builder.call(fma, [x, qv[gi], builder.load(a)]), a)

    g_blocks_any(builder, h, g_n, emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 4 if gb >= 3 else 8, fill))
    return context.get_dummy_value()


def _values3_codegen(context, builder, sig, args):
    h = vec_helpers()
    t0, nt = args[1], args[2]
    (w, (_, w_w)), (acc, (g_n, d)) = array_args(context, builder, sig, args, (4, 5))
    row_ptr, chunk = _source3(context, builder, h, sig, args)

    def row_source(r):
        row = row_ptr(builder.add(t0, r), prefetch=True)
        return lambda c: chunk(row, c)

    emit_row_values(builder, h, g_n, d, nt, w, w_w, acc, row_source)
    return context.get_dummy_value()


def _typer(gen, name):
    def typer(typingctx, codes, t0, nt, tab, x, out):
        ok = (
            isinstance(codes, nbt.Array)
            and codes.ndim == 2
            and codes.dtype == nbt.uint8
            and isinstance(tab, nbt.Array)
            and c_f32(x, out)
            and x.ndim == 2
            and out.ndim == 2
            and all(isinstance(v, nbt.Integer) for v in (t0, nt))
        )
        if not ok:
            return None
        return nbt.void(codes, nbt.int64, nbt.int64, tab, x, out), gen

    typer.__name__ = name
    return intrinsic(typer)


#: ``tile_scores_codes_3(codes, t0, nt, tab, qr, s)``: ``s[g, r] = Σ_j qr[g, j] · tab[code_j(t0 + r)]``
#: for ``r < nt``; ``codes`` uint8 (T, 3d / 8), rows of contiguous bytes (any row stride), ``tab``
#: 16 float32 (:func:`arraykv.ops.numba.planar.table16` of the 8 centroids: entries 8..15 repeat
#: 0..7, since a code is read with the bit above it; any dtype view of its 64 bytes), ``qr`` (G, d),
#: ``s`` (G, ≥ nt) C-contiguous
#: float32, ``d`` a multiple of 16. Not checked at run time.
#: Needs :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS` (AVX-512 or AVX2).
tile_scores_codes_3 = _typer(_scores3_codegen, "tile_scores_codes_3")
#: ``tile_values_codes_3(codes, t0, nt, tab, w, acc)``: ``acc[g, j] += Σ_{r < nt} w[g, r] · tab[code_j(t0 + r)]``;
#: as above, ``w`` (G, ≥ nt), ``acc`` (G, d) with ``d`` a multiple of 64.
tile_values_codes_3 = _typer(_values3_codegen, "tile_values_codes_3")


@nb.njit
def rows_3_loop(codes, t0, nt, tab, d):
    """Centroid values (nt, d) of rows ``t0 ..`` of 3-bit codes (stream bits ``[3j, 3j + 3)`` for code ``j``)."""
    out = np.empty((nt, d), np.float32)
    for r in range(nt):
        for j in range(d):
            bit = 3 * j
            pair = np.int64(codes[t0 + r, bit >> 3])
            if (bit >> 3) + 1 < codes.shape[1]:
                pair |= np.int64(codes[t0 + r, (bit >> 3) + 1]) << 8
            out[r, j] = tab[(pair >> (bit & 7)) & 7]
    return out


@nb.njit
def tile_scores_codes_3_loop(codes, t0, nt, tab, qr, s):
    """Reference of :func:`tile_scores_codes_3`."""
    rows_scores_loop(rows_3_loop(codes, t0, nt, tab, qr.shape[1]), nt, qr, s)


@nb.njit
def tile_values_codes_3_loop(codes, t0, nt, tab, w, acc):
    """Reference of :func:`tile_values_codes_3`."""
    rows_values_loop(rows_3_loop(codes, t0, nt, tab, acc.shape[1]), nt, w, acc)
