"""Packed 4- and 2-bit codes to centroid values sixteen at a time (Numba, ``vpermps``).

A fused kernel spends most of its time turning codes into floats unless one instruction does
sixteen of them: with AVX-512, ``vpermps`` looks up sixteen 32-bit indices in a 16-entry
float32 table held in one register, which is exactly a codebook of at most 16 centroids. With
AVX2 (8-lane registers) the same lookup is four 8-lane ``vpermps`` and two blends, and the
16-lane vector code around it runs as pairs of 8-lane instructions (LLVM splits it).
:func:`unpack16_4` and :func:`unpack16_2` take 16 packed bytes (32 four-bit or 64 two-bit
codes), split them into *bit planes* and write each plane's centroid values as 16
consecutive floats.

Plane order
-----------
Byte ``j`` of a row holds codes ``per·j + p`` for ``p < per`` (``per = 8 / bits``, the
layout of :mod:`arraykv.quant.bitpack`). The planar order puts code ``per·j + p`` of a row of
``nbytes`` bytes at position ``p·nbytes + j``: each plane is a contiguous run of the row's
bytes, so no code crosses a vector. Dot products and weighted sums do not care about channel
order as long as the other operand is permuted the same way (:func:`to_planar`,
:func:`from_planar`).

Without AVX-512 and AVX2 (or with ``NUMBA_CPU_NAME`` set and ``NUMBA_CPU_FEATURES`` naming
neither, so compiled code may run on another CPU) :data:`HAVE_PERMPS` is False and the same
functions are plain loops (used by the tests to check the instruction path against them; the
kernels keep their byte-table unpacking there).

The same instructions serve the other code layouts in sibling modules: :mod:`.simd3` (3-bit
codes), :mod:`.simd_int2` (2-bit integer codes in channel order), :mod:`.simd_signs` (QJL
sign bits as masks), :mod:`.simd_lanes` (product-quantization codes with tokens along the
lanes).
"""

from __future__ import annotations

import types

import numpy as np

try:
    import numba as nb
    from numba import types as nbt
    from numba.core import config as nb_config
    from numba.core.extending import intrinsic
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from .fused_driver import FASTMATH, softmax_tile

__all__ = [
    "HAVE_PERMPS",
    "planar_per",
    "table16",
    "unpack_tile_4",
    "unpack_tile_2",
    "unpack_tile_4_loop",
    "unpack_tile_2_loop",
    "to_planar",
    "from_planar",
    "channels_to_planar",
    "planar_to_channels",
    "tile_scores",
    "tile_values",
    "VECTOR_TILES",
    "tile_scores_codes_4",
    "tile_scores_codes_2",
    "tile_values_codes_4",
    "tile_values_codes_2",
    "tile_scores_codes_4_loop",
    "tile_scores_codes_2_loop",
    "tile_values_codes_4_loop",
    "tile_values_codes_2_loop",
    "PREFETCH_ROWS",
    "int4_group_scores",
    "tile_values_codes_4_scaled",
    "tile_values_codes_4_scaled_loop",
    "softmax_rows",
    "softmax_rows_affine",
    "softmax_rows_affine_loop",
    "int8_group_scores",
    "tile_values_codes_8_scaled",
    "tile_values_codes_8_scaled_loop",
]


def host_cpu_has(feature: str) -> bool:
    """Whether compiled code may use the host CPU's ``feature`` (an LLVM name: ``"avx512f"``, ``"f16c"``).

    When Numba compiles for a named CPU (``NUMBA_CPU_NAME``: portable caches) only the
    features named in ``NUMBA_CPU_FEATURES`` (``"+avx2,+fma,..."``) count, none without it;
    False where llvmlite cannot say.
    """
    if nb_config.CPU_NAME:
        named = getattr(nb_config, "CPU_FEATURES", None) or ""
        return f"+{feature}" in named.replace(" ", "").split(",")
    try:
        import llvmlite.binding as llb

        return bool(llb.get_host_cpu_features().get(feature, False))
    except Exception:  # pragma: no cover - llvmlite without the query
        return False


