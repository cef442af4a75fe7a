import math

import numpy as np
import pytest

from arraykv.quant.rotation import fwht, is_power_of_two, make_rotation, rotate, unrotate

from conftest import asarray, to_np


def hadamard_loops(d):
    return np.array([[(-1) ** bin(i & j).count("1") for j in range(d)] for i in range(d)], float)


@pytest.mark.parametrize("d", [2, 4, 8, 64, 128])
def test_fwht_matches_sylvester_matrix(xp, rng, d):
    x = rng.standard_normal((3, d)).astype(np.float32)
    got = to_np(fwht(asarray(xp, x)))
    np.testing.assert_allclose(got, x @ hadamard_loops(d).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [4, 64, 96, 128, 100])
def test_rotation_is_orthogonal_and_inverted(xp, rng, d):
    rot = make_rotation(d, seed=3, xp=xp)
    assert rot.kind == ("hadamard" if is_power_of_two(d) else "orthogonal")
    m = to_np(rot.dense()).astype(float)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-5)
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    y = rotate(asarray(xp, x), rot)
    np.testing.assert_allclose(to_np(y), x @ m.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(to_np(unrotate(y, rot)), x, rtol=1e-4, atol=1e-4)


def test_signs_come_before_the_hadamard():
    d = 64
    rot = make_rotation(d, seed=0, xp=np)
    s = np.asarray(rot.signs, float)
    m = np.asarray(rot.dense(), float)
    np.testing.assert_allclose(m, hadamard_loops(d) * s[None, :] / math.sqrt(d), atol=1e-6)
    # A constant vector must come out spread, not concentrated on one coordinate.
    y = m @ np.ones(d)
    assert np.max(np.abs(y)) < 0.5 * np.linalg.norm(y)


def test_seeded_and_namespace_independent():
    import array_api_strict as xs

    a = make_rotation(32, seed=7, xp=np)
    b = make_rotation(32, seed=7, xp=xs)
    c = make_rotation(32, seed=8, xp=np)
    np.testing.assert_array_equal(np.asarray(a.signs), to_np(b.signs))
    assert not np.array_equal(np.asarray(a.signs), np.asarray(c.signs))
    o1, o2 = make_rotation(24, seed=1, xp=np), make_rotation(24, seed=1, xp=xs)
    np.testing.assert_array_equal(np.asarray(o1.matrix), to_np(o2.matrix))
    assert a.nbytes == 32 * 4 and o1.nbytes == 24 * 4 + 24 * 24 * 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="dim"):
        make_rotation(1, xp=np)
    with pytest.raises(TypeError, match="seed"):
        make_rotation(8, seed=1.5, xp=np)
    with pytest.raises(TypeError, match="like= .* xp="):
        make_rotation(8)
