from functools import partial

import numpy as np
import pytest

from arraykv import ops
from arraykv.ops import set_kernels_enabled
from arraykv.quant import vq
from arraykv.quant.vq import code_bits

from conftest import asarray, to_np

# the quantizers with the accelerated steps (kernels on NumPy; the references with kernels off)
train_vq = partial(vq.train_vq, assign=ops.vq_assign, update=ops.vq_update)
vq_encode = partial(vq.vq_encode, encode=ops.vq_encode)
vq_decode = partial(vq.vq_decode, decode=ops.vq_decode)


def rel_mse(a, b):
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2) / np.mean(np.asarray(b, np.float64) ** 2))


@pytest.mark.parametrize("kernels", [False, True])
def test_objective_non_increasing(xp, rng, kernels):
    x = asarray(xp, rng.standard_normal((2, 300, 16)).astype(np.float32))
    with set_kernels_enabled(kernels):
        cb = train_vq(x, codebook_size=32, sub_dim=4, max_iter=15, tol=0.0)
    obj = np.array(cb.objective)
    assert len(obj) >= 3
    assert np.all(np.diff(obj) <= 1e-5 * obj[:-1])
    assert obj[-1] < obj[0]
    # The recorded objective is the error of the final codebook on its training data.
    back = to_np(vq_decode(vq_encode(x, cb), cb))
    assert float(np.sum((back - to_np(x)) ** 2)) <= obj[-1] * (1 + 1e-4)


@pytest.mark.parametrize("groups,n,k,s", [(3, 50, 8, 4), (1, 200, 16, 8), (5, 31, 31, 2)])
def test_kernels_match_reference(rng, groups, n, k, s):
    from arraykv.ops.numba.vq import assign, update

    x = rng.standard_normal((groups, n, s)).astype(np.float32)
    c = rng.standard_normal((groups, k, s)).astype(np.float32)
    idx_ref, err_ref = vq.assign_reference(x, c)
    idx, err = assign(x, c)
    d = ((x[:, :, None, :] - c[:, None, :, :]) ** 2).sum(-1)
    best = d.min(-1)
    # Both pick a nearest centroid (ties aside, the same one).
    np.testing.assert_allclose(np.take_along_axis(d, idx[..., None], -1)[..., 0], best, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.take_along_axis(d, np.asarray(idx_ref)[..., None], -1)[..., 0], best, rtol=1e-4, atol=1e-5
    )
    assert err == pytest.approx(err_ref, rel=1e-4)
    np.testing.assert_allclose(update(x, c, idx), vq.update_reference(x, c, idx), rtol=1e-5, atol=1e-6)


def test_gaussian_256_centroids_beats_scalar_one_bit(rng):
    x = rng.standard_normal((1, 4096, 128)).astype(np.float32)
    cb = train_vq(x, codebook_size=256, sub_dim=8, max_iter=20)
    codes = vq_encode(x, cb)
    assert codes.codes.shape == (1, 4096, 16) and codes.bits == 8
    assert rel_mse(vq_decode(codes, cb), x) <= 0.33
    # On vectors it was not trained on it still beats the best 1-bit scalar quantizer (0.363).
    y = rng.standard_normal((1, 2048, 128)).astype(np.float32)
    assert rel_mse(vq_decode(vq_encode(y, cb), cb), y) < 0.363


def test_code_widths(xp, rng):
    x = asarray(xp, rng.standard_normal((1, 400, 16)).astype(np.float32))
    small = train_vq(x, codebook_size=16, sub_dim=4, max_iter=3)
    c = vq_encode(x[None, ...], small)
    assert c.bits == 4 and c.codes.shape == (1, 1, 400, 2) and c.codes.dtype == xp.uint8
    big = train_vq(x, codebook_size=300, sub_dim=8, max_iter=2)
    c = vq_encode(x, big)
    assert c.bits == 9 and c.codes.dtype == xp.uint16 and c.codes.shape == (1, 400, 2)
    np.testing.assert_allclose(to_np(vq_decode(c, big)).shape, (1, 400, 16))
    assert [code_bits(k) for k in (2, 3, 16, 17, 256, 65536)] == [1, 2, 4, 5, 8, 16]


def test_seeded_and_namespace_independent(rng):
    import array_api_strict as xs

    x = rng.standard_normal((2, 120, 8)).astype(np.float32)
    a = train_vq(x, codebook_size=8, sub_dim=4, seed=3)
    b = train_vq(xs.asarray(x), codebook_size=8, sub_dim=4, seed=3)
    np.testing.assert_allclose(to_np(b.centroids), a.centroids, rtol=1e-4, atol=1e-5)


def test_bad_input(rng):
    x = rng.standard_normal((2, 40, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="codebook_size=64 training vectors"):
        train_vq(x, codebook_size=64, sub_dim=4)
    with pytest.raises(ValueError, match="codebook_size"):
        train_vq(x, codebook_size=1)
    with pytest.raises(ValueError, match="codebook_size"):
        train_vq(x, codebook_size=65537)
    with pytest.raises(ValueError, match="sub_dim must divide"):
        train_vq(x, codebook_size=4, sub_dim=5)
    with pytest.raises(ValueError, match="tol"):
        train_vq(x, codebook_size=4, sub_dim=4, tol=-1.0)
    with pytest.raises(ValueError, match="max_iter"):
        train_vq(x, codebook_size=4, sub_dim=4, max_iter=0)
    cb = train_vq(x, codebook_size=4, sub_dim=4)
    with pytest.raises(ValueError, match="heads"):
        vq_encode(x[:1], cb)