#: True when compiled code has AVX-512: a 16-entry table lookup is one ``vpermps``.
HAVE_AVX512 = host_cpu_has("avx512f")
#: True when the kernels may look up sixteen codes at once in a 16-entry register table: one
#: AVX-512 ``vpermps``, or with AVX2 four 8-lane ``vpermps`` and two blends
#: (:func:`_vec_helpers` ``perm_fn``); the other vector code is plain LLVM vectors of sixteen
#: float32, which LLVM splits into two 8-lane halves where AVX-512 is missing.
HAVE_PERMPS = HAVE_AVX512 or (host_cpu_has("avx2") and host_cpu_has("fma"))
#: True when the fused kernels score and sum tiles with :func:`tile_scores` / :func:`tile_values`
#: (head_dim a multiple of 64): where the code lookups are vectors too (AVX-512 or AVX2).
VECTOR_TILES = HAVE_PERMPS


def planar_per(bits: int, d: int) -> int:
    """Codes per byte when rows of ``d`` codes of ``bits`` bits are read in planar order, else 0.

    Planar reading needs :data:`HAVE_PERMPS`, 4- or 2-bit codes and rows of a whole number
    of 16-byte blocks (``d`` a multiple of 32 for 4 bits, 64 for 2 bits).
    """
    if not HAVE_PERMPS or bits not in (2, 4):
        return 0
    per = 8 // bits
    return per if d % (16 * per) == 0 else 0


def table16(cent) -> np.ndarray:
    """A codebook of at most 16 centroids as the 16 float32 of the register table.

    A codebook whose size divides 16 (1, 2, 4, 8 centroids: the codebooks of 0-3 bit codes)
    fills the table repeated, so entry ``i`` is centroid ``i mod size``: a lookup of a code
    then needs only its low bits, and the 2-bit paths skip masking the bits above them. Other
    sizes are followed by zeros.
    """
    cent = np.asarray(cent, np.float32).reshape(-1)
    if cent.size > 16:
        raise ValueError(f"a register table holds at most 16 centroids, received {cent.size}")
    out = np.zeros(16, np.float32)
    if cent.size and 16 % cent.size == 0:
        out[:] = np.tile(cent, 16 // cent.size)
    else:
        out[: cent.size] = cent
    return out


#: Rows ahead of the current one whose codes are prefetched (one tile): the codes stream from
#: memory while the previous tile is scored.
PREFETCH_ROWS = 64


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
        h = _vec_helpers()
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


@nb.njit(inline="always")
def channels_to_planar(src, per, dst):
    """``dst[p·(d/per) + j] = src[per·j + p]``: one row (d,) into planar order (compiled code)."""
    nbytes = src.shape[0] // per
    for j in range(nbytes):
        for p in range(per):
            dst[p * nbytes + j] = src[per * j + p]


@nb.njit(inline="always")
def planar_to_channels(src, per, dst):
    """The inverse of :func:`channels_to_planar`: ``dst[per·j + p] = src[p·(d/per) + j]``."""
    nbytes = src.shape[0] // per
    for j in range(nbytes):
        for p in range(per):
            dst[per * j + p] = src[p * nbytes + j]


def to_planar(x, per: int):
    """``x`` (..., d) with channel ``per·j + p`` moved to position ``p·(d / per) + j`` (a copy)."""
    x = np.asarray(x)
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], d // per, per).swapaxes(-1, -2).reshape(x.shape))


def from_planar(x, per: int):
    """The inverse of :func:`to_planar`."""
    x = np.asarray(x)
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], per, d // per).swapaxes(-1, -2).reshape(x.shape))


# ---- scores and weighted sums of a tile of unpacked rows, in 16-lane vectors ----------------
#
# Both take C-contiguous float32 arrays and a head_dim ``d`` that is a multiple of 64 (four
# vectors); they are generic LLVM vector code (``llvm.fma`` on <16 x float>), kept on the same
# condition as the unpacking above (:data:`HAVE_PERMPS`), where they were measured. The
# query heads of a KV group are taken four (then two, then one) at a time so that one load of
# a row feeds four multiply-adds; accumulators stay in registers for a whole tile.


def _vec_helpers():
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


