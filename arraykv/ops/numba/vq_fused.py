"""Numba kernel: one decode step of attention straight from vector-quantization (product-quantization) codes.

Layout read (the :class:`~arraykv.caches.vq.VQCache` state, :mod:`arraykv.quant.vq`):
``head_dim = m · s``; a key or value vector is ``m`` codes, code ``j`` naming a row of the
per-(KV head, sub-space) codebook ``centroids[h, j]`` of shape ``(K, s)``. A token's codes are
one row of ``ceil(m · β / 8)`` uint8 bytes packed LSB-first by
:func:`arraykv.quant.bitpack.pack_bits` (code ``j`` in stream bits ``[jβ, (j+1)β)``, stream bit
``i`` = bit ``i % 8`` of byte ``i // 8``) when ``β <= 8``, or ``m`` uint16 values when ``β > 8``.

A call is one compiled function that does the whole step for every (batch, KV head):

1. the queries of the KV head's GQA group times the softmax scale, ``qs`` (G, d);
2. the coded tokens in tiles of :data:`TILE`: the tile's key codes are unpacked once into a
   small ``(TILE, m)`` index block and scored for every query head of the group, an online
   softmax per query head is rescaled at most once per tile, then the tile's value codes are
   unpacked once and their weights accumulated. Two ways, picked per call by cost
   (:func:`_use_tables`):

   * *tables* (asymmetric distance computation): ``LUT[g, j, k] = qs_g,j · c_jk`` once per task,
     a token's score is ``Σ_j LUT[g, j, a_tj]``; the values go into per-sub-space weight
     histograms ``H[g, j, k] += p_t`` and ``out_g,j = Σ_k H[g, j, k] · c^V_jk`` at the end;
     4-bit key codes are scored a byte at a time from the packed row through pair tables
     ``LUT2[g, i, byte] = LUT[g, 2i, byte & 15] + LUT[g, 2i+1, byte >> 4]`` (m / 2 lookups);
   * *direct*: the centroid rows the codes name are read and multiplied in place (for short
     contexts, ``sub_dim == 1`` and codebooks above :data:`TABLE_MAX_K`, where building the
     ``G · m · K`` tables costs more than it saves);
3. a log-sum-exp merge of the token splits, the dense extra tokens (sinks and window, exact
   float32) in the same softmax, and the division by the denominator.

Small steps run on the calling thread (:mod:`arraykv.ops.numba.threads`, work counted as the
``2 · batch · heads · tokens · m`` codes read);
larger ones cut each head's tokens into spans run on Numba's threads. Work buffers are
``O(G · m · K)`` (tables; ``O(G · m · 128)`` more for 4-bit pair tables) plus ``O(TILE · (m + G))`` per task: nothing grows with the context.
Functions are compiled once per code dtype (uint8 packed, uint16), for read-only arguments,
and cached on disk.
"""

from __future__ import annotations

import math

import numpy as np

try:
    import numba as nb
    from numba import types as nbt
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from ...quant.vq import check_decode_attention_args
from .fused_driver import (FASTMATH, TILE, alloc_queries, build_steps, merge_splits, merge_top, prepare_queries, ro,
                           run_step, split_count)
from .threads import threads_for
from .vq import _unpack_tile

__all__ = ["vq_decode_attention", "decode_attention_mode", "TILE", "TABLE_MAX_K", "RESCALE_SLACK"]

#: Entries per byte position of the 4-bit pair tables (one per byte value).
PAIR_TABLE = 256
#: Largest codebook served by the tables (LUT and histograms, 2 · G · m · K floats per task).
TABLE_MAX_K = 1024
#: The online softmax keeps a reference maximum and rescales the accumulators only when a tile's
#: maximum exceeds it by more than this (in logits): weights stay below ``e**16``, far from
#: float32 overflow, and the ``G · m · K`` histograms are rarely rescaled.
RESCALE_SLACK = 16.0


def _signature(code):
    """``(q, scale, n, h_n, args, splits, out)``, ``args`` = ``(bits, tables, k_codes, k_cent, v_codes, v_cent,
    k_extra, v_extra)`` with uint8 (packed) or uint16 codes."""
    args = nbt.Tuple((nbt.int64, nbt.boolean, ro(code, 4), ro(nbt.float32, 4, "C"), ro(code, 4),
                      ro(nbt.float32, 4, "C"), ro(nbt.float32, 4, "C"), ro(nbt.float32, 4, "C")))
    return nbt.void(ro(nbt.float32, 3, "C"), nbt.float64, nbt.int64, nbt.int64, args, nbt.int64,
                    nbt.Array(nbt.float32, 3, "C"))


