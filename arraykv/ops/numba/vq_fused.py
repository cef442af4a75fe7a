"""Numba kernel: one decode step of attention straight from vector-quantization (product-quantization) codes.

Layout read (the :class:`~arraykv.caches.vq.VQCache` state, :mod:`arraykv.quant.vq`):
``head_dim = m · s``; a key or value vector is ``m`` codes, code ``j`` naming a row of the
per-(KV head, sub-space) codebook ``centroids[h, j]`` of shape ``(K, s)``. A token's codes are
one row of ``ceil(m · β / 8)`` uint8 bytes packed LSB-first by
:func:`arraykv.quant.bitpack.pack_bits` (code ``j`` in stream bits ``[jβ, (j+1)β)``, stream bit
``i`` = bit ``i % 8`` of byte ``i // 8``) when ``β <= 8``, or ``m`` uint16 values when ``β > 8``.

A call is one compiled function that does the whole step for every (batch, KV head):

1. the queries of the KV head's GQA group times the softmax scale, ``qs`` (G, d);
2. the coded tokens in tiles, one of three ways, picked per call (:func:`_lanes_fit`, then
   :func:`_use_tables` by cost):

   * *lanes* (AVX-512, 4-bit codes, codebooks of at most 16 entries — the default ``vq``
     cache): sixteen tokens along the lanes of a vector. A tile of :data:`LANE_TILE` code rows
     is transposed once (:func:`~arraykv.ops.numba.simd_lanes.codes_to_lanes`) so that one shift
     gives sub-space ``j``'s codes of sixteen tokens as a ``vpermps`` index; a score is
     ``Σ_j LUT[g, j][a_tj]`` with each 16-entry ADC table ``LUT[g, j, k] = qs_g,j · c_jk`` in a
     register (one ``vpermps`` and add per query head and sub-space), the online softmax of a
     tile runs for every query head at once in vectors, and each value channel's 16 centroid
     values are looked up the same way and accumulated with the weights, lane by lane, until
     the span ends (no scatter, no gather; :func:`_attend_lanes`);
   * *tables* (asymmetric distance computation, other codes): the same ``LUT[g, j, k]`` once
     per task in memory, a token's score is ``Σ_j LUT[g, j, a_tj]``; the values go into
     per-sub-space weight histograms ``H[g, j, k] += p_t`` and ``out_g,j = Σ_k H[g, j, k] ·
     c^V_jk`` at the end; 4-bit key codes are scored a byte at a time from the packed row
     through pair tables ``LUT2[g, i, byte] = LUT[g, 2i, byte & 15] + LUT[g, 2i+1, byte >> 4]``
     (m / 2 lookups); tiles of :data:`TILE` tokens, each tile's codes unpacked once into a
     ``(TILE, m)`` index block for every query head of the group, the online softmax of a query
     head rescaled at most once per tile;
   * *direct*: the centroid rows the codes name are read and multiplied in place (for short
     contexts, ``sub_dim == 1`` and codebooks above :data:`TABLE_MAX_K`, where building the
     ``G · m · K`` tables costs more than it saves);
3. a log-sum-exp merge of the token splits, the dense extra tokens (sinks and window, exact
   float32; float16 ones are read as bit patterns and converted in the kernel) in the same
   softmax, and the division by the denominator.

Small steps run on the calling thread (:mod:`arraykv.ops.numba.threads`, work counted as the
``2 · batch · heads · tokens · m`` codes read);
larger ones cut each head's tokens into spans run on Numba's threads. Work buffers are
``O(G · m · K)`` (tables; ``O(G · m · 128)`` more for 4-bit pair tables) plus ``O(TILE · (m + G))``
per task, or ``O(G · d · 16 + LANE_TILE · (m + G))`` on the lanes path: nothing grows with the
context. Functions are compiled once per code dtype (uint8 packed, uint16) and dense-token dtype
(float32, float16 bits), for read-only arguments, when a call first needs them, and cached on disk.
The host side checks NumPy arguments on their attributes (:func:`_numpy_shapes`) before the
array-API checks, which only run to report an error or for other arrays.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types as nbt
from numba.extending import overload

from ...quant.vq import VQLayerCodes, check_decode_attention_args
from .cpu_features import VECTOR_TILES
from .fused_driver import (
    FASTMATH,
    TILE,
    Step,
    alloc_queries,
    build_steps,
    merge_splits,
    merge_top,
    prepare_queries,
    ro,
    run_step,
    split_count,
)
from .half import half_to_float
from .ir_softmax import softmax_rows
from .simd_lanes import codes_to_lanes, lane_sums, lane_table_scores, lane_table_values, lane_tables
from .threads import threads_for
from .vq import unpack_flat_indices

__all__ = ["vq_decode_attention", "decode_attention_mode", "TILE", "LANE_TILE", "TABLE_MAX_K", "RESCALE_SLACK"]

#: Entries per byte position of the 4-bit pair tables (one per byte value).
PAIR_TABLE = 256
#: Largest codebook served by the tables (LUT and histograms, 2 · G · m · K floats per task).
TABLE_MAX_K = 1024
#: The online softmax keeps a reference maximum and rescales the accumulators only when a tile's
#: maximum exceeds it by more than this (in logits): weights stay below ``e**16``, far from
#: float32 overflow, and the ``G · m · K`` histograms are rarely rescaled.
RESCALE_SLACK = 16.0
#: Tokens per tile of the lanes path (:func:`_attend_lanes`): a multiple of 16.
LANE_TILE = 512
#: Code rows prefetched ahead of the rows being read by the lanes path (one tile: the codes stream from memory).
LANE_AHEAD = LANE_TILE
#: ``args.path`` of a call off the lanes path: centroid rows read directly, or ADC tables (None: the lanes path).
DIRECT, TABLES = 0, 1


class VQArgs(NamedTuple):
    """The arrays and scalars of one step of the VQ kernel (``args`` of its functions)."""

    #: bits per code, 1 to 16
    bits: int
    #: :data:`TABLES` or :data:`DIRECT`; None on the lanes path (a step of its own, so that a call
    #: compiles only the path it takes)
    path: int | None
    #: uint8 (b, h, T, ceil(m · bits / 8)) packed codes or uint16 (b, h, T, m): key codes
    k_codes: Any
    #: float32 (h, m, K, s), C-contiguous: key codebooks
    k_cent: Any
    #: value codes, as ``k_codes``
    v_codes: Any
    #: float32 (h, m, K_v, s), C-contiguous: value codebooks
    v_cent: Any
    #: float32, or float16 as ``uint16`` bit patterns, (b, h, E, d), C-contiguous: dense keys
    k_extra: Any
    #: dense values, as ``k_extra``
    v_extra: Any


def _signature(code, extra, lanes=False):
    """``(q, scale, n, h_n, args, splits, out)``, ``args`` the fields of :class:`VQArgs` with uint8
    (packed) or uint16 codes and float32 or float16 (``uint16`` bit patterns) dense tokens;
    ``path`` None (the lanes path) or an int."""
    ex = ro(extra, 4, "C")
    args = nbt.Tuple(
        (
            nbt.int64,
            nbt.none if lanes else nbt.int64,
            ro(code, 4),
            ro(nbt.float32, 4, "C"),
            ro(code, 4),
            ro(nbt.float32, 4, "C"),
            ex,
            ex,
        )
    )
    return nbt.void(
        ro(nbt.float32, 3, "C"), nbt.float64, nbt.int64, nbt.int64, args, nbt.int64, nbt.Array(nbt.float32, 3, "C")
    )


#: index ``2 · (uint16 codes) + (float16 dense tokens)``; the lanes path (packed codes only) at
#: ``4 + (float16 dense tokens)``
_SIGS = [_signature(code, extra) for code in (nbt.uint8, nbt.uint16) for extra in (nbt.float32, nbt.uint16)] + [
    _signature(nbt.uint8, extra, lanes=True) for extra in (nbt.float32, nbt.uint16)
]


def _pick(args: VQArgs) -> int:
    """The index in :data:`_SIGS` of a step's :class:`VQArgs`."""
    half = int(args.k_extra.dtype == np.uint16)
    if args.path is None:
        return 4 + half
    return 2 * int(args.k_codes.dtype != np.uint8) + half


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_span(b, h, t_lo, t_hi, qs, args, mref, l, acc):
    """Online softmax over coded tokens ``[t_lo, t_hi)`` of head ``(b, h)`` for every query head of its group.

    ``qs`` (G, d) are the queries times the softmax scale, ``args`` the step's :class:`VQArgs`
    (``path`` :data:`TABLES` or :data:`DIRECT`). ``mref``, ``l`` (G,) and ``acc`` (G, d) hold
    the reference maximum logit, ``Σ exp(logit − mref)`` and ``Σ exp(logit − mref) · v_t``; a
    caller starts them at ``-inf``, ``0``, ``0``.
    """
    bits, tables = args.bits, args.path == TABLES
    k_codes, k_cent, v_codes, v_cent = args.k_codes, args.k_cent, args.v_codes, args.v_cent
    g_n, d = qs.shape
    m = k_cent.shape[1]
    kk = k_cent.shape[2]
    kv = v_cent.shape[2]
    sd = k_cent.shape[3]
    ka = np.empty((TILE, m), np.int32)
    va = np.empty((TILE, m), np.int32)
    sc = np.empty((g_n, TILE), np.float32)
    kf = k_cent[h].reshape((m * kk, sd))  # row j·K + k is c_jk
    vf = v_cent[h].reshape((m * kv, sd))
    if tables:
        lut = np.empty((g_n, m * kk), np.float32)
        # two histograms, for even and odd tokens: consecutive tokens that name the same code
        # would otherwise wait on each other's scatter-add (store-to-load forwarding)
        hist = np.zeros((g_n, 2 * m * kv), np.float32)
        for g in range(g_n):
            for j in range(m):
                qj = qs[g, j * sd : (j + 1) * sd]
                row = lut[g, j * kk : (j + 1) * kk]
                cj = k_cent[h, j]
                for k in range(kk):
                    x = np.float32(0.0)
                    for c in range(sd):
                        x += qj[c] * cj[k, c]
                    row[k] = x
    else:
        lut = np.empty((0, 0), np.float32)
        hist = np.empty((0, 0), np.float32)
    # 4-bit codes: one table entry per (byte position, byte value) sums the two sub-spaces the
    # byte holds, so a score is ceil(m / 2) lookups straight from the packed row, no unpacking
    nbk = k_codes.shape[3]
    pairs = tables and bits == 4 and (t_hi - t_lo) * g_n >= 2 * PAIR_TABLE
    if pairs:
        lut2 = np.empty((g_n, nbk * PAIR_TABLE), np.float32)
        for g in range(g_n):
            lg = lut[g]
            for i in range(nbk):
                j0 = 2 * i
                for byte in range(PAIR_TABLE):
                    x = lg[j0 * kk + min(byte & 15, kk - 1)]
                    if j0 + 1 < m:
                        x += lg[(j0 + 1) * kk + min(byte >> 4, kk - 1)]
                    lut2[g, i * PAIR_TABLE + byte] = x
    else:
        lut2 = np.empty((0, 0), np.float32)
    for t0 in range(t_lo, t_hi, TILE):
        nt = min(t_hi, t0 + TILE) - t0
        # 1. scores of every query head from one unpacking of the tile's key codes
        if pairs:
            for g in range(g_n):
                lg = lut2[g]
                srow = sc[g]
                for r in range(nt):
                    row = k_codes[b, h, t0 + r]
                    x = np.float32(0.0)
                    for i in range(nbk):
                        x += lg[i * PAIR_TABLE + np.int32(row[i])]
                    srow[r] = x
        elif tables:
            unpack_flat_indices(k_codes, b, h, t0, nt, bits, kk, ka)
            for g in range(g_n):
                lg = lut[g]
                srow = sc[g]
                for r in range(nt):
                    a = ka[r]
                    x = np.float32(0.0)
                    for j in range(m):
                        x += lg[a[j]]
                    srow[r] = x
        else:
            unpack_flat_indices(k_codes, b, h, t0, nt, bits, kk, ka)
            for r in range(nt):
                a = ka[r]
                for g in range(g_n):
                    qg = qs[g]
                    x = np.float32(0.0)
                    for j in range(m):
                        cj = kf[a[j]]
                        for c in range(sd):
                            x += qg[j * sd + c] * cj[c]
                    sc[g, r] = x
        # 2. online softmax per query head and the value weights
        unpack_flat_indices(v_codes, b, h, t0, nt, bits, kv, va)
        for g in range(g_n):
            srow = sc[g]
            mt = srow[0]
            for r in range(1, nt):
                if srow[r] > mt:
                    mt = srow[r]
            if mt > mref[g] + RESCALE_SLACK:
                f = np.float32(math.exp(mref[g] - mt)) if mref[g] > -np.inf else np.float32(0.0)
                l[g] *= f
                if tables:
                    hg = hist[g]
                    for k in range(2 * m * kv):
                        hg[k] *= f
                else:
                    for c in range(d):
                        acc[g, c] *= f
                mref[g] = mt
            mr = mref[g]
            lsum = np.float32(0.0)
            if tables:
                h0 = hist[g, : m * kv]
                h1 = hist[g, m * kv :]
                r2 = nt - nt % 2
                for r in range(0, r2, 2):
                    p0 = np.float32(math.exp(srow[r] - mr))
                    p1 = np.float32(math.exp(srow[r + 1] - mr))
                    lsum += p0 + p1
                    a0 = va[r]
                    a1 = va[r + 1]
                    for j in range(m):
                        h0[a0[j]] += p0
                        h1[a1[j]] += p1
                for r in range(r2, nt):
                    p0 = np.float32(math.exp(srow[r] - mr))
                    lsum += p0
                    a0 = va[r]
                    for j in range(m):
                        h0[a0[j]] += p0
            else:
                ag = acc[g]
                for r in range(nt):
                    p = np.float32(math.exp(srow[r] - mr))
                    lsum += p
                    a = va[r]
                    for j in range(m):
                        cj = vf[a[j]]
                        for c in range(sd):
                            ag[j * sd + c] += p * cj[c]
            l[g] += lsum
    if tables:
        # 3. out_j = Σ_k H[j, k] · c^V_jk
        for g in range(g_n):
            hg = hist[g]
            ag = acc[g]
            for j in range(m):
                cj = v_cent[h, j]
                hj = hg[j * kv : (j + 1) * kv]
                hj1 = hg[(m + j) * kv : (m + j + 1) * kv]
                for k in range(kv):
                    w = hj[k] + hj1[k]
                    if w != 0.0:
                        for c in range(sd):
                            ag[j * sd + c] += w * cj[k, c]


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_lanes(b, h, t_lo, t_hi, qs, args, mref, l, acc):
    """:func:`_attend_span` for 4-bit codes of codebooks of at most 16 entries, sixteen tokens along the vector lanes.

    Every sub-space's 16-entry ADC table (``LUT[g, j]``, one per query head) and every
    channel's 16 centroid values (``C[c, k] = c^V_{c // s, k, c % s}``) fit one register, so
    ``vpermps`` indexed by the codes of sixteen tokens (:func:`~arraykv.ops.numba.simd_lanes.codes_to_lanes`)
    gives sixteen tokens' share of a score (:func:`~arraykv.ops.numba.simd_lanes.lane_table_scores`)
    or their values of a channel (:func:`~arraykv.ops.numba.simd_lanes.lane_table_values`, weighted
    sums kept per lane until the span ends). Tables past ``K`` repeat the last centroid, which
    reads codes ``>= K`` as ``K - 1``. The online softmax of a tile is
    :func:`~arraykv.ops.numba.ir_softmax.softmax_rows` (the reference maximum is the running maximum).
    """
    k_codes, k_cent, v_codes, v_cent = args.k_codes, args.k_cent, args.v_codes, args.v_cent
    g_n, d = qs.shape
    kk = k_cent.shape[2]
    kv = v_cent.shape[2]
    sd = k_cent.shape[3]
    nw = k_codes.shape[3] // 4  # dwords of a code row: sub-spaces 8w .. 8w+7
    # channel c's 16 centroid values (rows past K repeat the last), keys and values
    ktab = np.empty((d, 16), np.float32)
    ctab = np.empty((d, 16), np.float32)
    for c in range(d):
        j = c // sd
        i = c % sd
        for k in range(16):
            ktab[c, k] = k_cent[h, j, min(k, kk - 1), i]
            ctab[c, k] = v_cent[h, j, min(k, kv - 1), i]
    lut = np.zeros((g_n, 128 * nw), np.float32)  # sub-spaces m .. 8·nw − 1 (padding nibbles) score 0
    lane_tables(qs, ktab, sd, lut)
    nlb = LANE_TILE // 16 * nw
    lk = np.empty((nlb, 16), np.int32)
    lv = np.empty((nlb, 16), np.int32)
    s = np.empty((g_n, LANE_TILE), np.float32)
    al = np.zeros((g_n, 16 * d), np.float32)  # lane i of channel c: Σ over tokens ≡ i (mod 16)
    for g in range(g_n):
        for c in range(d):
            al[g, 16 * c] = acc[g, c]
    kc = k_codes[b, h]
    vc = v_codes[b, h]
    for t0 in range(t_lo, t_hi, LANE_TILE):
        nt = min(t_hi, t0 + LANE_TILE) - t0
        nblk = (nt + 15) // 16
        codes_to_lanes(kc, t0, nt, LANE_AHEAD, lk)
        lane_table_scores(lk, nblk, nw, lut, s)
        softmax_rows(s, nt, mref, l, al)
        codes_to_lanes(vc, t0, nt, LANE_AHEAD, lv)
        lane_table_values(lv, nblk, nw, sd, ctab, s, al)
    lane_sums(al, acc)


