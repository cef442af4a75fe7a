"""The rotating key mean: fit, detection of the rotary convention, and the caches that use it."""

import math

import numpy as np
import pytest

import arraykv
from arraykv.attention.polar_fused import polar_decode_attention_reference
from arraykv.ops import set_kernels_enabled
from arraykv.quant.rotary_mean import (
    RotaryMeanPlan,
    check_rope,
    fit_rotary_mean,
    rope_frequencies,
    rope_pairs,
    rotary_mean_at,
)

from conftest import asarray, to_np


def rope_loop(x, positions, base, layout):
    """Rotary embedding, one pair and one position at a time (the definition)."""
    x = np.array(x, dtype=np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    for i, p in enumerate(positions):
        for j in range(d // 2):
            a, c = (j, j + d // 2) if layout == "half" else (2 * j, 2 * j + 1)
            w = base ** (-2.0 * j / d) * p
            out[..., i, a] = x[..., i, a] * math.cos(w) - x[..., i, c] * math.sin(w)
            out[..., i, c] = x[..., i, c] * math.cos(w) + x[..., i, a] * math.sin(w)
    return out


def rope_keys(rng, b, h, n, d, base, layout, start=0, mean_scale=3.0, noise=1.0):
    """Keys with a shared projected mean, rotary-embedded at positions start .. start + n - 1."""
    mu = rng.standard_normal((b, h, 1, d)) * mean_scale
    pre = mu + noise * rng.standard_normal((b, h, n, d))
    return rope_loop(pre, range(start, start + n), base, layout).astype(np.float32), mu[:, :, 0, :]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("base", [10000.0, 100000.0, 500000.0, 31622.78])
def test_auto_finds_the_convention_and_the_projected_mean(rng, layout, base):
    x, mu = rope_keys(rng, 1, 2, 400, 32, base, layout, start=5)
    rm = fit_rotary_mean(x, 5)
    assert rm.layout == layout
    assert abs(math.log(rm.base / base)) < 0.01
    # every pair that turns noticeably over the tokens gets its frequency (a pair that turns
    # by less than a radian is told from a plain mean only by noise), and mu is recovered
    freq = to_np(rm.freq)
    fast = np.asarray(rope_frequencies(32, base)) * 400 > 1.0
    assert np.all(freq[..., fast] > 0)
    pairs = to_np(rm.pairs)
    turning = np.zeros(32, bool)
    turning[pairs[fast].ravel()] = True  # a pair that hardly turns: its mean is a plain one
    np.testing.assert_allclose(to_np(rm.mean)[..., turning], mu[..., turning], atol=0.25)
    m = to_np(rotary_mean_at(rm.mean, rm.freq, rm.pairs, np.arange(5, 405)))
    resid = ((x - m) ** 2).sum() / (x**2).sum()
    plain = ((x - x.mean(2, keepdims=True)) ** 2).sum() / (x**2).sum()
    # what is left is the noise: within 10 % of what the true rotating mean leaves (the share
    # itself depends on the drawn mean, 0.08-0.14 over seeds), and far below the plain mean's
    truth = rope_loop(np.repeat(mu[:, :, None, :], 400, axis=2), range(5, 405), base, layout)
    floor = ((x - truth) ** 2).sum() / (x**2).sum()
    assert resid <= 1.1 * floor and resid < 0.5 * plain


def test_gaussian_keys_get_plain_means(rng):
    x = (rng.standard_normal((2, 3, 300, 64)) + 0.5).astype(np.float32)
    rm = fit_rotary_mean(x, 0)
    assert rm.layout is None and rm.base is None
    assert np.all(to_np(rm.freq) == 0)
    np.testing.assert_allclose(to_np(rm.mean), x.mean(2), rtol=1e-5, atol=1e-6)


def test_explicit_convention_and_none(rng):
    x, _ = rope_keys(rng, 1, 1, 100, 16, 10000.0, "half")
    rm = fit_rotary_mean(x, 0, rope={"theta": 10000, "layout": "half"})
    assert (rm.layout, rm.base) == ("half", 10000.0)
    assert fit_rotary_mean(x, 0, rope=None).layout is None
    short = fit_rotary_mean(x[:, :, :10], 0)  # too few tokens to tell
    assert short.layout is None


def test_rotary_mean_at_matches_the_definition(xp, rng):
    d, n = 12, 7
    mu = rng.standard_normal((2, 3, d)).astype(np.float32)
    pairs = to_np(rope_pairs(d, "interleaved", xp=np)).astype(np.int32)
    freq = np.asarray(rope_frequencies(d, 500.0), np.float32)[None, None, :].repeat(2, 0).repeat(3, 1)
    freq[0, 1, 2] = 0.0  # one pair with a plain mean
    positions = np.arange(100000, 100000 + n)  # large positions: angles formed in float64
    got = to_np(rotary_mean_at(asarray(xp, mu), asarray(xp, freq), asarray(xp, pairs), asarray(xp, positions)))
    want = np.empty((2, 3, n, d))
    for b in range(2):
        for h in range(3):
            for i, p in enumerate(positions):
                for j, (a, c) in enumerate(pairs):
                    w = float(freq[b, h, j]) * float(p)
                    want[b, h, i, a] = mu[b, h, a] * math.cos(w) - mu[b, h, c] * math.sin(w)
                    want[b, h, i, c] = mu[b, h, c] * math.cos(w) + mu[b, h, a] * math.sin(w)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_plan_logits_match_queries_times_the_turned_mean(xp, rng, shared):
    # the factored form (one product with a (2J, n) phase table) against q · R_t μ formed in float64
    b, h, g, d, n = 2, 3, 4, 16, 9
    mu = rng.standard_normal((b, h, d)).astype(np.float32) * 3.0
    pairs = to_np(rope_pairs(d, "half", xp=np)).astype(np.int32)
    freq = np.asarray(rope_frequencies(d, 10000.0), np.float32)[None, None, :].repeat(b, 0).repeat(h, 1)
    freq[rng.random(freq.shape) < 0.3] = 0.0  # per head, some pairs hold a plain mean
    if not shared:
        freq[1, 2, 1] = 0.5 * freq.max(axis=(0, 1))[1]  # a head turning at its own frequency
    q = rng.standard_normal((b, h, g, d)).astype(np.float32)
    positions = np.arange(70000, 70000 + n, dtype=np.float64)
    plan = RotaryMeanPlan(asarray(xp, mu), asarray(xp, freq), asarray(xp, pairs))
    assert plan.shared == shared
    got = to_np(plan.logits(asarray(xp, q), 70000, 70000 + n))
    ang = freq.astype(np.float64)[:, :, None, :] * positions[None, None, :, None]  # (b, h, n, J)
    mt = np.repeat(mu.astype(np.float64)[:, :, None, :], n, axis=2)
    a, c = mt[..., pairs[:, 0]], mt[..., pairs[:, 1]]
    mt[..., pairs[:, 0]] = a * np.cos(ang) - c * np.sin(ang)
    mt[..., pairs[:, 1]] = c * np.cos(ang) + a * np.sin(ang)
    want = q.astype(np.float64) @ np.swapaxes(mt, -1, -2)
    assert got.shape == (b, h, g, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=5e-5 * np.abs(want).max())


def test_check_rope_errors():
    assert check_rope("auto") == "auto" and check_rope(None) is None
    assert check_rope({"theta": 10000, "layout": "half"}) == {"theta": 10000.0, "layout": "half"}
    for bad in (
        "on",
        3,
        {"theta": 1e4},
        {"theta": 0.5, "layout": "half"},
        {"theta": 1e4, "layout": "pairs"},
        {"theta": True, "layout": "half"},
        {"theta": 1e4, "layout": "half", "scale": 2},
    ):
        with pytest.raises(ValueError, match="rope"):
            check_rope(bad)
    with pytest.raises(ValueError, match="rope"):
        arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=16, rope="yes")


def _filled(method, k, v, q, prefill, **options):
    b, h, n, d = k.shape
    g = q.shape[1] // h
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, **options)
    cache.prefill(0, k[:, :, :prefill], v[:, :, :prefill], q[:, :, :prefill])
    cfg = arraykv.AttendConfig(softmax_scale=d**-0.5, n_kv_groups=g)
    outs = [cache.decode(0, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1], cfg) for t in range(prefill, n)]
    return cache, outs