_SIGS = [_signature(nbt.uint8), _signature(nbt.uint16)]


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _attend_span(b, h, t_lo, t_hi, qs, bits, tables, k_codes, k_cent, v_codes, v_cent, mref, l, acc):
    """Online softmax over coded tokens ``[t_lo, t_hi)`` of head ``(b, h)`` for every query head of its group.

    ``qs`` (G, d) are the queries times the softmax scale. ``mref``, ``l`` (G,) and ``acc``
    (G, d) hold the reference maximum logit, ``Σ exp(logit − mref)`` and
    ``Σ exp(logit − mref) · v_t``; a caller starts them at ``-inf``, ``0``, ``0``.
    """
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
                qj = qs[g, j * sd:(j + 1) * sd]
                row = lut[g, j * kk:(j + 1) * kk]
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
            _unpack_tile(k_codes, b, h, t0, nt, bits, kk, ka)
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
            _unpack_tile(k_codes, b, h, t0, nt, bits, kk, ka)
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
        _unpack_tile(v_codes, b, h, t0, nt, bits, kv, va)
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
                h0 = hist[g, :m * kv]
                h1 = hist[g, m * kv:]
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
                hj = hg[j * kv:(j + 1) * kv]
                hj1 = hg[(m + j) * kv:(m + j + 1) * kv]
                for k in range(kv):
                    w = hj[k] + hj1[k]
                    if w != 0.0:
                        for c in range(sd):
                            ag[j * sd + c] += w * cj[k, c]


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def _finish_head(b, h, qs, m_sp, l_sp, acc_sp, k_extra, v_extra, out):
    """Merge the token splits of head ``(b, h)`` with its dense tokens (log-sum-exp); write ``out[b, qi]``."""
    splits, g_n, d = acc_sp.shape
    e_n = k_extra.shape[2]
    for g in range(g_n):
        qg = qs[g]
        top = merge_top(m_sp, g)
        for t in range(e_n):
            x = np.float32(0.0)
            for c in range(d):
                x += qg[c] * k_extra[b, h, t, c]
            if x > top:
                top = x
        qi = h * g_n + g
        o = out[b, qi]
        for c in range(d):
            o[c] = np.float32(0.0)
        den = merge_splits(m_sp, l_sp, acc_sp, g, top, o)
        for t in range(e_n):
            x = np.float32(0.0)
            for c in range(d):
                x += qg[c] * k_extra[b, h, t, c]
            p = np.float32(math.exp(x - top))
            den += p
            for c in range(d):
                o[c] += p * v_extra[b, h, t, c]
        inv = np.float32(1.0) / den
        for c in range(d):
            o[c] *= inv


# ---- the kernel's part of the shared step (arraykv.ops.numba.fused_driver) -------------------
# args = (bits, tables, k_codes, k_cent, v_codes, v_cent, k_extra, v_extra)

alloc_state, prepare = alloc_queries, prepare_queries  # the state: scaled queries per slot


@nb.njit
def span(b, h, t_lo, t_hi, args, state, sb, sh, m, l, acc):
    bits, tables, k_codes, k_cent, v_codes, v_cent, _, _ = args
    _attend_span(b, h, t_lo, t_hi, state[0][sb, sh], bits, tables, k_codes, k_cent, v_codes, v_cent, m, l, acc)


@nb.njit
def finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out):
    _finish_head(b, h, state[0][sb, sh], m_sp, l_sp, acc_sp, args[6], args[7], out)


@nb.njit
def span_unit(args):
    return 1


# signature 0: packed uint8 codes, 1: uint16 codes
_step_serial, _step_parallel = build_steps(globals(), _SIGS, lambda step: int(step[4][2].dtype != np.uint8))


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


def vq_decode_attention(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, *, bits, softmax_scale):
    """Fused decode attention over VQ codes (NumPy); see :func:`decode_attention_mode`."""
    return decode_attention_mode(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, bits=bits,
                                 softmax_scale=softmax_scale)


def decode_attention_mode(q, k_codes, k_centroids, v_codes, v_centroids, k_extra, v_extra, *, bits, softmax_scale,
                          mode=None):
    """Fused decode attention over VQ codes (NumPy): ADC scores and histogram value sums.

    Same contract as :func:`arraykv.attention.vq_fused.vq_decode_attention_reference`.

    Parameters
    ----------
    q : ndarray of float, shape (batch, q_heads, head_dim)
        Any float dtype; computed in float32. Query head ``i`` uses KV head ``i // (q_heads // h)``.
    k_codes, v_codes : ndarray, shape (batch, h, T, ceil(m * bits / 8)) uint8 or (batch, h, T, m) uint16
        Packed codes (``bits <= 8``, :func:`~arraykv.quant.bitpack.pack_bits` layout) or one
        uint16 per code (``bits > 8``); read in place, any strides.
    k_centroids, v_centroids : ndarray of float, shape (h, m, K, s)
        Codebooks; ``K`` may differ between keys and values. Codes ``>= K`` (never written by
        :func:`~arraykv.quant.vq.vq_encode`) are read as ``K - 1``.
    k_extra, v_extra : ndarray of float, shape (batch, h, E, head_dim)
        Dense tokens (float16 sinks and window); ``E`` may be 0.
    bits : int
        Bits per code, 1 to 16.
    softmax_scale : float
    mode : {None, "tables", "direct"}
        Force a path (tests); None picks by cost (:func:`_use_tables`).

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
    """
    b, hq, h, t, e, d, m, bits = check_decode_attention_args(q, k_codes, k_centroids, v_codes, v_centroids,
                                                             k_extra, v_extra, bits)
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    kc = np.ascontiguousarray(k_centroids, dtype=np.float32)
    vc = np.ascontiguousarray(v_centroids, dtype=np.float32)
    ke = np.ascontiguousarray(k_extra, dtype=np.float32)
    ve = np.ascontiguousarray(v_extra, dtype=np.float32)
    kk, kv, sd = int(kc.shape[2]), int(vc.shape[2]), int(kc.shape[3])
    out = np.empty((b, hq, d), np.float32)
    work = 2 * b * h * t * m
    threads = threads_for(work)
    splits = 1 if threads == 1 else _splits(b * h, t, threads, max(4 * TILE, kk + kv))
    tables = _use_tables(kk, kv, sd, -(-t // splits)) if mode is None else mode == "tables"
    args = (q32, float(softmax_scale), t, h, (bits, tables, k_codes, kc, v_codes, vc, ke, ve))
    run_step(_step_serial, _step_parallel, threads, splits, work, args, out)
    return out
