"""The one-pass Numba VQ encoder against assignment + packing, and the array-API reference."""

from functools import partial

import numpy as np
import pytest

from arraykv import ops
from arraykv.ops import lookup, set_kernels_enabled
from arraykv.quant import vq
from arraykv.quant.bitpack import pack_bits
from arraykv.quant.vq import VQCodebook, code_bits

vq_encode = partial(vq.vq_encode, encode=ops.vq_encode)
vq_decode = partial(vq.vq_decode, decode=ops.vq_decode)

encode = lookup("vq_encode", np)
assign = lookup("vq_assign", np)
pytestmark = pytest.mark.skipif(encode is None, reason="the NumPy kernels are disabled (ARRAYKV_DISABLE_KERNELS=1)")


@pytest.mark.parametrize(
    "k,s,d,lead,t",
    [
        (2, 1, 8, (1,), 5),
        (5, 2, 32, (2,), 17),
        (16, 2, 64, (1,), 1),
        (16, 4, 64, (3,), 40),
        (100, 8, 64, (), 9),
        (256, 2, 32, (2,), 33),
        (300, 4, 32, (1,), 12),
        (7, 3, 24, (2, 2), 6),
    ],
)
def test_codes_equal_assignment_then_packing(rng, k, s, d, lead, t):
    h = 3
    cent = rng.standard_normal((h, d // s, k, s)).astype(np.float32)
    x = rng.standard_normal(lead + (h, t, d)).astype(np.float32)
    bits = code_bits(k)
    rows = int(np.prod(lead)) if lead else 1
    got = encode(x.reshape(rows, h, t, d), cent, bits)
    # the composition the one-pass kernel replaces: assign (same float32 arithmetic) then pack
    xg = np.transpose(x.reshape(rows, h, t, d // s, s), (1, 3, 0, 2, 4)).reshape(h * (d // s), rows * t, s)
    idx, _ = assign(xg, cent.reshape(h * (d // s), k, s))
    idx = np.transpose(idx.reshape(h, d // s, rows, t), (2, 0, 3, 1))  # (rows, h, t, m)
    want = pack_bits(idx.astype(np.uint8), bits) if bits <= 8 else idx.astype(np.uint16)
    np.testing.assert_array_equal(got, want)
    # through vq_encode, and against the array-API reference (distances by matmul: a near-tie
    # may pick the other centroid, at the same distance to float32 rounding)
    cb = VQCodebook(centroids=cent)
    fast = vq_encode(x, cb)
    with set_kernels_enabled(False):
        ref = vq_encode(x, cb)
    assert fast.codes.shape == ref.codes.shape and fast.codes.dtype == ref.codes.dtype
    dec_f = vq_decode(fast, cb).reshape(-1, s)
    dec_r = vq_decode(ref, cb).reshape(-1, s)
    err_f = ((dec_f - x.reshape(-1, s)) ** 2).sum(-1)
    err_r = ((dec_r - x.reshape(-1, s)) ** 2).sum(-1)
    np.testing.assert_allclose(err_f, err_r, rtol=1e-4, atol=1e-5)
    assert np.mean(np.all(dec_f == dec_r, axis=-1)) > 0.99


def test_float16_and_strided_input(rng):
    cent = rng.standard_normal((2, 16, 16, 2)).astype(np.float32)
    x = rng.standard_normal((1, 2, 20, 32)).astype(np.float16)
    strided = np.swapaxes(np.swapaxes(x, 2, 3).copy(), 2, 3)
    a = encode(x, cent, 4)
    np.testing.assert_array_equal(a, encode(strided, cent, 4))
    np.testing.assert_array_equal(a, encode(x.astype(np.float32), cent, 4))


decode = lookup("vq_decode", np)


@pytest.mark.parametrize(
    "k,s,d,lead,t",
    [
        (2, 1, 8, (1,), 5),
        (5, 2, 32, (2,), 17),
        (16, 2, 64, (1,), 1),
        (100, 8, 64, (), 9),
        (256, 2, 32, (2,), 33),
        (300, 4, 32, (1,), 12),
        (7, 3, 24, (2, 2), 6),
    ],
)
def test_decode_kernel_equals_the_reference(rng, k, s, d, lead, t):
    h = 2
    cent = rng.standard_normal((h, d // s, k, s)).astype(np.float32)
    x = rng.standard_normal(lead + (h, t, d)).astype(np.float32)
    cb = VQCodebook(centroids=cent)
    codes = vq_encode(x, cb)
    got = vq_decode(codes, cb)
    with set_kernels_enabled(False):
        want = vq_decode(codes, cb)
    assert got.shape == want.shape == x.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(vq_decode(codes, cb, dtype=np.float16), want.astype(np.float16))
