"""Packed-code rows as centroid values, for the fused PolarQuant kernel (Numba).

Layout of :mod:`arraykv.quant.bitpack`. :func:`_chunk_table` turns a codebook into 8-byte words
of the centroid values of every chunk of consecutive codes, so :func:`unpack_rows` unpacks two
codes per load and store (4- and 2-bit rows in planar order and 3-bit rows straight from the
codes where the vector lookups exist: :func:`arraykv.ops.numba.planar.planar_per`,
:func:`direct3`); float16 state is read through ``uint16`` views (Numba has no float16) and
:func:`arraykv.ops.numba.half.half_to_float`. Host side: :func:`fixed_args` (the arrays derived
from a cache's rotation, codebooks and sketch, memoised), :func:`bits16` and the read-only
placeholders ``NO_*`` of absent state.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..cpu_features import HAVE_PERMPS
from ..fused_driver import FASTMATH
from ..ir_codes import unpack_tile_2, unpack_tile_4
from ..planar import planar_per, planar_per_jit, table16

__all__ = [
    "SIGNS",
    "SIGN_TABLE",
    "unpack_rows",
    "direct3",
    "direct3_jit",
    "bits16",
    "fixed_args",
    "memo_by_objects",
    "NO_U16_3",
    "NO_U16_4",
    "NO_U8_4",
    "NO_I32_3",
    "NO_F32_2",
    "NO_F32_3",
    "NO_I32_2",
]

#: QJL bit values: bit 0 -> -1, bit 1 -> +1.
SIGNS = np.array([-1.0, 1.0], np.float32)
#: Codes per chunk of :func:`_chunk_table`, by bits.
_CHUNK = (1, 8, 4, 2, 2, 2, 1, 1, 1)


def _chunk_table(cent, bits):
    """Centroid values of every chunk of ``_CHUNK[bits]`` consecutive codes, as 8-byte words.

    Parameters
    ----------
    cent : ndarray of float32, shape (2**bits,)
    bits : int

    Returns
    -------
    ndarray of uint64, shape (2**(c·bits) · c / 2,), ``c = _CHUNK[bits]``
        Entry ``e`` (``c / 2`` words) holds ``cent[e & mask], cent[(e >> bits) & mask], ...``
        (the bitpack order), so one 8-byte load and store unpacks two codes. Chunks: 8 one-bit
        codes (a byte), 4 two-bit codes (a byte), 2 three-, four- or five-bit codes; empty for
        6–8 bits (those read ``cent``).
    """
    c = _CHUNK[bits]
    if c == 1:
        return np.zeros(0, np.uint64)
    e = np.arange(1 << (c * bits))
    idx = (e[:, None] >> (np.arange(c) * bits)[None, :]) & ((1 << bits) - 1)
    return np.ascontiguousarray(np.asarray(cent, np.float32)[idx]).view(np.uint64).reshape(-1)


SIGN_TABLE = _chunk_table(SIGNS, 1)


@nb.njit(inline="always")
def _unpack_small(codes, b, h, t0, t1, bits, table, cent, d, out, out64):
    """:func:`unpack_rows` for 1 or 2 bits (a literal here).

    A byte of ``8 / bits`` codes is ``4 / bits`` table words.
    """
    per = 8 // bits
    words = 4 // bits
    mask = (1 << bits) - 1
    for t in range(t0, t1):
        row = codes[b, h, t]
        r = t - t0
        for j in range(d // per):
            e = words * np.int64(row[j])
            for k in range(words):
                out64[r, words * j + k] = table[e + k]
        for i in range(d - d % per, d):
            out[r, i] = cent[(row[i // per] >> (bits * (i % per))) & mask]


@nb.njit(fastmath=FASTMATH, error_model="numpy")
def unpack_rows(codes, b, h, t0, t1, bits, table, cent, d, out, out64):
    """Centroid values of rows ``t0 .. t1`` of ``codes[b, h]`` into ``out[:t1 - t0, :d]``.

    Layout of :mod:`arraykv.quant.bitpack`. ``out`` (float32, (rows, even width >= d)) and
    ``out64`` are views of one buffer; ``table`` is :func:`_chunk_table` of ``cent``, or, when
    :func:`planar_per_jit` of ``(bits, d)`` is not 0, :func:`arraykv.ops.numba.planar.table16` of it
    (as 8 words) and the rows come out in planar order (:mod:`arraykv.ops.numba.planar`; the
    rows of ``codes`` must then be contiguous). The branch on ``bits`` is taken once per
    call, so every loop below is specialised.
    """
    per = planar_per_jit(bits, d)
    if per == 2:  # sixteen codes per instruction, one plane of codes per vector
        unpack_tile_4(codes[b, h], t0, t1 - t0, table, out)
    elif per == 4:
        unpack_tile_2(codes[b, h], t0, t1 - t0, table, out)
    elif bits == 4:
        for t in range(t0, t1):
            row = codes[b, h, t]
            r = t - t0
            for j in range(d // 2):
                out64[r, j] = table[row[j]]
            if d % 2:
                out[r, d - 1] = cent[row[d // 2] & 15]
    elif bits == 2:
        _unpack_small(codes, b, h, t0, t1, 2, table, cent, d, out, out64)
    elif bits == 1:
        _unpack_small(codes, b, h, t0, t1, 1, table, cent, d, out, out64)
    elif bits == 8:
        for t in range(t0, t1):
            row = codes[b, h, t]
            r = t - t0
            for j in range(d):
                out[r, j] = cent[row[j]]
    elif bits == 3:
        for t in range(t0, t1):
            row = codes[b, h, t]
            r = t - t0
            for grp in range(d // 8):  # eight codes in three bytes: four pairs of six bits
                word = np.int64(row[3 * grp]) | (np.int64(row[3 * grp + 1]) << 8) | (np.int64(row[3 * grp + 2]) << 16)
                out64[r, 4 * grp] = table[word & 63]
                out64[r, 4 * grp + 1] = table[(word >> 6) & 63]
                out64[r, 4 * grp + 2] = table[(word >> 12) & 63]
                out64[r, 4 * grp + 3] = table[word >> 18]
            for i in range(d - d % 8, d):
                bit = 3 * i
                pair = np.int64(row[bit >> 3])
                if (bit >> 3) + 1 < codes.shape[3]:
                    pair |= np.int64(row[(bit >> 3) + 1]) << 8
                out[r, i] = cent[(pair >> (bit & 7)) & 7]
    else:
        mask = np.uint64((1 << bits) - 1)
        pmask = np.uint64((1 << (2 * bits)) - 1)
        nbytes = codes.shape[3]
        full = d // 8 if bits <= 5 else 0  # 3 or 5 bits: four pairs of codes per group of eight
        for t in range(t0, t1):
            row = codes[b, h, t]
            r = t - t0
            for grp in range((d + 7) // 8):
                word = np.uint64(0)
                start = grp * bits
                for k in range(min(bits, nbytes - start)):
                    word |= np.uint64(row[start + k]) << np.uint64(8 * k)
                if grp < full:
                    for i in range(4):
                        out64[r, 4 * grp + i] = table[np.int64((word >> np.uint64(2 * bits * i)) & pmask)]
                else:
                    base = grp * 8
                    for i in range(min(8, d - base)):
                        out[r, base + i] = cent[np.int64((word >> np.uint64(i * bits)) & mask)]


# ---- host side: the fused kernel's arguments from a codec ------------------------------------


def _absent(ndim: int, dtype) -> np.ndarray:
    a = np.zeros((0,) * ndim, dtype)
    a.setflags(write=False)
    return a


NO_U16_3, NO_U16_4, NO_U8_4 = _absent(3, np.uint16), _absent(4, np.uint16), _absent(4, np.uint8)
NO_I32_3, NO_F32_2 = _absent(3, np.int32), _absent(2, np.float32)
NO_F32_3, NO_I32_2 = _absent(3, np.float32), _absent(2, np.int32)


def bits16(a, absent=NO_U16_3):
    """A float16 array as its uint16 bit patterns (a view); ``absent`` for None."""
    if a is None:
        return absent
    if a.dtype != np.float16:
        raise TypeError(f"expected float16 state, received {a.dtype}")
    return a.view(np.uint16)


#: Arguments derived from a cache's fixed objects (rotation, codebooks, sketch), by their ids.
#: The entry holds the objects themselves, so an id is not reused while it is cached.
_FIXED: dict = {}
_FIXED_MAX = 64


def memo_by_objects(store: dict, objs: tuple, make, limit: int = 64):
    """``make(*objs)``, memoised in ``store`` by the ids of ``objs`` (the entry keeps the objects,
    so an id cannot be reused while cached; at most ``limit`` entries, oldest dropped first)."""
    key = tuple(map(id, objs))
    hit = store.get(key)
    if hit is not None:
        for a, b in zip(hit[0], objs):  # a loop, not all() of a generator: this runs every decode step
            if a is not b:
                break
        else:
            return hit[1]
    value = make(*objs)
    if len(store) >= limit:
        try:  # layers run from several threads: another may have evicted it first
            store.pop(next(iter(store)), None)
        except (StopIteration, RuntimeError):
            pass
    store[key] = (objs, value)
    return value


def direct3(bits, d):
    """Whether rows of ``d`` 3-bit codes are read sixteen codes per ``vpermps``
    (:mod:`arraykv.ops.numba.simd3`); the same function runs in compiled code as :func:`direct3_jit`."""
    return HAVE_PERMPS and bits == 3 and d % 64 == 0


#: :func:`direct3` inside compiled code, inlined (``HAVE_PERMPS`` is a compile-time constant there).
direct3_jit = nb.njit(inline="always")(direct3)


def _row_table(cent, bits: int, d: int) -> np.ndarray:
    """The ``table`` argument of :func:`unpack_rows` for rows of ``d`` codes of ``bits`` bits (uint64 words);
    the 16-float register table where the rows are read with ``vpermps`` (planar, or 3-bit chunks)."""
    if planar_per(bits, d) or direct3(bits, d):
        return table16(cent).view(np.uint64)
    return _chunk_table(cent, bits)


def _make_fixed_args(rotation, kc, vc, sketch) -> tuple:
    k_cent = np.ascontiguousarray(kc.centroids, np.float32)
    v_cent = np.ascontiguousarray(vc.centroids, np.float32)
    d = int(rotation.dim)
    return (
        k_cent,
        _row_table(k_cent, int(kc.bits), d),
        int(kc.bits),
        v_cent,
        _row_table(v_cent, int(vc.bits), d),
        int(vc.bits),
        np.ascontiguousarray(rotation.signs, np.float32),
        NO_F32_2 if rotation.matrix is None else np.ascontiguousarray(rotation.matrix, np.float32),
        NO_F32_2 if sketch is None else np.ascontiguousarray(np.asarray(sketch.matrix, np.float32).T),
    )


def fixed_args(codec) -> tuple:
    """``(k_cent, k_table, k_bits, v_cent, v_table, v_bits, signs, rot, sketch_t)`` of ``codec``; ``sketch_t``
    is the QJL matrix transposed, (d, m) (a query's sketch is summed along its rows)."""
    return memo_by_objects(
        _FIXED, (codec.rotation, codec.k_codebook, codec.v_codebook, codec.qjl), _make_fixed_args, _FIXED_MAX
    )
