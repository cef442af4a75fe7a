"""Packed 4-, 2- and 8-bit codes to centroid values sixteen at a time, in LLVM IR (``vpermps``).

A fused kernel spends most of its time turning codes into floats unless one instruction does
sixteen of them: with AVX-512, ``vpermps`` looks up sixteen 32-bit indices in a 16-entry
float32 table held in one register, which is exactly a codebook of at most 16 centroids. With
AVX2 (8-lane registers) the same lookup is four 8-lane ``vpermps`` and two blends, and the
16-lane vector code around it runs as pairs of 8-lane instructions (LLVM splits it).

* :func:`unpack_tile_4` / :func:`unpack_tile_2`: rows of packed codes (32 four-bit or 64 two-bit
  codes per 16 bytes) split into bit planes, each plane's centroid values written as 16
  consecutive floats (the planar order of :mod:`.planar`);
* ``tile_scores_codes_<bits>`` / ``tile_values_codes_<bits>``: the tile products of
  :mod:`.ir_tiles` with the rows computed in registers from the packed codes, so a tile's
  centroid values are never stored and read back; ``tile_values_codes_<bits>_scaled`` with a
  scale per row and chunk of sixteen channels (the integer caches);
* :func:`int4_group_scores` / :func:`int8_group_scores`: the scores of one key group of the
  integer caches, tokens along the lanes.

Without AVX-512 and AVX2 (or with ``NUMBA_CPU_NAME`` set and ``NUMBA_CPU_FEATURES`` naming
neither, so compiled code may run on another CPU)
:data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS` is False and the same names are the plain
``*_loop`` functions (used by the tests to check the instruction path against them).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .cpu_features import HAVE_PERMPS
from .ir_tiles import array_args, c_f32, emit_scores, g_blocks_any, rows_scores_loop, rows_values_loop, vec_helpers

__all__ = [
    "unpack_tile_4",
    "unpack_tile_2",
    "unpack_tile_4_loop",
    "unpack_tile_2_loop",
    "tile_scores_codes_4",
    "tile_scores_codes_2",
    "tile_values_codes_4",
    "tile_values_codes_2",
    "tile_scores_codes_4_loop",
    "tile_scores_codes_2_loop",
    "tile_values_codes_4_loop",
    "tile_values_codes_2_loop",
    "int4_group_scores",
    "int8_group_scores",
    "tile_values_codes_4_scaled",
    "tile_values_codes_4_scaled_loop",
    "tile_values_codes_8_scaled",
    "tile_values_codes_8_scaled_loop",
]


# ---- packed rows to a tile of centroid values in planar order ---------------------------------


def _planes_codegen(bits: int):
    """LLVM code of ``unpack_tile_<bits>(codes, t0, nt, tab, out)``."""
    from llvmlite import ir
    from numba.core import cgutils

    per = 8 // bits
    mask = (1 << bits) - 1

    def codegen(context, builder, signature, args):
        codes, t0, nt, tab, out = args
        c_arr = context.make_array(signature.args[0])(context, builder, codes)
        t_arr = context.make_array(signature.args[3])(context, builder, tab)
        o_arr = context.make_array(signature.args[4])(context, builder, out)
        c_stride = cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbytes = cgutils.unpack_tuple(builder, c_arr.shape)[1]
        width = cgutils.unpack_tuple(builder, o_arr.shape)[1]
        i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
        v16i8, v16i32, v16f = ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16)
        h = vec_helpers()
        perm = h.perm_fn(builder)
        table = builder.load(builder.bitcast(t_arr.data, v16f.as_pointer()), align=4)
        blocks = builder.udiv(nbytes, ir.Constant(i64, 16))
        with cgutils.for_range(builder, nt) as lr:
            row = h.row_ptr(builder, c_arr.data, c_stride, builder.add(t0, lr.index), ahead=True)
            o_row = builder.mul(lr.index, width)
            with cgutils.for_range(builder, blocks) as lb:
                off = builder.mul(lb.index, ir.Constant(i64, 16))
                raw = builder.load(builder.bitcast(builder.gep(row, [off]), v16i8.as_pointer()), align=1)
                word = builder.zext(raw, v16i32)
                for p in range(per):
                    idx = builder.lshr(word, ir.Constant(v16i32, [bits * p] * 16)) if p else word
                    if p < per - 1:
                        idx = builder.and_(idx, ir.Constant(v16i32, [mask] * 16))
                    at = builder.add(o_row, builder.add(off, builder.mul(nbytes, ir.Constant(i64, p))))
                    builder.store(
                        perm(table, idx), builder.bitcast(builder.gep(o_arr.data, [at]), v16f.as_pointer()), align=4
                    )
        return context.get_dummy_value()

    return codegen


def _make_intrinsic(bits: int):
    def typer(typingctx, codes, t0, nt, tab, out):
        # ``tab``: any array whose first 64 bytes are the 16 float32 of :func:`table16`
        ok = (
            isinstance(codes, nbt.Array)
            and codes.ndim == 2
            and codes.dtype == nbt.uint8
            and isinstance(tab, nbt.Array)
            and isinstance(out, nbt.Array)
            and out.ndim == 2
            and out.dtype == nbt.float32
            and out.layout == "C"
            and all(isinstance(x, nbt.Integer) for x in (t0, nt))
        )
        if not ok:
            return None
        return nbt.void(codes, nbt.int64, nbt.int64, tab, out), _planes_codegen(bits)

    typer.__name__ = f"unpack_tile_{bits}"
    return intrinsic(typer)


@nb.njit(inline="always")
def _planes_loop(codes, t0, nt, tab, out, bits):
    per = 8 // bits
    mask = (1 << bits) - 1
    nbytes = codes.shape[1]
    t = tab.reshape(-1).view(np.float32)
    for i in range(nt):
        for j in range(nbytes):
            byte = np.int64(codes[t0 + i, j])
            for p in range(per):
                out[i, p * nbytes + j] = t[(byte >> (bits * p)) & mask]


@nb.njit
def unpack_tile_4_loop(codes, t0, nt, tab, out):
    """Reference of :func:`unpack_tile_4`: rows ``t0 .. t0+nt`` of ``codes`` (n, nbytes) → ``out[:nt]``,
    low nibbles' centroids at ``out[i, j]``, high nibbles' at ``out[i, nbytes + j]``."""
    _planes_loop(codes, t0, nt, tab, out, 4)


@nb.njit
def unpack_tile_2_loop(codes, t0, nt, tab, out):
    """Reference of :func:`unpack_tile_2`: plane ``p`` (bits ``2p, 2p+1`` of each byte) at ``out[i, p·nbytes + j]``."""
    _planes_loop(codes, t0, nt, tab, out, 2)


if HAVE_PERMPS:
    unpack_tile_4 = _make_intrinsic(4)
    unpack_tile_2 = _make_intrinsic(2)
else:
    unpack_tile_4 = unpack_tile_4_loop
    unpack_tile_2 = unpack_tile_2_loop


# ---- the same, straight from packed codes (no tile buffer) ----------------------------------
#
# ``tile_scores_codes_<bits>`` / ``tile_values_codes_<bits>`` are :func:`.ir_tiles.tile_scores` /
# :func:`.ir_tiles.tile_values` with the rows of ``buf`` computed in registers from packed codes
# (the planar order of :func:`unpack_tile_4`), so a tile's centroid values are never stored and
# read back. :data:`HAVE_PERMPS` only (``vpermps``).


def _code_source(builder, h, bits, c_arr, c_stride, nbytes, tab_arr):
    """Helpers that read planar chunks of code rows: ``(row_ptr(t), word(row, blk), chunk(word, p))``."""
    ir = h.ir
    i8, i32 = ir.IntType(8), ir.IntType(32)
    v16i8, v16i32 = ir.VectorType(i8, 16), ir.VectorType(i32, 16)
    perm = h.perm_fn(builder)
    table = builder.load(builder.bitcast(tab_arr.data, h.v16.as_pointer()), align=4)
    mask = ir.Constant(v16i32, [(1 << bits) - 1] * 16)

    def row_ptr(t, prefetch=False):
        return h.row_ptr(builder, c_arr.data, c_stride, t, ahead=prefetch)

    def word(row, blk):
        raw = builder.load(
            builder.bitcast(builder.gep(row, [builder.mul(blk, h.const(16))]), v16i8.as_pointer()), align=1
        )
        return builder.zext(raw, v16i32)

    def chunk(w, shift):
        """Centroids of plane ``shift / bits`` of a block word; ``shift`` an int or an i32 vector.
        8-bit codes are their own values (the integer caches): no table."""
        if bits == 8:
            return builder.uitofp(w, h.v16)
        idx = w
        if not (isinstance(shift, int) and shift == 0):
            sv = ir.Constant(v16i32, [shift] * 16) if isinstance(shift, int) else shift
            idx = builder.lshr(w, sv)
        # the lookup reads an index's low four bits: 4-bit codes need no mask, nor do 2-bit
        # codes, whose table repeats its four centroids (:func:`table16`); the top plane has
        # nothing above it
        if bits not in (2, 4) and not (isinstance(shift, int) and shift == 8 - bits):
            idx = builder.and_(idx, mask)
        return perm(table, idx)

    return row_ptr, word, chunk


def _scores_codes_codegen(bits):
    per = 8 // bits

    def codegen(context, builder, sig, args):
        h = vec_helpers()
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbytes = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        t0, nt = args[1], args[2]
        tab_arr = context.make_array(sig.args[3])(context, builder, args[3])
        (qr, (g_n, d)), (s, (_, s_w)) = array_args(context, builder, sig, args, (4, 5))
        row_ptr, word, chunk = _code_source(builder, h, bits, c_arr, c_stride, nbytes, tab_arr)
        fma = h.fma_fn(builder)
        blocks = builder.udiv(nbytes, h.const(16))
        accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

        def fill(g0, gb, r0, n_rows):  # n_rows (python int) rows from row r0 (relative to t0)
            qrows = [builder.mul(builder.add(g0, h.const(gi)), d) for gi in range(gb)]
            ptrs = [row_ptr(builder.add(t0, builder.add(r0, h.const(i))), prefetch=True) for i in range(n_rows)]
            with h.cgutils.for_range(builder, blocks) as lb:
                words = [word(p, lb.index) for p in ptrs]
                for p in range(per):
                    off = builder.mul(builder.add(builder.mul(h.const(p), blocks), lb.index), h.const(16))
                    qv = [h.vload(builder, qr, builder.add(qrows[gi], off)) for gi in range(gb)]
                    for i in range(n_rows):
                        x = chunk(words[i], bits * p)
                        for gi in range(gb):
                            a = accs[gi * n_rows + i]
                            builder.store(builder.call(fma, [x, qv[gi], builder.load(a)]), a)

        emit = emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 4 if gb >= 3 else 8, fill)
        g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _values_codes_codegen(bits, scaled=False):
    def codegen(context, builder, sig, args):
        h = vec_helpers()
        ir = h.ir
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbytes = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        t0, nt = args[1], args[2]
        tab_arr = context.make_array(sig.args[3])(context, builder, args[3])
        if scaled:  # (w, cscale, acc): each row's chunk k times cscale[r, k] before the weights
            (w, (_, w_w)), (csc, (_, cs_w)), (acc, (g_n, d)) = array_args(context, builder, sig, args, (4, 5, 6))
        else:
            (w, (_, w_w)), (acc, (g_n, d)) = array_args(context, builder, sig, args, (4, 5))
        row_ptr, word, chunk = _code_source(builder, h, bits, c_arr, c_stride, nbytes, tab_arr)
        fma = h.fma_fn(builder)
        blocks = builder.udiv(nbytes, h.const(16))
        accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]
        v16i32 = ir.VectorType(ir.IntType(32), 16)

        def emit(g0, gb):
            with h.cgutils.for_range(builder, builder.udiv(d, h.const(64))) as lc:
                c0 = builder.mul(lc.index, h.const(4))  # first chunk (of 16 channels) of the group
                rows = [builder.mul(builder.add(g0, h.const(gi)), d) for gi in range(gb)]
                src = []  # (block, shift vector) of each of the group's four chunks
                for k in range(4):
                    c = builder.add(c0, h.const(k))
                    plane = builder.udiv(c, blocks)
                    sh = builder.trunc(builder.mul(plane, h.const(bits)), ir.IntType(32))
                    shv = builder.insert_element(ir.Constant(v16i32, ir.Undefined), sh, ir.Constant(ir.IntType(32), 0))
                    shv = builder.shuffle_vector(shv, shv, ir.Constant(v16i32, [0] * 16))
                    src.append((builder.urem(c, blocks), shv))
                for gi in range(gb):
                    for k in range(4):
                        off = builder.add(rows[gi], builder.add(builder.mul(c0, h.const(16)), h.const(16 * k)))
                        builder.store(h.vload(builder, acc, off), accs[4 * gi + k])
                with h.cgutils.for_range(builder, nt) as lr:
                    r = lr.index
                    row = row_ptr(builder.add(t0, r), prefetch=True)
                    wv = [
                        h.splat(
                            builder,
                            builder.load(
                                builder.gep(w, [builder.add(builder.mul(builder.add(g0, h.const(gi)), w_w), r)])
                            ),
                        )
                        for gi in range(gb)
                    ]
                    for k in range(4):
                        x = chunk(word(row, src[k][0]), src[k][1])
                        if scaled:
                            at = builder.add(builder.mul(r, cs_w), builder.add(c0, h.const(k)))
                            x = builder.fmul(x, h.splat(builder, builder.load(builder.gep(csc, [at]))))
                        for gi in range(gb):
                            a = accs[4 * gi + k]
                            builder.store(builder.call(fma, [wv[gi], x, builder.load(a)]), a)
                for gi in range(gb):
                    for k in range(4):
                        off = builder.add(rows[gi], builder.add(builder.mul(c0, h.const(16)), h.const(16 * k)))
                        h.vstore(builder, builder.load(accs[4 * gi + k]), acc, off)

        g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _int_group_codegen(bits):
    """LLVM code of ``int<bits>_group_scores``: ``s[g, off + i] = Σ_c qf[g, c] · code[c, i]`` for the
    ``G`` tokens of one key group. Per 32 tokens and channel: two vectors of 16 codes (int4: the
    even and the odd tokens of one 16-byte block, interleaved at the end; int8: two 16-byte
    blocks), each multiplied into every query head of the block of heads."""

    def codegen(context, builder, sig, args):
        h = vec_helpers()
        ir = h.ir
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbk = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        (qf, (g_n, d)), (s, (_, s_w)) = array_args(context, builder, sig, args, (1, 2))
        off = args[3]
        fma = h.fma_fn(builder)
        v16i8, v16i32 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.IntType(32), 16)
        accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(8)]
        step = 16 if bits == 4 else 32  # bytes of codes per 32 tokens of a channel
        lo_idx = [i // 2 + (16 if i % 2 else 0) for i in range(16)]  # tokens 0..15 from (even, odd)
        hi_idx = [8 + i // 2 + (16 if i % 2 else 0) for i in range(16)]

        def codes16(c, blk, k):
            ptr = builder.gep(c_arr.data, [builder.add(builder.mul(c, c_stride), builder.add(blk, h.const(16 * k)))])
            return builder.zext(builder.load(builder.bitcast(ptr, v16i8.as_pointer()), align=1), v16i32)

        def emit(g0, gb):
            with h.cgutils.for_range(builder, builder.udiv(nbk, h.const(step))) as lb:
                blk = builder.mul(lb.index, h.const(step))
                for a in accs[: 2 * gb]:
                    builder.store(ir.Constant(h.v16, None), a)
                with h.cgutils.for_range(builder, d) as lc:
                    c = lc.index
                    if bits == 4:
                        raw = codes16(c, blk, 0)
                        pair = (
                            builder.and_(raw, ir.Constant(v16i32, [15] * 16)),
                            builder.lshr(raw, ir.Constant(v16i32, [4] * 16)),
                        )
                    else:
                        pair = (codes16(c, blk, 0), codes16(c, blk, 1))
                    xs = [builder.uitofp(x, h.v16) for x in pair]
                    for gi in range(gb):
                        qv = h.splat(
                            builder,
                            builder.load(
                                builder.gep(qf, [builder.add(builder.mul(builder.add(g0, h.const(gi)), d), c)])
                            ),
                        )
                        for p, x in enumerate(xs):
                            a = accs[2 * gi + p]
                            builder.store(builder.call(fma, [qv, x, builder.load(a)]), a)
                for gi in range(gb):
                    first, second = builder.load(accs[2 * gi]), builder.load(accs[2 * gi + 1])
                    if bits == 4:  # (even, odd) tokens back to token order
                        first, second = (
                            builder.shuffle_vector(first, second, ir.Constant(v16i32, lo_idx)),
                            builder.shuffle_vector(first, second, ir.Constant(v16i32, hi_idx)),
                        )
                    base = builder.add(
                        builder.add(builder.mul(builder.add(g0, h.const(gi)), s_w), off),
                        builder.mul(lb.index, h.const(32)),
                    )
                    h.vstore(builder, first, s, base)
                    h.vstore(builder, second, s, builder.add(base, h.const(16)))

        g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _group_typer(bits):
    gen = _int_group_codegen(bits)

    def typer(typingctx, codes, qf, s, off):
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
        return nbt.void(codes, qf, s, nbt.int64), gen

    return typer


_GROUP_TYPERS = {4: _group_typer(4), 8: _group_typer(8)}


def _int8_group_scores(typingctx, codes, qf, s, off):
    """:func:`int4_group_scores` for int8 codes: ``codes`` (d, G) uint8, ``G`` a multiple of 32."""
    return _GROUP_TYPERS[8](typingctx, codes, qf, s, off)


def _int4_group_scores(typingctx, codes, qf, s, off):
    """``s[g, off + i] = Σ_c qf[g, c] · codes_c[i]`` for one int4 key group (no scale or offset).

    ``codes`` (d, G/2) uint8: channel ``c``'s ``G`` codes packed two per byte (low nibble first,
    rows of whole 16-byte blocks: ``G`` a multiple of 32); ``qf`` (G_q, d) and ``s`` (G_q, ≥ off + G)
    C-contiguous float32. Tokens run along the vector lanes, so no sum across lanes is needed.
    """
    return _GROUP_TYPERS[4](typingctx, codes, qf, s, off)


int4_group_scores = intrinsic(_int4_group_scores)
int8_group_scores = intrinsic(_int8_group_scores)


def _scaled_values_intrinsic(bits):
    gen = _values_codes_codegen(bits, scaled=True)

    def typer(typingctx, codes, t0, nt, tab, w, cscale, acc):
        ok = (
            isinstance(codes, nbt.Array)
            and codes.ndim == 2
            and codes.dtype == nbt.uint8
            and isinstance(tab, nbt.Array)
            and c_f32(w, cscale, acc)
            and w.ndim == 2
            and cscale.ndim == 2
            and acc.ndim == 2
            and all(isinstance(v, nbt.Integer) for v in (t0, nt))
        )
        if not ok:
            return None
        return nbt.void(codes, nbt.int64, nbt.int64, tab, w, cscale, acc), gen

    typer.__name__ = f"tile_values_codes_{bits}_scaled"
    return intrinsic(typer)


def _codes_intrinsic(bits, which):
    gen = (_scores_codes_codegen if which == "scores" else _values_codes_codegen)(bits)

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

    typer.__name__ = f"tile_{which}_codes_{bits}"
    return intrinsic(typer)


@nb.njit
def _rows_loop(codes, t0, nt, tab, bits):
    out = np.empty((nt, codes.shape[1] * (8 // bits)), np.float32)
    _planes_loop(codes, t0, nt, tab, out, bits)
    return out


@nb.njit
def _scores_codes_loop(codes, t0, nt, tab, qr, s, bits):
    rows_scores_loop(_rows_loop(codes, t0, nt, tab, bits), nt, qr, s)


@nb.njit
def _values_codes_loop(codes, t0, nt, tab, w, acc, bits):
    rows_values_loop(_rows_loop(codes, t0, nt, tab, bits), nt, w, acc)


@nb.njit
def tile_scores_codes_4_loop(codes, t0, nt, tab, qr, s):
    """Reference of ``tile_scores_codes_4``: ``s[g, r] = Σ_j qr[g, j] · c[codes[t0 + r]]_j`` for ``r < nt``,
    the centroids of a row in the planar order of :func:`unpack_tile_4` (``qr`` (G, d) in that order too)."""
    _scores_codes_loop(codes, t0, nt, tab, qr, s, 4)


@nb.njit
def tile_scores_codes_2_loop(codes, t0, nt, tab, qr, s):
    """Reference of ``tile_scores_codes_2`` (planar order of :func:`unpack_tile_2`)."""
    _scores_codes_loop(codes, t0, nt, tab, qr, s, 2)


@nb.njit
def tile_values_codes_4_loop(codes, t0, nt, tab, w, acc):
    """Reference of ``tile_values_codes_4``: ``acc[g, j] += Σ_{r < nt} w[g, r] · c[codes[t0 + r]]_j`` (planar order)."""
    _values_codes_loop(codes, t0, nt, tab, w, acc, 4)


@nb.njit
def tile_values_codes_2_loop(codes, t0, nt, tab, w, acc):
    """Reference of ``tile_values_codes_2`` (planar order of :func:`unpack_tile_2`)."""
    _values_codes_loop(codes, t0, nt, tab, w, acc, 2)


@nb.njit
def tile_values_codes_4_scaled_loop(codes, t0, nt, tab, w, cscale, acc):
    """Reference of ``tile_values_codes_4_scaled`` (planar order).

    ``acc[g, j] += Σ_r w[g, r] · cscale[r, j // 16] · c[codes[t0 + r]]_j``.
    """
    rows = _rows_loop(codes, t0, nt, tab, 4)
    for g in range(acc.shape[0]):
        for r in range(nt):
            for j in range(acc.shape[1]):
                acc[g, j] += w[g, r] * cscale[r, j // 16] * rows[r, j]


@nb.njit
def tile_values_codes_8_scaled_loop(codes, t0, nt, tab, w, cscale, acc):
    """Reference of ``tile_values_codes_8_scaled``.

    ``acc[g, j] += Σ_r w[g, r] · cscale[r, j // 16] · codes[t0 + r, j]``.
    """
    for g in range(acc.shape[0]):
        for r in range(nt):
            for j in range(acc.shape[1]):
                acc[g, j] += w[g, r] * cscale[r, j // 16] * np.float32(codes[t0 + r, j])


if HAVE_PERMPS:
    tile_scores_codes_4 = _codes_intrinsic(4, "scores")
    tile_scores_codes_2 = _codes_intrinsic(2, "scores")
    tile_values_codes_4 = _codes_intrinsic(4, "values")
    tile_values_codes_2 = _codes_intrinsic(2, "values")
    #: :func:`tile_values_codes_4` with row ``r``'s chunk ``k`` (16 planar lanes) times ``cscale[r, k]``
    tile_values_codes_4_scaled = _scaled_values_intrinsic(4)
    #: the same for int8 codes, their own values, in channel order (no table is read)
    tile_values_codes_8_scaled = _scaled_values_intrinsic(8)
else:
    tile_scores_codes_4, tile_scores_codes_2 = tile_scores_codes_4_loop, tile_scores_codes_2_loop
    tile_values_codes_4, tile_values_codes_2 = tile_values_codes_4_loop, tile_values_codes_2_loop
    tile_values_codes_4_scaled = tile_values_codes_4_scaled_loop
    tile_values_codes_8_scaled = tile_values_codes_8_scaled_loop
