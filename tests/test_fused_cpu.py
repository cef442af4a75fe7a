"""Fused decode attention from packed PolarQuant/TurboQuant codes (issue: never dequantize)."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

import arraykv
from arraykv.attention.polar_fused import polar_decode_attention, polar_decode_attention_reference
from arraykv.backends import lookup, set_kernels_enabled

MODES = ["pqo2", "pqo3", "pqo4", "pq3", "tq3", "tq4"]


def _filled(method, d, g, b, tokens, rng, h=2, window=None):
    opts = {} if window is None else {"residual_window": window}
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, **opts)
    offset = rng.standard_normal(d) * 2.0
    spread = np.ones(d)
    spread[rng.choice(d, 3, replace=False)] = 12.0  # a few outlier key channels
    k = (rng.standard_normal((b, h, tokens, d)) * spread + offset).astype(np.float32)
    v = rng.standard_normal((b, h, tokens, d)).astype(np.float32)
    cache.prefill(0, k, v, rng.standard_normal((b, h * g, tokens, d)).astype(np.float32))
    for _ in range(3):
        k1 = (rng.standard_normal((b, h, 1, d)) * spread + offset).astype(np.float32)
        v1 = rng.standard_normal((b, h, 1, d)).astype(np.float32)
        q1 = rng.standard_normal((b, h * g, 1, d)).astype(np.float32)
        out = cache.decode(0, k1, v1, q1, arraykv.AttendConfig(d**-0.5, g))
    return cache, q1, out


def _exact_over_dequantized(cache, q, scale):
    """Attention over the cache's dequantized K/V plus its QJL logit bias (the Dequantized path)."""
    with set_kernels_enabled(False):
        st = cache.layer_codec_state(0)
    r = cache.dequantize(0)
    bias = None
    if st.qjl is not None and st.n_quantized:
        layer = cache._states[0]
        bias = cache._qjl_bias(layer, q, scale)
    return arraykv.attention(q, r.k, r.v, softmax_scale=scale, logit_bias=bias)


@pytest.mark.parametrize("method", MODES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("b", [1, 3])
def test_fused_equals_attention_over_dequantized(method, d, g, b, rng):
    cache, q, _ = _filled(method, d, g, b, 150, rng)
    scale = d**-0.5
    codec = cache.layer_codec_state(0)
    want = np.asarray(_exact_over_dequantized(cache, q, scale), np.float64)
    with set_kernels_enabled(False):
        ref = np.asarray(polar_decode_attention(codec, q, scale), np.float64)
    fused = np.asarray(polar_decode_attention(codec, q, scale), np.float64)
    denom = np.abs(want).max()
    assert np.abs(ref - want).max() <= 1e-4 * denom
    assert np.abs(fused - want).max() <= 1e-4 * denom
    assert fused.shape == (b, 2 * g, 1, d)


def test_kernel_is_used_on_numpy():
    assert lookup("polar_decode_attention", arraykv._compat.namespace(np.zeros(1))) is not None


@pytest.mark.parametrize("tokens,window", [(t, w) for t in (0, 1, 63, 64, 65, 1000) for w in (0, 16) if t + w])
def test_token_counts_around_tiles_and_window(tokens, window, rng):
    d, g, b = 64, 2, 2
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=d, residual_window=window)
    n = tokens + window
    k = rng.standard_normal((b, 2, n, d)).astype(np.float32)
    v = rng.standard_normal((b, 2, n, d)).astype(np.float32)
    cache.prefill(0, k, v, rng.standard_normal((b, 2 * g, n, d)).astype(np.float32))
    codec = cache.layer_codec_state(0)
    assert codec.n_quantized == tokens and codec.n_window == window
    q = rng.standard_normal((b, 2 * g, 1, d)).astype(np.float32)
    want = np.asarray(_exact_over_dequantized(cache, q, 0.125), np.float64)
    got = np.asarray(polar_decode_attention(codec, q, 0.125), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_float16_queries_give_float16_output(rng):
    cache, q, _ = _filled("pqo4", 64, 2, 1, 100, rng)
    out = polar_decode_attention(cache.layer_codec_state(0), q.astype(np.float16), 0.125)
    assert out.dtype == np.float16


def test_step_memory_does_not_grow_with_context(rng):
    """Peak traced allocation of one fused step is the same at 1k and 8k tokens."""
    d, g = 128, 4
    cache, q, _ = _filled("pqo4", d, g, 1, 8000, rng, h=4)
    full = cache.layer_codec_state(0)

    def peak(codec):
        polar_decode_attention(codec, q, 0.1)  # compiled and warm
        tracemalloc.start()
        polar_decode_attention(codec, q, 0.1)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    n = 1000
    short = dataclasses.replace(full, n_quantized=n, **{name: getattr(full, name)[:, :, :n, ...] for name in
                                ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers") if getattr(full, name) is not None})
    small, large = peak(short), peak(full)
    # dense float32 K/V of the extra 7000 tokens would be 7000*4*128*4*2 = 28 MB
    assert large <= small + 64 * 1024, (small, large)


@pytest.mark.parametrize("method", ["pqo4", "tq3"])
def test_cache_decode_returns_fused_on_numpy_and_matches_dequantized(method, rng):
    d, g = 64, 4
    caches = {path: arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=d, decode_path=path)
              for path in ("auto", "fused", "dequantized")}
    k = rng.standard_normal((1, 2, 80, d)).astype(np.float32)
    v = rng.standard_normal((1, 2, 80, d)).astype(np.float32)
    q = rng.standard_normal((1, 2 * g, 80, d)).astype(np.float32)  # the same calibration for all three
    for c in caches.values():
        c.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(d**-0.5, g)
    for _ in range(5):
        k1, v1 = (rng.standard_normal((1, 2, 1, d)).astype(np.float32) for _ in range(2))
        q1 = rng.standard_normal((1, 2 * g, 1, d)).astype(np.float32)
        out = {p: c.decode(0, k1, v1, q1, cfg) for p, c in caches.items()}
        assert isinstance(out["auto"], arraykv.Fused) and isinstance(out["fused"], arraykv.Fused)
        assert isinstance(out["dequantized"], arraykv.Dequantized)
        r = out["dequantized"].result
        want = arraykv.attention(q1, r.k, r.v, softmax_scale=cfg.softmax_scale, logit_bias=r.logit_bias)
        for p in ("auto", "fused"):
            np.testing.assert_allclose(out[p].output, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_decode_path_without_kernels(rng):
    """'auto' falls back to Dequantized without a kernel; 'fused' uses the array-API version."""
    d = 32
    k = rng.standard_normal((1, 1, 40, d)).astype(np.float32)
    q = rng.standard_normal((1, 1, 1, d)).astype(np.float32)
    with set_kernels_enabled(False):
        auto = arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=d)
        fused = arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=d, decode_path="fused")
        for c in (auto, fused):
            c.prefill(0, k, k, rng.standard_normal((1, 1, 40, d)).astype(np.float32))
        a = auto.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
        f = fused.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
    assert isinstance(a, arraykv.Dequantized) and isinstance(f, arraykv.Fused)
    want = arraykv.attention(q, a.result.k, a.result.v, softmax_scale=0.2)
    np.testing.assert_allclose(f.output, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="decode_path"):
        arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=d, decode_path="fast")
