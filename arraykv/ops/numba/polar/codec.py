"""Numba kernels for TurboQuant-MSE encode/decode (see :mod:`arraykv.quant.polar`), and their compiled loops.

One pass per vector, ``prange`` over chunks of 64 vectors: norm, random signs, in-place fast Walsh–Hadamard
transform (or a dense matrix for other sizes), bucketize by binary search over the thresholds
between centroids, the stored length (least-squares or unbiased), and bit packing in the same loop. Decode unpacks,
looks up centroids and applies the inverse transform. Results equal
:func:`~arraykv.quant.polar.polar_encode_reference` except where float rounding puts a
coordinate on the other side of a threshold (the reference multiplies by the dense matrix).

The other polar kernels reuse the pieces: :func:`fwht` (the transform, inlined),
:func:`encode_ser` / :func:`encode_par` and :func:`decode_ser` / :func:`decode_par` (the loops,
serial and parallel), :func:`host_array` and :func:`rotation_matrix` (their arguments).
"""

from __future__ import annotations

import math
import types

import numba as nb
import numpy as np

from ..threads import launch, threads_for

__all__ = [
    "polar_encode",
    "polar_decode",
    "fwht",
    "encode_par",
    "decode_par",
    "encode_ser",
    "decode_ser",
    "host_array",
    "rotation_matrix",
]


@nb.njit(cache=True, nogil=True, inline="always")
def fwht(v):
    """In-place unnormalized Walsh–Hadamard transform of a contiguous power-of-two vector.

    Sizes >= 8: the first three stages as one unrolled 8-point transform per group of eight,
    then stages over contiguous runs of length h >= 8, which vectorize.
    """
    d = v.shape[0]
    h = 1
    if d >= 8:
        for g in range(0, d, 8):
            a0, a1, a2, a3 = v[g], v[g + 1], v[g + 2], v[g + 3]
            a4, a5, a6, a7 = v[g + 4], v[g + 5], v[g + 6], v[g + 7]
            b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
            b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
            c0, c2, c1, c3 = b0 + b2, b0 - b2, b1 + b3, b1 - b3
            c4, c6, c5, c7 = b4 + b6, b4 - b6, b5 + b7, b5 - b7
            v[g], v[g + 4], v[g + 1], v[g + 5] = c0 + c4, c0 - c4, c1 + c5, c1 - c5
            v[g + 2], v[g + 6], v[g + 3], v[g + 7] = c2 + c6, c2 - c6, c3 + c7, c3 - c7
        h = 8
    while h < d:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                a = v[j]
                c = v[j + h]
                v[j] = a + c
                v[j + h] = a - c
        h *= 2


@nb.njit(cache=True, nogil=True, inline="always")
def _bucket(y, thr, levels):
    """Number of thresholds below ``y`` (``searchsorted(thr, y, side='left')``)."""
    if levels <= 16:
        pos = 0
        for t in range(levels - 1):
            pos += thr[t] < y
        return pos
    pos = 0
    step = levels >> 1
    while step > 0:
        if thr[pos + step - 1] < y:
            pos += step
        step >>= 1
    return pos