def _dense_f32(x, b, h, out):  # pragma: no cover
    raise NotImplementedError  # replaced in compiled code by the overload below


@overload(_dense_f32, inline="always")
def _dense_f32_impl(x, b, h, out):
    """``out[:] = x[b, h]`` as float32 (E, d): float16 bit patterns (uint16) converted
    (:func:`arraykv.ops.numba.half.half_to_float`), floats copied."""
    if isinstance(x.dtype, nbt.Integer):

        def impl(x, b, h, out):
            e_n, d = out.shape
            for t in range(e_n):
                for c in range(d):
                    out[t, c] = half_to_float(x[b, h, t, c], None)

        return impl

    def copy(x, b, h, out):
        e_n, d = out.shape
        for t in range(e_n):
            for c in range(d):
                out[t, c] = x[b, h, t, c]

    return copy


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _finish_head(b, h, qs, m_sp, l_sp, acc_sp, k_extra, v_extra, out):
    """Merge the token splits of head ``(b, h)`` with its dense tokens (log-sum-exp); write ``out[b, qi]``."""
    splits, g_n, d = acc_sp.shape
    e_n = k_extra.shape[2]
    ke = np.empty((e_n, d), np.float32)
    ve = np.empty((e_n, d), np.float32)
    x = np.empty(e_n, np.float32)
    if e_n:
        _dense_f32(k_extra, b, h, ke)
        _dense_f32(v_extra, b, h, ve)
    for g in range(g_n):
        qg = qs[g]
        top = merge_top(m_sp, g)
        for t in range(e_n):
            dot = np.float32(0.0)
            for c in range(d):
                dot += qg[c] * ke[t, c]
            x[t] = dot
            if dot > top:
                top = dot
        qi = h * g_n + g
        o = out[b, qi]
        for c in range(d):
            o[c] = np.float32(0.0)
        den = merge_splits(m_sp, l_sp, acc_sp, g, top, o)
        for t in range(e_n):
            p = np.float32(math.exp(x[t] - top))
            den += p
            for c in range(d):
                o[c] += p * ve[t, c]
        inv = np.float32(1.0) / den
        for c in range(d):
            o[c] *= inv


