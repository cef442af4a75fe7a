"""The Numba dense-and-sparse split against its array-API reference."""

import numpy as np
import pytest

from arraykv.ops import lookup, set_kernels_enabled, split_outliers
from arraykv.quant.outliers import scatter_outliers, split_outliers_reference

kernel = lookup("split_outliers", np)
pytestmark = pytest.mark.skipif(kernel is None, reason="the NumPy kernels are disabled (ARRAYKV_DISABLE_KERNELS=1)")


def planted(rng, shape, dtype, count):
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3.0, shape[-1]) + rng.uniform(-2, 2, shape[-1])
    flat = x.reshape(-1)
    pos = rng.choice(flat.size, count, replace=False)
    flat[pos] += rng.choice([-1.0, 1.0], count) * rng.uniform(30, 60, count)
    return x.astype(dtype)


@pytest.mark.parametrize("shape", [(1, 1, 7, 3), (2, 3, 50, 64), (3, 8, 129, 32), (1, 2, 1, 128)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("threshold", [2.0, 6.0])
def test_kernel_matches_the_reference(rng, shape, dtype, threshold):
    x = planted(rng, shape, dtype, count=min(5, int(np.prod(shape)) // 4))
    dense, out = split_outliers(x, threshold)
    with set_kernels_enabled(False):
        rdense, rout = split_outliers(x, threshold)
    assert dense.dtype == np.float32 and dense.shape == x.shape
    assert out.index.dtype == np.int32 and out.value.dtype == x.dtype
    assert np.all(np.diff(out.index) > 0)
    ki, ri = set(out.index.tolist()), set(rout.index.tolist())
    # The statistics are accumulated in float64 here and float32 there: a value may only change
    # side when it sits on the boundary |x - mu| = threshold * sigma (to float32 rounding).
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=(0, 2), keepdims=True)
    z = np.abs(x64 - mu) / (x64.std(axis=(0, 2), keepdims=True) * threshold + 1e-30)
    for i in ki ^ ri:
        assert abs(z.reshape(-1)[i] - 1.0) < 1e-5, i
    same = np.ones(x.size, bool)
    same[list(ki ^ ri)] = False
    np.testing.assert_allclose(dense.reshape(-1)[same], rdense.reshape(-1)[same], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.value, x.reshape(-1)[out.index])
    # Restored exactly.
    np.testing.assert_array_equal(
        scatter_outliers(dense.astype(x.dtype), out).reshape(-1)[out.index], x.reshape(-1)[out.index]
    )


def test_planted_outliers_are_found_and_nothing_else(rng):
    x = planted(rng, (2, 4, 300, 64), "float32", count=12)
    dense, out = split_outliers(x, 6.0)
    assert out.count == 12
    ref_dense, ref_out = split_outliers_reference(x, 6.0)
    np.testing.assert_array_equal(out.index, ref_out.index)


def test_no_outliers_returns_the_float32_input_without_a_copy(rng):
    x = rng.standard_normal((1, 2, 64, 32)).astype(np.float32)
    dense, out = split_outliers(x, 50.0)
    assert out.count == 0 and dense is x
    with set_kernels_enabled(False):
        rdense, rout = split_outliers(x, 50.0)
    assert rout.count == 0
    np.testing.assert_array_equal(dense, rdense)


def test_strided_input(rng):
    x = planted(rng, (2, 3, 40, 64), "float32", count=4)
    view = np.swapaxes(np.swapaxes(x, 1, 2).copy(), 1, 2)  # same values, non-contiguous
    d1, o1 = split_outliers(view, 6.0)
    d2, o2 = split_outliers(x, 6.0)
    np.testing.assert_array_equal(o1.index, o2.index)
    np.testing.assert_array_equal(d1, d2)
