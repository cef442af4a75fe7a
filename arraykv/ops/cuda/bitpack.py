"""GPU bit packing: launches ``kernels/bitpack.cu`` (layout of :mod:`arraykv.quant.bitpack`)."""

from __future__ import annotations

from typing import NamedTuple

from ..._types import Array, Namespace
from .loader import get_kernel, require_cupy

__all__ = [
    "pack_bits",
    "unpack_bits",
    "pack_bits_into",
    "unpack_bits_into",
    "plan_bitpack",
    "SOURCE",
    "name_expressions",
]

#: The file under ``kernels/`` these launchers run.
SOURCE = "bitpack.cu"
_FAMILY = [f"{kind}<{b}>" for kind in ("pack_bits", "unpack_bits") for b in range(1, 9)]


def name_expressions() -> list[str]:
    """Every kernel name expression these launchers ask the compiler for (all compiled together)."""
    return list(_FAMILY)


class BitpackLaunch(NamedTuple):
    """Geometry of one bitpack launch: one thread per group of eight codes."""

    rows: int
    n: int
    row_bytes: int
    grid: tuple[int]
    block: tuple[int]


def plan_bitpack(rows: int, n: int, bits: int, threads: int = 256) -> BitpackLaunch:
    """Launch geometry for ``rows`` rows of ``n`` codes of ``bits`` bits (checked, no GPU needed)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, received {bits}")
    if rows < 0 or n < 0:
        raise ValueError(f"rows and n must be >= 0, received {rows} and {n}")
    if n >= 2**31:
        raise ValueError(f"n must be < 2**31 codes per row, received {n}")
    groups = rows * ((n + 7) // 8)
    blocks = max(1, (groups + threads - 1) // threads)
    return BitpackLaunch(rows, n, (n * bits + 7) // 8, (blocks,), (threads,))


def _output(cp: Namespace, shape: tuple[int, ...], out: Array | None) -> Array:
    if out is None:
        return cp.empty(shape, dtype=cp.uint8)
    if tuple(out.shape) != tuple(shape) or out.dtype != cp.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, received {out.dtype} {out.shape}")
    return out


def pack_bits(codes: Array, bits: int) -> Array:
    """GPU :func:`arraykv.quant.bitpack.pack_bits_reference` (see :func:`pack_bits_into`)."""
    return pack_bits_into(codes, bits)


def unpack_bits(packed: Array, bits: int, n: int) -> Array:
    """GPU :func:`arraykv.quant.bitpack.unpack_bits_reference` (see :func:`unpack_bits_into`)."""
    return unpack_bits_into(packed, bits, n)


def pack_bits_into(codes: Array, bits: int, out: Array | None = None) -> Array:
    """Pack CuPy uint8 codes (..., n) into (..., ceil(n*bits/8)) bytes on the GPU (into ``out`` if given)."""
    cp = require_cupy()
    codes = cp.ascontiguousarray(codes)
    lead, n = codes.shape[:-1], int(codes.shape[-1])
    rows = 1
    for s in lead:
        rows *= int(s)
    plan = plan_bitpack(rows, n, int(bits))
    out = _output(cp, lead + (plan.row_bytes,), out)
    if rows and n:
        kern = get_kernel(SOURCE, f"pack_bits<{int(bits)}>", _FAMILY)
        kern(plan.grid, plan.block, (codes, out, cp.int64(rows), cp.int32(n), cp.int32(plan.row_bytes)))
    return out


def unpack_bits_into(packed: Array, bits: int, n: int, out: Array | None = None) -> Array:
    """Inverse of :func:`pack_bits_into`: CuPy uint8 (..., row_bytes) -> (..., n)."""
    cp = require_cupy()
    packed = cp.ascontiguousarray(packed)
    lead = packed.shape[:-1]
    rows = 1
    for s in lead:
        rows *= int(s)
    plan = plan_bitpack(rows, int(n), int(bits))
    out = _output(cp, lead + (int(n),), out)
    if rows and n:
        kern = get_kernel(SOURCE, f"unpack_bits<{int(bits)}>", _FAMILY)
        kern(plan.grid, plan.block, (packed, out, cp.int64(rows), cp.int32(int(n)), cp.int32(plan.row_bytes)))
    return out