@pytest.mark.parametrize(
    "method,d,b,g", [("pqo2", 64, 1, 3), ("pqo4", 32, 2, 1), ("tq3", 64, 1, 2), ("pqo3", 48, 1, 4)]
)
@pytest.mark.parametrize("kernels", [True, False])
def test_cache_with_rotating_mean_decodes_what_it_stores(rng, method, d, b, g, kernels):
    h, n, pre = 2, 300, 260
    k, _ = rope_keys(rng, b, h, n, d, 100000.0, "half")
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    q = rng.standard_normal((b, h * g, n, d)).astype(np.float32)
    with set_kernels_enabled(kernels):
        cache, outs = _filled(method, k, v, q, pre, decode_path="fused")
        codec = cache.layer_codec_state(0)
        assert codec.k_mean_freq is not None and codec.k_mean_pairs.shape == (d // 2, 2)
        r = cache.dequantize(0)
        want = (
            arraykv.attention(q[:, :, -1:], r.k, r.v, softmax_scale=d**-0.5, logit_bias=None)
            if method[:2] != "tq"
            else None
        )
        if want is not None:
            np.testing.assert_allclose(outs[-1].output, want, rtol=2e-4, atol=2e-5)
        ref = polar_decode_attention_reference(codec, q[:, :, -1:], d**-0.5)
        np.testing.assert_allclose(outs[-1].output, ref, rtol=2e-4, atol=2e-5)
    # the stored keys are far closer than with plain centering
    plain, _ = _filled(method, k, v, q, pre, rope=None)
    err = float(((r.k - k) ** 2).sum())
    err_plain = float(((plain.dequantize(0).k - k) ** 2).sum())
    assert err < 0.65 * err_plain  # 0.31-0.54 of it over eight seeds of each case


def test_parallel_kernel_path_matches_reference(rng, monkeypatch):
    from arraykv.ops.numba.threads import serial_below

    d, h, g = 64, 2, 2
    k, _ = rope_keys(rng, 1, h, 1200, d, 10000.0, "interleaved")
    v = rng.standard_normal((1, h, 1200, d)).astype(np.float32)
    q = rng.standard_normal((1, h * g, 1200, d)).astype(np.float32)
    with serial_below(1):
        cache, outs = _filled("pqo3", k, v, q, 1190)
    codec = cache.layer_codec_state(0)
    ref = polar_decode_attention_reference(codec, q[:, :, -1:], d**-0.5)
    np.testing.assert_allclose(outs[-1].output, ref, rtol=2e-4, atol=2e-5)


def test_rotating_mean_survives_save_and_load(rng, tmp_path):
    d, h = 32, 2
    k, _ = rope_keys(rng, 1, h, 200, d, 100000.0, "half")
    v = rng.standard_normal((1, h, 200, d)).astype(np.float32)
    q = rng.standard_normal((1, h, 200, d)).astype(np.float32)
    cache, _ = _filled("pqo3", k, v, q, 150)
    cache.save(tmp_path / "c.akv")
    back = arraykv.load(tmp_path / "c.akv")
    np.testing.assert_array_equal(back.dequantize(0).k, cache.dequantize(0).k)
    assert back.get_config()["rope"] == "auto"
    cfg = arraykv.AttendConfig(softmax_scale=d**-0.5, n_kv_groups=1)
    a = cache.decode(0, k[:, :, -1:], v[:, :, -1:], q[:, :, -1:], cfg).output
    c = back.decode(0, k[:, :, -1:], v[:, :, -1:], q[:, :, -1:], cfg).output
    np.testing.assert_array_equal(a, c)
