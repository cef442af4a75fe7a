"""float16 <-> float32 inside compiled code (:mod:`arraykv.ops.numba.half`), against NumPy's conversions."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from arraykv.ops.numba import half

_EVERY_HALF = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _same_half_bits(got, want):
    """Equal bit patterns, NaN for NaN (a NaN's payload may differ)."""
    nan = np.isnan(want.view(np.float16))
    assert np.array_equal(np.isnan(got.view(np.float16)), nan)
    assert np.array_equal(got[~nan], want[~nan])


def _hard_floats():
    """float32 patterns where rounding to float16 is decided: every float16 value, the midpoints
    between neighbours (ties), one float32 ulp either side of both, the overflow edge, the
    smallest subnormals and zero, infinities, NaN, and random bit patterns."""
    vals = _EVERY_HALF.view(np.float16).astype(np.float32)
    vals = vals[np.isfinite(vals)]
    vals = np.unique(vals)
    mids = (vals[:-1].astype(np.float64) + vals[1:]) / 2
    mids = mids.astype(np.float32)  # exact: float16 neighbours' midpoints fit in float32
    base = np.concatenate(
        [
            vals,
            mids,
            np.float32(
                [
                    65504,
                    65519.996,
                    65520,
                    65536,
                    1e6,
                    2.0**-24,
                    2.0**-25,
                    2.0**-26,
                    3 * 2.0**-26,
                    2.0**-14,
                    0.0,
                    np.inf,
                    -np.inf,
                ]
            ),
        ]
    )
    base = np.concatenate([base, -base])
    near = np.concatenate([np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    rnd = np.random.default_rng(0).integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([base, near, rnd, np.float32([np.nan, -np.nan])]).astype(np.float32)


def _each(convert):
    """``out[i] = convert(x[i])`` for a scalar conversion of compiled code, compiled."""

    @nb.njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = convert(x[i])

    return run


@pytest.mark.parametrize("convert", ["host", "integer"])
def test_float_to_half_rounds_like_numpy(convert):
    """The F16C form (where the host has it) and the integer form give NumPy's ``astype(float16)``."""
    x = _hard_floats()
    got = np.empty(x.shape, np.uint16)
    _each(half.float_to_half if convert == "host" else half.float_to_half_bits)(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    _same_half_bits(got, want)


def test_half_is_finite_on_every_bit_pattern():
    got = np.empty(65536, np.bool_)
    _each(half.half_is_finite)(_EVERY_HALF, got)
    assert np.array_equal(got, np.isfinite(_EVERY_HALF.view(np.float16)))


@pytest.mark.parametrize("convert", ["host", "integer"])
def test_half_to_float_is_exact_for_every_bit_pattern(convert):
    """The F16C form (where the host has it) and the integer form the kernels use without it (or
    when Numba compiles for a named CPU) give NumPy's value of every float16 bit pattern."""
    table = half.HALF_TO_FLOAT

    @nb.njit
    def host(bits):
        return half.half_to_float(bits, table)

    got = np.empty(65536, np.float32)
    _each(host if convert == "host" else half.half_bits_to_float)(_EVERY_HALF, got)
    want = _EVERY_HALF.view(np.float16).astype(np.float32)
    finite = ~np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])  # signed zeros, subnormals, inf
    assert np.array_equal(np.isnan(got), np.isnan(want))
