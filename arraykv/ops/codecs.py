"""Accelerated quantizer ops: each takes exactly the arguments of its array-API reference.

Every function here runs the kernel registered for the namespace of its array arguments
(:mod:`arraykv.ops.registry`: Numba on NumPy, CUDA on CuPy) or, where there is none, the
reference named in its docstring, and returns what the reference returns. The quantizers of
:mod:`arraykv.quant` take these as their step functions, for example
``polar_encode(x, codebook, rotation, encode=ops.polar_encode)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _compat
from .._types import Array
from ..quant.bitpack import check_pack_args, check_unpack_args
from ..quant.codebooks import Codebook
from ..quant.outliers import SparseOutliers
from ..quant.polar_encoder import PolarEncoder
from ..quant.rotation import Rotation
from .registry import implementation, reference

__all__ = [
    "pack_bits",
    "unpack_bits",
    "polar_encode",
    "polar_encode_tokens",
    "polar_store_token",
    "polar_decode",
    "intq_group_minmax",
    "intq_quantize_pack",
    "intq_dequantize",
    "split_outliers",
    "vq_assign",
    "vq_update",
    "vq_encode",
    "vq_decode",
]

#: Code widths of the integer quantize/dequantize kernels (others run the reference).
INTQ_KERNEL_BITS = (2, 4, 8)


def _impl(name: str, x: Array) -> Callable[..., Any]:
    xp = _compat.namespace(x)
    return implementation(name, xp, _compat.device(x) if _compat.is_torch(xp) else None)


def pack_bits(codes: Array, bits: int) -> Array:
    """:func:`arraykv.quant.bitpack.pack_bits` with a kernel: uint8 (..., n) -> uint8 (..., ceil(n·bits/8))."""
    bits = check_pack_args(codes, bits)
    return _impl("pack_bits", codes)(codes, bits)


def unpack_bits(packed: Array, bits: int, n: int) -> Array:
    """:func:`arraykv.quant.bitpack.unpack_bits` with a kernel: uint8 (..., ceil(n·bits/8)) -> uint8 (..., n)."""
    bits, n = check_unpack_args(packed, bits, n)
    return _impl("unpack_bits", packed)(packed, bits, n)


def polar_encode(x: Array, codebook: Codebook, rotation: Rotation, *, unbiased: bool = False) -> tuple[Array, Array]:
    """:func:`arraykv.quant.polar.polar_encode_reference`: float (..., dim) -> (uint8 codes, float16 norms (...)).

    The kernels agree with the reference except where float rounding puts a rotated coordinate
    on the other side of a threshold.
    """
    out: tuple[Array, Array] = _impl("polar_encode", x)(x, codebook, rotation, unbiased=unbiased)
    return out


def polar_encode_tokens(k: Array, v: Array, enc: PolarEncoder, start: int) -> dict[str, Array]:
    """:func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference`: a polar cache's spilled tokens
    at positions ``start ..``, encoded with ``enc`` (a :class:`arraykv.quant.polar_encoder.PolarEncoder`;
    with their keys' QJL residual sketch when it holds one)."""
    out: dict[str, Array] = _impl("polar_encode_tokens", k)(k, v, enc, start)
    return out


def polar_store_token(
    k: Array,
    v: Array,
    window_k: Array,
    window_v: Array,
    leaving: int,
    arriving: int,
    enc: PolarEncoder,
    start: int,
    rows: dict[str, Array],
    at: int,
) -> bool:
    """:func:`arraykv.quant.polar_store.polar_store_token_reference`: one decode step of a full polar
    window, written into preallocated rows; False (nothing to commit) when a float16 result overflows."""
    stored: bool = _impl("polar_store_token", k)(k, v, window_k, window_v, leaving, arriving, enc, start, rows, at)
    return stored


def polar_decode(codes: Array, norms: Array, codebook: Codebook, rotation: Rotation) -> Array:
    """:func:`arraykv.quant.polar.polar_decode_reference`: packed codes + norms (...) -> float32 (..., dim)."""
    return _impl("polar_decode", codes)(codes, norms, codebook, rotation)


def intq_group_minmax(x32: Array, group_size: int) -> tuple[Array, Array]:
    """:func:`arraykv.quant.intq.group_minmax_reference`: float32 (..., n) -> (min, max), float32 (..., groups)."""
    out: tuple[Array, Array] = _impl("intq_group_minmax", x32)(x32, group_size)
    return out


def intq_quantize_pack(x32: Array, group_size: int, bits: int, off32: Array, inv: Array) -> Array:
    """:func:`arraykv.quant.intq.quantize_pack_reference`: float32 (..., n) -> packed uint8 codes.

    Kernels serve 2-, 4- and 8-bit codes (:data:`INTQ_KERNEL_BITS`); other widths run the reference.
    """
    fn = _impl("intq_quantize_pack", x32) if bits in INTQ_KERNEL_BITS else reference("intq_quantize_pack")
    return fn(x32, group_size, bits, off32, inv)


def intq_dequantize(codes: Array, bits: int, group_size: int, n: int, s32: Array, o32: Array) -> Array:
    """:func:`arraykv.quant.intq.dequantize_reference`: packed codes -> float32 (..., n) (kernels: 2, 4, 8 bits)."""
    fn = _impl("intq_dequantize", codes) if bits in INTQ_KERNEL_BITS else reference("intq_dequantize")
    return fn(codes, bits, group_size, n, s32, o32)


def split_outliers(x: Array, threshold: float) -> tuple[Array, SparseOutliers]:
    """:func:`arraykv.quant.outliers.split_outliers_reference`: (dense float32, SparseOutliers).

    The kernel accumulates the statistics in float64, so a value within one float32 ulp of the
    boundary may fall on the other side than in the reference; both splits are exact.
    """
    out: tuple[Array, SparseOutliers] = _impl("split_outliers", x)(x, threshold)
    return out


def vq_assign(xg: Array, c: Array) -> tuple[Array, Array]:
    """:func:`arraykv.quant.vq.assign_reference`: nearest centroid (groups, n) int64 and the summed error."""
    out: tuple[Array, Array] = _impl("vq_assign", xg)(xg, c)
    return out


def vq_update(xg: Array, c: Array, idx: Array) -> Array:
    """:func:`arraykv.quant.vq.update_reference`: cluster means, float32 (groups, K, sub_dim)."""
    return _impl("vq_update", xg)(xg, c, idx)


def vq_encode(x: Array, centroids: Array, bits: int) -> Array:
    """:func:`arraykv.quant.vq.vq_encode_reference`: codes of ``x`` (rows, h, t, d), packed below 9 bits."""
    return _impl("vq_encode", x)(x, centroids, bits)


def vq_decode(codes: Array, centroids: Array, bits: int) -> Array:
    """:func:`arraykv.quant.vq.vq_decode_reference`: the vectors codes (rows, h, t, ·) name, float32 (rows, h, t, d)."""
    return _impl("vq_decode", codes)(codes, centroids, bits)
