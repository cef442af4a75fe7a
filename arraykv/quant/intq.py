"""Group-wise asymmetric integer quantization along the last axis.

Layout
------
An array of shape ``(..., n)`` is cut along its last axis into ``ceil(n / group_size)``
groups of ``group_size`` consecutive values (the last group may be shorter). Each group gets a
float ``scale`` and ``offset`` (its minimum); every value becomes a ``bits``-bit code

``code = clip(floor((x - offset) / scale + 1/2), 0, 2**bits - 1)``,  ``x̂ = scale * code + offset``

and the codes of a row are packed with :func:`arraykv.quant.bitpack.pack_bits` (INT2: four
codes per byte, the first in the lowest two bits; INT4: two per byte, low nibble first; INT8:
one per byte). ``offset`` is the zero point expressed in value units (``zero_point = -offset /
scale`` in the integer convention); storing it as a float keeps an exact zero-range group (all
values equal) exact.

Quantizing a different axis (per-channel over tokens, as KIVI does for keys) is done by moving
that axis last before calling :func:`quantize_groups`.

Magnitude
---------
float16 parameters hold normal numbers between ``2**-14`` and 65504 only: data of magnitude
1e-6 would get scales that underflow (int8 returned worse than zeros) and data near 65504
offsets that overflow. The parameters are therefore kept for data divided by ``2**exponent``,
one power of two per quantized array (:func:`half_exponent`): ``x̂ = 2**exponent · (scale ·
code + offset)``. The division is exact, typical data (largest magnitude between ``2**-6`` and
``2**12``) keeps ``exponent = 0`` and exactly the parameters it always had, and nothing is
stored for it per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _compat
from .._types import Array, DType, Namespace
from .._validation import check_int, dtype_name, is_floating
from .bitpack import pack_bits_reference, packed_nbytes, unpack_bits_reference

__all__ = [
    "IntQuantized",
    "quantize_groups",
    "dequantize_groups",
    "half_exponent",
    "group_minmax_reference",
    "quantize_pack_reference",
    "dequantize_reference",
]

_PARAM_DTYPES = ("float16", "float32")
#: Data whose largest magnitude lies in this range keeps ``exponent = 0`` (see :func:`half_exponent`).
HALF_SAFE_RANGE = (2.0**-6, 2.0**12)
#: The largest finite float16.
HALF_MAX = 65504.0
#: The smallest exponent :func:`half_exponent` returns (``2**-120`` is a normal float32 and its
#: inverse finite); data smaller than that keeps its relative precision no more, but stays finite.
MIN_EXPONENT = -120


def half_exponent(max_abs: float) -> int:
    """The power of two that brings data of largest magnitude ``max_abs`` into float16's comfortable range.

    Parameters
    ----------
    max_abs : float
        Largest ``|x|`` of the data (finite, >= 0).

    Returns
    -------
    int
        0 when ``max_abs`` is 0 or within :data:`HALF_SAFE_RANGE` (the parameters are stored as
        they always were), else ``floor(log2(max_abs))``, so that ``x / 2**exponent`` has its
        largest magnitude in ``[1, 2)``, but never below :data:`MIN_EXPONENT`.

    Notes
    -----
    For ``b``-bit codes a group whose values span ``[m, M]`` gets ``scale = (M - m) / (2**b -
    1)``. With the data's largest magnitude ``A >= 2**-6``, the scale of the groups that hold
    it is at least ``A / 2**b >= 2**-14`` for ``b <= 8``, a normal float16 (relative rounding
    ``2**-11``); with ``A <= 2**12`` later data up to about 16 times larger (65504) still fits.
    """
    a = float(max_abs)
    if not (a > 0.0) or not math.isfinite(a) or HALF_SAFE_RANGE[0] <= a <= HALF_SAFE_RANGE[1]:
        return 0
    # at least MIN_EXPONENT: 2**-exponent must stay finite and 2**exponent normal in float32
    # (data of subnormal magnitude, ~1e-41, would otherwise be scaled by 2**137 = inf)
    return max(int(math.floor(math.log2(a))), MIN_EXPONENT)


@dataclass(frozen=True)
class IntQuantized:
    """Packed group-wise integer codes and their per-group parameters.

    Attributes
    ----------
    codes : array of uint8, shape (..., ceil(n * bits / 8))
        Codes packed along the last axis (layout of :mod:`arraykv.quant.bitpack`).
    scale, offset : array of float16 or float32, shape (..., ceil(n / group_size))
        ``x̂ = scale * code + offset`` within each group.
    bits : int
        Bits per code (1 to 8).
    group_size : int
        Values per group along the last axis.
    n : int
        Length of the quantized last axis.
    exponent : int, default 0
        ``x̂ = 2**exponent · (scale · code + offset)``: the parameters describe the data divided
        by ``2**exponent`` (see the module notes; 0 for typical magnitudes and float32 parameters).
    """

    codes: Array
    scale: Array
    offset: Array
    bits: int
    group_size: int
    n: int
    exponent: int = 0

    @property
    def shape(self) -> tuple:
        """Shape of the quantized array, ``(..., n)``."""
        return tuple(int(s) for s in self.codes.shape[:-1]) + (self.n,)

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and offsets."""
        return sum(_compat.array_nbytes(a) for a in (self.codes, self.scale, self.offset))

    @property
    def bits_per_value(self) -> float:
        """Stored bits per quantized value, parameters included."""
        count = 1
        for s in self.shape:
            count *= s
        return 8.0 * self.nbytes / max(count, 1)


