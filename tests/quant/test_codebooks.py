import numpy as np
import pytest

from arraykv.quant.codebooks import lloyd_max, make_codebook

from conftest import to_np

# REFERENCE.md section 1 (independently recomputed values).
GAUSS = {
    1: ([0.797885], 0.363380),
    2: ([0.452780, 1.510418], 0.117482),
    3: ([0.245094, 0.756005, 1.343909, 2.151946], 0.034548),
    4: ([0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590], 0.009501),
}
SPHERE = {
    64: [0.358387, 0.114526, 0.033391, 0.009132],
    128: [0.360889, 0.116000, 0.033966, 0.009315],
    256: [0.362136, 0.116740, 0.034256, 0.009408],
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_matches_reference(bits):
    cents, mse = lloyd_max(bits)
    half = cents[len(cents) // 2 :]
    np.testing.assert_allclose(half, GAUSS[bits][0], atol=1e-5)
    np.testing.assert_allclose(cents[: len(cents) // 2], [-c for c in reversed(half)], atol=1e-12)
    assert abs(mse - GAUSS[bits][1]) < 1e-5


@pytest.mark.parametrize("d", [64, 128, 256])
def test_sphere_distortion_matches_reference(d):
    for bits in (1, 2, 3, 4):
        assert abs(lloyd_max(bits, d)[1] - SPHERE[d][bits - 1]) < 1e-5


def test_sphere_tends_to_scaled_gaussian():
    cg, mg = lloyd_max(3)
    cs, ms = lloyd_max(3, 4096)
    np.testing.assert_allclose(np.array(cs) * np.sqrt(4096), cg, rtol=2e-3)
    assert abs(ms - mg) < 1e-4


def test_lloyd_conditions_hold_by_monte_carlo(rng):
    # Centroids are conditional means of their cells, checked on samples of the density.
    d = 32
    x = rng.standard_normal((200000, d))
    u = (x / np.linalg.norm(x, axis=1, keepdims=True))[:, 0]
    cents, mse = lloyd_max(2, d)
    c = np.array(cents)
    t = (c[1:] + c[:-1]) / 2
    idx = np.searchsorted(t, u)
    for i in range(4):
        assert abs(u[idx == i].mean() - c[i]) < 3e-3
    assert abs(d * np.mean((u - c[idx]) ** 2) - mse) < 0.01 * mse


def test_make_codebook_arrays(xp):
    cb = make_codebook(3, 128, xp=xp)
    c, t = to_np(cb.centroids), to_np(cb.thresholds)
    assert c.dtype == np.float32 and c.shape == (8,) and t.shape == (7,)
    assert np.all(np.diff(c) > 0) and np.all((t > c[:-1]) & (t < c[1:]))
    assert cb.nbytes == 15 * 4 and cb.bits_per_value == 3.0
    assert lloyd_max(3, 128) is lloyd_max(3, 128)  # cached


@pytest.mark.parametrize(
    "bits,dim,exc", [(0, None, ValueError), (9, None, ValueError), (2, 2, ValueError), (2.0, None, TypeError)]
)
def test_bad_arguments(bits, dim, exc):
    with pytest.raises(exc):
        lloyd_max(bits, dim)
