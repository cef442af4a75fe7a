import math

import numpy as np
import pytest

import arraykv
from arraykv.caches.polar import PolarCache
from arraykv.caches.sliding import SPARE_ROWS
from arraykv.ops import set_kernels_enabled
from arraykv.quant.bitpack import unpack_bits

from cache_contract import attend, random_kvq
from conftest import asarray, to_np

METHODS = [f"{p}{b}" for p in ("pqo", "pq", "tq") for b in (2, 3, 4)]


def make(method="pqo4", **kw):
    opts = dict(num_layers=2, num_kv_heads=2, head_dim=32)
    opts.update(kw)
    return arraykv.make_cache(method, **opts)


def outlier_keys(rng, b, h, t, d, n=4, factor=15.0):
    k = rng.standard_normal((b, h, t, d)).astype(np.float32)
    for hh in range(h):
        k[:, hh, :, rng.choice(d, n, replace=False)] *= factor
    return k


def cos(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.mean(np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)))


@pytest.mark.parametrize("method", METHODS)
def test_registered_with_the_seed_bits(method):
    c = make(method)
    assert isinstance(c, PolarCache) and isinstance(c, arraykv.CompressedKVCache)
    b = int(method[-1])
    mse_bits = b if method.startswith("pqo") else b - 1
    assert (c.key_bits, c.value_bits, c.qjl) == (mse_bits, mse_bits, method.startswith("tq"))
    assert c.get_config()["method"] == method


@pytest.mark.parametrize("method", ["pqo3", "tq4", "pq2"])
def test_prefill_exact_then_decodes_close(xp, rng, method):
    cache = make(method, residual_window=4, decode_path="dequantized")
    g, scale = 2, 1 / math.sqrt(32)
    k, v, q = random_kvq(rng, xp, 1, 2, g, 24, 32)
    r = cache.prefill(0, k, v, q)
    np.testing.assert_array_equal(to_np(r.k), to_np(k))
    assert r.logit_bias is None
    ks, vs = [to_np(k)], [to_np(v)]
    for _ in range(12):
        k, v, q = random_kvq(rng, xp, 1, 2, g, 1, 32)
        out = cache.decode(0, k, v, q, arraykv.AttendConfig(scale, g))
        assert isinstance(out, arraykv.Dequantized)
        ks.append(to_np(k))
        vs.append(to_np(v))
        fk, fv = np.concatenate(ks, 2), np.concatenate(vs, 2)
        res = out.result
        assert res.k.shape == fk.shape
        if method.startswith("tq"):
            assert res.logit_bias.shape == (1, 4, 1, fk.shape[2])
            np.testing.assert_array_equal(to_np(res.logit_bias)[..., -4:], 0)  # the window is exact
            np.testing.assert_array_equal(to_np(res.logit_bias)[..., :4], 0)  # so are the sink tokens
        else:
            assert res.logit_bias is None
        # Window tokens come back as float16 copies.
        np.testing.assert_allclose(to_np(res.k)[:, :, -4:], fk[:, :, -4:], rtol=1e-3, atol=1e-3)
        want = arraykv.attention(q, asarray(xp, fk), asarray(xp, fv), softmax_scale=scale)
        assert cos(to_np(attend(out, q, scale)), to_np(want)) > {"pqo3": 0.9, "tq4": 0.85, "pq2": 0.5}[method]
    assert cache.seq_len(0) == 36


def test_second_prefill_bias_shape_and_scale(rng):
    c = make("tq3", residual_window=0, softmax_scale=0.5)
    k, v, q = random_kvq(rng, np, 2, 2, 3, 10, 32)
    c.prefill(1, k, v, q)
    k2, v2, q2 = random_kvq(rng, np, 2, 2, 3, 5, 32)
    r = c.prefill(1, k2, v2, q2)
    assert r.k.shape == (2, 2, 15, 32) and r.logit_bias.shape == (2, 6, 5, 15)
    c2 = make("tq3", residual_window=0, softmax_scale=1.0)
    c2.prefill(1, k, v, q)
    r2 = c2.prefill(1, k2, v2, q2)
    np.testing.assert_allclose(np.asarray(r2.logit_bias) * 0.5, r.logit_bias, rtol=1e-5, atol=1e-6)


