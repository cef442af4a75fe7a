"""Numba kernel: one decode step of attention over a low-rank layer, in coefficient space.

Layout read (the :class:`~arraykv.caches.lowrank.LowRankCache` state,
:func:`arraykv.attention.lowrank_fused.lowrank_decode_attention`): per (batch, KV head) ``T``
encoded tokens as coefficient rows ``c_t`` (``r_k``) and ``e_t`` (``r_v``) on the head's bases
``B_K`` (head_dim, r_k) and ``B_V`` (head_dim, r_v) with means ``μ_K``, ``μ_V``, then ``E``
tokens kept as vectors (sinks and the recent window). Coefficients and kept tokens are float16,
read in place through ``uint16`` views and converted one element at a time
(:func:`arraykv.ops.numba.half.half_to_float`), or float32.

A call is the step of :mod:`arraykv.ops.numba.fused_driver`:

1. *prepare*, per (batch, KV head): the scaled queries ``q'`` of its GQA group, their
   projections ``q̃ = B_Kᵀ q'`` (G, r_k) and biases ``q'·μ_K``;
2. *span*, coded tokens in tiles of :data:`TILE`: a tile's key coefficient rows are converted
   once (one flat run of values, sixteen per F16C instruction) and scored for every query head
   of the group, ``q̃·c_t + q'·μ_K``; an online softmax per query head (rescaled at most once
   per tile); the tile's value coefficient rows are converted once and summed with their
   weights in coefficient space, ``w = Σ p_t e_t`` (the first ``r_v`` entries of the step's
   value accumulator);
3. *finish*: a log-sum-exp merge of the token splits, the value sum lifted once,
   ``B_V w + (Σ p_t) μ_V``, the kept tokens in the same online softmax, and the division by
   the denominator.

With AVX-512 (:data:`arraykv.ops.numba.cpu_features.VECTOR_TILES`) the softmax of a tile runs for every
query head at once in 16-lane vectors, and so do the products over ranks (and head dims) that
are multiples of 16 (:func:`_tile_scores16`, :func:`_tile_values16`); other sizes run plain
loops. Small steps run on the calling thread (:mod:`arraykv.ops.numba.threads`, work counted as
the ``batch · heads · T · (r_k + r_v)`` coefficients read); larger ones cut each head's tokens
into spans run on Numba's threads. Work buffers are ``O(TILE · (r_k + r_v + G))`` per task plus
``O(G · (TILE + head_dim))`` per head: nothing grows with the context. One compiled signature
serves float16 and float32 state (both are passed, the unused one empty), compiled for
read-only arguments of any layout (per head_dim variant: 64, 128, any other) when a call first
needs it, and cached on disk.

Notes
-----
Per step and query head the kernel reads ``T (r_k + r_v)`` coefficients and does
``T (r_k + r_v)`` multiply-adds, plus ``head_dim · (r_k + r_v)`` for the projection and the
lift, against ``T · head_dim`` of each for attention over reconstructed keys and values
(and no ``O(T)`` conversion of the layer to float32 per step, which the array-API version
pays). Scores and weights are float32 with the same exponential as the other fused kernels;
the result equals the reference to float32 rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types as nbt
from numba.core.extending import intrinsic

from ..._validation import check_softmax_scale
from ...attention.lowrank_fused import check_decode_args, lowrank_decode_attention as _reference
from ...quant.lowrank import LowRankLayerCoefficients
from .cpu_features import VECTOR_TILES
from .fused_driver import (
    FASTMATH,
    Step,
    build_steps,
    merge_splits,
    merge_top,
    plan,
    ro,
    run_step,
    softmax_tile,
    tile_add_rows,
    tile_dots,
)
from .half import HALF_TO_FLOAT, half_to_float
from .ir_softmax import softmax_rows
from .ir_tiles import array_args, c_f32, scores_codegen, vec_helpers

__all__ = ["lowrank_decode_attention", "TILE"]

#: Tokens per tile: the per-tile work that does not depend on its length (array views and their
#: reference counts, the softmax's bookkeeping) is shared by many tokens, while the tile's
#: converted rows (``TILE · (r_k + r_v)`` float32, 64 KiB at rank 32) stay in the caches.
#: Measured (SmolLM2 shape, 490 and 4096 tokens): 256 beat 128 and 512 by 5–10 %.
TILE = 256


class LowRankArgs(NamedTuple):
    """The arrays of one step of the low-rank kernel (``args`` of its functions).

    Each coefficient or kept-token array comes twice, as ``uint16`` bit patterns of float16
    (``…16``) and as float32 (``…32``), one of the two empty (shape ``(0, 0, 0, 0)``).
    """

    #: (b, h, T, r_k): key coefficients as float16 bit patterns
    k_coef16: Any
    #: (b, h, T, r_k): key coefficients as float32
    k_coef32: Any
    #: float32 (h, d, r_k), C-contiguous: key bases
    k_basis: Any
    #: float32 (h, d), C-contiguous: key means
    k_mean: Any
    #: (b, h, T, r_v): value coefficients as float16 bit patterns
    v_coef16: Any
    #: (b, h, T, r_v): value coefficients as float32
    v_coef32: Any
    #: float32 (h, d, r_v), C-contiguous: value bases
    v_basis: Any
    #: float32 (h, d), C-contiguous: value means
    v_mean: Any
    #: (b, h, E, d): kept keys as float16 bit patterns
    k_extra16: Any
    #: (b, h, E, d): kept keys as float32
    k_extra32: Any
    #: (b, h, E, d): kept values as float16 bit patterns
    v_extra16: Any
    #: (b, h, E, d): kept values as float32
    v_extra32: Any
    #: float32 (65536,): float16 bit pattern -> value (:data:`arraykv.ops.numba.half.HALF_TO_FLOAT`)
    half: Any


class LowRankState(NamedTuple):
    """The query-side state of the step, per (batch, KV head) slot (:func:`_prepare_head`)."""

    #: float32 (b_n, h_n, G, d): the scaled queries
    qs: Any
    #: float32 (b_n, h_n, G, r_k): the scaled queries projected on the key basis
    qt: Any
    #: float32 (b_n, h_n, G): the scaled queries' products with the key mean
    bias: Any


_U16_4, _F32_4 = ro(nbt.uint16, 4), ro(nbt.float32, 4)
_F32_3C, _F32_2C, _F32_1C = ro(nbt.float32, 3, "C"), ro(nbt.float32, 2, "C"), ro(nbt.float32, 1, "C")
#: ``(q, scale, n, h_n, args, splits, out)`` with ``args`` the fields of :class:`LowRankArgs`.
_SIG = nbt.void(
    _F32_3C,
    nbt.float64,
    nbt.int64,
    nbt.int64,
    nbt.Tuple(
        (_U16_4, _F32_4, _F32_3C, _F32_2C, _U16_4, _F32_4, _F32_3C, _F32_2C, _U16_4, _F32_4, _U16_4, _F32_4, _F32_1C)
    ),
    nbt.int64,
    nbt.Array(nbt.float32, 3, "C"),
)
#: head_dim as a compile-time constant in the steps built for it (``build_steps(dims=...)``); 0: any
_D = 0


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _rows(x16, x32, b, h, t0, nt, table, out):
    """Rows ``t0 .. t0 + nt`` of ``x[b, h]`` as float32 into ``out[:nt]`` (``x16`` when it is not empty, else ``x32``).

    ``out`` is C-contiguous with exactly the rows' width. The rows are read as one contiguous
    block: a view where they are laid out so (any buffer sliced along the token axis), else a
    copy of just these rows; the block is then converted as one flat run of values.
    """
    if x16.shape[0]:
        blk = np.ascontiguousarray(x16[b, h, t0 : t0 + nt])
        src = blk.reshape(blk.size)
        dst = out.reshape(out.size)
        for j in range(src.shape[0]):
            dst[j] = half_to_float(src[j], table)
    else:
        blk32 = np.ascontiguousarray(x32[b, h, t0 : t0 + nt])
        src32 = blk32.reshape(blk32.size)
        dst = out.reshape(out.size)
        for j in range(src32.shape[0]):
            dst[j] = src32[j]


# ---- tile products in 16-lane vectors (AVX-512: arraykv.ops.numba.ir_tiles) -----------------
#
# Used when the ranks are multiples of 16 (:data:`VECTOR_TILES`): the plain loops
# (:func:`~arraykv.ops.numba.fused_driver.tile_dots`, ``tile_add_rows``) leave the
# compiler a 32-wide product per token and query head, which it finishes with a sum across the
# lanes for every score and a store and reload of the value sums for every token; here the
# accumulators stay in registers for a whole tile and four scores share one lane reduction.


@intrinsic
def _tile_scores16(typingctx, buf, nt, qr, s):
    """``s[g, i] = Σ_j qr[g, j] · buf[i, j]`` for ``i < nt`` and every row ``g`` of ``qr``.

    ``buf`` (rows, width), ``qr`` (G, r), ``s`` (G, ≥ nt): C-contiguous float32, ``r`` a
    multiple of 16, ``nt ≤ rows``, ``width ≥ r``; not checked at run time. The code of
    :func:`arraykv.ops.numba.ir_tiles.tile_scores`, whose loops take the columns sixteen at a time.
    """
    if not (c_f32(buf, qr, s) and isinstance(nt, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, qr, s), scores_codegen


def _values16_codegen(context, builder, sig, args):
    h = vec_helpers()
    (buf, (_, width)), (w, (_, w_w)), (acc, (g_n, acc_w)) = array_args(context, builder, sig, args, (0, 2, 3))
    nt, ncol = args[1], args[4]
    fma = h.fma_fn(builder)
    # accumulators [row parity][query head][column block]: two rows per step on separate chains,
    # so the multiply-adds of one head and block do not wait on each other
    accs = [[[h.cgutils.alloca_once(builder, h.v16) for _ in range(2)] for _ in range(4)] for _ in range(2)]
    npairs = builder.udiv(nt, h.const(2))

    def emit(g0, gb, c0, cb):  # heads g0 .. g0 + gb, columns c0 .. c0 + 16 cb
        rows = [builder.mul(builder.add(g0, h.const(gi)), acc_w) for gi in range(gb)]
        wrows = [builder.mul(builder.add(g0, h.const(gi)), w_w) for gi in range(gb)]
        cols = [builder.add(c0, h.const(16 * ci)) for ci in range(cb)]
        for gi in range(gb):
            for ci in range(cb):
                builder.store(h.vload(builder, acc, builder.add(rows[gi], cols[ci])), accs[0][gi][ci])
                builder.store(h.ir.Constant(h.v16, None), accs[1][gi][ci])

        def step(r, u):
            xs = [h.vload(builder, buf, builder.add(builder.mul(r, width), col)) for col in cols]
            for gi in range(gb):
                wv = h.splat(builder, builder.load(builder.gep(w, [builder.add(wrows[gi], r)])))
                for ci in range(cb):
                    a = accs[u][gi][ci]
                    builder.store(builder.call(fma, [wv, xs[ci], builder.load(a)]), a)

        with h.cgutils.for_range(builder, npairs) as lp:
            r0 = builder.mul(lp.index, h.const(2))
            step(r0, 0)
            step(builder.add(r0, h.const(1)), 1)
        last = builder.sub(nt, h.const(1))
        with h.cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.urem(nt, h.const(2)), h.const(0))):
            step(last, 0)
        for gi in range(gb):
            for ci in range(cb):
                total = builder.fadd(builder.load(accs[0][gi][ci]), builder.load(accs[1][gi][ci]))
                h.vstore(builder, total, acc, builder.add(rows[gi], cols[ci]))

    def heads(g0, gb):  # the columns in blocks of 32, then 16
        n2 = builder.udiv(ncol, h.const(32))
        with h.cgutils.for_range(builder, n2) as lc:
            emit(g0, gb, builder.mul(lc.index, h.const(32)), 2)
        with h.cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.urem(ncol, h.const(32)), h.const(0))):
            emit(g0, gb, builder.mul(n2, h.const(32)), 1)

    h.g_blocks(builder, g_n, heads)
    return context.get_dummy_value()


@intrinsic
def _tile_values16(typingctx, buf, nt, w, acc, ncol):
    """``acc[g, j] += Σ_{i < nt} w[g, i] · buf[i, j]`` for ``j < ncol`` and every row ``g`` of ``acc``.

    ``buf`` (rows, width), ``w`` (G, ≥ nt), ``acc`` (G, ≥ ncol): C-contiguous float32, ``ncol``
    a multiple of 16, ``nt ≤ rows``, ``width ≥ ncol``; not checked at run time.
    """
    if not (c_f32(buf, w, acc) and isinstance(nt, nbt.Integer) and isinstance(ncol, nbt.Integer)):
        return None
    return nbt.void(buf, nbt.int64, w, acc, nbt.int64), _values16_codegen


@nb.njit(inline="always")
def _vec(r):
    """Whether products over ``r`` columns run in 16-lane vectors."""
    return VECTOR_TILES and r % 16 == 0


@nb.njit(inline="always")
def _dots(q, x, n, s):
    """``s[g, i] = q[g] · x[i, :q.shape[1]]`` for ``i < n`` (C-contiguous float32 arrays)."""
    if _vec(q.shape[1]):
        _tile_scores16(x, n, q, s)
    else:
        tile_dots(q, x, n, q.shape[1], s)


@nb.njit(inline="always")
def _add_rows(w, x, n, r, acc):
    """``acc[g, :r] += Σ_{i < n} w[g, i] · x[i, :r]`` (C-contiguous float32 arrays)."""
    if _vec(r):
        _tile_values16(x, n, w, acc, r)
    else:
        tile_add_rows(w, x, n, r, acc)


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_span(b, h, t_lo, t_hi, qt, bias, args, m, l, acc):
    """Online softmax over coded tokens ``[t_lo, t_hi)`` of head ``(b, h)`` for every query head of its group.

    ``qt`` (G, r_k) are the projected scaled queries and ``bias`` (G,) their products with the
    key mean; ``args`` the step's :class:`LowRankArgs`. ``m``, ``l`` (G,) and ``acc`` (G, d)
    hold the running maximum logit, the sum of ``exp(logit − m)`` and, in ``acc[:, :r_v]``,
    ``Σ exp(logit − m) · e_t``; a caller starts them at ``-inf``, ``0``, ``0``.
    """
    k16, k32, v16, v32, table = args.k_coef16, args.k_coef32, args.v_coef16, args.v_coef32, args.half
    g_n = qt.shape[0]
    rk = qt.shape[1]
    rv = v16.shape[3] if v16.shape[0] else v32.shape[3]
    kb = np.empty((TILE, rk), np.float32)
    vb = np.empty((TILE, rv), np.float32)
    s = np.empty((g_n, TILE), np.float32)
    ebits = np.empty(TILE, np.int32)
    vec = _vec(acc.shape[1])  # the tile's softmax for every query head at once, in 16-lane vectors
    for t0 in range(t_lo, t_hi, TILE):
        nt = min(t_hi, t0 + TILE) - t0
        # 1. scores of every query head from one conversion of the tile's key coefficients
        _rows(k16, k32, b, h, t0, nt, table, kb)
        _dots(qt, kb, nt, s)
        for g in range(g_n):
            for i in range(nt):
                s[g, i] += bias[g]
        # 2. online softmax per query head, then the value coefficients weighted for all of them
        _rows(v16, v32, b, h, t0, nt, table, vb)
        if vec:
            softmax_rows(s, nt, m, l, acc)
        else:
            for g in range(g_n):
                softmax_tile(s[g], nt, m, l, acc, g, ebits)
        _add_rows(s, vb, nt, rv, acc)


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _prepare_head(q, b, h, scale, k_basis, k_mean, qs, qt, bias):
    """``qs = scale · q`` for the group of KV head ``h``, ``qt = qs B_K[h]`` and ``bias = qs · μ_K[h]``."""
    g_n = qs.shape[0]
    d = _D if _D else qs.shape[1]
    rk = qt.shape[1]
    sc = np.float32(scale)
    for g in range(g_n):
        x = np.float32(0.0)
        for c in range(d):
            y = q[b, h * g_n + g, c] * sc
            qs[g, c] = y
            x += y * k_mean[h, c]
        bias[g] = x
        for j in range(rk):
            qt[g, j] = np.float32(0.0)
    if rk:
        _add_rows(qs, k_basis[h], d, rk, qt)


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _finish_head(b, h, n, qs, m_sp, l_sp, acc_sp, args, out):
    """Merge the token splits of head ``(b, h)`` (log-sum-exp), lift the value sum, add the kept tokens, write ``out``.

    The merged coded tokens are the starting state (maximum, sum, value sum ``B_V w + (Σ p) μ_V``)
    of an online softmax that then takes the kept tokens in tiles, like the coded ones.
    """
    v_basis, v_mean, table = args.v_basis, args.v_mean, args.half
    ke16, ke32, ve16, ve32 = args.k_extra16, args.k_extra32, args.v_extra16, args.v_extra32
    g_n, dd = acc_sp.shape[1], acc_sp.shape[2]
    d = _D if _D else dd
    e_n = ke16.shape[2] if ke16.shape[0] else ke32.shape[2]
    rv = v_basis.shape[2] if n else 0
    m = np.empty(g_n, np.float32)
    l = np.empty(g_n, np.float32)
    w = np.zeros((g_n, dd), np.float32)
    o = np.zeros((g_n, d), np.float32)
    for g in range(g_n):
        m[g] = merge_top(m_sp, g)
        l[g] = merge_splits(m_sp, l_sp, acc_sp, g, m[g], w[g])
    if rv:  # the coded tokens' value sum, lifted from coefficient space: B_V w + (Σ p) μ_V
        wr = np.empty((g_n, rv), np.float32)
        for g in range(g_n):
            for j in range(rv):
                wr[g, j] = w[g, j]
        _dots(wr, v_basis[h], d, o)
        for g in range(g_n):
            for c in range(d):
                o[g, c] += l[g] * v_mean[h, c]
    if e_n:
        blk = np.empty((min(e_n, TILE), d), np.float32)
        s = np.empty((g_n, TILE), np.float32)
        ebits = np.empty(TILE, np.int32)
        vec = _vec(d)
        for t0 in range(0, e_n, TILE):
            nt = min(e_n, t0 + TILE) - t0
            _rows(ke16, ke32, b, h, t0, nt, table, blk[:nt])
            _dots(qs, blk, nt, s)
            if vec:
                softmax_rows(s, nt, m, l, o)
            else:
                for g in range(g_n):
                    softmax_tile(s[g], nt, m, l, o, g, ebits)
            _rows(ve16, ve32, b, h, t0, nt, table, blk[:nt])
            _add_rows(s, blk, nt, d, o)
    for g in range(g_n):
        inv = np.float32(1.0) / l[g]
        for c in range(d):
            out[b, h * g_n + g, c] = o[g, c] * inv


# ---- the kernel's part of the shared step (arraykv.ops.numba.fused_driver); args: LowRankArgs


@nb.njit(inline="always")
def alloc_state(b_n, h_n, g_n, d, args):
    rk = args.k_basis.shape[2]
    return LowRankState(
        np.empty((b_n, h_n, g_n, d), np.float32),
        np.empty((b_n, h_n, g_n, rk), np.float32),
        np.zeros((b_n, h_n, g_n), np.float32),
    )


@nb.njit(inline="always")
def prepare(q, b, h, scale, args, state, sb, sh):
    _prepare_head(q, b, h, scale, args.k_basis, args.k_mean, state.qs[sb, sh], state.qt[sb, sh], state.bias[sb, sh])


@nb.njit(inline="always")
def span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    _attend_span(b, h, t_lo, t_hi, state.qt[sb, sh], state.bias[sb, sh], args, m, l, acc)


@nb.njit(inline="always")
def finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out):
    n = args.k_coef16.shape[2] if args.k_coef16.shape[0] else args.k_coef32.shape[2]
    _finish_head(b, h, n, state.qs[sb, sh], m_sp, l_sp, acc_sp, args, out)


@nb.njit(inline="always")
def span_unit(args):
    return 1


_step_serial, _step_parallel = build_steps(globals(), LowRankArgs, [_SIG], dims=(64, 128))

_NO_U16_4 = np.zeros((0, 0, 0, 0), np.uint16)
_NO_F32_4 = np.zeros((0, 0, 0, 0), np.float32)
_NO_U16_4.setflags(write=False)
_NO_F32_4.setflags(write=False)
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def _pair(x):
    """``(uint16 bit patterns, float32)`` of an array of float16 (a view) or other floats (float32), one empty."""
    dt = x.dtype
    if dt is _F16 or dt == _F16:
        return x.view(np.uint16), _NO_F32_4
    return _NO_U16_4, (x if dt is _F32 or dt == _F32 else x.astype(np.float32))


def _plan(bh: int, n: int, r: int) -> tuple:
    """``(threads, token splits per head)``: :func:`arraykv.ops.numba.fused_driver.plan` of ``bh · n · r``
    coefficients (``r = r_k + r_v``), spans of at least ``4 · TILE`` tokens."""
    return plan(bh, n, bh * n * r, 4 * TILE)


def lowrank_decode_attention(q, layer_coefficients: LowRankLayerCoefficients, k_extra, v_extra, *, softmax_scale):
    """Fused decode attention over a low-rank layer (NumPy), reading float16 coefficients in place.

    Same contract as :func:`arraykv.attention.lowrank_fused.lowrank_decode_attention`.

    Parameters
    ----------
    q : ndarray of float, shape (batch, q_heads, 1, head_dim)
        Any float dtype; computed in float32.
    layer_coefficients : LowRankLayerCoefficients
        The layer's coefficients, bases and means, unpacked here and nowhere else:

        * ``k_coef``, ``v_coef``: ndarray of float16 or float32, shape (batch, h, T, r_k) and
          (batch, h, T, r_v): read in place (float16 through a ``uint16`` view), any strides;
          other float dtypes are converted to float32.
        * ``k_basis``, ``v_basis``: ndarray of float, shape (h, head_dim, r_k) and
          (h, head_dim, r_v), or None when ``T = 0``.
        * ``k_mean``, ``v_mean``: ndarray of float, shape (h, head_dim), or None when ``T = 0``.
    k_extra, v_extra : ndarray of float, shape (batch, h, E, head_dim)
        Kept tokens, read like the coefficients.
    softmax_scale : float

    Returns
    -------
    ndarray, shape (batch, q_heads, 1, head_dim), dtype of ``q``
    """
    softmax_scale = check_softmax_scale(softmax_scale)
    lc = layer_coefficients
    k_coef, k_basis, k_mean = lc.k_coef, lc.k_basis, lc.k_mean
    v_coef, v_basis, v_mean = lc.v_coef, lc.v_basis, lc.v_mean
    b, h, g, d, n, e, rk, rv = check_decode_args(q, k_coef, k_basis, k_mean, v_coef, v_basis, v_mean, k_extra, v_extra)
    if rv > d:  # the value sum lives in the step's (G, head_dim) accumulator; bases wider than tall do not fit
        return _reference(q, layer_coefficients, k_extra, v_extra, softmax_scale=softmax_scale)
    if n:
        k16, k32 = _pair(k_coef)
        v16, v32 = _pair(v_coef)
        kb, km, vb, vm = (np.ascontiguousarray(a, dtype=np.float32) for a in (k_basis, k_mean, v_basis, v_mean))
    else:
        k16, k32, v16, v32 = _NO_U16_4, _NO_F32_4, _NO_U16_4, _NO_F32_4
        kb, vb = np.zeros((h, d, 0), np.float32), np.zeros((h, d, 0), np.float32)
        km = vm = np.zeros((h, d), np.float32)
    ke16, ke32 = _pair(k_extra)
    ve16, ve32 = _pair(v_extra)
    hq = h * g
    threads, splits = _plan(b * h, n, rk + rv)
    out = np.empty((b, hq, d), np.float32)
    args = LowRankArgs(k16, k32, kb, km, v16, v32, vb, vm, ke16, ke32, ve16, ve32, HALF_TO_FLOAT)
    step = Step(np.ascontiguousarray(q.reshape(b, hq, d), dtype=np.float32), float(softmax_scale), n, h, args)
    run_step(_step_serial, _step_parallel, threads, splits, b * h * n * (rk + rv), step, out)
    out = out.reshape(b, hq, 1, d)
    return out if q.dtype == np.float32 else out.astype(q.dtype)
