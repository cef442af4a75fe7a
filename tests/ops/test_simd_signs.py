"""Sign-sketch scores from packed bits (AVX-512 masks) against the one-sign-at-a-time loop."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from arraykv.ops.numba.cpu_features import HAVE_PERMPS
from arraykv.ops.numba.simd_signs import tile_sign_scores, tile_sign_scores_loop

pytestmark = pytest.mark.skipif(not HAVE_PERMPS, reason="AVX-512 path (the kernels use the loop without it)")


@nb.njit
def _vector(signs, t0, nt, sq, s):
    tile_sign_scores(signs, t0, nt, sq, s)


def _naive(signs, t0, nt, sq):
    """float64 scores from unpacked ±1 signs (bit i % 8 of byte i // 8)."""
    m = sq.shape[1]
    bits = np.unpackbits(signs[t0 : t0 + nt], axis=1, bitorder="little")[:, :m]
    return sq.astype(np.float64) @ (2.0 * bits - 1.0).T


@pytest.mark.parametrize("m", [16, 64, 96, 128])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("nt", [1, 3, 4, 9, 64])
def test_tile_sign_scores(m, g, nt, rng):
    t0 = 5
    full = rng.integers(0, 256, (t0 + 70, m // 8 + 3), dtype=np.uint8)
    signs = full[:, : m // 8 + 1]  # rows of contiguous bytes with a longer row stride
    sq = rng.standard_normal((g, m)).astype(np.float32)
    got = np.full((g, 64), 7.0, np.float32)
    loop = np.full((g, 64), 7.0, np.float32)
    _vector(signs, t0, nt, sq, got)
    tile_sign_scores_loop(signs, t0, nt, sq, loop)
    want = _naive(signs, t0, nt, sq)
    np.testing.assert_allclose(got[:, :nt], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(loop[:, :nt], want, rtol=1e-5, atol=1e-4)
    assert np.all(got[:, nt:] == 7.0)  # nothing written past the tile's rows
