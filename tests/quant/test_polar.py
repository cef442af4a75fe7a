from functools import partial

import numpy as np
import pytest

from arraykv import ops
from arraykv.ops import set_kernels_enabled
from arraykv.quant import polar as _polar
from arraykv.quant.bitpack import unpack_bits
from arraykv.quant.codebooks import lloyd_max, make_codebook
from arraykv.quant.polar import PolarCode
from arraykv.quant.rotation import make_rotation

from conftest import asarray, to_np

# the quantizers with the accelerated steps (kernels on NumPy; the reference with kernels off)
polar_encode = partial(_polar.polar_encode, encode=ops.polar_encode)
polar_decode = partial(_polar.polar_decode, decode=ops.polar_decode)


def encode_loops(x, rot, cents, length="fit"):
    """Per vector, straight from the definition: rotate, nearest centroid, least-squares or unbiased length."""
    m = to_np(rot.dense()).astype(float)
    c = to_np(cents).astype(float)
    codes, lengths = [], []
    for row in x.reshape(-1, x.shape[-1]).astype(float):
        n = np.linalg.norm(row)
        y = m @ (row / n) if n > 0 else np.zeros_like(row)
        i = np.argmin(np.abs(y[:, None] - c[None, :]), axis=1)
        codes.append(i)
        if length == "fit":
            lengths.append(n * (y @ c[i]) / (c[i] @ c[i]))
        else:
            lengths.append(n / (y @ c[i]) if n > 0 else 0.0)
    return np.array(codes).reshape(x.shape), np.array(lengths).reshape(x.shape[:-1])


def rel_mse(x, y):
    return float(((x - y) ** 2).sum() / (x**2).sum())


@pytest.mark.parametrize("length", ["fit", "unbiased"])
@pytest.mark.parametrize("d", [8, 64, 96])
@pytest.mark.parametrize("bits", [1, 3, 4])
def test_reference_matches_loops(xp, rng, d, bits, length):
    x = rng.standard_normal((2, 7, d)).astype(np.float32)
    rot, cb = make_rotation(d, 5, xp=xp), make_codebook(bits, d, xp=xp)
    with set_kernels_enabled(False):
        code = polar_encode(asarray(xp, x), cb, rot, length=length)
    codes = to_np(unpack_bits(code.codes, bits, d))
    want_codes, want_len = encode_loops(x, rot, lloyd_max(bits, d)[0], length)
    assert (codes == want_codes).mean() > 0.999
    np.testing.assert_allclose(to_np(code.norms).astype(float), want_len, rtol=2e-3)
    assert code.codes.shape == (2, 7, (d * bits + 7) // 8)


@pytest.mark.parametrize("length", ["fit", "unbiased"])
@pytest.mark.parametrize("shape", [(1, 128), (3, 5, 64), (65, 96), (2, 2, 33, 16), (0, 32)])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6])
def test_kernel_matches_reference(rng, shape, bits, length):
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 10)
    rot, cb = make_rotation(d, int(rng.integers(100)), xp=np), make_codebook(bits, d, xp=np)
    with set_kernels_enabled(True):
        fast = polar_encode(x, cb, rot, length=length)
        fast_dec = polar_decode(fast, cb, rot)
    with set_kernels_enabled(False):
        ref = polar_encode(x, cb, rot, length=length)
        ref_dec_of_fast = polar_decode(fast, cb, rot)
    a, b = unpack_bits(fast.codes, bits, d), unpack_bits(ref.codes, bits, d)
    # Float rounding may put a coordinate on the other side of a threshold, nothing more.
    assert x.size == 0 or (a != b).mean() <= 1e-3
    if x.size:
        np.testing.assert_allclose(fast.norms.astype(float), ref.norms.astype(float), rtol=2e-3)
    np.testing.assert_allclose(
        fast_dec, ref_dec_of_fast, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(x).max(initial=0)))
    )
    assert fast.codes.dtype == np.uint8 and fast.norms.dtype == np.float16


