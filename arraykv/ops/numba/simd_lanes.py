"""Product-quantization codes with tokens along the vector lanes (Numba, ``vpermps``).

A product-quantization code row holds ``m`` 4-bit codes, one per sub-space, two per byte
(:mod:`arraykv.quant.bitpack` order: code ``j`` in bits ``4(j % 2)`` of byte ``j // 2``), so
dword ``w`` of a row (its bytes ``4w .. 4w+3``, little-endian) holds codes ``8w .. 8w+7``,
code ``8w + k`` in bits ``[4k, 4k + 4)``. :func:`codes_to_lanes` transposes sixteen rows into
one int32 vector per dword, token ``i`` in lane ``i``; shifted right by ``4k`` such a vector
is the ``vpermps`` index of sub-space ``8w + k`` for sixteen tokens (the instruction reads
the low four bits of each lane), so a 16-entry table per sub-space (an ADC row, or one
channel of a codebook) gives that sub-space's values for sixteen tokens in one instruction.

:func:`lane_table_scores` scores sixteen tokens per instruction from per-sub-space ADC tables
(:func:`lane_tables`), :func:`lane_table_values` sums the values the same way, per lane until
a span ends (:func:`lane_sums`); the ``vq`` kernel's default path
(:mod:`arraykv.ops.numba.vq_fused`). Each has a ``*_loop`` version, the plain loop it is checked
against and what runs without vector lookups (:data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS`).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .cpu_features import HAVE_PERMPS
from .ir_tiles import array_args, c_f32, g_blocks_any, vec_helpers

#: Prefetched code rows go to the second-level cache (prefetcht1): the next tiles, not the working set of this one.
_PREFETCH_LOCALITY = 1


def _lanes_codegen(context, builder, sig, args):
    h = vec_helpers()
    ir = h.ir
    i32 = ir.IntType(32)
    c_arr = context.make_array(sig.args[0])(context, builder, args[0])
    c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
    nbk = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
    t0, nt, ahead = args[1], args[2], args[3]
    ((out, _),) = array_args(context, builder, sig, args, (4,))
    nw = builder.udiv(nbk, h.const(4))
    nblk = builder.udiv(builder.add(nt, h.const(15)), h.const(16))
    last = builder.sub(builder.add(t0, nt), h.const(1))
    v16i32 = ir.VectorType(i32, 16)

    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(idx)), idx))

    def transpose(xs, width):
        """16 rows of ``width`` (4, 2 or 1) dwords → ``width`` vectors of 16 lanes (row ``i`` in lane ``i``)."""
        if width == 1:
            v = ir.Constant(v16i32, ir.Undefined)
            for i, x in enumerate(xs):
                v = builder.insert_element(v, x, ir.Constant(i32, i))
            return [v]
        vs, n = list(xs), width  # rows concatenated into vectors of 16 dwords, row-major
        while n < 16:
            vs = [sh(vs[2 * i], vs[2 * i + 1], list(range(2 * n))) for i in range(len(vs) // 2)]
            n *= 2
        per = 16 // width  # rows per vector: row r, dword w at index (r % per) · width + w of vector r // per
        if width == 2:
            return [sh(vs[0], vs[1], [16 * (i // 8) + (i % 8) * 2 + w for i in range(16)]) for w in range(2)]
        outs = []
        for w_lo in (0, 2):  # rows 0-7 and 8-15 of dwords (w_lo, w_lo + 1), then the two halves merged
            u = [
                sh(
                    vs[2 * p],
                    vs[2 * p + 1],
                    [16 * ((i % 8) // per) + (i % per) * width + w_lo + i // 8 for i in range(16)],
                )
                for p in range(2)
            ]
            outs.append(sh(u[0], u[1], list(range(8)) + list(range(16, 24))))
            outs.append(sh(u[0], u[1], list(range(8, 16)) + list(range(24, 32))))
        return outs

    vec4 = ir.VectorType(i32, 4)
    vec2 = ir.VectorType(i32, 2)
    with h.cgutils.for_range(builder, nblk) as lb:
        blk = lb.index
        rows = []
        for i in range(16):
            r = builder.add(t0, builder.add(builder.mul(blk, h.const(16)), h.const(i)))
            r = builder.select(builder.icmp_signed(">", r, last), last, r)
            rows.append(builder.gep(c_arr.data, [builder.mul(r, c_stride)]))
        obase = builder.mul(builder.mul(blk, nw), h.const(16))
        with builder.if_then(builder.icmp_signed(">", ahead, h.const(0))):
            # the sixteen rows ``ahead`` further on (a prefetch never faults): one prefetch per 64
            # bytes of their span when they are packed (stride of at most 64 bytes), else per row
            first = builder.gep(rows[0], [builder.mul(ahead, c_stride)])
            packed = builder.and_(
                builder.icmp_signed(">", c_stride, h.const(0)), builder.icmp_signed("<=", c_stride, h.const(64))
            )
            with builder.if_else(packed) as (then, otherwise):
                with then:
                    lines = builder.udiv(builder.add(builder.mul(c_stride, h.const(16)), h.const(63)), h.const(64))
                    with h.cgutils.for_range(builder, lines) as lp:
                        h.prefetch(
                            builder, builder.gep(first, [builder.mul(lp.index, h.const(64))]), _PREFETCH_LOCALITY
                        )
                with otherwise:
                    step = builder.mul(ahead, c_stride)
                    with h.cgutils.for_range(builder, builder.udiv(builder.add(nbk, h.const(63)), h.const(64))) as lp:
                        off = builder.add(step, builder.mul(lp.index, h.const(64)))
                        for p in rows:
                            h.prefetch(builder, builder.gep(p, [off]), _PREFETCH_LOCALITY)

        def load(ptr_off, ty):
            return [builder.load(builder.bitcast(builder.gep(p, [ptr_off]), ty.as_pointer()), align=1) for p in rows]

        def put(vecs, w0):
            for k, v in enumerate(vecs):
                at = builder.add(obase, builder.mul(builder.add(w0, h.const(k)), h.const(16)))
                builder.store(v, builder.bitcast(builder.gep(out, [at]), v16i32.as_pointer()), align=4)

        nq = builder.udiv(nbk, h.const(16))
        with h.cgutils.for_range(builder, nq) as lq:
            put(transpose(load(builder.mul(lq.index, h.const(16)), vec4), 4), builder.mul(lq.index, h.const(4)))
        rest = builder.urem(nbk, h.const(16))
        w8 = builder.mul(nq, h.const(4))
        with builder.if_then(builder.icmp_unsigned(">=", rest, h.const(8))):
            put(transpose(load(builder.mul(nq, h.const(16)), vec2), 2), w8)
        with builder.if_then(builder.icmp_unsigned("==", builder.urem(rest, h.const(8)), h.const(4))):
            put(transpose(load(builder.sub(nbk, h.const(4)), i32), 1), builder.sub(nw, h.const(1)))
    return context.get_dummy_value()


def _lane_scores_codegen(context, builder, sig, args):
    """``s[g, 16b + i] = Σ_{w, k} lut[g, 128w + 16k + nibble k of lanes[b·nw + w, i]]``: per dword of
    the codes, eight shifts shared by the block of query heads, one ``vpermps`` and add per head."""
    h = vec_helpers()
    ir = h.ir
    v16i32 = ir.VectorType(ir.IntType(32), 16)
    (lanes, _), (lut, (g_n, lw)), (s, (_, s_w)) = array_args(context, builder, sig, args, (0, 3, 4))
    nblk, nw = args[1], args[2]
    perm = h.perm_fn(builder)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(8)]

    def emit_blk(blk):
        def emit(g0, gb):
            for a in accs[: 2 * gb]:
                builder.store(ir.Constant(h.v16, None), a)
            rows = [builder.mul(builder.add(g0, h.const(gi)), lw) for gi in range(gb)]
            with h.cgutils.for_range(builder, nw) as lw_:
                w = lw_.index
                at = builder.mul(builder.add(builder.mul(blk, nw), w), h.const(16))
                word = builder.load(builder.bitcast(builder.gep(lanes, [at]), v16i32.as_pointer()), align=4)
                for k in range(8):
                    idx = builder.lshr(word, ir.Constant(v16i32, [4 * k] * 16)) if k else word
                    off = builder.add(builder.mul(w, h.const(128)), h.const(16 * k))
                    for gi in range(gb):
                        x = perm(h.vload(builder, lut, builder.add(rows[gi], off)), idx)
                        a = accs[2 * gi + k % 2]
                        builder.store(builder.fadd(builder.load(a), x), a)
            for gi in range(gb):
                v = builder.fadd(builder.load(accs[2 * gi]), builder.load(accs[2 * gi + 1]))
                h.vstore(
                    builder,
                    v,
                    s,
                    builder.add(builder.mul(builder.add(g0, h.const(gi)), s_w), builder.mul(blk, h.const(16))),
                )

        return emit

    with h.cgutils.for_range(builder, nblk) as lb:
        g_blocks_any(builder, h, g_n, emit_blk(lb.index))
    return context.get_dummy_value()


def _lane_values_codegen(context, builder, sig, args):
    """``acc[g, 16c + i] += w[g, 16b + i] · ctab[c, nibble (c // sd) of the lanes of block b]``: per
    block of channels (four for three or four query heads, else eight), accumulators in registers
    for the whole tile; a channel's ``vpermps`` is shared by the block of query heads."""
    h = vec_helpers()
    ir = h.ir
    i32 = ir.IntType(32)
    v16i32 = ir.VectorType(i32, 16)
    (lanes, _), (ctab, (d, _)), (wt, (_, w_w)), (acc, (g_n, a_w)) = array_args(
        context, builder, sig, args, (0, 4, 5, 6)
    )
    nblk, nw, sd = args[1], args[2], args[3]
    perm = h.perm_fn(builder)
    fma = h.fma_fn(builder)
    accs = [h.cgutils.alloca_once(builder, h.v16) for _ in range(16)]

    def emit(g0, gb):
        cb = 4 if gb >= 3 else 8
        with h.cgutils.for_range(builder, builder.udiv(d, h.const(cb))) as lc:
            c0 = builder.mul(lc.index, h.const(cb))
            src = []  # (dword, shift vector, table) of each channel of the block
            for ci in range(cb):
                c = builder.add(c0, h.const(ci))
                j = builder.udiv(c, sd)
                shift = builder.trunc(builder.mul(builder.urem(j, h.const(8)), h.const(4)), i32)
                shv = builder.insert_element(ir.Constant(v16i32, ir.Undefined), shift, ir.Constant(i32, 0))
                shv = builder.shuffle_vector(shv, shv, ir.Constant(v16i32, [0] * 16))
                src.append((builder.udiv(j, h.const(8)), shv, h.vload(builder, ctab, builder.mul(c, h.const(16)))))
            offs = [
                [
                    builder.add(
                        builder.mul(builder.add(g0, h.const(gi)), a_w),
                        builder.mul(builder.add(c0, h.const(ci)), h.const(16)),
                    )
                    for ci in range(cb)
                ]
                for gi in range(gb)
            ]
            for gi in range(gb):
                for ci in range(cb):
                    builder.store(h.vload(builder, acc, offs[gi][ci]), accs[gi * cb + ci])
            with h.cgutils.for_range(builder, nblk) as lb:
                blk = lb.index
                wv = [
                    h.vload(
                        builder,
                        wt,
                        builder.add(builder.mul(builder.add(g0, h.const(gi)), w_w), builder.mul(blk, h.const(16))),
                    )
                    for gi in range(gb)
                ]
                base = builder.mul(blk, nw)
                for ci, (dw, shv, tab) in enumerate(src):
                    at = builder.mul(builder.add(base, dw), h.const(16))
                    word = builder.load(builder.bitcast(builder.gep(lanes, [at]), v16i32.as_pointer()), align=4)
                    x = perm(tab, builder.lshr(word, shv))
                    for gi in range(gb):
                        a = accs[gi * cb + ci]
                        builder.store(builder.call(fma, [wv[gi], x, builder.load(a)]), a)
            for gi in range(gb):
                for ci in range(cb):
                    h.vstore(builder, builder.load(accs[gi * cb + ci]), acc, offs[gi][ci])

    g_blocks_any(builder, h, g_n, emit)
    return context.get_dummy_value()


def _i32_c(t, ndim) -> bool:
    return isinstance(t, nbt.Array) and t.dtype == nbt.int32 and t.layout == "C" and t.ndim == ndim


def _codes_to_lanes(typingctx, codes, t0, nt, ahead, out):
    """Rows ``t0 .. t0+nt`` of 4-bit code rows, sixteen tokens at a time, transposed to tokens along the lanes.

    Each row's bytes ``ahead`` rows further on are prefetched (``ahead <= 0``: none), so that the
    next tile of a stream from memory arrives while this one is used.

    ``codes`` (n, nbytes) uint8 (rows at any stride, bytes contiguous, ``nbytes`` a multiple of
    4, ``nt ≥ 1``); ``out`` (≥ ceil(nt / 16) · nbytes / 4, 16) C-contiguous int32:
    ``out[b · nw + w, i]`` is dword ``w`` (bytes ``4w .. 4w+3``, little-endian) of row
    ``t0 + min(16b + i, nt − 1)`` (``nw = nbytes / 4``): the lanes past the last row repeat it,
    so every lane holds valid codes. Nothing is checked at run time.
    """
    ok = (
        isinstance(codes, nbt.Array)
        and codes.ndim == 2
        and codes.dtype == nbt.uint8
        and _i32_c(out, 2)
        and all(isinstance(x, nbt.Integer) for x in (t0, nt, ahead))
    )
    if not ok:
        return None
    return nbt.void(codes, nbt.int64, nbt.int64, nbt.int64, out), _lanes_codegen


def _lane_table_scores(typingctx, lanes, nblk, nw, lut, s):
    """ADC scores of ``16 · nblk`` tokens for every query head: one ``vpermps`` per head and sub-space.

    ``lanes`` (≥ nblk · nw, 16) int32 from :func:`codes_to_lanes`; ``lut`` (G, 128 · nw) float32,
    row ``g`` the 16-entry tables of sub-spaces ``0 .. 8·nw − 1`` one after the other (sub-spaces
    past the last real one all zero); ``s`` (G, ≥ 16 · nblk) float32, all C-contiguous:
    ``s[g, 16b + i] = Σ_j lut[g, 16j + a_j]`` with ``a_j`` code ``j`` of lane ``i`` of block ``b``.
    """
    ok = (
        _i32_c(lanes, 2)
        and c_f32(lut, s)
        and lut.ndim == 2
        and s.ndim == 2
        and all(isinstance(x, nbt.Integer) for x in (nblk, nw))
    )
    if not ok:
        return None
    return nbt.void(lanes, nbt.int64, nbt.int64, lut, s), _lane_scores_codegen


def _lane_table_values(typingctx, lanes, nblk, nw, sd, ctab, w, acc):
    """Weighted sums of the channels of ``16 · nblk`` tokens, tokens kept along the lanes.

    ``lanes`` as for :func:`lane_table_scores`; ``ctab`` (d, 16) float32, row ``c`` channel ``c``'s
    16-entry table (``c % sd`` of the centroids of sub-space ``c // sd``, ``d`` a multiple of
    8); ``w`` (G, ≥ 16 · nblk) float32 weights; ``acc`` (G, ≥ 16 · d) float32, all C-contiguous:
    ``acc[g, 16c + i] += Σ_b w[g, 16b + i] · ctab[c, a_{c // sd}]`` with ``a_j`` code ``j`` of lane
    ``i`` of block ``b``. ``acc[g, 16c : 16c + 16]`` are lane-partial sums (their sum is the channel's).
    """
    ok = (
        _i32_c(lanes, 2)
        and c_f32(ctab, w, acc)
        and ctab.ndim == 2
        and w.ndim == 2
        and acc.ndim == 2
        and all(isinstance(x, nbt.Integer) for x in (nblk, nw, sd))
    )
    if not ok:
        return None
    return nbt.void(lanes, nbt.int64, nbt.int64, nbt.int64, ctab, w, acc), _lane_values_codegen


def _lane_tables_codegen(context, builder, sig, args):
    h = vec_helpers()
    (q, (g_n, d)), (tab, _), (lut, (_, lw)) = array_args(context, builder, sig, args, (0, 1, 3))
    sd = args[2]
    fma = h.fma_fn(builder)
    acc = h.cgutils.alloca_once(builder, h.v16)
    with h.cgutils.for_range(builder, g_n) as lg:
        with h.cgutils.for_range(builder, builder.udiv(d, sd)) as lj:
            c0 = builder.mul(lj.index, sd)
            builder.store(h.ir.Constant(h.v16, None), acc)
            with h.cgutils.for_range(builder, sd) as li:
                c = builder.add(c0, li.index)
                x = h.splat(builder, builder.load(builder.gep(q, [builder.add(builder.mul(lg.index, d), c)])))
                builder.store(
                    builder.call(fma, [x, h.vload(builder, tab, builder.mul(c, h.const(16))), builder.load(acc)]), acc
                )
            h.vstore(
                builder,
                builder.load(acc),
                lut,
                builder.add(builder.mul(lg.index, lw), builder.mul(lj.index, h.const(16))),
            )
    return context.get_dummy_value()


def _lane_sums_codegen(context, builder, sig, args):
    h = vec_helpers()
    (al, (g_n, a_w)), (acc, (_, d)) = array_args(context, builder, sig, args, (0, 1))
    with h.cgutils.for_range(builder, g_n) as lg:
        with h.cgutils.for_range(builder, builder.udiv(d, h.const(4))) as lc:
            c0 = builder.mul(lc.index, h.const(4))
            base = builder.add(builder.mul(lg.index, a_w), builder.mul(c0, h.const(16)))
            v = h.reduce_many(builder, [h.vload(builder, al, builder.add(base, h.const(16 * k))) for k in range(4)])
            at = builder.add(builder.mul(lg.index, d), c0)
            builder.store(v, builder.bitcast(builder.gep(acc, [at]), v.type.as_pointer()), align=4)
    return context.get_dummy_value()


def _lane_tables(typingctx, q, tab, sd, lut):
    """Per query head, the 16-entry ADC table of every sub-space.

    ``lut[g, 16j + k] = Σ_{i < sd} q[g, j·sd + i] · tab[j·sd + i, k]`` for ``j < d / sd``:

    ``q`` (G, d), ``tab`` (d, 16) (row ``c``: channel ``c``'s 16 centroid values, as ``ctab`` of
    :func:`lane_table_values`), ``lut`` (G, ≥ 16 · d / sd), C-contiguous float32, ``sd`` dividing
    ``d``; entries past sub-space ``d / sd − 1`` are left as they are.
    """
    ok = c_f32(q, tab, lut) and q.ndim == 2 and tab.ndim == 2 and lut.ndim == 2 and isinstance(sd, nbt.Integer)
    if not ok:
        return None
    return nbt.void(q, tab, nbt.int64, lut), _lane_tables_codegen


def _lane_sums(typingctx, al, acc):
    """``acc[g, c] = Σ_{i < 16} al[g, 16c + i]``: the lane-partial sums of :func:`lane_table_values` added up.

    ``al`` (G, ≥ 16 · d), ``acc`` (G, d): C-contiguous float32, ``d`` a multiple of 4.
    """
    if not (c_f32(al, acc) and al.ndim == 2 and acc.ndim == 2):
        return None
    return nbt.void(al, acc), _lane_sums_codegen


@nb.njit
def lane_tables_loop(q, tab, sd, lut):
    """Reference of :func:`lane_tables`."""
    g_n, d = q.shape
    for g in range(g_n):
        for j in range(d // sd):
            for k in range(16):
                x = np.float32(0.0)
                for i in range(sd):
                    x += q[g, j * sd + i] * tab[j * sd + i, k]
                lut[g, 16 * j + k] = x


@nb.njit
def lane_sums_loop(al, acc):
    """Reference of :func:`lane_sums`."""
    g_n, d = acc.shape
    for g in range(g_n):
        for c in range(d):
            x = np.float32(0.0)
            for i in range(16):
                x += al[g, 16 * c + i]
            acc[g, c] = x


@nb.njit
def codes_to_lanes_loop(codes, t0, nt, ahead, out):
    """Reference of :func:`codes_to_lanes` (no prefetching)."""
    nw = codes.shape[1] // 4
    for blk in range((nt + 15) // 16):
        for i in range(16):
            r = t0 + min(16 * blk + i, nt - 1)
            for w in range(nw):
                x = np.uint32(0)
                for k in range(4):
                    x |= np.uint32(codes[r, 4 * w + k]) << np.uint32(8 * k)
                out[blk * nw + w, i] = np.int32(x)


@nb.njit
def lane_table_scores_loop(lanes, nblk, nw, lut, s):
    """Reference of :func:`lane_table_scores`."""
    for g in range(lut.shape[0]):
        for blk in range(nblk):
            for i in range(16):
                x = np.float32(0.0)
                for w in range(nw):
                    word = np.int64(lanes[blk * nw + w, i])
                    for k in range(8):
                        x += lut[g, 128 * w + 16 * k + ((word >> (4 * k)) & 15)]
                s[g, 16 * blk + i] = x


@nb.njit
def lane_table_values_loop(lanes, nblk, nw, sd, ctab, w, acc):
    """Reference of :func:`lane_table_values`."""
    for g in range(acc.shape[0]):
        for c in range(ctab.shape[0]):
            j = c // sd
            for blk in range(nblk):
                for i in range(16):
                    a = (np.int64(lanes[blk * nw + j // 8, i]) >> (4 * (j % 8))) & 15
                    acc[g, 16 * c + i] += w[g, 16 * blk + i] * ctab[c, a]


if HAVE_PERMPS:
    codes_to_lanes = intrinsic(_codes_to_lanes)
    lane_table_scores = intrinsic(_lane_table_scores)
    lane_table_values = intrinsic(_lane_table_values)
    lane_tables = intrinsic(_lane_tables)
    lane_sums = intrinsic(_lane_sums)
else:
    codes_to_lanes, lane_table_scores, lane_table_values = (
        codes_to_lanes_loop,
        lane_table_scores_loop,
        lane_table_values_loop,
    )
    lane_tables, lane_sums = lane_tables_loop, lane_sums_loop

__all__ = [
    "codes_to_lanes",
    "lane_table_scores",
    "lane_table_values",
    "lane_tables",
    "lane_sums",
    "codes_to_lanes_loop",
    "lane_table_scores_loop",
    "lane_table_values_loop",
    "lane_tables_loop",
    "lane_sums_loop",
]
