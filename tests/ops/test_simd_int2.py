"""2-bit integer code tiles (AVX-512 lanes in channel / token order) against the plain loops and NumPy."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from arraykv.ops.numba.cpu_features import HAVE_PERMPS
from arraykv.ops.numba.simd_int2 import (
    int2_group_scores,
    int2_group_scores_loop,
    tile_values_codes_2_scaled,
    tile_values_codes_2_scaled_loop,
)
from arraykv.quant.bitpack import pack_bits_reference

pytestmark = pytest.mark.skipif(not HAVE_PERMPS, reason="AVX-512 path (the kernel keeps its byte tables without it)")


@nb.njit
def _group(codes, qf, s, off):
    int2_group_scores(codes, qf, s, off)


@nb.njit
def _values(codes, t0, nt, w, cscale, acc):
    tile_values_codes_2_scaled(codes, t0, nt, w, cscale, acc)


def _strided(packed, extra=3):
    wide = np.zeros((packed.shape[0], packed.shape[1] + extra), np.uint8)
    wide[:, : packed.shape[1]] = packed
    return wide[:, : packed.shape[1]]  # rows of contiguous bytes, a longer row stride


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7])
def test_int2_group_scores(d, group, g, rng):
    codes = rng.integers(0, 4, (d, group), dtype=np.uint8)  # channel rows of token codes
    packed = _strided(pack_bits_reference(codes, 2))
    qf = rng.standard_normal((g, d)).astype(np.float32)
    off = 5
    want = qf.astype(np.float64) @ codes.astype(np.float64)
    for fn in (_group, int2_group_scores_loop):
        s = np.full((g, off + group + 4), 9.0, np.float32)
        fn(packed, qf, s, off)
        np.testing.assert_allclose(s[:, off : off + group], want, rtol=1e-5, atol=1e-4)
        assert np.all(s[:, :off] == 9.0) and np.all(s[:, off + group :] == 9.0)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("nt", [1, 5, 64])
def test_tile_values_codes_2_scaled(d, g, nt, rng):
    t0 = 3
    codes = rng.integers(0, 4, (t0 + 64, d), dtype=np.uint8)
    packed = _strided(pack_bits_reference(codes, 2))
    w = rng.random((g, 64)).astype(np.float32)
    cscale = rng.random((64, d // 16)).astype(np.float32)
    start = rng.standard_normal((g, d)).astype(np.float32)
    vals = codes[t0 : t0 + nt].astype(np.float64) * np.repeat(cscale[:nt], 16, axis=1)
    want = start + w[:, :nt].astype(np.float64) @ vals
    for fn in (_values, tile_values_codes_2_scaled_loop):
        acc = start.copy()
        fn(packed, t0, nt, w, cscale, acc)
        np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-4)