def test_tq_bias_corrects_logits_without_bias(rng):
    # Over many keys, logits with the QJL bias are unbiased estimates of the exact ones.
    d = 64
    # key weights off: they would tune the MSE part to this one query and hide its bias
    c = make("tq3", head_dim=d, num_kv_heads=1, residual_window=0, softmax_scale=1.0, key_scale=False)
    k = rng.standard_normal((1, 1, 4000, d)).astype(np.float32)
    q = k[:, :, :1] + rng.standard_normal((1, 1, 1, d)).astype(np.float32)
    c.prefill(0, k[:, :, :1], k[:, :, :1], q)
    r = c.prefill(0, k[:, :, 1:], k[:, :, 1:], np.repeat(q, 3999, axis=2))
    est = (np.asarray(r.k[0, 0], float) @ q[0, 0, 0]) + np.asarray(r.logit_bias[0, 0, 0], float)
    true = k[0, 0] @ q[0, 0, 0]
    err = est - true
    mse_only = np.asarray(r.k[0, 0], float) @ q[0, 0, 0] - true
    assert abs(err[1:].mean()) < 4 * err[1:].std() / math.sqrt(3998)
    assert abs(err[1:].mean()) < abs(mse_only[1:].mean())


def test_memory_usage_is_bytes_held(rng):
    d = 128
    c = arraykv.make_cache("pqo3", num_layers=2, num_kv_heads=2, head_dim=d, residual_window=0, sink_tokens=0)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 300, d)
    c.prefill(0, k, v, q)
    arrays = c.layer_arrays(0)
    held = sum(a.nbytes for a in arrays.values())
    fixed = d * 4 + 15 * 4  # signs + 3-bit codebook (centroids and thresholds)
    # the window and the rollback copies slide in buffers with SPARE_ROWS float16 rows of room each
    spare = 2 * (2 * 2 * SPARE_ROWS * d * 2)
    assert c.memory_usage() == held + fixed + spare
    codes_bits = sum(arrays[n].nbytes for n in ("k_codes", "k_norms", "v_codes", "v_norms")) * 8
    assert codes_bits / (2 * 2 * 300 * d) == pytest.approx(3.125)
    # Gaussian keys: no outlier channel, no centering (only zero means held).
    assert arrays["k_outlier_idx"].shape == (1, 2, 0) and np.all(arrays["k_mean"] == 0)
    c.prefill(1, k, v, q)
    assert c.memory_usage() == 2 * (held + spare) + fixed
    assert c.reserved_bytes() >= c.memory_usage()
    c.reset()
    assert c.memory_usage() == 0


