from functools import partial

import numpy as np
import pytest

from arraykv import ops
from arraykv.ops import set_kernels_enabled
from arraykv.quant import intq
from arraykv.quant.intq import IntQuantized

from conftest import asarray, to_np
from naive import intq_quantize_loops

# the quantizers with the accelerated steps (kernels on NumPy; the references with kernels off)
quantize_groups = partial(
    intq.quantize_groups, group_minmax=ops.intq_group_minmax, quantize_pack=ops.intq_quantize_pack
)
dequantize_groups = partial(intq.dequantize_groups, dequantize=ops.intq_dequantize)


def loops_reference(x, bits, g, param_dtype):
    """Group by group with plain Python loops, straight from the documented formula."""
    x = np.asarray(x, np.float32)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[1]
    levels = 2**bits - 1
    out = np.empty_like(rows)
    for r in range(rows.shape[0]):
        for a in range(0, n, g):
            grp = rows[r, a : a + g]
            lo, hi = grp.min(), grp.max()
            scale = np.float32(np.float32(hi - lo) / np.float32(levels)).astype(param_dtype).astype(np.float32)
            off = np.float32(lo).astype(param_dtype).astype(np.float32)
            for i, val in enumerate(grp):
                c = (
                    0
                    if scale == 0
                    else min(max(np.floor((val - off) * (np.float32(1) / scale) + np.float32(0.5)), 0), levels)
                )
                out[r, a + i] = np.float32(c) * scale + off
    return out.reshape(x.shape)


@pytest.mark.parametrize("bits", [2, 4, 8, 3])
@pytest.mark.parametrize("shape,g", [((5,), 2), ((3, 37), 8), ((2, 3, 64), 32), ((4, 33), 33), ((2, 1, 7), 16)])
@pytest.mark.parametrize("param_dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernels", [False, True])
def test_matches_loops_kernels_on_and_off(xp, rng, bits, shape, g, param_dtype, kernels):
    if not hasattr(xp, param_dtype):
        pytest.skip(f"{param_dtype} not offered by this namespace")
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 5)).astype(np.float32)
    with set_kernels_enabled(kernels):
        q = quantize_groups(asarray(xp, x), bits, g, param_dtype=param_dtype)
        got = to_np(dequantize_groups(q))
    assert q.codes.shape[-1] == (shape[-1] * bits + 7) // 8
    assert q.scale.shape[-1] == -(-shape[-1] // g)
    np.testing.assert_allclose(got, loops_reference(x, bits, g, param_dtype), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape,g", [((3, 37), 8), ((2, 2, 64), 32), ((4, 33), 7), ((1, 6), 6), ((2, 5), 1)])
@pytest.mark.parametrize("param_dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernels", [False, True])
def test_packed_codes_and_parameters_equal_loops(rng, bits, shape, g, param_dtype, kernels):
    """The stored bytes themselves (2 bits: four codes per byte, the first in the lowest bits)."""
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    x[..., 0] = x[..., 1]  # repeated values and a constant group (g == 1) on the way
    with set_kernels_enabled(kernels):
        q = quantize_groups(x, bits, g, param_dtype=param_dtype)
    codes, scale, offset = intq_quantize_loops(x, bits, g, param_dtype)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.offset, offset)


def test_two_bit_layout_by_hand():
    """Codes 0, 1, 2, 3 of one group of four values land in one byte, lowest bits first."""
    q = quantize_groups(np.array([[0.0, 1.0, 2.0, 3.0, 3.0, 0.0]], np.float32), 2, 4)
    assert q.codes.tolist() == [[0b11100100, 0b00000011]]  # second group (range [0, 3]): codes 3, 0
    np.testing.assert_array_equal(dequantize_groups(q), [[0, 1, 2, 3, 3, 0]])


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kernel_and_reference_codes_identical(rng, bits, parallel, parallel_threshold):
    if parallel:  # every call takes the multi-threaded path
        parallel_threshold(0)
    for shape in [(7, 100), (2, 3, 128), (1, 5), (64, 300)]:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        g = int(rng.integers(1, shape[-1] + 1))
        with set_kernels_enabled(False):
            a = quantize_groups(x, bits, g)
            da = dequantize_groups(a)
        b = quantize_groups(x, bits, g)
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.scale, b.scale)
        np.testing.assert_array_equal(da, dequantize_groups(b))


@pytest.mark.parametrize("bits", [2, 4])
def test_error_bound_and_constant_groups(xp, rng, bits):
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[2] = 1.25  # a constant row must come back exactly
    q = quantize_groups(asarray(xp, x), bits, 16)
    back = to_np(dequantize_groups(q))
    step = np.repeat(to_np(q.scale), 16, axis=-1)
    assert np.all(np.abs(back - x) <= step / 2 + 1e-6)
    np.testing.assert_array_equal(back[2], x[2])
    assert q.bits_per_value == pytest.approx(bits + 64 / 16)


def test_float16_input_and_output_dtype(xp, rng):
    if not hasattr(xp, "float16"):
        with pytest.raises(ValueError, match="not offered"):
            quantize_groups(asarray(xp, np.zeros((2, 4), np.float32)), 8, 4, param_dtype="float16")
        return
    x = asarray(xp, rng.standard_normal((3, 32)).astype(np.float16))
    q = quantize_groups(x, 8, 32)
    assert dequantize_groups(q, dtype=x.dtype).dtype == x.dtype
    assert isinstance(q, IntQuantized) and q.shape == (3, 32)


def test_bad_input():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(x, 9, 4)
    with pytest.raises(ValueError, match="group_size"):
        quantize_groups(x, 4, 0)
    with pytest.raises(TypeError, match="floating"):
        quantize_groups(x.astype(np.int32), 4, 4)
    with pytest.raises(ValueError, match="param_dtype"):
        quantize_groups(x, 4, 4, param_dtype="int8")
    with pytest.raises(TypeError, match="IntQuantized"):
        dequantize_groups(x)
