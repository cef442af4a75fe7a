"""Integer caches keep their relative accuracy at any data magnitude, and never store inf.

float16 scales underflow for data of magnitude 1e-6 (int8 came back with a relative error of
2.3, worse than zeros) and overflow near 65504. A layer now keeps its data in units of a power
of two fixed by its first non-zero store (``arraykv.quant.intq.half_exponent``), so float16
holds normal scales at every magnitude and typical data keeps exactly what it stored before.
"""

import numpy as np
import pytest

import arraykv
from arraykv.attention.int_fused import int_decode_attention_reference
from arraykv.ops import int_decode_attention
from arraykv.quant.intq import dequantize_groups, half_exponent, quantize_groups

from conftest import asarray, to_np

H, D, T = 2, 64, 160
SCALES = [1e-8, 1e-6, 1e-3, 1.0, 1e2, 1e4]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _fill(cache, k, v, q, prompt=96):
    cache.prefill(0, k[:, :, :prompt, :], v[:, :, :prompt, :], q[:, :, :prompt, :])
    out = None
    for t in range(prompt, int(k.shape[2])):
        out = cache.decode(
            0, k[:, :, t : t + 1, :], v[:, :, t : t + 1, :], q[:, :, t : t + 1, :], arraykv.AttendConfig(D**-0.5)
        )
    return out


def _errors(method, scale, data, dtype=np.float32, **opts):
    k0, v0, q = data
    k, v = (k0 * scale).astype(dtype), (v0 * scale).astype(dtype)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, **opts)
    _fill(cache, k, v, q.astype(dtype))
    r = cache.dequantize(0)
    for name, a in cache._layer_arrays(cache._states[0]).items():
        a = to_np(a)
        if a.dtype.kind == "f":
            assert np.isfinite(a).all(), f"{method} at scale {scale:g} stores non-finite {name}"
    return rel(r.k, k), rel(r.v, v), cache


@pytest.fixture
def data(rng):
    return tuple(rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3))


@pytest.mark.parametrize("method", ["int2", "int4", "int8"])
def test_relative_error_does_not_depend_on_the_data_scale(method, data):
    base_k, base_v, base = _errors(method, 1.0, data)
    for scale in SCALES:
        ek, ev, cache = _errors(method, scale, data)
        # within a small factor of the scale-1 error (the same data, only scaled)
        assert ek <= 1.1 * base_k and ev <= 1.1 * base_v, (method, scale, ek, ev, base_k, base_v)
        assert cache.memory_usage() == base.memory_usage()  # no extra bytes per value


@pytest.mark.parametrize("method", ["int2", "int4", "int8"])
def test_values_near_the_float16_maximum_store_no_inf(method, data):
    k0, v0, q = data
    top = float(max(np.abs(k0).max(), np.abs(v0).max()))
    for dtype in (np.float16, np.float32):
        scale = 65000.0 / top  # the largest value just below float16's maximum
        base_k, base_v, _ = _errors(method, 1.0, data, dtype)
        ek, ev, _ = _errors(method, scale, data, dtype)
        assert ek <= 1.1 * base_k and ev <= 1.1 * base_v, (method, dtype, ek, ev)
    ek, ev, _ = _errors(method, 6e4, data)  # float32 data far beyond float16's range
    assert ek <= 1.1 * base_k and ev <= 1.1 * base_v


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("method", ["int2", "int4", "int8"])
def test_fused_decode_attends_over_what_the_layer_holds(method, scale, data):
    k0, v0, q = data
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D, decode_path="fused")
    out = _fill(cache, k0 * scale, v0 * scale, q)
    r = cache.dequantize(0)
    q1 = q[:, :, -1:]
    want = arraykv.attention(q1, r.k, r.v, softmax_scale=D**-0.5)
    assert rel(out.output, want) < 1e-4
    codec = cache.layer_codec_state(0)
    assert rel(int_decode_attention(codec, q1, D**-0.5), want) < 1e-4
    assert rel(int_decode_attention_reference(codec, q1, D**-0.5), want) < 1e-4


def test_other_namespaces_store_the_same_units(xp, rng):
    k0, v0, q = (rng.standard_normal((1, H, 70, D)).astype(np.float32) for _ in range(3))
    for scale in (1e-7, 1e5):
        cache = arraykv.make_cache("int2", num_layers=1, num_kv_heads=H, head_dim=D, decode_path="fused")
        k, v = asarray(xp, k0 * scale), asarray(xp, v0 * scale)
        _fill(cache, k, v, asarray(xp, q), prompt=40)
        r = cache.dequantize(0)
        assert rel(to_np(r.k), k0 * scale) < 0.45 and rel(to_np(r.v), v0 * scale) < 0.45