@pytest.mark.parametrize("bits,floor", [(4, 0.99), (3, 0.97)])
def test_outlier_key_channels_are_protected(rng, bits, floor):
    b, h, g, d, t = 1, 2, 4, 128, 256
    k = outlier_keys(rng, b, h, t, d)
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    q = rng.standard_normal((b, h * g, t, d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    got = {}
    for name, opts in (("default", {}), ("rotation only", {"outliers": 0, "key_scale": False})):
        c = arraykv.make_cache(f"pqo{bits}", num_layers=1, num_kv_heads=h, head_dim=d, residual_window=0, **opts)
        c.prefill(0, k, v, q)
        r = c.dequantize(0)
        qq = q[:, :, -32:]
        got[name] = cos(
            arraykv.attention(qq, r.k, r.v, softmax_scale=scale), arraykv.attention(qq, k, v, softmax_scale=scale)
        )
    assert got["default"] >= floor
    assert got["rotation only"] < got["default"] - 0.02
    st = c.layer_codec_state(0)
    assert st.k_outlier_idx is None


def _profiled(rng, profile, shape):
    return (rng.standard_normal(shape) * profile).astype(np.float32)


def test_key_weights_follow_query_and_key_energy(rng):
    """``k_scale = sqrt(rms_q / rms_k)`` per channel, mean square 1; ones for silent queries."""
    b, h, g, d, t = 1, 2, 3, 64, 200
    a = np.exp(np.linspace(-1.0, 1.0, d))  # key channel RMS
    p = np.exp(np.linspace(1.0, -1.0, d))[::-1] ** 2  # query channel RMS
    k = _profiled(rng, a, (b, h, t, d))
    q = _profiled(rng, p, (b, h * g, t, d))
    c = make("pqo4", head_dim=d, residual_window=0, sink_tokens=0, center=False, outliers=0)
    c.prefill(0, k, k, q)
    s = c.layer_arrays(0)["k_scale"].astype(np.float64)
    rq = np.sqrt(np.mean(q.reshape(b, h, g * t, d).astype(np.float64) ** 2, axis=2))
    rk = np.sqrt(np.mean(k.astype(np.float64) ** 2, axis=2))
    want = np.sqrt(rq / rk)
    want /= np.sqrt(np.mean(want**2, axis=-1, keepdims=True))
    np.testing.assert_allclose(s, np.clip(want, 1 / 16, 16), rtol=2e-3)
    # queries that carry nothing (an ONNX graph passes zeros): no weighting
    c = make("pqo4", head_dim=d, residual_window=0, sink_tokens=0)
    c.prefill(0, k, k, np.zeros_like(q))
    np.testing.assert_array_equal(c.layer_arrays(0)["k_scale"], 1)
    # turned off: ones
    c = make("pqo4", head_dim=d, residual_window=0, sink_tokens=0, key_scale=False)
    c.prefill(0, k, k, q)
    np.testing.assert_array_equal(c.layer_arrays(0)["k_scale"], 1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_query_weighted_keys_lower_the_logit_error(rng, bits):
    """Keys and queries with different channel profiles: the weighted quantizer's q·k error on
    held-out queries follows the isotropic-error model, (Σ a p)² / (Σ a² Σ p²) of the plain one."""
    b, h, g, d, t = 1, 2, 2, 64, 512
    a = np.exp(np.linspace(-1.2, 1.2, d))
    p = a[::-1].copy()
    k = _profiled(rng, a, (b, h, t, d))
    q = _profiled(rng, p, (b, h * g, t, d))
    q_new = _profiled(rng, p, (b, h * g, 64, d))
    err = {}
    for ks in (False, True):
        c = make(f"pqo{bits}", head_dim=d, residual_window=0, sink_tokens=0, outliers=0, center=False, key_scale=ks)
        c.prefill(0, k, k, q)
        kd = c.dequantize(0).k
        e = (kd - k).reshape(b, h, 1, t, d)
        qn = q_new.reshape(b, h, g, 64, d)
        err[ks] = float(np.mean(np.einsum("bhgqd,bhgtd->bhgqt", qn, np.broadcast_to(e, (b, h, g, t, d))) ** 2))
    predicted = np.sum(a * p) ** 2 / (np.sum(a * a) * np.sum(p * p))
    assert predicted < 0.5
    assert err[True] / err[False] == pytest.approx(predicted, rel=0.4)


def test_window_spills_into_codes_in_order(rng):
    c = make("pqo4", residual_window=5, sink_tokens=2)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 3, 32)
    c.prefill(0, k, v, q)
    assert c.layer_codec_state(0).n_quantized == 0
    for _ in range(6):
        kk, vv, qq = random_kvq(rng, np, 1, 2, 1, 1, 32)
        c.decode(0, kk, vv, qq, arraykv.AttendConfig(1.0))
        k, v = np.concatenate([k, kk], 2), np.concatenate([v, vv], 2)
    s = c.layer_codec_state(0)
    assert (s.n_sink, s.n_quantized, s.n_window) == (2, 2, 7)
    r = c.dequantize(0)
    np.testing.assert_allclose(r.k[:, :, 4:], k[:, :, 4:], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(r.k[:, :, :2], k[:, :, :2], rtol=1e-3, atol=1e-3)
    assert cos(r.k[:, :, 2:4], k[:, :, 2:4]) > 0.95


def test_codec_state_decodes_as_documented(rng):
    d = 64
    c = arraykv.make_cache("tq4", num_layers=1, num_kv_heads=2, head_dim=d, residual_window=3, outliers=2)
    k = outlier_keys(rng, 2, 2, 40, d, n=2) + 3.0
    v = rng.standard_normal((2, 2, 40, d)).astype(np.float32)
    q = rng.standard_normal((2, 2, 40, d)).astype(np.float32)
    c.prefill(0, k, v, q)
    s = c.layer_codec_state(0)
    m = np.asarray(s.rotation.dense(), float)
    cents = np.asarray(s.k_codebook.centroids, float)
    codes = unpack_bits(s.k_codes, s.k_codebook.bits, d)
    kd = s.k_norms.astype(float)[..., None] * (cents[codes] @ m)
    for bb in range(2):
        for hh in range(2):
            kd[bb, hh][:, s.k_outlier_idx[bb, hh]] = s.k_outliers[bb, hh].astype(float)
    kd = kd / s.k_scale.astype(float)[:, :, None, :] + s.k_mean.astype(float)[:, :, None, :]
    kw = s.k_window.astype(float)
    kd = np.concatenate([kw[:, :, : s.n_sink], kd, kw[:, :, s.n_sink :]], axis=2)
    np.testing.assert_allclose(kd, c.dequantize(0).k, rtol=1e-4, atol=1e-4)
    assert s.k_qjl.shape == (2, 2, 33, d // 8) and s.n_sink == 4 and s.k_qjl_norms.dtype == np.float16
    assert np.median(np.abs(s.k_mean.astype(float) - 3.0)) < 0.5  # the offset was found and removed


def test_kernels_on_and_off_agree(rng):
    k, v, q = random_kvq(rng, np, 1, 2, 2, 50, 32)
    outs = []
    for on in (True, False):
        with set_kernels_enabled(on):
            c = make("pqo3", residual_window=0)
            c.prefill(0, k, v, q)
            outs.append(c.dequantize(0).k)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-3, atol=2e-3)


def test_config_rebuilds_identical_cache(rng):
    c = make("tq3", seed=9, residual_window=2, outliers=1, num_layers=1)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 30, 32)
    c.prefill(0, k, v, q)
    c2 = arraykv.make_cache(**c.get_config())
    c2.prefill(0, k, v, q)
    a, b = c.layer_arrays(0), c2.layer_arrays(0)
    assert sorted(a) == sorted(b)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])
    c3 = make("tq3", seed=10, residual_window=2, outliers=1, num_layers=1)
    c3.prefill(0, k, v, q)
    assert not np.array_equal(c3.layer_arrays(0)["k_codes"], a["k_codes"])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_dtype_preserved(rng, dtype):
    c = make("pqo2", residual_window=2)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 9, 32, dtype)
    c.prefill(0, k, v, q)
    r = c.prefill(0, k, v, q)
    assert r.k.dtype == np.dtype(dtype) and r.v.dtype == np.dtype(dtype)