# ---- the kernel's part of the shared step (arraykv.ops.numba.fused_driver); args: VQArgs -----

alloc_state, prepare = alloc_queries, prepare_queries  # the state: scaled queries per slot


def _span_path(b, h, t_lo, t_hi, qs, args, m, l, acc):  # pragma: no cover
    raise NotImplementedError  # replaced in compiled code by the overload below


@overload(_span_path, inline="always")
def _span_path_impl(b, h, t_lo, t_hi, qs, args, m, l, acc):
    """:func:`_attend_lanes` when ``args.path`` is None, else :func:`_attend_span` (chosen at compile time)."""
    if isinstance(dict(zip(args.fields, args.types))["path"], nbt.NoneType):
        return lambda b, h, t_lo, t_hi, qs, args, m, l, acc: _attend_lanes(b, h, t_lo, t_hi, qs, args, m, l, acc)
    return lambda b, h, t_lo, t_hi, qs, args, m, l, acc: _attend_span(b, h, t_lo, t_hi, qs, args, m, l, acc)


@nb.njit(inline="always")
def span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    _span_path(b, h, t_lo, t_hi, state.qs[sb, sh], args, m, l, acc)


@nb.njit(inline="always")
def finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out):
    _finish_head(b, h, state.qs[sb, sh], m_sp, l_sp, acc_sp, args.k_extra, args.v_extra, out)


