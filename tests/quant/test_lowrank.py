import numpy as np
import pytest

from arraykv.quant.lowrank import choose_rank, eckart_young_error, fit_basis, project, reconstruct

from conftest import asarray, to_np


def key_like(rng, h=2, n=600, d=64, kind="gaussian"):
    if kind == "gaussian":
        return rng.standard_normal((h, n, d)).astype(np.float32)
    if kind == "lowrank_noise":
        u = rng.standard_normal((h, n, 8))
        w = rng.standard_normal((h, 8, d)) * 3
        return (u @ w + 0.3 * rng.standard_normal((h, n, d)) + rng.standard_normal((h, 1, d))).astype(np.float32)
    x = rng.standard_normal((h, n, d))
    x[:, :, [3, 17, 40]] *= 15  # outlier channels
    x[:, :, [3, 17, 40]] += 5
    return x.astype(np.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.sum((a - b) ** 2) / np.sum(b**2)))


@pytest.mark.parametrize("kind", ["gaussian", "lowrank_noise", "outlier_channels"])
@pytest.mark.parametrize("rank", [4, 16])
def test_within_one_percent_of_eckart_young(xp, rng, kind, rank):
    x = key_like(rng, kind=kind)
    xa = asarray(xp, x)
    b = fit_basis(xa, rank=rank)
    got = rel_err(to_np(reconstruct(project(xa, b), b)), x)
    ey = eckart_young_error(xa, rank)
    # An SVD computed independently by NumPy in float64.
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    assert ey == pytest.approx(np.sqrt((s[:, rank:] ** 2).sum() / (s**2).sum()), rel=1e-6)
    assert got <= ey * 1.01
    # Centred PCA is the optimal rank-r affine approximation: match its SVD optimum to 1%.
    xc = x - x.mean(axis=1, keepdims=True)
    sc = np.linalg.svd(xc.astype(np.float64), compute_uv=False)
    opt = np.sqrt((sc[:, rank:] ** 2).sum() / (x.astype(np.float64) ** 2).sum())
    assert got == pytest.approx(opt, rel=0.01)


def test_uncentred_matches_truncated_svd(rng):
    x = key_like(rng, kind="lowrank_noise")
    b = fit_basis(x, rank=8, center=False)
    assert b.mean is None
    got = rel_err(reconstruct(project(x, b), b), x)
    assert got == pytest.approx(eckart_young_error(x, 8), rel=0.01)


def test_basis_orthonormal_and_full_rank_exact(xp, rng):
    x = key_like(rng, d=16, n=100)
    b = fit_basis(asarray(xp, x), rank=16)
    u = to_np(b.basis).astype(np.float64)
    np.testing.assert_allclose(np.swapaxes(u, 1, 2) @ u, np.broadcast_to(np.eye(16), (2, 16, 16)), atol=1e-5)
    back = to_np(reconstruct(project(asarray(xp, x), b), b))
    np.testing.assert_allclose(back, x, atol=1e-4)


def test_energy_picks_fewest_directions(xp, rng):
    x = key_like(rng, kind="lowrank_noise")
    b = fit_basis(asarray(xp, x), energy=0.9)
    kept = to_np(b.energy_kept())
    assert np.all(kept >= 0.9 - 1e-6)
    var = to_np(b.variance).astype(np.float64)
    frac = np.cumsum(var, axis=1) / var.sum(axis=1, keepdims=True)
    assert np.any(frac[:, b.rank - 2] < 0.9)  # one direction fewer misses the target in some head
    assert choose_rank(asarray(xp, var.astype(np.float32)), 1.0) <= 64


def test_shared_basis_across_heads(rng):
    x = key_like(rng)
    b = fit_basis(x, rank=8, per_head=False)
    np.testing.assert_array_equal(b.basis[0], b.basis[1])


def test_bad_input(rng):
    x = key_like(rng, d=16, n=20)
    for kw, exc in [
        ({"rank": 0}, ValueError),
        ({"rank": 17}, ValueError),
        ({}, ValueError),
        ({"rank": 2, "energy": 0.5}, ValueError),
        ({"energy": 1.5}, ValueError),
        ({"energy": "x"}, TypeError),
        ({"rank": 2.5}, TypeError),
    ]:
        with pytest.raises(exc):
            fit_basis(x, **kw)
    with pytest.raises(ValueError, match="shape"):
        fit_basis(x[0], rank=2)
    with pytest.raises(TypeError, match="floating"):
        fit_basis(x.astype(np.int32), rank=2)
