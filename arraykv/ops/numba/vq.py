"""Numba kernels for vector-quantization (product-quantization) k-means and coding (see :mod:`arraykv.quant.vq`).

``assign`` computes exact squared distances point by point (no ``‖x‖² - 2x·c + ‖c‖²``
expansion and no (n, K) temporary), so it is both faster and slightly more accurate than the
array-API reference; ``update`` accumulates cluster sums in one pass.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .threads import launch

__all__ = ["assign", "update", "encode", "decode", "unpack_flat_indices"]


@nb.njit(cache=True, nogil=True, parallel=True)
def _assign(x, c, idx, err):
    groups, n, s = x.shape
    k = c.shape[1]
    for p in nb.prange(groups * n):
        g = p // n
        i = p % n
        best = np.inf
        arg = 0
        for j in range(k):
            d = np.float32(0.0)
            for t in range(s):
                diff = x[g, i, t] - c[g, j, t]
                d += diff * diff
            if d < best:
                best = d
                arg = j
        idx[g, i] = arg
        err[g, i] = best


@nb.njit(cache=True, nogil=True, parallel=True)
def _update(x, c, idx, out):
    groups, n, s = x.shape
    k = c.shape[1]
    for g in nb.prange(groups):
        sums = np.zeros((k, s), np.float64)
        counts = np.zeros(k, np.int64)
        for i in range(n):
            j = idx[g, i]
            counts[j] += 1
            for t in range(s):
                sums[j, t] += x[g, i, t]
        for j in range(k):
            for t in range(s):
                if counts[j] > 0:
                    out[g, j, t] = np.float32(sums[j, t] / counts[j])
                else:
                    out[g, j, t] = c[g, j, t]


def assign(xg, c):
    xg = np.ascontiguousarray(xg, np.float32)
    c = np.ascontiguousarray(c, np.float32)
    idx = np.empty(xg.shape[:2], np.int64)
    err = np.empty(xg.shape[:2], np.float32)
    with launch(xg.size * c.shape[1]):  # one decode step's token: no worker threads
        _assign(xg, c, idx, err)
    return idx, float(err.sum(dtype=np.float64))


def update(xg, c, idx):
    out = np.empty(c.shape, np.float32)
    with launch(xg.size):
        _update(
            np.ascontiguousarray(xg, np.float32),
            np.ascontiguousarray(c, np.float32),
            np.ascontiguousarray(idx, np.int64),
            out,
        )
    return out


@nb.njit(inline="always")
def _nearest(x, c, r, hh, tt, j):
    """Index of the centroid of ``c[hh, j]`` nearest to sub-vector ``j`` of ``x[r, hh, tt]`` (first minimum)."""
    k, s = c.shape[2], c.shape[3]
    best = np.inf
    arg = 0
    for kk in range(k):
        d = np.float32(0.0)
        for u in range(s):
            diff = x[r, hh, tt, j * s + u] - c[hh, j, kk, u]
            d += diff * diff
        if d < best:
            best = d
            arg = kk
    return arg


@nb.njit(inline="always")
def _cell(p, h, t):
    """Task ``p`` of a ``prange`` over ``rows · h · t`` as ``(row, head, token)``."""
    return p // (h * t), (p // t) % h, p % t


@nb.njit(cache=True, nogil=True, parallel=True)
def _encode_packed(x, c, bits, out):
    """Nearest centroid of every sub-vector, packed LSB-first into ``out`` (rows, h, t, nbytes) uint8."""
    rows, h, t, _ = x.shape
    m = c.shape[1]
    for p in nb.prange(rows * h * t):
        r, hh, tt = _cell(p, h, t)
        o = out[r, hh, tt]
        for i in range(o.shape[0]):
            o[i] = 0
        for j in range(m):
            arg = _nearest(x, c, r, hh, tt, j)
            pos = j * bits
            byte = pos >> 3
            off = pos & 7
            o[byte] |= np.uint8((arg << off) & 255)
            if off + bits > 8:
                o[byte + 1] |= np.uint8(arg >> (8 - off))


@nb.njit(cache=True, nogil=True, parallel=True)
def _encode_wide(x, c, out):
    """Nearest centroid of every sub-vector as one uint16 per code: ``out`` (rows, h, t, m)."""
    rows, h, t, _ = x.shape
    m = c.shape[1]
    for p in nb.prange(rows * h * t):
        r, hh, tt = _cell(p, h, t)
        for j in range(m):
            out[r, hh, tt, j] = _nearest(x, c, r, hh, tt, j)


def encode(x, centroids, bits):
    """VQ codes of ``x`` (rows, h, t, d) in one pass: the codes of :func:`arraykv.quant.vq.vq_encode_reference`.

    Parameters
    ----------
    x : ndarray of float, shape (rows, h, t, d)
    centroids : ndarray of float32, shape (h, m, K, s), ``m · s = d``
    bits : int
        ``ceil(log2 K)``; codes of up to 8 bits are packed (``ceil(m · bits / 8)`` uint8 per
        token, the :func:`~arraykv.quant.bitpack.pack_bits` layout), wider ones are uint16.

    Returns
    -------
    ndarray of uint8, shape (rows, h, t, ceil(m · bits / 8)), or of uint16, shape (rows, h, t, m)

    Notes
    -----
    The distance of a sub-vector to each centroid is summed in float32 channel by channel and
    the first minimum wins, exactly as in :func:`assign`, so the codes are the same as
    ``assign`` followed by ``pack_bits``. One call replaces the dozen array operations of the
    reference, which matters for one decode-step token (microseconds, not tens of them).
    """
    x = np.ascontiguousarray(x, np.float32)
    c = np.ascontiguousarray(centroids, np.float32)
    rows, h, t, _ = x.shape
    m = c.shape[1]
    if bits > 8:
        out = np.empty((rows, h, t, m), np.uint16)
        with launch(x.size * c.shape[2]):
            _encode_wide(x, c, out)
        return out
    out = np.empty((rows, h, t, (m * bits + 7) // 8), np.uint8)
    with launch(x.size * c.shape[2]):
        _encode_packed(x, c, int(bits), out)
    return out


@nb.njit(cache=True, nogil=True, parallel=True)
def _decode_packed(codes, c, bits, out):
    """Centroids named by packed codes (rows, h, t, nbytes) → vectors ``out`` (rows, h, t, m · s)."""
    rows, h, t, nbytes = codes.shape
    m, k, s = c.shape[1], c.shape[2], c.shape[3]
    mask = (1 << bits) - 1
    for p in nb.prange(rows * h * t):
        r = p // (h * t)
        hh = (p // t) % h
        tt = p % t
        row = codes[r, hh, tt]
        o = out[r, hh, tt]
        for j in range(m):
            pos = j * bits
            byte = pos >> 3
            off = pos & 7
            a = np.int64(row[byte]) >> off
            if off + bits > 8:
                a |= np.int64(row[byte + 1]) << (8 - off)
            a = min(a & mask, k - 1)
            for u in range(s):
                o[j * s + u] = c[hh, j, a, u]


@nb.njit(cache=True, nogil=True, parallel=True)
def _decode_wide(codes, c, out):
    """Centroids named by uint16 codes (rows, h, t, m) → vectors ``out`` (rows, h, t, m · s)."""
    rows, h, t, m = codes.shape
    k, s = c.shape[2], c.shape[3]
    for p in nb.prange(rows * h * t):
        r, hh, tt = _cell(p, h, t)
        for j in range(m):
            a = min(np.int64(codes[r, hh, tt, j]), k - 1)
            for u in range(s):
                out[r, hh, tt, j * s + u] = c[hh, j, a, u]


def decode(codes, centroids, bits):
    """Vectors that VQ codes name, in one pass: the result of :func:`arraykv.quant.vq.vq_decode_reference`.

    Parameters
    ----------
    codes : ndarray, shape (rows, h, t, ceil(m · bits / 8)) uint8 (packed) or (rows, h, t, m) uint16
    centroids : ndarray of float32, shape (h, m, K, s)
    bits : int

    Returns
    -------
    ndarray of float32, shape (rows, h, t, m · s)

    Notes
    -----
    Codes ``>= K`` (never written by the encoder) read as ``K − 1``, as in the fused attention kernel.
    """
    c = np.ascontiguousarray(centroids, np.float32)
    codes = np.ascontiguousarray(codes)
    rows, h, t = codes.shape[:3]
    m, s = c.shape[1], c.shape[3]
    out = np.empty((rows, h, t, m * s), np.float32)
    with launch(out.size):
        if bits > 8:
            _decode_wide(codes, c, out)
        else:
            _decode_packed(codes, c, int(bits), out)
    return out


# ---- read side: codes as indices, for the fused kernel (arraykv.ops.numba.vq_fused) ------------


@nb.njit(inline="always")
def unpack_flat_indices(codes, b, h, t0, nt, bits, kn, out):
    """Codes ``a_tj`` of tokens ``[t0, t0 + nt)`` of head ``(b, h)`` as flat indices ``j · kn + min(a_tj, kn − 1)``
    into ``out[:nt]`` (nt, m): rows of a ``(m · kn, ...)`` view of one head's codebooks or tables."""
    m = out.shape[1]
    top = kn - 1
    if bits > 8 or bits == 8:
        for r in range(nt):
            row = codes[b, h, t0 + r]
            o = out[r]
            for j in range(m):
                o[j] = min(np.int32(row[j]), top) + j * kn
    elif bits == 4:
        half = m // 2
        for r in range(nt):
            row = codes[b, h, t0 + r]
            o = out[r]
            for i in range(half):
                x = np.int32(row[i])
                o[2 * i] = min(x & 15, top) + 2 * i * kn
                o[2 * i + 1] = min(x >> 4, top) + (2 * i + 1) * kn
            if m % 2 == 1:
                o[m - 1] = min(np.int32(row[half]) & 15, top) + (m - 1) * kn
    else:
        mask = np.uint64((1 << bits) - 1)
        ub = np.uint64(bits)
        for r in range(nt):
            row = codes[b, h, t0 + r]
            nbytes = row.shape[0]
            o = out[r]
            for grp in range((m + 7) // 8):
                base = grp * bits
                w = np.uint64(0)
                for k in range(bits):
                    if base + k < nbytes:
                        w |= np.uint64(row[base + k]) << np.uint64(8 * k)
                j0 = grp * 8
                for i in range(min(8, m - j0)):
                    o[j0 + i] = min(np.int32((w >> (np.uint64(i) * ub)) & mask), top) + (j0 + i) * kn