@nb.njit(inline="always")
def span_unit(args):
    return 1


_step_serial, _step_parallel = build_steps(globals(), VQArgs, _SIGS, _pick)


def _use_tables(kk: int, kv: int, sub_dim: int, span: int) -> bool:
    """Whether a task of ``span`` tokens should build the ADC tables.

    Per token and query head the tables cost ``2m`` lookups against ``2d = 2ms`` gathered
    multiply-adds of the direct path; building and reading them out costs about
    ``(K_k + K_v) · d`` once. Measured (3 KV heads, G = 3, d = 64): the tables win from about
    ``K ≈ span / 2`` on, for every ``s`` (even ``s = 1``, where the direct path's gathers are slower).
    """
    if max(kk, kv) > TABLE_MAX_K:
        return False
    return kk + kv <= span


_splits = split_count


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _numpy_shapes(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, bits):
    """``(b, hq, h, T, E, d, m, bits)`` when the arguments are NumPy arrays that pass every check of
    :func:`~arraykv.quant.vq.check_decode_attention_args`, else None.

    The same checks on plain attributes, for the decode step's small calls (the array-API
    checks cost microseconds); None sends the call to the full checks, which raise the errors.
    """
    nd = np.ndarray
    if not (
        type(q) is nd
        and type(k_codes) is nd
        and type(v_codes) is nd
        and type(k_centroids) is nd
        and type(v_centroids) is nd
        and type(k_extra) is nd
        and type(v_extra) is nd
        and type(bits) is int
        and 1 <= bits <= 16
    ):
        return None
    if not (
        q.ndim == 3
        and k_centroids.ndim == 4
        and v_centroids.ndim == 4
        and k_codes.ndim == 4
        and v_codes.ndim == 4
        and k_extra.ndim == 4
        and v_extra.ndim == 4
    ):
        return None
    fl = _FLOATS
    if not (
        q.dtype in fl
        and k_centroids.dtype in fl
        and v_centroids.dtype in fl
        and k_extra.dtype in fl
        and v_extra.dtype in fl
    ):
        return None
    b, hq, d = q.shape
    h, m, _, s = k_centroids.shape
    vcs = v_centroids.shape
    if vcs[0] != h or vcs[1] != m or vcs[3] != s or m * s != d or h < 1 or hq % h:
        return None
    width, want = ((m * bits + 7) // 8, np.uint8) if bits <= 8 else (m, np.uint16)
    ks, vs = k_codes.shape, v_codes.shape
    t = ks[2]
    if not (
        k_codes.dtype == want
        and v_codes.dtype == want
        and ks[0] == b
        and ks[1] == h
        and ks[3] == width
        and vs[0] == b
        and vs[1] == h
        and vs[2] == t
        and vs[3] == width
    ):
        return None
    es, fs = k_extra.shape, v_extra.shape
    e = es[2]
    if not (
        es[0] == b
        and es[1] == h
        and es[3] == d
        and fs[0] == b
        and fs[1] == h
        and fs[2] == e
        and fs[3] == d
        and t + e > 0
    ):
        return None
    return b, hq, h, t, e, d, m, bits


def _lanes_fit(bits: int, kk: int, kv: int, d: int, k_codes, v_codes) -> bool:
    """Whether a call can take the lanes path (:func:`_attend_lanes`): AVX-512, 4-bit packed codes
    of codebooks of at most 16 entries, code rows of a multiple of 4 bytes read in place (bytes
    contiguous) and ``head_dim`` a multiple of 8."""
    return (
        VECTOR_TILES
        and bits == 4
        and kk <= 16
        and kv <= 16
        and d % 8 == 0
        and k_codes.shape[3] % 4 == 0
        and k_codes.dtype == np.uint8
        and k_codes.strides[3] == 1
        and v_codes.strides[3] == 1
    )


def vq_decode_attention(q, layer_codes: VQLayerCodes, k_extra, v_extra, *, softmax_scale):
    """Fused decode attention over VQ codes (NumPy); see :func:`decode_attention_mode`."""
    return decode_attention_mode(q, layer_codes, k_extra, v_extra, softmax_scale=softmax_scale)


def decode_attention_mode(q, layer_codes: VQLayerCodes, k_extra, v_extra, *, softmax_scale, mode=None):
    """Fused decode attention over VQ codes (NumPy): ADC scores and histogram value sums.

    Same contract as :func:`arraykv.attention.vq_fused.vq_decode_attention_reference`.

    Parameters
    ----------
    q : ndarray of float, shape (batch, q_heads, head_dim)
        Any float dtype; computed in float32. Query head ``i`` uses KV head ``i // (q_heads // h)``.
    layer_codes : VQLayerCodes
        The layer's codes, codebooks and code width, unpacked here and nowhere else:

        * ``k_codes``, ``v_codes``: ndarray, shape (batch, h, T, ceil(m * bits / 8)) uint8 or
          (batch, h, T, m) uint16: packed codes (``bits <= 8``,
          :func:`~arraykv.quant.bitpack.pack_bits` layout) or one uint16 per code
          (``bits > 8``); read in place, any strides.
        * ``k_centroids``, ``v_centroids``: ndarray of float, shape (h, m, K, s): codebooks;
          ``K`` may differ between keys and values. Codes ``>= K`` (never written by
          :func:`~arraykv.quant.vq.vq_encode`) are read as ``K - 1``.
        * ``bits``: int, bits per code, 1 to 16.
    k_extra, v_extra : ndarray of float, shape (batch, h, E, head_dim)
        Dense tokens (float16 sinks and window); ``E`` may be 0.
    softmax_scale : float
    mode : {None, "lanes", "tables", "direct"}
        Force a path (tests; ``"lanes"`` raises ValueError where the call cannot take it); None
        takes the lanes path where it can (:func:`_lanes_fit`), else picks by cost
        (:func:`_use_tables`).

    Returns
    -------
    ndarray of float32, shape (batch, q_heads, head_dim)

    Notes
    -----
    Asymmetric distance computation (Jégou, Douze & Schmid, 2011, "Product quantization for
    nearest neighbor search"): the query stays exact while the key is its PQ reconstruction
    ``k_t = [c_{1,a_t1}, …, c_{m,a_tm}]``, so

    .. math:: \\mathrm{scale} \\cdot q \\cdot k_t = \\sum_j \\mathrm{LUT}[j, a_{tj}],
              \\qquad \\mathrm{LUT}[j, k] = \\mathrm{scale} \\cdot q_j \\cdot c_{jk},

    ``m · K · s`` multiply-adds once, then ``m`` lookups per token instead of ``d``
    multiply-adds. The value sum is linear in the reconstructed values, so it groups by code:

    .. math:: \\sum_t p_t v_t = \\Big[\\sum_k H_{jk}\\, c^V_{jk}\\Big]_{j=1..m},
              \\qquad H_{jk} = \\sum_{t:\\, b_{tj} = k} p_t,

    ``m`` scatter-adds per token and one ``m · K · s`` product at the end. ``p_t`` is the
    online softmax weight ``exp(logit_t − M)`` against a reference maximum ``M``, raised (and
    ``H`` rescaled by ``exp(M_old − M_new)``) at most once per tile and only when a logit
    exceeds ``M`` by more than :data:`RESCALE_SLACK`; splits and dense tokens are merged by
    log-sum-exp. When the tables would cost more than they save (short spans, ``s == 1``,
    ``K >`` :data:`TABLE_MAX_K` — so uint16 codebooks up to 65536 never allocate ``m × 65536``
    histograms) the kernel reads the named centroid rows directly instead, same result.

    With codebooks of at most 16 entries both sums are computed without tables in memory:
    ``LUT[j, ·]`` and a value channel's 16 centroids are one vector register each, and the
    permute that reads a register table at sixteen indices at once takes the codes of sixteen
    tokens (the *lanes* path). Per sixteen tokens and query head that is ``m`` permutes and
    adds for the scores and ``d`` multiply-adds for the values (each value permute shared by
    the group's query heads), instead of ``16 · m`` loads and ``16 · m`` scatter-adds; the
    reference maximum of the softmax is then the exact running maximum.
    """
    lc = layer_codes
    k_codes, k_centroids, v_codes, v_centroids, bits = lc.k_codes, lc.k_centroids, lc.v_codes, lc.v_centroids, lc.bits
    shapes = _numpy_shapes(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, bits)
    if shapes is None:  # not plain NumPy arrays, or a check fails: the full checks (and their messages)
        shapes = check_decode_attention_args(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, bits)
    b, hq, h, t, e, d, m, bits = shapes
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    kc = np.ascontiguousarray(k_centroids, dtype=np.float32)
    vc = np.ascontiguousarray(v_centroids, dtype=np.float32)
    if k_extra.dtype == np.float16 and v_extra.dtype == np.float16:  # converted in the kernel
        ke, ve = np.ascontiguousarray(k_extra).view(np.uint16), np.ascontiguousarray(v_extra).view(np.uint16)
    else:
        ke = np.ascontiguousarray(k_extra, dtype=np.float32)
        ve = np.ascontiguousarray(v_extra, dtype=np.float32)
    kk, kv, sd = int(kc.shape[2]), int(vc.shape[2]), int(kc.shape[3])
    out = np.empty((b, hq, d), np.float32)
    work = 2 * b * h * t * m
    threads = threads_for(work)
    splits = 1 if threads == 1 else _splits(b * h, t, threads, max(4 * TILE, kk + kv))
    lanes = _lanes_fit(bits, kk, kv, d, k_codes, v_codes)
    if mode is None:
        path = None if lanes else TABLES if _use_tables(kk, kv, sd, -(-t // splits)) else DIRECT
    elif mode == "lanes":
        if not lanes:
            raise ValueError(
                "mode='lanes' needs AVX-512, 4-bit codes of codebooks of at most 16 entries, "
                "rows of a multiple of 4 bytes and head_dim a multiple of 8"
            )
        path = None
    else:
        path = TABLES if mode == "tables" else DIRECT
    args = VQArgs(bits=bits, path=path, k_codes=k_codes, k_cent=kc, v_codes=v_codes, v_cent=vc, k_extra=ke, v_extra=ve)
    run_step(_step_serial, _step_parallel, threads, splits, work, Step(q32, float(softmax_scale), t, h, args), out)
    return out