@pytest.mark.parametrize("scale", [1e-6, 1e4])
def test_save_and_load_keep_the_units(tmp_path, scale, data):
    k0, v0, q = data
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=H, head_dim=D)
    _fill(cache, k0[:, :, :-1] * scale, v0[:, :, :-1] * scale, q[:, :, :-1])
    cache.save(tmp_path / "c.akv")
    back = arraykv.load(tmp_path / "c.akv")
    np.testing.assert_array_equal(back.dequantize(0).k, cache.dequantize(0).k)
    step = [a[:, :, -1:] for a in (k0 * scale, v0 * scale, q)]
    cfg = arraykv.AttendConfig(D**-0.5)
    a, b = back.decode(0, *step, cfg).output, cache.decode(0, *step, cfg).output  # fused: to the last bits
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def test_a_layer_of_zeros_takes_its_units_from_the_first_non_zero_data(tmp_path, data):
    k0, v0, q = data
    zeros = np.zeros((1, H, 40, D), np.float32)
    cache = arraykv.make_cache("int8", num_layers=1, num_kv_heads=H, head_dim=D)
    cache.prefill(0, zeros, zeros, zeros)
    cache.save(tmp_path / "z.akv")
    back = arraykv.load(tmp_path / "z.akv")
    for c in (cache, back):
        c.prefill(0, k0 * 1e-6, v0 * 1e-6, q)
        r = c.dequantize(0)
        assert rel(r.k[:, :, 40:], k0 * 1e-6) < 0.01 and rel(r.v[:, :, 40:], v0 * 1e-6) < 0.01
        np.testing.assert_array_equal(r.k[:, :, :32], zeros[:, :, :32])  # its first key group stays zero
    np.testing.assert_array_equal(back.dequantize(0).k, cache.dequantize(0).k)


def test_a_later_store_beyond_float16_is_refused_unchanged(data):
    k0, v0, q = data
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=H, head_dim=D)
    cache.prefill(0, k0[:, :, :40], v0[:, :, :40], q[:, :, :40])  # magnitude ~4: units of 2**0
    before = {n: np.array(a) for n, a in cache._layer_arrays(cache._states[0]).items()}
    big = k0[:, :, 40:41] * 1e6
    with pytest.raises(ValueError, match="beyond what this layer's float16 scales"):
        cache.decode(0, big, v0[:, :, 40:41], q[:, :, 40:41], arraykv.AttendConfig(0.125))
    after = {n: np.array(a) for n, a in cache._layer_arrays(cache._states[0]).items()}
    assert before.keys() == after.keys() and cache.seq_len(0) == 40
    for n in before:
        np.testing.assert_array_equal(after[n], before[n])
    # float32 scales and no float16 window hold it
    wide = arraykv.make_cache("int4", num_layers=1, num_kv_heads=H, head_dim=D, scale_dtype="float32")
    wide.prefill(0, k0[:, :, :40], v0[:, :, :40], q[:, :, :40])
    wide.decode(0, big, v0[:, :, 40:41], q[:, :, 40:41], arraykv.AttendConfig(0.125))
    assert np.isfinite(wide.dequantize(0).k).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_groups_with_float16_parameters_at_any_scale(rng, bits):
    x = rng.standard_normal((3, 256)).astype(np.float32)
    base = rel(dequantize_groups(quantize_groups(x, bits, 32, param_dtype="float16")), x)
    for scale in SCALES + [6e4, 1e6]:
        q = quantize_groups(x * scale, bits, 32, param_dtype="float16")
        assert np.isfinite(np.asarray(q.scale)).all() and np.isfinite(np.asarray(q.offset)).all()
        assert rel(dequantize_groups(q), x * scale) <= 1.1 * base, (bits, scale)
        assert q.exponent == half_exponent(float(np.abs(x * scale).max()))
        assert q.bits_per_value == bits + 32 / 32
    assert quantize_groups(x * 1e-6, bits, 32).exponent == 0  # float32 parameters need no units
    assert quantize_groups(x, bits, 32, param_dtype="float16").exponent == 0  # typical data: as before


def test_half_exponent():
    assert half_exponent(0.0) == 0 and half_exponent(1.0) == 0 and half_exponent(4096.0) == 0
    assert half_exponent(2.0**-6) == 0 and half_exponent(2.0**-7) == -7
    assert half_exponent(3e-6) == -19 and half_exponent(1e5) == 16


@pytest.mark.parametrize("method", ["int2", "int4", "int8"])
def test_subnormal_keys_and_values_stay_finite(method):
    """Data of float32-subnormal magnitude (~1e-41): the power-of-two unit stays a normal float32
    (it was 2**-137, whose inverse is inf), so every output is finite and near the input."""
    rng = np.random.default_rng(5)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    k = (rng.standard_normal((1, 2, 80, 64)) * 1e-41).astype(np.float32)
    q = rng.standard_normal((1, 4, 80, 64)).astype(np.float32)
    r = cache.prefill(0, k, k, q)
    out = cache.decode(0, k[:, :, :1], k[:, :, :1], q[:, :, :1], arraykv.AttendConfig(0.125, 2))
    got = out.output if isinstance(out, arraykv.Fused) else out.result.v
    assert np.isfinite(np.asarray(r.k)).all() and np.isfinite(np.asarray(got)).all()
    assert np.abs(np.asarray(r.k)).max() <= 1e-39