def _arrays(context, builder, sig, args, which):
    from numba.core import cgutils

    out = []
    for i in which:
        a = context.make_array(sig.args[i])(context, builder, args[i])
        out.append((a.data, cgutils.unpack_tuple(builder, a.shape)))
    return out


def _c_f32(*tys) -> bool:
    return all(isinstance(t, nbt.Array) and t.dtype == nbt.float32 and t.layout == "C" for t in tys)


def _emit_scores(builder, h, nt, s, s_w, accs, rows_of, fill):
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


def _emit_row_values(builder, h, g_n, d, nt, w, w_w, acc, row_source):
    """``acc[g, :] += Σ_{r < nt} w[g, r] · row_r`` for every query head (blocks of
    :func:`_g_blocks_any`), channels 64 at a time: four 16-channel chunks times the block's heads
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

    _g_blocks_any(builder, h, g_n, emit)


def _scores_codegen(context, builder, sig, args):
    h = _vec_helpers()
    (buf, (_, width)), (qr, (g_n, d)), (s, (_, s_w)) = _arrays(context, builder, sig, args, (0, 2, 3))
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

    h.g_blocks(builder, g_n, _emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 16 // gb if gb > 1 else 8, fill))
    return context.get_dummy_value()


def _values_codegen(context, builder, sig, args):
    h = _vec_helpers()
    (buf, (_, width)), (w, (_, w_w)), (acc, (g_n, d)) = _arrays(context, builder, sig, args, (0, 2, 3))
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
    if not (_c_f32(buf, qr, s) and isinstance(nt, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, qr, s), _scores_codegen


@intrinsic
def tile_values(typingctx, buf, nt, w, acc):
    """``acc[g, j] += Σ_{r < nt} w[g, r] · buf[r, j]`` (every row of ``acc``).

    ``buf`` (rows, width), ``w`` (G, ≥ nt), ``acc`` (G, d): C-contiguous float32, ``d`` a
    multiple of 64, ``nt ≤ rows``, ``width ≥ d``; not checked at run time.
    """
    if not (_c_f32(buf, w, acc) and isinstance(nt, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, w, acc), _values_codegen


# ---- the same, straight from packed codes (no tile buffer) ----------------------------------
#
# ``tile_scores_codes_<bits>`` / ``tile_values_codes_<bits>`` are :func:`tile_scores` /
# :func:`tile_values` with the rows of ``buf`` computed in registers from packed codes (the
# planar order of :func:`unpack_tile_4`), so a tile's centroid values are never stored and
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


def _g_blocks_any(builder, h, g_n, emit):
    """``emit(g0, gb)`` for query heads in blocks of four, then one block of the 1-3 left."""
    n4 = builder.udiv(g_n, h.const(4))
    with h.cgutils.for_range(builder, n4) as lp:
        emit(builder.mul(lp.index, h.const(4)), 4)
    g0 = builder.mul(n4, h.const(4))
    rest = builder.sub(g_n, g0)
    for gb in (1, 2, 3):
        with h.cgutils.if_unlikely(builder, builder.icmp_unsigned("==", rest, h.const(gb))):
            emit(g0, gb)


def _scores_codes_codegen(bits):
    per = 8 // bits

    def codegen(context, builder, sig, args):
        h = _vec_helpers()
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbytes = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        t0, nt = args[1], args[2]
        tab_arr = context.make_array(sig.args[3])(context, builder, args[3])
        (qr, (g_n, d)), (s, (_, s_w)) = _arrays(context, builder, sig, args, (4, 5))
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

        emit = _emit_scores(builder, h, nt, s, s_w, accs, lambda gb: 4 if gb >= 3 else 8, fill)
        _g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _values_codes_codegen(bits, scaled=False):
    def codegen(context, builder, sig, args):
        h = _vec_helpers()
        ir = h.ir
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbytes = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        t0, nt = args[1], args[2]
        tab_arr = context.make_array(sig.args[3])(context, builder, args[3])
        if scaled:  # (w, cscale, acc): each row's chunk k times cscale[r, k] before the weights
            (w, (_, w_w)), (csc, (_, cs_w)), (acc, (g_n, d)) = _arrays(context, builder, sig, args, (4, 5, 6))
        else:
            (w, (_, w_w)), (acc, (g_n, d)) = _arrays(context, builder, sig, args, (4, 5))
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

        _g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _int_group_codegen(bits):
    """LLVM code of ``int<bits>_group_scores``: ``s[g, off + i] = Σ_c qf[g, c] · code[c, i]`` for the
    ``G`` tokens of one key group. Per 32 tokens and channel: two vectors of 16 codes (int4: the
    even and the odd tokens of one 16-byte block, interleaved at the end; int8: two 16-byte
    blocks), each multiplied into every query head of the block of heads."""

    def codegen(context, builder, sig, args):
        h = _vec_helpers()
        ir = h.ir
        c_arr = context.make_array(sig.args[0])(context, builder, args[0])
        c_stride = h.cgutils.unpack_tuple(builder, c_arr.strides)[0]
        nbk = h.cgutils.unpack_tuple(builder, c_arr.shape)[1]
        (qf, (g_n, d)), (s, (_, s_w)) = _arrays(context, builder, sig, args, (1, 2))
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

        _g_blocks_any(builder, h, g_n, emit)
        return context.get_dummy_value()

    return codegen


def _group_typer(bits):
    gen = _int_group_codegen(bits)

    def typer(typingctx, codes, qf, s, off):
        ok = (
            isinstance(codes, nbt.Array)
            and codes.ndim == 2
            and codes.dtype == nbt.uint8
            and _c_f32(qf, s)
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
            and _c_f32(w, cscale, acc)
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
            and _c_f32(x, out)
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


# ---- the online softmax of a tile, every query head --------------------------------------

#: 2**f on |f| <= 1/2, Taylor coefficients ln(2)**k / k! (as :func:`arraykv.ops.numba.fused_driver.softmax_tile`)
_EXP2 = (
    0.6931471805599453,
    0.2402265069591007,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.00015403530393381606,
    1.525273380405984e-05,
)


def _softmax_codegen(context, builder, sig, args):
    """``softmax_rows(s, nt, m, l, acc)``."""
    return _softmax_ir(context, builder, sig, args, None)


def _softmax_affine_codegen(context, builder, sig, args):
    """``softmax_rows_affine(s, nt, kn, cq, rt, vn, m, l, acc)``."""
    return _softmax_ir(context, builder, sig, args, (2, 3, 4, 5))


def _softmax_ir(context, builder, sig, args, affine):
    """The online-softmax step of a tile; with ``affine`` (argument positions of ``kn, cq, rt,
    vn``) the logits are ``s·kn + cq[g] + rt[g]`` (computed as they are read, stored back) and
    the weights written are ``p·vn`` (the sum ``l`` takes ``p``)."""
    h = _vec_helpers()
    ir = h.ir
    tail = (6, 7, 8) if affine else (2, 3, 4)
    (s, (g_n, s_w)), (m, _), (l, _), (acc, (_, d)) = _arrays(context, builder, sig, args, (0,) + tail)
    if affine:
        (kn, _), (cq, _), (rt, (_, rt_w)), (vn, _) = _arrays(context, builder, sig, args, affine)
    nt = args[1]
    f32, v16 = h.f32, h.v16
    i32 = ir.IntType(32)
    v16i32 = ir.VectorType(i32, 16)
    mod = builder.module

    def intrinsic_fn(name, ret, argtys):
        fn = mod.globals.get(name)
        return fn if fn is not None else ir.Function(mod, ir.FunctionType(ret, argtys), name)

    vmax = intrinsic_fn("llvm.maxnum.v16f32", v16, [v16, v16])
    vfloor = intrinsic_fn("llvm.floor.v16f32", v16, [v16])
    sexp = intrinsic_fn("llvm.exp.f32", f32, [f32])
    lanes = ir.Constant(v16i32, list(range(16)))
    ninf = ir.Constant(v16, [float("-inf")] * 16)
    zero = ir.Constant(v16, [0.0] * 16)
    nvec = builder.udiv(builder.add(nt, h.const(15)), h.const(16))
    nt32 = builder.trunc(nt, i32)
    ntv = builder.shuffle_vector(
        builder.insert_element(ir.Constant(v16i32, ir.Undefined), nt32, ir.Constant(i32, 0)),
        ir.Constant(v16i32, ir.Undefined),
        ir.Constant(v16i32, [0] * 16),
    )
    mx = h.cgutils.alloca_once(builder, v16)
    sm = h.cgutils.alloca_once(builder, v16)

    def live(k):  # lanes of vector k that hold one of the nt logits
        base = builder.trunc(builder.mul(k, h.const(16)), i32)
        bv = builder.shuffle_vector(
            builder.insert_element(ir.Constant(v16i32, ir.Undefined), base, ir.Constant(i32, 0)),
            ir.Constant(v16i32, ir.Undefined),
            ir.Constant(v16i32, [0] * 16),
        )
        return builder.icmp_signed("<", builder.add(bv, lanes), ntv)

    fma0 = h.fma_fn(builder)
    with h.cgutils.for_range(builder, g_n) as lg:
        g = lg.index
        row = builder.mul(g, s_w)
        builder.store(ninf, mx)
        if affine:
            cqv = h.splat(builder, builder.load(builder.gep(cq, [g])))
            rt_row = builder.mul(g, rt_w)
        with h.cgutils.for_range(builder, nvec) as lk:
            off = builder.mul(lk.index, h.const(16))
            x = h.vload(builder, s, builder.add(row, off))
            if affine:  # the logits: s·ℓ_k + q·μ + the rotating mean's term, stored back
                x = builder.fadd(
                    builder.call(fma0, [x, h.vload(builder, kn, off), cqv]),
                    h.vload(builder, rt, builder.add(rt_row, off)),
                )
                h.vstore(builder, x, s, builder.add(row, off))
            x = builder.select(live(lk.index), x, ninf)
            builder.store(builder.call(vmax, [builder.load(mx), x]), mx)
        v = builder.load(mx)
        n = 16
        while n > 1:  # the tile's largest logit
            idx = ir.Constant(ir.VectorType(i32, n // 2), list(range(n // 2)))
            hi = ir.Constant(ir.VectorType(i32, n // 2), list(range(n // 2, n)))
            v = (
                builder.call(
                    intrinsic_fn(
                        f"llvm.maxnum.v{n // 2}f32", ir.VectorType(f32, n // 2), [ir.VectorType(f32, n // 2)] * 2
                    ),
                    [builder.shuffle_vector(v, v, idx), builder.shuffle_vector(v, v, hi)],
                )
                if n > 2
                else builder.call(
                    intrinsic_fn("llvm.maxnum.f32", f32, [f32, f32]),
                    [builder.extract_element(v, ir.Constant(i32, 0)), builder.extract_element(v, ir.Constant(i32, 1))],
                )
            )
            n //= 2
        tmax = v
        m_ptr = builder.gep(m, [g])
        l_ptr = builder.gep(l, [g])
        m_old = builder.load(m_ptr)
        with h.cgutils.if_unlikely(builder, builder.fcmp_ordered(">", tmax, m_old)):
            # a new maximum: rescale the running sum and value sum once (m_old = -inf gives 0)
            c = builder.call(sexp, [builder.fsub(m_old, tmax)])
            builder.store(builder.fmul(builder.load(l_ptr), c), l_ptr)
            cv = h.splat(builder, c)
            arow = builder.mul(g, d)
            with h.cgutils.for_range(builder, builder.udiv(d, h.const(16))) as la:
                at = builder.add(arow, builder.mul(la.index, h.const(16)))
                h.vstore(builder, builder.fmul(h.vload(builder, acc, at), cv), acc, at)
            builder.store(tmax, m_ptr)
        mt = h.splat(builder, builder.load(m_ptr))
        builder.store(zero, sm)
        log2e = ir.Constant(v16, [1.4426950408889634] * 16)
        lo = ir.Constant(v16, [-126.0] * 16)
        half_c = ir.Constant(v16, [0.5] * 16)
        coef = [ir.Constant(v16, [c] * 16) for c in _EXP2]
        one = ir.Constant(v16, [1.0] * 16)
        fma = h.fma_fn(builder)
        with h.cgutils.for_range(builder, nvec) as lk:
            at = builder.add(row, builder.mul(lk.index, h.const(16)))
            x = h.vload(builder, s, at)
            y = builder.fmul(builder.fsub(x, mt), log2e)
            y = builder.call(vmax, [y, lo])
            nf = builder.call(vfloor, [builder.fadd(y, half_c)])
            f = builder.fsub(y, nf)
            p = coef[-1]
            for cf in reversed(coef[:-1]):
                p = builder.call(fma, [p, f, cf])
            p = builder.call(fma, [p, f, one])
            e = builder.shl(
                builder.add(builder.fptosi(nf, v16i32), ir.Constant(v16i32, [127] * 16)), ir.Constant(v16i32, [23] * 16)
            )
            p = builder.fmul(p, builder.bitcast(e, v16))
            alive = live(lk.index)
            builder.store(builder.fadd(builder.load(sm), builder.select(alive, p, zero)), sm)
            if affine:  # the weights carry the value lengths
                p = builder.fmul(p, h.vload(builder, vn, builder.mul(lk.index, h.const(16))))
            h.vstore(builder, builder.select(alive, p, zero), s, at)
        builder.store(builder.fadd(builder.load(l_ptr), h.hsum(builder, builder.load(sm))), l_ptr)
    return context.get_dummy_value()


@intrinsic
def softmax_rows(typingctx, s, nt, m, l, acc):
    """:func:`arraykv.ops.numba.fused_driver.softmax_tile` for every row ``g`` of ``s`` at once, in vectors.

    ``s`` (G, width) logits in, weights out (``width`` a multiple of 16, ``nt ≤ width``; lanes
    from ``nt`` to the end of their vector are written 0); ``m``, ``l`` (G,) and ``acc`` (G, d)
    (``d`` a multiple of 16) the running maximum, sum and value sum, rescaled once when the
    tile raises the maximum. Same polynomial and exponent-field construction as ``softmax_tile``.
    """
    ok = (
        _c_f32(s, m, l, acc)
        and s.ndim == 2
        and m.ndim == 1
        and l.ndim == 1
        and acc.ndim == 2
        and isinstance(nt, nbt.Integer)
    )
    if not ok:
        return None
    return nbt.void(s, nbt.int64, m, l, acc), _softmax_codegen


@nb.njit(fastmath=FASTMATH)
def softmax_rows_affine_loop(s, nt, kn, cq, rt, vn, m, l, acc):
    """Reference of :func:`softmax_rows_affine`: the logits, the tile's softmax
    (:func:`~arraykv.ops.numba.fused_driver.softmax_tile`), then the weights times ``vn``."""
    ebits = np.empty(s.shape[1], np.int32)
    for g in range(s.shape[0]):
        for r in range(nt):
            s[g, r] = s[g, r] * kn[r] + cq[g] + rt[g, r]
        softmax_tile(s[g], nt, m, l, acc, g, ebits)
        for r in range(nt):
            s[g, r] *= vn[r]


@intrinsic
def softmax_rows_affine(typingctx, s, nt, kn, cq, rt, vn, m, l, acc):
    """:func:`softmax_rows` of the logits ``s[g]·kn + cq[g] + rt[g]``, writing the weights times ``vn``.

    ``kn``, ``vn`` (≥ width,) and ``rt`` (G, ≥ width) float32, C-contiguous, ``cq`` (G,):
    the per-token key and value lengths, the per-query constant and per-token term of a fused
    step, applied as the tile is read (the logits are stored back into ``s`` on the way) rather
    than in separate loops over the tile. ``l`` sums the weights before ``vn``. Reference:
    :func:`softmax_rows_affine_loop`.
    """
    ok = (
        _c_f32(s, kn, cq, rt, vn, m, l, acc)
        and s.ndim == 2
        and rt.ndim == 2
        and kn.ndim == 1
        and vn.ndim == 1
        and cq.ndim == 1
        and m.ndim == 1
        and l.ndim == 1
        and acc.ndim == 2
        and isinstance(nt, nbt.Integer)
    )
    if not ok:
        return None
    return nbt.void(s, nbt.int64, kn, cq, rt, vn, m, l, acc), _softmax_affine_codegen
