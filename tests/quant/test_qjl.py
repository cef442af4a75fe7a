import math

import numpy as np
import pytest

from arraykv.quant.codebooks import make_codebook
from arraykv.quant.qjl import make_sketch, prod_decode, prod_encode, qjl_decode, qjl_encode, qjl_inner
from arraykv.quant.rotation import make_rotation

from conftest import asarray, to_np


def unit(rng, n, d):
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_qjl_matches_formula(xp, rng):
    d = 32
    sk = make_sketch(d, 3, xp=xp)
    r = rng.standard_normal((5, d)).astype(np.float32)
    q = rng.standard_normal((5, d)).astype(np.float32)
    code = qjl_encode(asarray(xp, r), sk)
    s = to_np(sk.matrix).astype(float)
    sign = np.where(r @ s.T >= 0, 1.0, -1.0)
    want = math.sqrt(math.pi / 2) / d * np.linalg.norm(r, axis=1) * np.sum((q @ s.T) * sign, axis=1)
    np.testing.assert_allclose(to_np(qjl_inner(asarray(xp, q), code, sk)), want, rtol=2e-3, atol=1e-4)
    dec = to_np(qjl_decode(code, sk))
    np.testing.assert_allclose(np.sum(q * dec, axis=1), want, rtol=2e-3, atol=1e-4)
    assert code.bits_per_value == pytest.approx(1 + 16 / d) or xp.__name__ == "array_api_strict"


# REFERENCE.md: inner-product error variance of TurboQuant-prod for unit vectors, times d.
VAR_D = {2: 0.56, 3: 0.18, 4: 0.054}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_prod_is_unbiased_with_reference_variance(rng, bits):
    d, n = 64, 100000
    x, q = unit(rng, n, d), unit(rng, n, d)
    rot, sk = make_rotation(d, 11, xp=np), make_sketch(d, 11, xp=np)
    cb = make_codebook(bits - 1, d, xp=np)
    code = prod_encode(x, cb, rot, sk)
    err = np.sum(q * np.asarray(prod_decode(code, cb, rot, sk)), axis=1).astype(float) - np.sum(q * x, axis=1)
    se = err.std() / math.sqrt(n)
    assert abs(err.mean()) < 3 * se
    assert abs(err.var() * d / VAR_D[bits] - 1) < 0.10
    assert code.bits_per_value == pytest.approx(bits + 32 / d)


def test_mse_alone_is_biased_prod_much_less(rng):
    # The reason QJL exists: the MSE quantizer's inner products with correlated queries are
    # biased; TurboQuant-prod's are unbiased over the sketch (a single fixed sketch leaves a
    # small residual bias of order 1/sqrt(m d)).
    d, n = 64, 40000
    x = unit(rng, n, d)
    q = x + 0.5 * unit(rng, n, d)
    rot, sk = make_rotation(d, 2, xp=np), make_sketch(d, 2, xp=np)
    cb1 = make_codebook(1, d, xp=np)
    from arraykv.quant.polar import polar_decode, polar_encode

    true = np.sum(q * x, axis=1)
    mse = np.sum(q * np.asarray(polar_decode(polar_encode(x, cb1, rot), cb1, rot)), axis=1)
    prod = np.sum(q * np.asarray(prod_decode(prod_encode(x, cb1, rot, sk), cb1, rot, sk)), axis=1)
    assert abs(np.mean(prod - true)) < 0.1 * abs(np.mean(mse - true))


def test_bad_arguments():
    sk = make_sketch(8, 0, xp=np)
    with pytest.raises(ValueError, match="last axis"):
        qjl_encode(np.zeros((2, 4), np.float32), sk)
    with pytest.raises(TypeError, match="floating"):
        qjl_encode(np.zeros((2, 8), np.int64), sk)
