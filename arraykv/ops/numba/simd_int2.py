"""Packed 2-bit integer codes as sixteen float32 lanes in channel (or token) order (Numba, vectors).

The ``int2`` cache packs four codes per byte, lowest bits first (:mod:`arraykv.quant.bitpack`),
so sixteen consecutive codes are one 32-bit word: spread over sixteen lanes, shifted right by
``2k`` and cut to two bits, lane ``k`` holds code ``k``, in order. That serves both of its
layouts without the planar reordering the 4-bit tiles use (:mod:`arraykv.ops.numba.planar`),
which would mix value groups of 32 channels inside one vector:

* :func:`int2_group_scores`: a key group (``d`` channel rows of ``G`` token codes) scored
  with its tokens along the lanes, ``s[g, off + i] = Σ_c qf[g, c] · code_c[i]``;
* :func:`tile_values_codes_2_scaled`: ``acc[g, j] += Σ_r w[g, r] · cscale[r, j // 16] ·
  code_j(t0 + r)`` for value rows of ``d`` codes, each 16-channel chunk with its own scale.

Their ``*_loop`` versions are the plain loops they are checked against.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .ir_tiles import array_args, c_f32, emit_row_values, g_blocks_any, vec_helpers

__all__ = [
    "int2_group_scores",
    "tile_values_codes_2_scaled",
    "int2_group_scores_loop",
    "tile_values_codes_2_scaled_loop",
]


def _sixteen(builder, h):
    """``codes16(ptr)``: the sixteen 2-bit codes of the four bytes at ``ptr`` as <16 x float>, in order."""
    ir = h.ir
    i32 = ir.IntType(32)
    v16i32 = ir.VectorType(i32, 16)
    shifts = ir.Constant(v16i32, [2 * k for k in range(16)])
    three = ir.Constant(v16i32, [3] * 16)

    def codes16(ptr):
        word = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=1)
        spread = builder.insert_element(ir.Constant(v16i32, ir.Undefined), word, ir.Constant(i32, 0))
        spread = builder.shuffle_vector(spread, spread, ir.Constant(v16i32, [0] * 16))
        return builder.uitofp(builder.and_(builder.lshr(spread, shifts), three), h.v16)

    return codes16


def _group_codegen(context, builder, sig, args):
    h = vec_helpers()
    c_arr = context.make_array(sig.args[0])(context, builder, args[0])
    c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
    nbk = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
    (qf, (g_n, d)), (s, (_, s_w)) = array_args(context, builder, sig, args, (1, 2))
    off = args[3]
    fma = h.fma_fn(builder)
    codes16 = _sixteen(builder, h)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(8)]

    def emit(g0, gb):  # 32 tokens (8 bytes of each channel row) per pass: 2 x gb accumulators
        with h.cgutils.for_range(builder, builder.udiv(nbk, h.const(8))) as lb:
            blk = builder.mul(lb.index, h.const(8))
            for a in accs[: 2 * gb]:
                builder.store(h.ir.Constant(h.v16, None), a)
            with h.cgutils.for_range(builder, d) as lc:
                row = builder.gep(c_arr.data, [builder.add(builder.mul(lc.index, c_stride), blk)])
                xs = (codes16(row), codes16(builder.gep(row, [h.const(4)])))
                for gi in range(gb):
                    qv = h.splat(
                        builder,
                        builder.load(
                            builder.gep(qf, [builder.add(builder.mul(builder.add(g0, h.const(gi)), d), lc.index)])
                        ),
                    )
                    for p, x in enumerate(xs):
                        a = accs[2 * gi + p]
                        builder.store(builder.call(fma, [qv, x, builder.load(a)]), a)
            for gi in range(gb):
                base = builder.add(
                    builder.add(builder.mul(builder.add(g0, h.const(gi)), s_w), off), builder.mul(lb.index, h.const(32))
                )
                h.vstore(builder, builder.load(accs[2 * gi]), s, base)
                h.vstore(builder, builder.load(accs[2 * gi + 1]), s, builder.add(base, h.const(16)))

    g_blocks_any(builder, h, g_n, emit)
    return context.get_dummy_value()


@intrinsic
def int2_group_scores(typingctx, codes, qf, s, off):
    """``s[g, off + i] = Σ_c qf[g, c] · codes_c[i]`` for one int2 key group (no scale or offset).

    ``codes`` (d, G/4) uint8: channel ``c``'s ``G`` token codes packed four per byte (lowest
    bits first; ``G`` a multiple of 32, bytes of a row contiguous); ``qf`` (G_q, d) and ``s``
    (G_q, ≥ off + G) C-contiguous float32. Not checked at run time.
    Needs :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS` (AVX-512 or AVX2).
    """
    ok = (
        isinstance(codes, nbt.Array)
        and codes.ndim == 2
        and codes.dtype == nbt.uint8
        and c_f32(qf, s)
        and qf.ndim == 2
        and s.ndim == 2
        and isinstance(off, nbt.Integer)
    )
    if not ok:
        return None
    return nbt.void(codes, qf, s, nbt.int64), _group_codegen


def _values_codegen(context, builder, sig, args):
    h = vec_helpers()
    c_arr = context.make_array(sig.args[0])(context, builder, args[0])
    c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
    t0, nt = args[1], args[2]
    (w, (_, w_w)), (csc, (_, cs_w)), (acc, (g_n, d)) = array_args(context, builder, sig, args, (3, 4, 5))
    codes16 = _sixteen(builder, h)

    def row_source(r):  # row t0 + r: chunk c is 4 bytes of codes times the chunk's group scale
        row = h.row_ptr(builder, c_arr.data, c_stride, builder.add(t0, r), ahead=True)

        def chunk(c):
            x = codes16(builder.gep(row, [builder.mul(c, h.const(4))]))
            return builder.fmul(
                x, h.splat(builder, builder.load(builder.gep(csc, [builder.add(builder.mul(r, cs_w), c)])))
            )

        return chunk

    emit_row_values(builder, h, g_n, d, nt, w, w_w, acc, row_source)
    return context.get_dummy_value()


@intrinsic
def tile_values_codes_2_scaled(typingctx, codes, t0, nt, w, cscale, acc):
    """``acc[g, j] += Σ_{r < nt} w[g, r] · cscale[r, j // 16] · code_j(t0 + r)`` (channel order).

    ``codes`` uint8 (T, d/4), rows of contiguous bytes (any row stride), four codes per byte
    lowest bits first; ``w`` (G, ≥ nt), ``cscale`` (≥ nt, d/16), ``acc`` (G, d) C-contiguous
    float32, ``d`` a multiple of 64. Not checked at run time.
    Needs :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS` (AVX-512 or AVX2).
    """
    ok = (
        isinstance(codes, nbt.Array)
        and codes.ndim == 2
        and codes.dtype == nbt.uint8
        and c_f32(w, cscale, acc)
        and w.ndim == 2
        and cscale.ndim == 2
        and acc.ndim == 2
        and all(isinstance(v, nbt.Integer) for v in (t0, nt))
    )
    if not ok:
        return None
    return nbt.void(codes, nbt.int64, nbt.int64, w, cscale, acc), _values_codegen


@nb.njit
def _code2(row, j):
    return np.float32((row[j >> 2] >> (2 * (j & 3))) & 3)


@nb.njit
def int2_group_scores_loop(codes, qf, s, off):
    """Reference of :func:`int2_group_scores`."""
    n_tok = 4 * codes.shape[1]
    for g in range(qf.shape[0]):
        for i in range(n_tok):
            x = np.float32(0.0)
            for c in range(qf.shape[1]):
                x += qf[g, c] * _code2(codes[c], i)
            s[g, off + i] = x


@nb.njit
def tile_values_codes_2_scaled_loop(codes, t0, nt, w, cscale, acc):
    """Reference of :func:`tile_values_codes_2_scaled`."""
    for g in range(acc.shape[0]):
        for r in range(nt):
            for j in range(acc.shape[1]):
                acc[g, j] += w[g, r] * cscale[r, j // 16] * _code2(codes[t0 + r], j)