def test_head_dim_sizes(rng):
    for d in (4, 48, 96, 256):
        c = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=1, head_dim=d, residual_window=0)
        k, v, q = random_kvq(rng, np, 1, 1, 1, 64, d)
        c.prefill(0, k, v, q)
        assert cos(c.dequantize(0).k, k) > 0.97


@pytest.mark.parametrize(
    "opts,exc,match",
    [
        ({"key_bits": 9}, ValueError, "key_bits"),
        ({"value_bits": 0}, ValueError, "value_bits"),
        ({"key_bits": 2.5}, TypeError, "key_bits"),
        ({"head_dim": 2}, ValueError, "head_dim"),
        ({"head_dim": 1500}, ValueError, "power of two"),
        ({"residual_window": -1}, ValueError, "residual_window"),
        ({"outliers": "many"}, ValueError, "outliers"),
        ({"outliers": 32}, ValueError, "outliers"),
        ({"center": "yes"}, ValueError, "center"),
        ({"outlier_threshold": 0.5}, ValueError, "outlier_threshold"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ({"seed": -3}, ValueError, "seed"),
        ({"key_scale": "yes"}, TypeError, "key_scale"),
        ({"sink_tokens": -1}, ValueError, "sink_tokens"),
    ],
)
def test_bad_options(opts, exc, match):
    with pytest.raises(exc, match=match):
        make("pqo3", **opts)
