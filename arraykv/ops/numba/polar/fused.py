"""Numba kernel: one decode step of attention straight from PolarQuant/TurboQuant packed codes.

A call is one compiled function that does the whole step for every (batch, KV head):

1. *queries*: divide by the key channel weights ``k_scale``, split out the outlier channels,
   rotate (fast Walsh–Hadamard with the rotation's signs, or the dense matrix), ``q·k_mean``
   and the QJL sketch ``S q̃`` (:func:`arraykv.attention.polar_fused.prepare_queries`); with a
   rotating key mean, the two coefficients per turning channel pair of ``q·m_p`` and the
   phase tables of one tile;
2. *quantized tokens*, in tiles of ``TILE``: the tile's key codes are unpacked once into
   centroid values (byte-chunk tables: one 8-byte load and store per two codes) and scored
   against every query head of the GQA group (plus, for a rotating key mean,
   ``Σ_j A_j cos ω_j p + B_j sin ω_j p``, phases carried from tile to tile by one complex
   multiplication per pair), an online softmax per query head is rescaled
   once per tile, then the value codes are unpacked and accumulated, weighted, in the rotated
   domain. With AVX-512 and ``head_dim`` a multiple of 64 (:mod:`arraykv.ops.numba.ir_codes`):
   4- and 2-bit codes are scored and summed straight from the packed rows, sixteen codes per
   ``vpermps`` in planar order (the queries of ``prepare`` and the value sums of ``finish`` are
   permuted to match), other widths from the unpacked tile; scores, value sums, the rotating
   mean's share and the softmax are 16-lane tile products;
3. *finish* (:func:`arraykv.attention.polar_fused.merge_window`): a log-sum-exp merge of the
   token splits, the float16 window (sinks and recent tokens, one exact block), the inverse
   rotation of the value sum, ``v_mean``, and the division by the softmax denominator.

Small steps run on the calling thread (:mod:`arraykv.ops.numba.threads`: below
``PARALLEL_MIN_WORK`` values, ``batch · heads · tokens · head_dim``); larger ones split each
head's tokens over Numba's threads (only step 2 is parallel: steps 1 and 3 cost
``O(heads · head_dim · (log head_dim + m + window))``). Work buffers are
``O(heads · G · head_dim)`` plus ``O(G · TILE)`` per task: nothing grows with the context.
float16 state is read through ``uint16`` views (Numba has no float16): the per-token lengths
and outlier channels in the token loop through :data:`HALF_TO_FLOAT` (a few table lines: the
lengths of a layer are of like magnitude), the window, means and weights of a call through
:func:`arraykv.ops.numba.half.half_to_float` (F16C, no table). Functions are compiled for fixed
argument types (read-only, any layout) when a call
first needs them, with head_dim fixed for 64 and 128 (its loops then unroll into whole vectors;
:func:`arraykv.ops.numba.fused_driver.build_steps`), and cached on disk.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types as nbt

from ..cpu_features import VECTOR_TILES
from ..fused_driver import FASTMATH, TILE, Step, build_steps, plan, ro, run_step, softmax_tile, tile_add_rows, tile_dots
from ..half import HALF_TO_FLOAT
from ..ir_codes import tile_scores_codes_2, tile_scores_codes_4, tile_values_codes_2, tile_values_codes_4
from ..ir_softmax import softmax_rows, softmax_rows_affine
from ..ir_tiles import tile_scores, tile_values
from ..planar import channels_to_planar, planar_per_jit
from ..simd3 import tile_scores_codes_3, tile_values_codes_3
from ..simd_signs import tile_sign_scores
from .query import finish_head, prepare_head, prepare_rotating
from .rows import (
    NO_F32_3,
    NO_I32_2,
    NO_I32_3,
    NO_U8_4,
    NO_U16_3,
    NO_U16_4,
    SIGN_TABLE,
    SIGNS,
    bits16,
    direct3_jit,
    fixed_args,
    memo_by_objects,
    unpack_rows,
)

__all__ = ["polar_decode_attention", "PolarArgs", "TILE", "HALF_TO_FLOAT"]


class PolarArgs(NamedTuple):
    """The arrays and scalars of one step of the PolarQuant/TurboQuant kernel (``args`` of its functions).

    float16 arrays are read as their ``uint16`` bit patterns (:func:`~arraykv.ops.numba.polar.rows.bits16`);
    an absent array is an empty one of the same number of axes.
    """

    #: uint8 (b, h, T, bytes per row), rows contiguous: packed key codes
    k_codes: Any
    #: float16 bits (b, h, T): key lengths
    k_norms: Any
    #: float32, C-contiguous: key centroids (one per code)
    k_cent: Any
    #: uint64, C-contiguous: byte-chunk table of the key centroids (:func:`~arraykv.ops.numba.polar.rows.fixed_args`)
    k_table: Any
    #: bits per key code
    k_bits: int
    #: uint8 (b, h, T, bytes per row), rows contiguous: packed value codes
    v_codes: Any
    #: float16 bits (b, h, T): value lengths
    v_norms: Any
    #: float32, C-contiguous: value centroids (one per code)
    v_cent: Any
    #: uint64, C-contiguous: byte-chunk table of the value centroids
    v_table: Any
    #: bits per value code
    v_bits: int
    #: float16 bits (b, h, d): key channel weights (empty: ones)
    k_scale: Any
    #: float16 bits (b, h, d): key mean (at position 0 for a rotating mean; empty: zeros)
    k_mean: Any
    #: float16 bits (b, h, d): value mean (empty: zeros)
    v_mean: Any
    #: int32 (b, h, n_out): the key channels kept exactly, ascending
    k_idx: Any
    #: float16 bits (b, h, T, n_out): their exact values
    k_outliers: Any
    #: float32 (d,), C-contiguous: the signs of the Walsh–Hadamard rotation (empty: dense ``rot``)
    signs: Any
    #: float32 (d, d), C-contiguous: the dense rotation (empty: Walsh–Hadamard with ``signs``)
    rot: Any
    #: float32 (d, m), C-contiguous: the transposed QJL sketch (m = 0: no QJL)
    sketch_t: Any
    #: uint64, C-contiguous: byte-chunk table of ``(-1, 1)``, for the QJL sign bits
    sign_table: Any
    #: uint8 (b, h, T, m / 8), rows contiguous: QJL sign bits
    k_qjl: Any
    #: float16 bits (b, h, T): QJL residual lengths
    k_qjl_norms: Any
    #: float32 (b, h, d // 2): angular frequency of each channel pair of a rotating key mean
    rm_freq: Any
    #: int32 (d // 2, 2): the channels of each pair (0 rows: no rotating mean)
    rm_pairs: Any
    #: position of quantized token 0 (the sink tokens come first)
    pos0: int
    #: exact tokens in the float16 window (sinks and recent tokens)
    n_window: int
    #: float16 bits (b, h, n_window, d): the window's keys
    k_window: Any
    #: float16 bits (b, h, n_window, d): the window's values
    v_window: Any
    #: float32 (65536,): float16 bit pattern -> value (:data:`HALF_TO_FLOAT`)
    half: Any


class PolarState(NamedTuple):
    """The query-side state of the step, per (batch, KV head) slot (leading axes ``(b_n, h_n)``)."""

    #: float32 (G, d): rotated scaled queries (planar order where the key codes are read so)
    qr: Any
    #: float32 (G, n_out): scaled queries at the outlier channels
    qout: Any
    #: float32 (G,): ``q·k_mean`` of each query head
    qconst: Any
    #: float32 (G, m): QJL sketch of the queries
    sq: Any
    #: float32 (G, n_p): cosine coefficients of the rotating mean's turning pairs
    ra: Any
    #: float32 (G, n_p): sine coefficients
    rb: Any
    #: float64 (n_p,): angular frequencies of the turning pairs
    rw: Any
    #: float32 (TILE, n_p): cosines of the phase advance within a tile
    ct: Any
    #: float32 (TILE, n_p): sines of the phase advance within a tile
    st: Any
    #: float64 (n_p, 2): the phase advance of one whole tile (cos, sin)
    step: Any
    #: int64: turning pairs in use (:func:`prepare_rotating`)
    n_js: Any
    #: float32 (d,): scratch row (not per slot)
    x: Any


_U8_4, _U16_3, _U16_4, _I32_3 = ro(nbt.uint8, 4), ro(nbt.uint16, 3), ro(nbt.uint16, 4), ro(nbt.int32, 3)
_F32_1C, _F32_2C = ro(nbt.float32, 1, "C"), ro(nbt.float32, 2, "C")
_Q = ro(nbt.float32, 3, "C")
_OUT = nbt.Array(nbt.float32, 3, "C")
_TAB = ro(nbt.uint64, 1, "C")
#: (q, scale, n, h_n, args, splits, out), args the fields of :class:`PolarArgs`
_ARGS = nbt.Tuple(
    (
        _U8_4,
        _U16_3,
        _F32_1C,
        _TAB,
        nbt.int64,
        _U8_4,
        _U16_3,
        _F32_1C,
        _TAB,
        nbt.int64,
        _U16_3,
        _U16_3,
        _U16_3,
        _I32_3,
        _U16_4,
        _F32_1C,
        _F32_2C,
        _F32_2C,
        _TAB,
        _U8_4,
        _U16_3,
        ro(nbt.float32, 3),
        ro(nbt.int32, 2),
        nbt.int64,
        nbt.int64,
        _U16_4,
        _U16_4,
        _F32_1C,
    )
)
_SIG = nbt.void(_Q, nbt.float64, nbt.int64, nbt.int64, _ARGS, nbt.int64, _OUT)


#: head_dim as a compile-time constant in the steps built for it (``build_steps(dims=...)``); 0: any
_D = 0


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    """Online softmax over quantized tokens ``[t_lo, t_hi)`` of head ``(b, h)``, every query head.

    ``args`` is the step's :class:`PolarArgs`, ``state`` its :class:`PolarState` (slot ``(sb, sh)``
    is head ``(b, h)``'s). ``m``, ``l`` (G,) and ``acc`` (G, d) hold the running maximum logit, the sum of
    ``exp(logit − m)`` and ``Σ exp(logit − m) · ℓ_t c[codes_t]`` (rotated value domain);
    they are updated in place, so a caller starts them at ``-inf``, ``0``, ``0``.
    ``k_table``, ``v_table``, ``sign_table`` are :func:`arraykv.ops.numba.polar.rows._chunk_table` of the key and value
    centroids and of ``(-1, 1)`` (the QJL bits). Per tile of ``TILE`` tokens: the key codes are
    unpacked once for the whole GQA group, scored, the softmax state rescaled once, then the
    value codes unpacked and accumulated. ``n_j`` turning pairs of a rotating key mean
    (:func:`prepare_rotating`; token ``t`` sits at position ``pos0 + t``) add their share of
    ``q·m_p`` to each logit.
    """
    qr, qout, qconst, sq = state.qr[sb, sh], state.qout[sb, sh], state.qconst[sb, sh], state.sq[sb, sh]
    n_j, ra, rb, rw = state.n_js[sb, sh], state.ra[sb, sh], state.rb[sb, sh], state.rw[sb, sh]
    ct, st, step = state.ct[sb, sh], state.st[sb, sh], state.step[sb, sh]
    k_codes, k_norms, k_cent, k_table, k_bits = args.k_codes, args.k_norms, args.k_cent, args.k_table, args.k_bits
    v_codes, v_norms, v_cent, v_table, v_bits = args.v_codes, args.v_norms, args.v_cent, args.v_table, args.v_bits
    k_outliers, k_qjl, k_qjl_norms, sign_table = args.k_outliers, args.k_qjl, args.k_qjl_norms, args.sign_table
    half, pos0 = args.half, args.pos0
    g_n = qr.shape[0]
    d = _D if _D else qr.shape[1]
    n_out = qout.shape[1]
    m_rows = sq.shape[1]
    buf64 = np.empty((TILE, (d + 1) // 2), np.uint64)
    buf = buf64.view(np.float32)
    pbuf64 = np.empty((TILE, (m_rows + 1) // 2), np.uint64)
    pbuf = pbuf64.view(np.float32)
    s = np.empty((g_n, TILE), np.float32)
    # rotating key mean: the phase (cos, sin of ω p) at the current tile's first token
    ph = np.empty((n_j, 2), np.float64)
    for j in range(n_j):
        ang = rw[j] * np.float64(pos0 + t_lo)
        ph[j, 0] = math.cos(ang)
        ph[j, 1] = math.sin(ang)
    ra_t = np.empty((g_n, n_j), np.float32)
    rb_t = np.empty((g_n, n_j), np.float32)
    rterm = np.zeros((g_n, TILE), np.float32)
    vec = VECTOR_TILES and d % 64 == 0  # scores and value sums in explicit 16-lane vectors
    # the rotating mean's share as one more small product per tile: rows [cos | sin] of each
    # token offset, coefficients [A | B] turned to the tile's start, zero-padded to 64 lanes
    w_cs = (2 * n_j + 63) // 64 * 64 if vec else 0
    cs = np.zeros((TILE if w_cs else 0, w_cs), np.float32)
    rab = np.zeros((g_n, w_cs), np.float32)
    if w_cs:
        for r in range(TILE):
            for j in range(n_j):
                cs[r, j] = ct[r, j]
                cs[r, n_j + j] = st[r, j]
    # the QJL correction's signed sums straight from the packed signs, sixteen per mask
    qjl_vec = vec and m_rows > 0 and m_rows % 16 == 0
    qjl_loop = m_rows > 0 and not qjl_vec  # the QJL correction per token, from unpacked signs
    sq_c = np.ascontiguousarray(sq) if qjl_vec else np.empty((0, 0), np.float32)
    sk = np.empty((g_n, TILE), np.float32)
    kn = np.empty(TILE, np.float32)
    qn_t = np.empty(TILE, np.float32)
    vn = np.empty(TILE, np.float32)
    ebits = np.empty(TILE, np.int32)
    al = acc.copy()  # the task's own accumulator: the compiler knows it aliases no other array
    # 4- and 2-bit codes: scored and summed straight from the packed rows (planar order, no tile buffer)
    k_direct = planar_per_jit(k_bits, d) if vec else 0
    v_direct = planar_per_jit(v_bits, d) if vec else 0
    k3 = vec and direct3_jit(k_bits, d)  # 3-bit codes: sixteen per vpermps from six bytes, channel order
    v3 = vec and direct3_jit(v_bits, d)
    # no per-token term besides the lengths, q·μ and the rotating mean: the softmax applies them
    affine = vec and n_out == 0 and m_rows == 0
    for t0 in range(t_lo, t_hi, TILE):
        t1 = min(t_hi, t0 + TILE)
        # 1. scores of the tile
        if k_direct == 2:
            tile_scores_codes_4(k_codes[b, h], t0, t1 - t0, k_table, qr, s)
        elif k_direct == 4:
            tile_scores_codes_2(k_codes[b, h], t0, t1 - t0, k_table, qr, s)
        elif k3:
            tile_scores_codes_3(k_codes[b, h], t0, t1 - t0, k_table, qr, s)
        else:
            unpack_rows(k_codes, b, h, t0, t1, k_bits, k_table, k_cent, d, buf, buf64)
        nt = t1 - t0
        if qjl_vec:
            tile_sign_scores(k_qjl[b, h], t0, nt, sq_c, sk)
        elif m_rows:
            unpack_rows(k_qjl, b, h, t0, t1, 1, sign_table, SIGNS, m_rows, pbuf, pbuf64)
        if not vec:
            tile_dots(qr, buf, nt, d, s)
        elif not k_direct and not k3:
            tile_scores(buf, nt, qr, s)
        if n_j:  # coefficients turned to this tile's start: A cos ω(p0+r) + B sin ω(p0+r)
            for j in range(n_j):
                cp = ph[j, 0]
                sp = ph[j, 1]
                for g in range(g_n):
                    ra_t[g, j] = np.float32(ra[g, j] * cp + rb[g, j] * sp)
                    rb_t[g, j] = np.float32(rb[g, j] * cp - ra[g, j] * sp)
                ph[j, 0] = cp * step[j, 0] - sp * step[j, 1]
                ph[j, 1] = sp * step[j, 0] + cp * step[j, 1]
            if w_cs:
                for g in range(g_n):
                    for j in range(n_j):
                        rab[g, j] = ra_t[g, j]
                        rab[g, n_j + j] = rb_t[g, j]
                tile_scores(cs, nt, rab, rterm)
            for g in range(g_n if not w_cs else 0):
                for r in range(nt):
                    x = np.float32(0.0)
                    for j in range(n_j):
                        x += ra_t[g, j] * ct[r, j] + rb_t[g, j] * st[r, j]
                    rterm[g, r] = x
        # float16 lengths once per tile (table loads: F16C conversions of these strided reads are
        # vectorized with gathers, slower here), then loops the compiler vectorizes
        for r in range(nt):
            kn[r] = half[k_norms[b, h, t0 + r]]
            vn[r] = half[v_norms[b, h, t0 + r]]
        if affine:  # 2. lengths, q·μ, the rotating mean's term, softmax and value lengths in one pass
            softmax_rows_affine(s, nt, kn, qconst, rterm, vn, m, l, al)
        for g in range(g_n if not affine else 0):
            sg = s[g]
            rg = rterm[g]
            cg = qconst[g]
            for r in range(nt):
                sg[r] = sg[r] * kn[r] + cg + rg[r]
        if qjl_vec:  # the QJL correction: residual lengths once per tile, then whole vectors
            for r in range(nt):
                qn_t[r] = half[k_qjl_norms[b, h, t0 + r]]
            for g in range(g_n):
                sg = s[g]
                skg = sk[g]
                for r in range(nt):
                    sg[r] += skg[r] * qn_t[r]
        if n_out or qjl_loop:  # exact outlier channels (and the scalar QJL path), per token
            for t in range(t0, t1):
                r = t - t0
                qn = half[k_qjl_norms[b, h, t]] if qjl_loop else np.float32(0.0)
                for g in range(g_n):
                    x = s[g, r]
                    for o in range(n_out):
                        x += qout[g, o] * half[k_outliers[b, h, t, o]]
                    if qjl_loop:
                        sdot = np.float32(0.0)
                        for i in range(m_rows):
                            sdot += sq[g, i] * pbuf[r, i]
                        x += sdot * qn
                    s[g, r] = x
        # 2. online softmax: rescale once per tile, then the tile's weights
        if vec and not affine:
            softmax_rows(s, nt, m, l, al)
        for g in range(g_n if not vec else 0):
            softmax_tile(s[g], nt, m, l, al, g, ebits)
        # 3. weighted values in the rotated domain
        if not v_direct and not v3:
            unpack_rows(v_codes, b, h, t0, t1, v_bits, v_table, v_cent, d, buf, buf64)
        for g in range(g_n if not affine else 0):
            sg = s[g]
            for r in range(nt):
                sg[r] *= vn[r]
        if v_direct == 2:
            tile_values_codes_4(v_codes[b, h], t0, t1 - t0, v_table, s, al)
        elif v_direct == 4:
            tile_values_codes_2(v_codes[b, h], t0, t1 - t0, v_table, s, al)
        elif v3:
            tile_values_codes_3(v_codes[b, h], t0, t1 - t0, v_table, s, al)
        elif vec:
            tile_values(buf, nt, s, al)
        else:
            tile_add_rows(s, buf, nt, d, al)
    acc[:, :] = al


# ---- the kernel's part of the shared step (arraykv.ops.numba.fused_driver); args: PolarArgs --


@nb.njit(inline="always")
def alloc_state(b_n, h_n, g_n, d, args):
    """The :class:`PolarState`: per (batch, KV head) slot ``qr, qout, qconst, sq`` (:func:`prepare_head`),
    the rotating mean's ``ra, rb, rw, ct, st, step`` and pair count (:func:`prepare_rotating`), and a
    scratch row."""
    n_out = args.k_idx.shape[2]
    m_rows = args.sketch_t.shape[1]
    n_p = args.rm_pairs.shape[0]
    return PolarState(
        np.empty((b_n, h_n, g_n, d), np.float32),
        np.empty((b_n, h_n, g_n, n_out), np.float32),
        np.empty((b_n, h_n, g_n), np.float32),
        np.empty((b_n, h_n, g_n, m_rows), np.float32),
        np.empty((b_n, h_n, g_n, n_p), np.float32),
        np.empty((b_n, h_n, g_n, n_p), np.float32),
        np.empty((b_n, h_n, n_p), np.float64),
        np.empty((b_n, h_n, TILE, n_p), np.float32),
        np.empty((b_n, h_n, TILE, n_p), np.float32),
        np.empty((b_n, h_n, n_p, 2), np.float64),
        np.zeros((b_n, h_n), np.int64),
        np.empty(d, np.float32),
    )


@nb.njit(inline="always")
def prepare(q, b, h, scale, args, state, sb, sh):
    qr, qout, qconst, sq, ra, rb, rw, ct, st, step, n_js, x = (
        state.qr,
        state.qout,
        state.qconst,
        state.sq,
        state.ra,
        state.rb,
        state.rw,
        state.ct,
        state.st,
        state.step,
        state.n_js,
        state.x,
    )
    prepare_head(
        q,
        b,
        h,
        scale,
        args.k_scale,
        args.k_mean,
        args.k_idx,
        args.signs,
        args.rot,
        args.sketch_t,
        args.half,
        x,
        qr[sb, sh],
        qout[sb, sh],
        qconst[sb, sh],
        sq[sb, sh],
    )
    n_js[sb, sh] = prepare_rotating(
        q,
        b,
        h,
        scale,
        args.k_mean,
        args.rm_freq,
        args.rm_pairs,
        args.half,
        qconst[sb, sh],
        ra[sb, sh],
        rb[sb, sh],
        rw[sb, sh],
        ct[sb, sh],
        st[sb, sh],
        step[sb, sh],
    )
    k_per = planar_per_jit(args.k_bits, x.shape[0])
    if k_per:  # key codes come out of the tile unpacking in planar order: the queries follow
        rows = qr[sb, sh]
        for g in range(rows.shape[0]):
            channels_to_planar(rows[g], k_per, x)
            rows[g, :] = x


@nb.njit(inline="always")
def span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    _attend_span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc)


@nb.njit(inline="always")
def finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out):
    finish_head(
        q,
        b,
        h,
        scale,
        m_sp,
        l_sp,
        acc_sp,
        args.n_window,
        args.k_window,
        args.v_window,
        args.v_mean,
        args.signs,
        args.rot,
        args.half,
        planar_per_jit(args.v_bits, acc_sp.shape[2]),
        out,
    )


@nb.njit(inline="always")
def span_unit(args):
    return 1


_step_serial, _step_parallel = build_steps(globals(), PolarArgs, [_SIG], dims=(64, 128))


def _plan(bh: int, n: int, d: int) -> tuple:
    """``(threads, token splits per head)``: :func:`arraykv.ops.numba.fused_driver.plan` of ``bh · n · d``
    values, spans of at least ``4 · TILE`` tokens."""
    return plan(bh, n, bh * n * d, 4 * TILE)


#: The arguments of a step that follow from a layer's fixed and calibration objects (see
#: :func:`_static_args`), memoised by those objects' ids (the entries keep the objects).
_STATIC: dict = {}
#: Entries of :data:`_STATIC` (one per calibrated layer in use: a model's layers, a few caches).
_STATIC_MAX = 1024


def _make_static(rotation, k_codebook, v_codebook, qjl, k_scale, k_mean, v_mean, k_idx, freq, pairs) -> tuple:
    k_cent, k_table, k_bits, v_cent, v_table, v_bits, signs, rot, sketch_t = fixed_args(
        _FixedView(rotation, k_codebook, v_codebook, qjl)
    )
    if k_idx is None or k_idx.shape[-1] == 0:
        idx = None
    else:
        idx = np.asarray(k_idx, np.int32)
    if freq is None:
        rotating = None
    else:
        rotating = (np.asarray(freq, np.float32), np.ascontiguousarray(pairs, np.int32))
    return (
        (k_cent, k_table, k_bits, v_cent, v_table, v_bits, bits16(k_scale), bits16(k_mean), bits16(v_mean)),
        idx,
        (signs, rot, sketch_t, SIGN_TABLE),
        rotating,
    )


class _FixedView(NamedTuple):
    """The fixed objects of a codec, as :func:`~arraykv.ops.numba.polar.rows.fixed_args` reads them."""

    rotation: Any
    k_codebook: Any
    v_codebook: Any
    qjl: Any


def _static_args(codec) -> tuple:
    """``(head, idx, middle, rotating)``: the step arguments that change only with the layer's
    fixed objects and calibration: centroids, tables, bits and the float16 bits of ``k_scale``,
    ``k_mean``, ``v_mean`` (``head``); the outlier channels as int32 or None; the rotation's
    signs and matrix, the QJL sketch and the sign table (``middle``); a rotating mean's
    frequencies and pairs, or None. Memoised by the objects (a decode step of a layer finds
    the previous step's)."""
    return memo_by_objects(
        _STATIC,
        (
            codec.rotation,
            codec.k_codebook,
            codec.v_codebook,
            codec.qjl,
            getattr(codec, "k_scale", None),
            codec.k_mean,
            codec.v_mean,
            codec.k_outlier_idx,
            getattr(codec, "k_mean_freq", None),
            getattr(codec, "k_mean_pairs", None),
        ),
        _make_static,
        _STATIC_MAX,
    )


def polar_decode_attention(codec, q, scale):
    """Fused decode attention over a :class:`~arraykv.caches.polar.PolarLayerCodec` (NumPy).

    Same contract as :func:`arraykv.attention.polar_fused.polar_decode_attention_reference`.

    Parameters
    ----------
    codec : PolarLayerCodec
        NumPy state (float16 side arrays, uint8 codes, int32 outlier indices).
    q : ndarray, shape (batch, q_heads, 1, head_dim)
        Any float dtype; computed in float32.
    scale : float
        Softmax scale.

    Returns
    -------
    ndarray, shape (batch, q_heads, 1, head_dim), dtype of ``q``

    Notes
    -----
    The step's arguments are the fields of :class:`PolarArgs`, passed as a plain tuple; those
    that follow from the fixed objects and the calibration are memoised (:func:`_static_args`),
    so a decode step converts only the token arrays and the window.
    """
    b, qh, t, d = q.shape
    if t != 1:
        raise ValueError(f"q must hold one new token per head (batch, q_heads, 1, head_dim), received {q.shape}")
    k_codes, v_codes = codec.k_codes, codec.v_codes
    if k_codes.strides[-1] != 1:  # the tile unpacking reads rows as contiguous bytes
        k_codes = np.ascontiguousarray(k_codes)
    if v_codes.strides[-1] != 1:
        v_codes = np.ascontiguousarray(v_codes)
    h = k_codes.shape[1]
    n = int(codec.n_quantized)
    head, idx, middle, rotating = _static_args(codec)
    if idx is None:
        idx, k_out = NO_I32_3, NO_U16_4
    else:
        k_out = NO_U16_4 if n == 0 else bits16(codec.k_outliers)
    if codec.qjl is None:
        k_qjl, k_qjl_norms = NO_U8_4, NO_U16_3
    else:  # rows of contiguous bytes, as the sign masks are read
        k_qjl, k_qjl_norms = codec.k_qjl, bits16(codec.k_qjl_norms)
        if k_qjl.strides[-1] != 1:
            k_qjl = np.ascontiguousarray(k_qjl)
    rm_freq, rm_pairs = (NO_F32_3, NO_I32_2) if rotating is None or n == 0 else rotating
    k_cent, k_table, k_bits, v_cent, v_table, v_bits, k_scale, k_mean, v_mean = head
    signs, rot, sketch_t, sign_table = middle
    args = (  # the fields of PolarArgs, in order
        k_codes,
        bits16(codec.k_norms),
        k_cent,
        k_table,
        k_bits,
        v_codes,
        bits16(codec.v_norms),
        v_cent,
        v_table,
        v_bits,
        k_scale,
        k_mean,
        v_mean,
        idx,
        k_out,
        signs,
        rot,
        sketch_t,
        sign_table,
        k_qjl,
        k_qjl_norms,
        rm_freq,
        rm_pairs,
        int(codec.n_sink),
        int(codec.n_window),
        bits16(codec.k_window, NO_U16_4),
        bits16(codec.v_window, NO_U16_4),
        HALF_TO_FLOAT,
    )
    threads, splits = _plan(b * h, n, d)
    out = np.empty((b, qh, d), np.float32)
    q32 = q.reshape(b, qh, d)
    if q32.dtype != np.float32 or not q32.flags.c_contiguous:
        q32 = np.ascontiguousarray(q32, dtype=np.float32)
    if threads == 1 or b * h * splits == 1:  # the serial step on this thread, straight to its compiled function
        _step_serial.compiled(d, args)(q32, float(scale), n, h, args, 1, out)
    else:
        step = Step(q32, float(scale), n, h, PolarArgs._make(args))
        run_step(_step_serial, _step_parallel, threads, splits, b * h * n * d, step, out)
    out = out.reshape(b, qh, 1, d)
    return out if q.dtype == np.float32 else out.astype(q.dtype)
