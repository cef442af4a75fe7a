"""The online softmax of a tile of logits for every query head at once, in LLVM IR (16-lane vectors).

:func:`softmax_rows` is :func:`arraykv.ops.numba.fused_driver.softmax_tile` for every row of a
tile's scores; :func:`softmax_rows_affine` first forms the logits from the raw scores, the
per-token key lengths and per-query constants as it reads them, and writes the weights times the
value lengths (:func:`softmax_rows_affine_loop`, its plain loop).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from .fused_driver import FASTMATH, softmax_tile
from .ir_tiles import array_args, c_f32, vec_helpers

__all__ = ["softmax_rows", "softmax_rows_affine", "softmax_rows_affine_loop"]


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
    h = vec_helpers()
    ir = h.ir
    tail = (6, 7, 8) if affine else (2, 3, 4)
    (s, (g_n, s_w)), (m, _), (l, _), (acc, (_, d)) = array_args(context, builder, sig, args, (0,) + tail)
    if affine:
        (kn, _), (cq, _), (rt, (_, rt_w)), (vn, _) = array_args(context, builder, sig, args, affine)
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
        c_f32(s, m, l, acc)
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
        c_f32(s, kn, cq, rt, vn, m, l, acc)
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