def _check_bits_group(bits: Any, group_size: Any) -> tuple:
    bits = check_int("bits", bits, low=1, high=8)
    group_size = check_int("group_size", group_size, low=1)
    return bits, group_size


def _param_dtype(xp: Namespace, name: Any) -> DType:
    if name not in _PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {_PARAM_DTYPES}, received {name!r}")
    dt = getattr(xp, name, None) if name == "float16" and not hasattr(xp, "float16") else getattr(xp, name)
    if dt is None:
        raise ValueError(f"param_dtype={name!r} is not offered by this array library; use 'float32'")
    return dt


def quantize_groups(
    x: Array,
    bits: int,
    group_size: int,
    *,
    param_dtype: str = "float32",
    exponent: int | None = None,
    group_minmax: Callable | None = None,
    quantize_pack: Callable | None = None,
) -> IntQuantized:
    """Quantize ``x`` group-wise along its last axis.

    Parameters
    ----------
    x : array of float16/float32/float64, shape (..., n)
        Finite values (not checked here; callers validate at their entry points).
    bits : int
        Bits per code, 1 to 8 (the caches use 2, 4 and 8; those widths have Numba kernels).
    group_size : int
        Values per group; the last group of a row is shorter when it does not divide ``n``.
    param_dtype : {"float32", "float16"}
        Dtype of the stored scales and offsets. Codes are computed from the rounded
        parameters, so dequantization uses exactly what was stored.
    exponent : int, optional
        Quantize ``x / 2**exponent`` (exact) and record ``exponent`` in the result. None: 0 for
        float32 parameters, :func:`half_exponent` of ``max |x|`` for float16 ones (one more
        pass over ``x``), so that float16 scales neither underflow nor overflow.
    group_minmax, quantize_pack : callable, optional
        The two passes, with the signatures of :func:`group_minmax_reference` and
        :func:`quantize_pack_reference` (the defaults); ``arraykv.ops.intq_group_minmax`` and
        ``arraykv.ops.intq_quantize_pack`` pick a kernel for the namespace.

    Returns
    -------
    IntQuantized

    Notes
    -----
    Asymmetric (min–max) uniform quantization: a group with range ``[m, M]`` uses step
    ``Δ = (M - m) / (2**bits - 1)``; the rounding error of each value is at most ``Δ / 2`` and
    ``Δ² / 12`` on average for values spread over the range. Small groups track local
    magnitude (the group-wise scheme of KIVI, Liu et al. 2024); the parameters cost
    ``2 * 16 / group_size`` (float16) or ``2 * 32 / group_size`` (float32) extra bits per value.
    Computation is in float32.
    """
    bits, group_size = _check_bits_group(bits, group_size)
    xp = _compat.namespace(x)
    if not is_floating(xp, x.dtype):
        raise TypeError(f"x must have a floating dtype, received {dtype_name(x.dtype)}")
    if x.ndim < 1 or int(x.shape[-1]) < 1:
        raise ValueError(f"x must have a non-empty last axis, received shape {tuple(x.shape)}")
    pdt = _param_dtype(xp, param_dtype)
    x32 = xp.astype(x, xp.float32) if x.dtype != xp.float32 else x
    if exponent is None:
        exponent = half_exponent(float(xp.max(xp.abs(x32)))) if pdt != xp.float32 else 0
    exponent = check_int("exponent", exponent, low=-140, high=140)
    if exponent:
        x32 = x32 * 2.0**-exponent
    levels = (1 << bits) - 1
    mn, mx = (group_minmax or group_minmax_reference)(x32, group_size)
    scale = xp.astype((mx - mn) / float(levels), pdt)
    offset = xp.astype(mn, pdt)
    scale32 = xp.astype(scale, xp.float32)
    off32 = xp.astype(offset, xp.float32)
    inv = xp.where(scale32 > 0.0, 1.0 / xp.where(scale32 > 0.0, scale32, 1.0), 0.0)
    codes = (quantize_pack or quantize_pack_reference)(x32, group_size, bits, off32, inv)
    return IntQuantized(
        codes=codes, scale=scale, offset=offset, bits=bits, group_size=group_size, n=int(x.shape[-1]), exponent=exponent
    )