# REFERENCE.md: TurboQuant-MSE optimum for d = 128
OPT128 = {2: 0.1160, 3: 0.03397, 4: 0.00932}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_distortion_near_optimum(rng, bits):
    x = rng.standard_normal((4000, 128)).astype(np.float32)
    rot, cb = make_rotation(128, 0, xp=np), make_codebook(bits, 128, xp=np)
    code = polar_encode(x, cb, rot)
    err = rel_mse(x, polar_decode(code, cb, rot))
    assert abs(err / OPT128[bits] - 1) < 0.03
    assert code.bits_per_value == bits + 16 / 128


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_adversarial_inputs_within_2x_of_gaussian(rng, bits):
    d = 128
    rot, cb = make_rotation(d, 0, xp=np), make_codebook(bits, d, xp=np)
    g = rng.standard_normal((2000, d)).astype(np.float32)
    gauss = rel_mse(g, polar_decode(polar_encode(g, cb, rot), cb, rot))
    cases = {
        "constant": np.ones((4, d), np.float32) * np.array([[1.0], [-3.0], [0.01], [1e3]], np.float32),
        "one-hot": np.eye(d, dtype=np.float32) * 7.0,
        "ramp": np.tile(np.arange(d, dtype=np.float32), (3, 1)) - np.array([[0.0], [63.5], [-100.0]], np.float32),
        "alternating": np.tile(np.array([1.0, -1.0], np.float32), (2, d // 2)),
    }
    for name, x in cases.items():
        err = rel_mse(x, polar_decode(polar_encode(x, cb, rot), cb, rot))
        assert err < 2 * gauss, (name, err, gauss)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unbiased_length_keeps_the_inner_product_with_the_input(rng, bits):
    # <x^, x> = |x|^2 exactly (up to the float16 length), so a query along x sees no shrinkage;
    # the fitted length shrinks it by about cos^2(theta) = 1 - mse.
    d = 64
    x = rng.standard_normal((3000, d)).astype(np.float32) * 3.0
    rot, cb = make_rotation(d, 1, xp=np), make_codebook(bits, d, xp=np)
    for kernels in (True, False):
        with set_kernels_enabled(kernels):
            unb = polar_decode(polar_encode(x, cb, rot, length="unbiased"), cb, rot)
            fit = polar_decode(polar_encode(x, cb, rot, length="fit"), cb, rot)
        ratio_u = (unb * x).sum(-1) / (x * x).sum(-1)
        ratio_f = (fit * x).sum(-1) / (x * x).sum(-1)
        np.testing.assert_allclose(ratio_u, 1.0, atol=2e-3)
        assert abs(float(ratio_f.mean()) - (1.0 - float(cb.mse))) < 0.02
        # the price: a larger error, orthogonal to x (tan^2 vs sin^2 cos^2 of the angle)
        err_u, err_f = rel_mse(x, unb), rel_mse(x, fit)
        assert err_f < err_u < err_f / (1.0 - float(cb.mse)) ** 2 * 1.05


def test_zero_vector_and_dtypes(xp):
    rot, cb = make_rotation(16, 0, xp=xp), make_codebook(3, 16, xp=xp)
    x = asarray(xp, np.zeros((2, 16), np.float32))
    for length in ("fit", "unbiased"):
        out = polar_decode(polar_encode(x, cb, rot, length=length), cb, rot, dtype=xp.float32)
        assert np.all(to_np(out) == 0)


def test_bad_arguments(rng):
    rot, cb = make_rotation(16, 0, xp=np), make_codebook(3, 16, xp=np)
    with pytest.raises(ValueError, match="last axis"):
        polar_encode(np.zeros((2, 8), np.float32), cb, rot)
    with pytest.raises(TypeError, match="floating"):
        polar_encode(np.zeros((2, 16), np.int32), cb, rot)
    with pytest.raises(ValueError, match="codebook is for dim"):
        polar_encode(np.zeros((2, 16), np.float32), make_codebook(3, 32, xp=np), rot)
    with pytest.raises(ValueError, match="length must be one of fit, unbiased"):
        polar_encode(np.zeros((2, 16), np.float32), cb, rot, length="exact")
    with pytest.raises(TypeError, match="PolarCode"):
        polar_decode("codes", cb, rot)
    with pytest.raises(ValueError, match="bits=4"):
        polar_decode(PolarCode(np.zeros((1, 8), np.uint8), np.zeros(1, np.float16), 4, 16), cb, rot)
