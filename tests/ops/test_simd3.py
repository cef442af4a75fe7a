"""3-bit code tiles through ``vpermps`` against the plain loops and a NumPy unpacking."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from arraykv.ops.numba.cpu_features import HAVE_PERMPS
from arraykv.ops.numba.planar import table16
from arraykv.ops.numba.simd3 import (
    tile_scores_codes_3,
    tile_scores_codes_3_loop,
    tile_values_codes_3,
    tile_values_codes_3_loop,
)
from arraykv.quant.bitpack import pack_bits_reference

pytestmark = pytest.mark.skipif(not HAVE_PERMPS, reason="AVX-512 path (the kernels use the byte tables without it)")


@nb.njit
def _scores(codes, t0, nt, tab, qr, s):
    tile_scores_codes_3(codes, t0, nt, tab, qr, s)


@nb.njit
def _values(codes, t0, nt, tab, w, acc):
    tile_values_codes_3(codes, t0, nt, tab, w, acc)


def _case(rng, d, rows):
    idx = rng.integers(0, 8, (rows, d), dtype=np.uint8)
    packed = pack_bits_reference(idx, 3)
    wide = np.zeros((rows, packed.shape[1] + 5), np.uint8)  # a longer row stride
    wide[:, : packed.shape[1]] = packed
    tab = table16(rng.standard_normal(8))  # entries 8..15 repeat 0..7: the kernels read four index bits
    return idx, wide[:, : packed.shape[1]], tab


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("nt", [1, 5, 8, 64])
def test_tile_scores_codes_3(d, g, nt, rng):
    t0 = 3
    idx, codes, tab = _case(rng, d, t0 + 64)
    qr = rng.standard_normal((g, d)).astype(np.float32)
    want = qr.astype(np.float64) @ tab[idx[t0 : t0 + nt]].astype(np.float64).T
    for fn in (_scores, tile_scores_codes_3_loop):
        s = np.full((g, 64), 9.0, np.float32)
        fn(codes, t0, nt, tab, qr, s)
        np.testing.assert_allclose(s[:, :nt], want, rtol=1e-5, atol=1e-4)
        assert np.all(s[:, nt:] == 9.0)


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("nt", [1, 5, 64])
def test_tile_values_codes_3(d, g, nt, rng):
    t0 = 2
    idx, codes, tab = _case(rng, d, t0 + 64)
    w = rng.random((g, 64)).astype(np.float32)
    start = rng.standard_normal((g, d)).astype(np.float32)
    want = start + w[:, :nt].astype(np.float64) @ tab[idx[t0 : t0 + nt]].astype(np.float64)
    for fn in (_values, tile_values_codes_3_loop):
        acc = start.copy()
        fn(codes, t0, nt, tab, w, acc)
        np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-4)
