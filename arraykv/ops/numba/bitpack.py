"""Numba kernels for bit packing (the layout of :mod:`arraykv.quant.bitpack`).

Calls on few codes (one decode step's token, say) run on the calling thread
(:mod:`arraykv.ops.numba.threads`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .threads import launch

__all__ = ["pack_bits", "unpack_bits"]


@nb.njit(cache=True, nogil=True, parallel=True)
def _pack(codes, bits, out):
    rows, n = codes.shape
    nbytes = out.shape[1]
    mask = (1 << bits) - 1
    groups = (n + 7) // 8
    for r in nb.prange(rows):
        for g in range(groups):
            word = np.uint64(0)
            base = g * 8
            valid = min(8, n - base)
            for i in range(valid):
                word |= np.uint64(codes[r, base + i] & mask) << np.uint64(i * bits)
            start = g * bits
            for b in range(min(bits, nbytes - start)):
                out[r, start + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(255))


@nb.njit(cache=True, nogil=True, parallel=True)
def _unpack(packed, bits, n, out):
    rows, nbytes = packed.shape
    mask = np.uint64((1 << bits) - 1)
    groups = (n + 7) // 8
    for r in nb.prange(rows):
        for g in range(groups):
            start = g * bits
            word = np.uint64(0)
            for b in range(min(bits, nbytes - start)):
                word |= np.uint64(packed[r, start + b]) << np.uint64(8 * b)
            base = g * 8
            for i in range(min(8, n - base)):
                out[r, base + i] = np.uint8((word >> np.uint64(i * bits)) & mask)


def pack_bits(codes, bits):
    codes = np.ascontiguousarray(codes)
    lead, n = codes.shape[:-1], codes.shape[-1]
    out = np.empty(lead + ((n * bits + 7) // 8,), dtype=np.uint8)
    if codes.size == 0:
        return out
    with launch(codes.size):
        _pack(codes.reshape(-1, n), int(bits), out.reshape(-1, out.shape[-1]))
    return out


def unpack_bits(packed, bits, n):
    packed = np.ascontiguousarray(packed)
    lead = packed.shape[:-1]
    out = np.empty(lead + (int(n),), dtype=np.uint8)
    if out.size == 0:
        return out
    with launch(out.size):
        _unpack(packed.reshape(-1, packed.shape[-1]), int(bits), int(n), out.reshape(-1, int(n)))
    return out
