"""Planar order of packed 4- and 2-bit codes, and the 16-entry register tables of codebooks.

Plane order
-----------
Byte ``j`` of a row holds codes ``per·j + p`` for ``p < per`` (``per = 8 / bits``, the
layout of :mod:`arraykv.quant.bitpack`). The planar order puts code ``per·j + p`` of a row of
``nbytes`` bytes at position ``p·nbytes + j``: each plane is a contiguous run of the row's
bytes, so no code crosses a vector. Dot products and weighted sums do not care about channel
order as long as the other operand is permuted the same way (:func:`to_planar`,
:func:`from_planar` on the host; :func:`channels_to_planar`, :func:`planar_to_channels` in
compiled code). :func:`planar_per` says when rows are read in that order (the vector lookups of
:mod:`arraykv.ops.numba.ir_codes`), :func:`table16` makes the register table they look codes up in.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .cpu_features import HAVE_PERMPS

__all__ = [
    "planar_per",
    "planar_per_jit",
    "table16",
    "to_planar",
    "from_planar",
    "channels_to_planar",
    "planar_to_channels",
]


def planar_per(bits: int, d: int) -> int:
    """Codes per byte when rows of ``d`` codes of ``bits`` bits are read in planar order, else 0.

    Planar reading needs :data:`~arraykv.ops.numba.cpu_features.HAVE_PERMPS`, 4- or 2-bit codes and
    rows of a whole number of 16-byte blocks (``d`` a multiple of 32 for 4 bits, 64 for 2 bits).
    The same function runs in compiled code as :func:`planar_per_jit`.
    """
    if not HAVE_PERMPS:
        return 0
    if bits == 4 and d % 32 == 0:
        return 2
    if bits == 2 and d % 64 == 0:
        return 4
    return 0


#: :func:`planar_per` inside compiled code, inlined (``HAVE_PERMPS`` is a compile-time constant there).
planar_per_jit = nb.njit(inline="always")(planar_per)


def table16(cent) -> np.ndarray:
    """A codebook of at most 16 centroids as the 16 float32 of the register table.

    A codebook whose size divides 16 (1, 2, 4, 8 centroids: the codebooks of 0-3 bit codes)
    fills the table repeated, so entry ``i`` is centroid ``i mod size``: a lookup of a code
    then needs only its low bits, and the 2-bit paths skip masking the bits above them. Other
    sizes are followed by zeros.
    """
    cent = np.asarray(cent, np.float32).reshape(-1)
    if cent.size > 16:
        raise ValueError(f"a register table holds at most 16 centroids, received {cent.size}")
    out = np.zeros(16, np.float32)
    if cent.size and 16 % cent.size == 0:
        out[:] = np.tile(cent, 16 // cent.size)
    else:
        out[: cent.size] = cent
    return out


@nb.njit(inline="always")
def channels_to_planar(src, per, dst):
    """``dst[p·(d/per) + j] = src[per·j + p]``: one row (d,) into planar order (compiled code)."""
    nbytes = src.shape[0] // per
    for j in range(nbytes):
        for p in range(per):
            dst[p * nbytes + j] = src[per * j + p]


@nb.njit(inline="always")
def planar_to_channels(src, per, dst):
    """The inverse of :func:`channels_to_planar`: ``dst[per·j + p] = src[p·(d/per) + j]``."""
    nbytes = src.shape[0] // per
    for j in range(nbytes):
        for p in range(per):
            dst[per * j + p] = src[p * nbytes + j]


def to_planar(x, per: int):
    """``x`` (..., d) with channel ``per·j + p`` moved to position ``p·(d / per) + j`` (a copy)."""
    x = np.asarray(x)
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], d // per, per).swapaxes(-1, -2).reshape(x.shape))


def from_planar(x, per: int):
    """The inverse of :func:`to_planar`."""
    x = np.asarray(x)
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], per, d // per).swapaxes(-1, -2).reshape(x.shape))