def _encode_py(x, signs, matrix, hadamard, thr, cents, bits, unbiased, codes, lengths):
    n, d = x.shape
    levels = cents.shape[0]
    nbytes = codes.shape[1]
    groups = (d + 7) >> 3
    inv_sqrt_d = np.float32(1.0 / math.sqrt(d))
    chunk = 64
    for blk in nb.prange((n + chunk - 1) // chunk):
        buf = np.empty(d, dtype=np.float32)
        idx = np.zeros(groups * 8, dtype=np.uint8)
        for r in range(blk * chunk, min(n, (blk + 1) * chunk)):
            ss = np.float32(0.0)
            for i in range(d):
                ss += x[r, i] * x[r, i]
            norm = np.float32(math.sqrt(ss))
            inv = np.float32(1.0) / norm if norm > 0 else np.float32(0.0)
            if hadamard:
                for i in range(d):
                    buf[i] = x[r, i] * signs[i]
                fwht(buf)
                inv = inv * inv_sqrt_d
            else:
                for i in range(d):
                    acc = np.float32(0.0)
                    for j in range(d):
                        acc += matrix[i, j] * x[r, j]
                    buf[i] = acc
            dot = np.float32(0.0)
            sq = np.float32(0.0)
            for i in range(d):
                y = buf[i] * inv
                pos = _bucket(y, thr, levels)
                idx[i] = pos
                c = cents[pos]
                dot += y * c
                sq += c * c
            for g in range(groups):
                word = np.uint64(0)
                for k in range(8):
                    word |= np.uint64(idx[g * 8 + k]) << np.uint64(k * bits)
                start = g * bits
                for q in range(bits):
                    if start + q < nbytes:
                        codes[r, start + q] = np.uint8((word >> np.uint64(8 * q)) & np.uint64(255))
            if unbiased:
                lengths[r] = norm / dot if dot > 0 else np.float32(0.0)
            else:
                lengths[r] = norm * dot / sq


def _decode_py(codes, lengths, signs, matrix, hadamard, cents, bits, out):
    n, d = out.shape
    nbytes = codes.shape[1]
    mask = np.uint64((1 << bits) - 1)
    inv_sqrt_d = np.float32(1.0 / math.sqrt(d))
    groups = (d + 7) >> 3
    chunk = 64
    for blk in nb.prange((n + chunk - 1) // chunk):
        buf = np.empty(groups * 8, dtype=np.float32)
        for r in range(blk * chunk, min(n, (blk + 1) * chunk)):
            for g in range(groups):
                start = g * bits
                word = np.uint64(0)
                for q in range(bits):
                    if start + q < nbytes:
                        word |= np.uint64(codes[r, start + q]) << np.uint64(8 * q)
                for k in range(8):
                    buf[g * 8 + k] = cents[np.int64((word >> np.uint64(k * bits)) & mask)]
            length = lengths[r]
            if hadamard:
                v = buf[:d]
                fwht(v)
                f = length * inv_sqrt_d
                for i in range(d):
                    out[r, i] = v[i] * signs[i] * f
            else:
                for j in range(d):
                    out[r, j] = np.float32(0.0)
                for i in range(d):
                    bi = buf[i] * length
                    for j in range(d):
                        out[r, j] += matrix[i, j] * bi


# Parallel variants for large inputs; serial ones for small calls (a decode step), where waking
# the thread pool costs more than the work, especially on a busy machine.
def _named(fn, name: str):
    """``fn`` under another name. Numba keys its disk cache by a function's name and first line,
    not by its options, so a serial and a parallel variant jitted from one function would load
    whichever of the two was compiled first (both ran serially, or both in parallel, by chance)."""
    out = types.FunctionType(
        fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name, fn.__defaults__, fn.__closure__
    )
    out.__qualname__ = name
    return out


encode_par = nb.njit(cache=True, nogil=True, parallel=True)(_named(_encode_py, "encode_par"))
decode_par = nb.njit(cache=True, nogil=True, parallel=True)(_named(_decode_py, "decode_par"))
encode_ser = nb.njit(cache=True, nogil=True)(_named(_encode_py, "encode_ser"))
decode_ser = nb.njit(cache=True, nogil=True)(_named(_decode_py, "decode_ser"))


def host_array(a, dtype=np.float32):
    """``a`` as a C-contiguous NumPy array of ``dtype`` (no copy when it is one already)."""
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)


_NO_MATRIX = np.zeros((1, 1), dtype=np.float32)


def rotation_matrix(rotation):
    """The dense matrix of ``rotation`` as float32, or a 1 x 1 placeholder for a Hadamard rotation."""
    return _NO_MATRIX if rotation.matrix is None else host_array(rotation.matrix)


def polar_encode(x, codebook, rotation, *, unbiased=False):
    """Kernel of :func:`arraykv.quant.polar.polar_encode_reference`: ``(codes uint8, lengths float16)``.

    Parameters
    ----------
    x : ndarray of float, shape (..., dim)
    codebook : Codebook
    rotation : Rotation
    unbiased : bool, default False
        Store ``‖x‖ / ⟨y, ŷ⟩`` instead of the least-squares length.

    Returns
    -------
    codes : ndarray of uint8, shape (..., ceil(dim · bits / 8))
    lengths : ndarray of float16, shape (...)
    """
    x = np.asarray(x)
    lead, d = x.shape[:-1], int(x.shape[-1])
    flat = host_array(x.reshape(-1, d))
    bits = int(codebook.bits)
    codes = np.empty((flat.shape[0], (d * bits + 7) // 8), dtype=np.uint8)
    lengths = np.empty(flat.shape[0], dtype=np.float32)
    args = (
        flat,
        host_array(rotation.signs),
        rotation_matrix(rotation),
        rotation.kind == "hadamard",
        host_array(codebook.thresholds),
        host_array(codebook.centroids),
        bits,
        bool(unbiased),
        codes,
        lengths,
    )
    if threads_for(flat.size) == 1:
        encode_ser(*args)
    else:
        with launch(flat.size):
            encode_par(*args)
    return codes.reshape(lead + (codes.shape[1],)), lengths.astype(np.float16).reshape(lead)


def polar_decode(codes, norms, codebook, rotation):
    """Kernel of :func:`arraykv.quant.polar.polar_decode_reference`: float32 ``(..., dim)``.

    Parameters
    ----------
    codes : ndarray of uint8, shape (..., ceil(dim · bits / 8))
    norms : ndarray of float16/float32, shape (...)
    codebook, rotation
        The ones used to encode.
    """
    codes = np.asarray(codes)
    lead = codes.shape[:-1]
    d = int(rotation.dim)
    flat = np.ascontiguousarray(codes.reshape(-1, codes.shape[-1]))
    out = np.empty((flat.shape[0], d), dtype=np.float32)
    args = (
        flat,
        host_array(np.asarray(norms).reshape(-1)),
        host_array(rotation.signs),
        rotation_matrix(rotation),
        rotation.kind == "hadamard",
        host_array(codebook.centroids),
        int(codebook.bits),
        out,
    )
    if threads_for(out.size) == 1:
        decode_ser(*args)
    else:
        with launch(out.size):
            decode_par(*args)
    return out.reshape(lead + (d,))
