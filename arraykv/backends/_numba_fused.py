"""Numba kernel: decode attention straight from PolarQuant/TurboQuant packed codes on CPU.

One task per (batch, KV head, token split) walks its tokens in tiles of ``TILE``: it unpacks a
token's key codes once into centroid values, scores every query head of the GQA group against
them, updates an online softmax per query head once per tile, then unpacks the value codes
and accumulates them, weighted, in the rotated domain. Splits are merged with a log-sum-exp
afterwards. Work buffers are ``O(G · head_dim + G · TILE)`` per task: nothing grows with the
context.
"""

from __future__ import annotations

import math
import os

import numpy as np

try:
    import numba as nb
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from ..attention.polar_fused import merge_window, prepare_queries

__all__ = ["polar_decode_attention", "TILE"]

TILE = 64
#: float16 bit pattern -> float32 value. Numba has no float16 arrays, so float16 state is
#: read through ``uint16`` views (no copy) and this 256 KiB table.
HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@nb.njit(inline="always")
def _unpack_row(codes, bits, cent, out):
    """Centroid values of one row of packed codes (layout of arraykv.quant.bitpack)."""
    d = out.shape[0]
    if bits == 4:
        for j in range(d // 2):
            byte = codes[j]
            out[2 * j] = cent[byte & 15]
            out[2 * j + 1] = cent[byte >> 4]
        if d % 2:
            out[d - 1] = cent[codes[d // 2] & 15]
    elif bits == 2:
        for j in range(d // 4):
            byte = codes[j]
            out[4 * j] = cent[byte & 3]
            out[4 * j + 1] = cent[(byte >> 2) & 3]
            out[4 * j + 2] = cent[(byte >> 4) & 3]
            out[4 * j + 3] = cent[byte >> 6]
        for i in range(d - d % 4, d):
            out[i] = cent[(codes[i // 4] >> (2 * (i % 4))) & 3]
    elif bits == 8:
        for j in range(d):
            out[j] = cent[codes[j]]
    else:
        mask = (1 << bits) - 1
        nbytes = codes.shape[0]
        for grp in range((d + 7) // 8):
            word = np.uint64(0)
            start = grp * bits
            for b in range(min(bits, nbytes - start)):
                word |= np.uint64(codes[start + b]) << np.uint64(8 * b)
            base = grp * 8
            for i in range(min(8, d - base)):
                out[base + i] = cent[np.int64((word >> np.uint64(i * bits)) & np.uint64(mask))]


@nb.njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _attend(qr, qconst, qout, sq, k_codes, k_norms, k_cent, k_bits, v_codes, v_norms, v_cent, v_bits,
            k_outliers, k_qjl, k_qjl_norms, use_qjl, half, splits, out_m, out_l, out_acc):
    b_n, h_n, g_n, d = qr.shape
    n = k_codes.shape[2]
    n_out = qout.shape[3]
    m_rows = sq.shape[3]
    per = (n + splits - 1) // splits
    tasks = b_n * h_n * splits
    for task in nb.prange(tasks):
        sp = task % splits
        bh = task // splits
        b = bh // h_n
        h = bh % h_n
        t_lo = sp * per
        t_hi = min(n, t_lo + per)
        kvec = np.empty(d, np.float32)
        vvec = np.empty(d, np.float32)
        s = np.empty((g_n, TILE), np.float32)
        m = np.full(g_n, -np.inf, np.float32)
        l = np.zeros(g_n, np.float32)
        acc = np.zeros((g_n, d), np.float32)
        for t0 in range(t_lo, t_hi, TILE):
            t1 = min(t_hi, t0 + TILE)
            # 1. scores of the tile
            for t in range(t0, t1):
                _unpack_row(k_codes[b, h, t], k_bits, k_cent, kvec)
                kn = half[k_norms[b, h, t]]
                for g in range(g_n):
                    dot = np.float32(0.0)
                    for j in range(d):
                        dot += qr[b, h, g, j] * kvec[j]
                    x = dot * kn + qconst[b, h, g]
                    for j in range(n_out):
                        x += qout[b, h, g, j] * half[k_outliers[b, h, t, j]]
                    if use_qjl:
                        sdot = np.float32(0.0)
                        row = k_qjl[b, h, t]
                        for j in range(m_rows):
                            bit = (row[j >> 3] >> (j & 7)) & 1
                            sdot += sq[b, h, g, j] if bit else -sq[b, h, g, j]
                        x += sdot * half[k_qjl_norms[b, h, t]]
                    s[g, t - t0] = x
            # 2. online softmax: rescale once per tile
            for g in range(g_n):
                mt = m[g]
                for t in range(t1 - t0):
                    if s[g, t] > mt:
                        mt = s[g, t]
                if mt > m[g]:
                    c = np.float32(math.exp(m[g] - mt)) if m[g] > -np.inf else np.float32(0.0)
                    l[g] *= c
                    for j in range(d):
                        acc[g, j] *= c
                    m[g] = mt
            # 3. weighted values in the rotated domain
            for t in range(t0, t1):
                _unpack_row(v_codes[b, h, t], v_bits, v_cent, vvec)
                vn = half[v_norms[b, h, t]]
                for g in range(g_n):
                    p = np.float32(math.exp(s[g, t - t0] - m[g]))
                    l[g] += p
                    w = p * vn
                    for j in range(d):
                        acc[g, j] += w * vvec[j]
        for g in range(g_n):
            out_m[b, h, sp, g] = m[g]
            out_l[b, h, sp, g] = l[g]
            for j in range(d):
                out_acc[b, h, sp, g, j] = acc[g, j]


def _bits16(a):
    """A float16 array as its uint16 bit patterns (a view when the layout allows)."""
    if a.dtype != np.float16:
        raise TypeError(f"expected float16 state, received {a.dtype}")
    return a.view(np.uint16)


#: Below this many (batch · head · token) units a step runs on the calling thread alone:
#: waking worker threads costs more than the work (measured: 0.46 ms on one thread against
#: 16 ms on two for 3 heads × 100 tokens on a busy 2-core machine).
PARALLEL_MIN_WORK = 16384


def _threads_for(work: int) -> int:
    return 1 if work < PARALLEL_MIN_WORK else max(1, nb.get_num_threads())


def _splits(bh: int, n: int, cores: int) -> int:
    """Token splits per (batch, head): enough tasks for every core, tiles of work each."""
    want = max(1, -(-2 * cores // bh))
    return max(1, min(want, n // (4 * TILE) or 1))


def polar_decode_attention(codec, q, scale):
    """Fused decode attention over a :class:`~arraykv.caches.polar.PolarLayerCodec` (NumPy).

    Same contract as :func:`arraykv.attention.polar_fused.polar_decode_attention_reference`.
    """
    prep = prepare_queries(codec, q, scale)
    qr = np.ascontiguousarray(prep["qr"], dtype=np.float32)
    b, h, g, d = qr.shape
    n = codec.n_quantized
    if n == 0:
        m = np.full((b, h, g), -np.inf, np.float32)
        return merge_window(codec, prep, scale, m, np.zeros((b, h, g), np.float32), np.zeros((b, h, g, d), np.float32), q.dtype)
    use_qjl = codec.qjl is not None
    sq = np.ascontiguousarray(prep["sq"], np.float32) if use_qjl else np.zeros((b, h, g, 0), np.float32)
    k_qjl = codec.k_qjl if use_qjl else np.zeros((b, h, n, 0), np.uint8)
    k_qjl_norms = codec.k_qjl_norms if use_qjl else np.zeros((b, h, n), np.float16)
    qout = np.ascontiguousarray(prep["qout"], np.float32)
    k_out = codec.k_outliers if qout.shape[3] else np.zeros((b, h, n, 0), np.float16)
    threads = _threads_for(b * h * n)
    splits = _splits(b * h, n, threads)
    out_m = np.empty((b, h, splits, g), np.float32)
    out_l = np.empty((b, h, splits, g), np.float32)
    out_acc = np.empty((b, h, splits, g, d), np.float32)
    saved = nb.get_num_threads()
    nb.set_num_threads(threads)  # thread-local in Numba: other threads keep their setting
    try:
        _run(qr, prep, qout, sq, codec, k_out, k_qjl, k_qjl_norms, use_qjl, splits, out_m, out_l, out_acc)
    finally:
        nb.set_num_threads(saved)
    # merge the token splits (log-sum-exp)
    m = out_m.max(axis=2)
    w = np.exp(out_m - m[:, :, None, :])
    w[~np.isfinite(out_m)] = 0.0
    l = (out_l * w).sum(axis=2)
    acc = (out_acc * w[..., None]).sum(axis=2)
    return merge_window(codec, prep, scale, m, l, acc, q.dtype)


def _run(qr, prep, qout, sq, codec, k_out, k_qjl, k_qjl_norms, use_qjl, splits, out_m, out_l, out_acc):
    _attend(qr, np.ascontiguousarray(prep["qconst"], np.float32), qout, sq,
            codec.k_codes, _bits16(codec.k_norms), np.asarray(codec.k_codebook.centroids, np.float32), int(codec.k_codebook.bits),
            codec.v_codes, _bits16(codec.v_norms), np.asarray(codec.v_codebook.centroids, np.float32), int(codec.v_codebook.bits),
            _bits16(k_out), k_qjl, _bits16(k_qjl_norms), use_qjl, HALF_TO_FLOAT, splits, out_m, out_l, out_acc)