def dequantize_groups(q: IntQuantized, dtype: DType | None = None, *, dequantize: Callable | None = None) -> Array:
    """Reconstruct ``x̂`` of shape ``(..., n)`` from :func:`quantize_groups` output.

    Parameters
    ----------
    q : IntQuantized
    dtype : dtype, optional
        Output dtype (default float32).
    dequantize : callable, optional
        With the signature of :func:`dequantize_reference` (the default);
        ``arraykv.ops.intq_dequantize`` picks a kernel for the namespace.

    Returns
    -------
    array, shape (..., n)
        ``2**q.exponent · (scale · code + offset)``, computed in float32.
    """
    if not isinstance(q, IntQuantized):
        raise TypeError(f"q must be an IntQuantized, received {type(q).__name__}")
    xp = _compat.namespace(q.codes)
    s32 = xp.astype(q.scale, xp.float32)
    o32 = xp.astype(q.offset, xp.float32)
    out = (dequantize or dequantize_reference)(q.codes, q.bits, q.group_size, q.n, s32, o32)
    if q.exponent:
        out = out * 2.0**q.exponent
    if dtype is not None and out.dtype != dtype:
        out = xp.astype(out, dtype)
    return out


# -- array-API references (what the Numba kernels are tested against) -----------------


def _padded_groups(x: Array, group_size: int) -> Array:
    """``x`` (..., n) as (..., groups, group_size), the last group padded with its last value."""
    xp = _compat.namespace(x)
    lead = tuple(int(s) for s in x.shape[:-1])
    n = int(x.shape[-1])
    groups = -(-n // group_size)
    pad = groups * group_size - n
    if pad:
        edge = xp.broadcast_to(x[..., n - 1 : n], lead + (pad,))
        x = xp.concat([x, edge], axis=-1)
    return xp.reshape(x, lead + (groups, group_size))


def group_minmax_reference(x32: Array, group_size: int) -> tuple[Array, Array]:
    """Per-group minimum and maximum of ``x32`` (..., n): two arrays (..., groups), float32."""
    xp = _compat.namespace(x32)
    g = _padded_groups(x32, group_size)
    return xp.min(g, axis=-1), xp.max(g, axis=-1)


def quantize_pack_reference(x32: Array, group_size: int, bits: int, off32: Array, inv: Array) -> Array:
    """Codes of ``x32`` (..., n) given float32 offsets and inverse scales (..., groups), packed."""
    xp = _compat.namespace(x32)
    n = int(x32.shape[-1])
    g = _padded_groups(x32, group_size)
    t = (g - off32[..., None]) * inv[..., None]
    levels = float((1 << bits) - 1)
    c = xp.clip(xp.floor(t + 0.5), 0.0, levels)
    lead = tuple(int(s) for s in x32.shape[:-1])
    codes = xp.reshape(xp.astype(c, xp.uint8), lead + (-1,))[..., :n]
    return pack_bits_reference(codes, bits)


def dequantize_reference(codes: Array, bits: int, group_size: int, n: int, s32: Array, o32: Array) -> Array:
    """``scale * code + offset`` for packed ``codes`` (..., bytes): float32 (..., n)."""
    xp = _compat.namespace(codes)
    c = unpack_bits_reference(codes, bits, n)
    lead = tuple(int(s) for s in c.shape[:-1])
    groups = int(s32.shape[-1])
    pad = groups * group_size - n
    if pad:
        c = xp.concat([c, xp.zeros(lead + (pad,), dtype=xp.uint8, device=_compat.device(c))], axis=-1)
    cg = xp.astype(xp.reshape(c, lead + (groups, group_size)), xp.float32)
    out = cg * s32[..., None] + o32[..., None]
    return xp.reshape(out, lead + (groups * group_size,))[..., :n]


def codes_nbytes(n: int, bits: int) -> int:
    """Bytes of one packed row of ``n`` codes."""
    return packed_nbytes(n, bits)
