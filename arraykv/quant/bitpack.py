"""Bit packing of small unsigned integer codes (1–8 bits per code).

Layout
------
Along the last axis, a row of ``n`` codes of ``bits`` bits becomes a little-endian bit stream
of ``ceil(n * bits / 8)`` bytes: code ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``, and
stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``. Eight codes always fill exactly ``bits``
bytes, so packing works on groups of eight. Examples: 4 bits → ``byte = c0 | c1 << 4``;
2 bits → ``c0 | c1 << 2 | c2 << 4 | c3 << 6``; 3 bits → 8 codes in 3 bytes. Rows are padded to
whole bytes independently, so any leading shape packs row by row. ``kernels/bitpack.cu`` uses
the same layout on the GPU.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._types import Array
from .._validation import check_int

__all__ = [
    "packed_nbytes",
    "pack_bits",
    "unpack_bits",
    "pack_bits_reference",
    "unpack_bits_reference",
    "check_pack_args",
    "check_unpack_args",
]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy: ``ceil(n * bits / 8)``."""
    return (int(n) * int(bits) + 7) // 8


def _check_bits(bits: Any) -> int:
    return check_int("bits", bits, low=1, high=8)


def check_pack_args(codes: Array, bits: int) -> int:
    """Validate the arguments of :func:`pack_bits`; return ``bits`` as an int."""
    bits = _check_bits(bits)
    xp = _compat.namespace(codes)
    if codes.dtype != xp.uint8:
        raise TypeError(f"codes must be uint8, received {codes.dtype}")
    if codes.ndim < 1:
        raise ValueError("codes must have at least one dimension")
    return bits


def pack_bits(codes: Array, bits: int) -> Array:
    """Pack codes ``< 2**bits`` along the last axis.

    Parameters
    ----------
    codes : array of uint8, shape (..., n)
        Values must be below ``2**bits``; higher bits are discarded.
    bits : int
        Bits per code, 1 to 8.

    Returns
    -------
    array of uint8, shape (..., ceil(n * bits / 8))

    Notes
    -----
    Array-API code; ``arraykv.ops.pack_bits`` is the same function with a kernel per namespace.
    """
    return pack_bits_reference(codes, check_pack_args(codes, bits))


def check_unpack_args(packed: Array, bits: Any, n: Any) -> tuple:
    """Validate the arguments of :func:`unpack_bits`; return ``(bits, n)`` as ints."""
    bits = _check_bits(bits)
    n = check_int("n", n, low=0)
    xp = _compat.namespace(packed)
    if packed.dtype != xp.uint8:
        raise TypeError(f"packed must be uint8, received {packed.dtype}")
    if packed.ndim < 1 or int(packed.shape[-1]) != packed_nbytes(n, bits):
        raise ValueError(
            f"packed must have {packed_nbytes(n, bits)} bytes on its last axis for n={n}, bits={bits}, "
            f"received shape {tuple(packed.shape)}"
        )
    return bits, n


def unpack_bits(packed: Array, bits: int, n: int) -> Array:
    """Inverse of :func:`pack_bits`: ``unpack_bits(pack_bits(c, b), b, c.shape[-1]) == c``.

    Parameters
    ----------
    packed : array of uint8, shape (..., ceil(n * bits / 8))
    bits : int
        Bits per code, 1 to 8.
    n : int
        Codes per row.

    Returns
    -------
    array of uint8, shape (..., n)

    Notes
    -----
    Array-API code; ``arraykv.ops.unpack_bits`` is the same function with a kernel per namespace.
    """
    bits, n = check_unpack_args(packed, bits, n)
    return unpack_bits_reference(packed, bits, n)


def pack_bits_reference(codes: Array, bits: int) -> Array:
    """Array-API version of :func:`pack_bits` (no checks).

    Byte ``b`` of a group of eight codes gathers the codes whose stream bits overlap
    ``[8b, 8b + 8)``, each shifted into place, in int32: no 64-bit unsigned shifts, which not
    every namespace implements (PyTorch has no ``<<`` on uint64).
    """
    xp = _compat.namespace(codes)
    dev = _compat.device(codes)
    lead = tuple(int(s) for s in codes.shape[:-1])
    n = int(codes.shape[-1])
    groups = (n + 7) // 8
    if groups * 8 != n:
        pad = xp.zeros(lead + (groups * 8 - n,), dtype=xp.uint8, device=dev)
        codes = xp.concat([codes, pad], axis=-1)
    c = xp.astype(xp.reshape(codes, lead + (groups, 8)), xp.int32) & ((1 << bits) - 1)
    out = []
    for b in range(bits):
        byte = xp.zeros(lead + (groups,), dtype=xp.int32, device=dev)
        for i in range(8):
            shift = i * bits - 8 * b  # where code i's lowest bit lands in byte b
            if shift >= 8 or shift + bits <= 0:
                continue
            part = (c[..., i] << shift) & 255 if shift >= 0 else c[..., i] >> -shift
            byte = byte | part
        out.append(xp.astype(byte, xp.uint8))
    packed = xp.reshape(xp.stack(out, axis=-1), lead + (groups * bits,))
    return packed[..., : packed_nbytes(n, bits)]


def unpack_bits_reference(packed: Array, bits: int, n: int) -> Array:
    """Array-API version of :func:`unpack_bits` (no checks; int32 arithmetic, as :func:`pack_bits_reference`)."""
    xp = _compat.namespace(packed)
    dev = _compat.device(packed)
    lead = tuple(int(s) for s in packed.shape[:-1])
    groups = (n + 7) // 8
    have = int(packed.shape[-1])
    if groups * bits != have:
        pad = xp.zeros(lead + (groups * bits - have,), dtype=xp.uint8, device=dev)
        packed = xp.concat([packed, pad], axis=-1)
    p = xp.astype(xp.reshape(packed, lead + (groups, bits)), xp.int32)
    mask = (1 << bits) - 1
    codes = []
    for i in range(8):
        code = xp.zeros(lead + (groups,), dtype=xp.int32, device=dev)
        for b in range(bits):
            shift = 8 * b - i * bits  # where byte b's lowest bit lands in code i
            if shift >= bits or shift + 8 <= 0:
                continue
            code = code | (p[..., b] << shift if shift >= 0 else p[..., b] >> -shift)
        codes.append(xp.astype(code & mask, xp.uint8))
    out = xp.reshape(xp.stack(codes, axis=-1), lead + (groups * 8,))
    return out[..., :n]
