"""float16 values inside compiled code: one element from its ``uint16`` bit pattern (Numba).

Numba has no float16 arrays, so the kernels read float16 state through ``uint16`` views (no
copy). :func:`half_to_float` turns one bit pattern into its float32 value: with the F16C
instructions (:data:`HAVE_F16C`) it is the conversion instruction itself, which the compiler
vectorizes over a loop (sixteen values per instruction with AVX-512); elsewhere it is a load
from :data:`arraykv.ops.numba.polar_rows.HALF_TO_FLOAT` (a 256 KiB table), one scalar load per
value. Both give the exact float32 value of every bit pattern (subnormals, infinities, NaN).
"""

from __future__ import annotations

try:
    from llvmlite import ir
    from numba import types as nbt
    from numba.core.extending import intrinsic, overload
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from .polar_rows import HALF_TO_FLOAT
from .simd import host_cpu_has

__all__ = ["HAVE_F16C", "HALF_TO_FLOAT", "half_to_float"]


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


def half_to_float(x, table):  # pragma: no cover - replaced in compiled code by the overload below
    """float32 value of the float16 bit pattern ``x`` (uint16); ``table`` is :data:`HALF_TO_FLOAT`."""
    return table[x]


@overload(half_to_float, inline="always")
def _half_to_float_impl(x, table):
    if HAVE_F16C:
        return lambda x, table: _convert_half(x)
    return lambda x, table: table[x]
