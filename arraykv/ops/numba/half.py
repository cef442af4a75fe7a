"""float16 values inside compiled code: one element from its ``uint16`` bit pattern (Numba).

Numba has no float16 arrays, so the kernels read float16 state through ``uint16`` views (no
copy). :func:`half_to_float` turns one bit pattern into its float32 value: with the F16C
instructions (:data:`HAVE_F16C`) it is the conversion instruction itself, which the compiler
vectorizes over a loop (sixteen values per instruction with AVX-512); elsewhere a few integer
operations and one multiply (see Notes of :func:`half_bits_to_float`). Both give the exact
float32 value of every bit pattern (subnormals, infinities, NaN) and read no table: a decode
step between a model's matrix products, which evict the caches, would otherwise miss on most
reads of a 256 KiB table (:data:`HALF_TO_FLOAT`, the ``half``
argument of the kernels' signatures; the token loops still read per-token lengths and
integer scales from it: there a strided F16C read is vectorized with gathers, which measured
slower than table loads whose few lines stay cached).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types as nbt
from numba.core.extending import intrinsic, overload

from .cpu_features import host_cpu_has

__all__ = [
    "HAVE_F16C",
    "HALF_TO_FLOAT",
    "half_to_float",
    "half_bits_to_float",
    "float_to_half",
    "float_to_half_bits",
    "half_is_finite",
]

#: float16 bit pattern -> float32 value. Numba has no float16 arrays, so float16 state is
#: read through ``uint16`` views (no copy) and this 256 KiB table.
HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

#: True when compiled code converts float16 with the F16C instructions (the host has them and
#: Numba compiles for the host). Without them the conversion would be a call into a runtime
#: library the JIT does not link, so the table is read instead.
HAVE_F16C = host_cpu_has("f16c")


@intrinsic
def _convert_half(typingctx, x):
    """float32 value of the float16 bit pattern ``x`` (uint16): an IEEE half-to-single extension."""
    if not isinstance(x, nbt.Integer) or x.bitwidth != 16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return nbt.float32(x), codegen


@intrinsic
def _bits_to_float(typingctx, x):
    """The float32 whose bit pattern is ``x`` (uint32)."""
    if not isinstance(x, nbt.Integer) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return nbt.float32(x), codegen


@intrinsic
def _round_to_half(typingctx, x):
    """float16 bit pattern (uint16) of the float32 ``x``: an IEEE single-to-half truncation
    (round to nearest even, overflow to infinity)."""
    if not isinstance(x, nbt.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return nbt.uint16(x), codegen


@intrinsic
def _float_bits(typingctx, x):
    """The bit pattern (uint32) of the float32 ``x``."""
    if not isinstance(x, nbt.Float) or x.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return nbt.uint32(x), codegen


#: 2**112: a float16's exponent bias (15) below a float32's (127).
_HALF_SCALE = 2.0**112


def half_bits_to_float(x):  # pragma: no cover - replaced in compiled code by the overload below
    """float32 value of the float16 bit pattern ``x`` (uint16) by integer operations (no F16C).

    Notes
    -----
    A float16 ``(sign, e, f)`` placed in a float32's bits as ``(sign, e, f << 13)`` is its value
    times ``2**-112`` for normal and subnormal numbers alike (the exponent biases differ by 112),
    so one multiply finishes it; ``e = 31`` (infinity, NaN) gets the float32 exponent 255.
    """
    raise NotImplementedError


@overload(half_bits_to_float, inline="always")
def _half_bits_to_float_impl(x):
    def impl(x):
        u = np.int64(x)
        em = u & 0x7FFF
        inf = ((em + 0x400) >> 15) * 0x7F800000  # exponent field 31 -> 255
        return _bits_to_float(np.uint32((em << 13) | ((u & 0x8000) << 16) | inf)) * np.float32(_HALF_SCALE)

    return impl


def half_to_float(x, table):  # pragma: no cover - replaced in compiled code by the overload below
    """float32 value of the float16 bit pattern ``x`` (uint16). ``table`` (:data:`HALF_TO_FLOAT`,
    which the kernels' signatures still carry) is not read."""
    return table[x]


@overload(half_to_float, inline="always")
def _half_to_float_impl(x, table):
    if HAVE_F16C:
        return lambda x, table: _convert_half(x)
    return lambda x, table: half_bits_to_float(x)


def float_to_half_bits(x):  # pragma: no cover - replaced in compiled code by the overload below
    """float16 bit pattern (uint16) of the float32 ``x`` by integer operations (no F16C): NumPy's
    ``astype(float16)`` bit for bit (round to nearest even; beyond 65504 rounds to infinity).

    Notes
    -----
    Normal results: the exponent is rebiased by subtracting ``112 << 23`` from the float32's
    bits, and the 13 dropped mantissa bits are rounded by adding ``0xFFF`` plus the lowest
    kept bit (ties go to the even neighbour; a carry runs into the exponent, as it should).
    Results below ``2**-14`` are subnormal: the 24-bit significand is shifted to units of
    ``2**-24`` and rounded the same way. NaN keeps its top payload bits (made nonzero).
    """
    raise NotImplementedError


@overload(float_to_half_bits, inline="always")
def _float_to_half_bits_impl(x):
    def impl(x):
        u = np.int64(_float_bits(np.float32(x)))
        sign = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        if a >= 0x7F800000:  # infinity, NaN
            if a == 0x7F800000:
                return np.uint16(sign | 0x7C00)
            payload = (a >> 13) & 0x3FF
            return np.uint16(sign | 0x7C00 | (payload if payload else 1))
        if a >= 0x477FF000:  # 65520 and up round to infinity
            return np.uint16(sign | 0x7C00)
        if a >= 0x38800000:  # a normal float16
            a -= 0x38000000
            return np.uint16(sign | ((a + 0xFFF + ((a >> 13) & 1)) >> 13))
        if a < 0x33000000:  # below 2**-25 (half the smallest subnormal, a tie to 0): zero
            return np.uint16(sign)
        shift = 126 - (a >> 23)  # 14 .. 24: the significand in units of 2**-24
        m = (a & 0x7FFFFF) | 0x800000
        r = m >> shift
        rem = m - (r << shift)
        half = np.int64(1) << (shift - 1)
        if rem > half or (rem == half and (r & 1)):
            r += 1
        return np.uint16(sign | r)

    return impl


def float_to_half(x):  # pragma: no cover - replaced in compiled code by the overload below
    """float16 bit pattern (uint16) of the float32 ``x``, rounded as NumPy's ``astype(float16)``:
    the F16C instruction where the host has it (:data:`HAVE_F16C`), else :func:`float_to_half_bits`."""
    raise NotImplementedError


@overload(float_to_half, inline="always")
def _float_to_half_impl(x):
    if HAVE_F16C:
        return lambda x: _round_to_half(np.float32(x))
    return lambda x: float_to_half_bits(x)


def half_is_finite(bits):  # pragma: no cover - replaced in compiled code by the overload below
    """Whether the float16 bit pattern ``bits`` (uint16) is finite (its exponent field is not all ones)."""
    raise NotImplementedError


@overload(half_is_finite, inline="always")
def _half_is_finite_impl(bits):
    return lambda bits: (np.int64(bits) & 0x7C00) != 0x7C00
