"""Numba kernels for group-wise integer quantization (the layout of :mod:`arraykv.quant.intq`).

Each kernel does in one pass what the array-API reference does in several (pad, reshape,
round, clip, pack), with identical float32 arithmetic so results match bit for bit. Calls on
fewer than :data:`~arraykv.ops.numba.threads.PARALLEL_MIN_WORK` values run on the calling thread: a decode step of a
small model touches a few hundred thousand values, and waking Numba's worker threads costs
more than that work (on a busy machine, milliseconds).

Code widths: 8 bits (one per byte), 4 bits (two per byte, low nibble first) and 2 bits (four
per byte, the first code in the lowest two bits), the layout of
:mod:`arraykv.quant.bitpack`; other widths use the array-API reference.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .polar.codec import _named
from .threads import launch, threads_for

__all__ = ["group_minmax", "quantize_pack", "dequantize"]


def _minmax_py(x, g, mn, mx):
    rows, n = x.shape
    groups = mn.shape[1]
    for r in nb.prange(rows):
        for j in range(groups):
            a = j * g
            b = min(a + g, n)
            lo = x[r, a]
            hi = lo
            for i in range(a + 1, b):
                v = x[r, i]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            mn[r, j] = lo
            mx[r, j] = hi


@nb.njit(inline="always")
def _level(x, off, inv, levels):
    """``clip(floor((x − off) · inv + 1/2), 0, levels)``: the integer level of one value (a float)."""
    t = np.floor((x - off) * inv + np.float32(0.5))
    if t < np.float32(0.0):
        t = np.float32(0.0)
    if t > levels:
        t = levels
    return t


def _quant_pack_py(x, g, bits, off, inv, out):
    rows, n = x.shape
    levels = np.float32((1 << bits) - 1)
    for r in nb.prange(rows):
        if bits == 8:
            for i in range(n):
                out[r, i] = np.uint8(_level(x[r, i], off[r, i // g], inv[r, i // g], levels))
        else:  # 4 or 2 bits: 8 // bits codes per byte, the first in the lowest bits
            per = 8 // bits
            nb_out = out.shape[1]
            for p in range(nb_out):
                byte = 0
                for h in range(per):
                    i = per * p + h
                    if i < n:
                        byte |= int(_level(x[r, i], off[r, i // g], inv[r, i // g], levels)) << (bits * h)
                out[r, p] = np.uint8(byte)


def _dequant_py(codes, bits, g, n, s, o, out):
    rows = codes.shape[0]
    for r in nb.prange(rows):
        for i in range(n):
            j = i // g
            if bits == 8:
                c = codes[r, i]
            elif bits == 4:
                c = (codes[r, i >> 1] >> (4 * (i & 1))) & 15
            else:
                c = (codes[r, i >> 2] >> (2 * (i & 3))) & 3
            out[r, i] = np.float32(c) * s[r, j] + o[r, j]


# A parallel variant of each loop for large calls and a serial one for small calls (a decode
# step), under names of their own (Numba keys its disk cache by a function's name and first
# line, not its options: see arraykv.ops.numba.polar.codec._named). A small call compiles and
# runs the serial variant only, which compiles in a fraction of the parallel one's time.
def _variants(fn, name: str) -> tuple:
    return (
        nb.njit(cache=True, nogil=True)(_named(fn, name + "_ser")),
        nb.njit(cache=True, nogil=True, parallel=True)(_named(fn, name + "_par")),
    )


_minmax_ser, _minmax_par = _variants(_minmax_py, "_minmax")
_quant_pack_ser, _quant_pack_par = _variants(_quant_pack_py, "_quant_pack")
_dequant_ser, _dequant_par = _variants(_dequant_py, "_dequant")


def _run(serial, parallel, work: int, *args) -> None:
    """``serial(*args)`` when ``work`` values get one thread (:func:`threads_for`), else ``parallel`` in a launch."""
    if threads_for(work) == 1:
        serial(*args)
        return
    with launch(work):
        parallel(*args)


def _rows(a):
    a = np.ascontiguousarray(a)
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


def group_minmax(x32, group_size):
    lead, n = x32.shape[:-1], x32.shape[-1]
    groups = -(-n // group_size)
    mn = np.empty(lead + (groups,), np.float32)
    mx = np.empty(lead + (groups,), np.float32)
    _run(
        _minmax_ser, _minmax_par, x32.size, _rows(x32), int(group_size), mn.reshape(-1, groups), mx.reshape(-1, groups)
    )
    return mn, mx


def quantize_pack(x32, group_size, bits, off32, inv):
    lead, n = x32.shape[:-1], x32.shape[-1]
    nbytes = (n * bits + 7) // 8
    out = np.empty(lead + (nbytes,), np.uint8)
    groups = off32.shape[-1]
    _run(
        _quant_pack_ser,
        _quant_pack_par,
        x32.size,
        _rows(x32),
        int(group_size),
        int(bits),
        _rows(np.asarray(off32, np.float32)).reshape(-1, groups),
        _rows(np.asarray(inv, np.float32)).reshape(-1, groups),
        out.reshape(-1, nbytes),
    )
    return out


def dequantize(codes, bits, group_size, n, s32, o32):
    lead = codes.shape[:-1]
    out = np.empty(lead + (int(n),), np.float32)
    groups = s32.shape[-1]
    _run(
        _dequant_ser,
        _dequant_par,
        out.size,
        _rows(codes),
        int(bits),
        int(group_size),
        int(n),
        _rows(s32).reshape(-1, groups),
        _rows(o32).reshape(-1, groups),
        out.reshape(-1, int(n)),
    )
    return out
