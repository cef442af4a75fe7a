"""Fused decode attention from packed PolarQuant/TurboQuant codes (issue: never dequantize)."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

import arraykv
from arraykv.attention.polar_fused import polar_decode_attention_reference
from arraykv.caches.polar_decode import qjl_logit_bias
from arraykv.ops import lookup, polar_decode_attention, set_kernels_enabled

MODES = ["pqo2", "pqo3", "pqo4", "pq3", "tq3", "tq4"]
#: (residual_window, sink_tokens): float16 recent tokens and first tokens kept exactly
EXACT = {"window+sinks": (24, 4), "none": (0, 0), "window": (24, 0), "sinks": (0, 4)}


def _filled(method, d, g, b, tokens, rng, h=2, window=None, sinks=None, **opts):
    if window is not None:
        opts["residual_window"] = window
    if sinks is not None:
        opts["sink_tokens"] = sinks
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, **opts)
    offset = rng.standard_normal(d) * 2.0
    spread = np.ones(d)
    spread[rng.choice(d, 3, replace=False)] = 12.0  # a few outlier key channels
    k = (rng.standard_normal((b, h, tokens, d)) * spread + offset).astype(np.float32)
    v = (rng.standard_normal((b, h, tokens, d)) + 0.5).astype(np.float32)
    cache.prefill(0, k, v, rng.standard_normal((b, h * g, tokens, d)).astype(np.float32))
    for _ in range(3):
        k1 = (rng.standard_normal((b, h, 1, d)) * spread + offset).astype(np.float32)
        v1 = (rng.standard_normal((b, h, 1, d)) + 0.5).astype(np.float32)
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
        bias = qjl_logit_bias(layer, cache._codec(layer.xp, layer.device), q, scale)
    return arraykv.attention(q, r.k, r.v, softmax_scale=scale, logit_bias=bias)


def _first_tokens(codec, n):
    """The codec state of the first ``n`` quantized tokens (views)."""
    per_token = ("k_codes", "k_norms", "v_codes", "v_norms", "k_outliers", "k_qjl", "k_qjl_norms")
    return dataclasses.replace(
        codec,
        n_quantized=n,
        **{name: getattr(codec, name)[:, :, :n, ...] for name in per_token if getattr(codec, name) is not None},
    )


def _reference(codec, q, scale):
    return np.asarray(polar_decode_attention_reference(codec, q, scale), np.float64)


def _check_three_ways(cache, q, scale, tol=1e-4):
    """Fused kernel == array-API reference == attention over the dequantized cache (relative ``tol``)."""
    codec = cache.layer_codec_state(0)
    want = np.asarray(_exact_over_dequantized(cache, q, scale), np.float64)
    ref = _reference(codec, q, scale)
    fused = np.asarray(polar_decode_attention(codec, q, scale), np.float64)
    denom = np.abs(want).max()
    assert fused.shape == want.shape == q.shape
    assert np.abs(ref - want).max() <= tol * denom
    assert np.abs(fused - want).max() <= tol * denom
    assert np.abs(fused - ref).max() <= tol * denom
    return codec


@pytest.mark.parametrize("method", MODES)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("exact", ["window+sinks", "none"])
def test_fused_equals_attention_over_dequantized(method, d, g, b, exact, rng):
    window, sinks = EXACT[exact]
    cache, q, _ = _filled(method, d, g, b, 130, rng, window=window, sinks=sinks)
    codec = _check_three_ways(cache, q, d**-0.5)
    assert codec.n_window == (window + sinks) and codec.n_sink == sinks
    assert (codec.rotation.matrix is None) == (d != 96)


@pytest.mark.parametrize("method", MODES)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("exact", ["window", "sinks"])
def test_fused_with_only_window_or_only_sinks(method, d, exact, rng):
    window, sinks = EXACT[exact]
    cache, q, _ = _filled(method, d, 4, 2, 90, rng, window=window, sinks=sinks)
    codec = _check_three_ways(cache, q, 0.3)
    assert codec.n_window == window + sinks


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("d", [20, 33, 64])
@pytest.mark.parametrize("qjl", [False, True])
def test_every_bit_width(bits, d, qjl, rng):
    """Keys and values at widths 1–8 (3, 5, 7 bits straddle bytes; d = 20 and 33 end mid-group, 33 mid-byte)."""
    cache, q, _ = _filled("tq4" if qjl else "pqo4", d, 3, 2, 80, rng, key_bits=bits, value_bits=9 - bits)
    codec = _check_three_ways(cache, q, d**-0.5)
    assert (codec.k_codebook.bits, codec.v_codebook.bits) == (bits, 9 - bits)


@pytest.mark.parametrize(
    "opts",
    [
        {"key_scale": True},
        {"center": False},
        {"center": True, "outliers": 5},
        {"outliers": 0},
        {"key_scale": True, "outliers": 2, "center": True},
    ],
)
@pytest.mark.parametrize("method", ["pqo3", "tq3"])
def test_calibration_options(opts, method, rng):
    cache, q, _ = _filled(method, 64, 4, 2, 100, rng, **opts)
    codec = _check_three_ways(cache, q, 0.125)
    if opts.get("outliers"):
        assert codec.k_outlier_idx.shape[-1] == opts["outliers"]
    if opts.get("key_scale"):
        assert np.ptp(codec.k_scale.astype(np.float32)) > 0  # the weights are not all ones


@pytest.mark.parametrize("d", [64, 96])
def test_absent_side_arrays_read_as_defaults(d, rng):
    """k_scale None -> ones, k_mean/v_mean None -> zeros, k_outlier_idx None -> no outlier channel."""
    cache, q, _ = _filled("tq4", d, 2, 2, 120, rng, center=True, outliers=3)
    full = cache.layer_codec_state(0)
    ones = np.ones_like(full.k_scale)
    variants = [
        dict(k_scale=None),
        dict(k_mean=None, v_mean=None),
        dict(k_outlier_idx=None, k_outliers=None),
        dict(k_scale=None, k_mean=None, v_mean=None, k_outlier_idx=None, k_outliers=None),
    ]
    outs = []
    for change in variants:
        codec = dataclasses.replace(full, **change)
        ref = _reference(codec, q, 0.2)
        got = np.asarray(polar_decode_attention(codec, q, 0.2), np.float64)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        outs.append(got)
    # None reads as the neutral value: the same as ones / zeros given explicitly
    same = dataclasses.replace(full, k_scale=ones)
    np.testing.assert_allclose(
        outs[0], np.asarray(polar_decode_attention(same, q, 0.2), np.float64), rtol=1e-6, atol=1e-6
    )
    assert np.abs(outs[1] - outs[0]).max() > 1e-3  # dropping the means changes the result


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("method", ["pqo4", "tq3", "pq3"])
def test_parallel_kernel_and_token_splits(splits, method, rng, monkeypatch):
    """The threaded kernel (forced on a small cache) with 1–7 token spans per head, empty spans included."""
    from arraykv.ops.numba.polar import fused as nf

    cache, q, _ = _filled(method, 96 if method == "pq3" else 64, 4, 2, 20 + 37 * splits, rng)
    codec = cache.layer_codec_state(0)
    serial = np.asarray(polar_decode_attention(codec, q, 0.125), np.float64)
    calls = []
    real = nf._step_parallel

    def spy(*args):
        calls.append(args[-2])
        return real(*args)

    monkeypatch.setattr(nf, "_plan", lambda bh, n, d: (nf.nb.get_num_threads(), splits))
    monkeypatch.setattr(nf, "_step_parallel", spy)
    par = np.asarray(polar_decode_attention(codec, q, 0.125), np.float64)
    assert calls == [splits]
    np.testing.assert_allclose(par, serial, rtol=1e-5, atol=1e-5 * np.abs(serial).max())
    ref = _reference(codec, q, 0.125)
    np.testing.assert_allclose(par, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # more spans than tokens: trailing spans are empty
    few = _first_tokens(codec, 2)
    monkeypatch.setattr(nf, "_plan", lambda bh, n, d: (nf.nb.get_num_threads(), 5))
    got = np.asarray(polar_decode_attention(few, q, 0.125), np.float64)
    want = _reference(few, q, 0.125)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_small_steps_stay_on_the_calling_thread(rng, monkeypatch):
    from arraykv.ops.numba.polar import fused as nf
    from arraykv.ops.numba.threads import PARALLEL_MIN_WORK

    assert nf._plan(3, (PARALLEL_MIN_WORK // 64 - 1) // 3, 64) == (1, 1)
    if nf.nb.get_num_threads() > 1:
        threads, splits = nf._plan(8, 32768, 64)
        assert threads == nf.nb.get_num_threads() and splits >= 1
    cache, q, _ = _filled("pqo4", 64, 3, 1, 500, rng, h=3)

    def fail(*args):
        raise AssertionError("the threaded kernel ran for a small step")

    monkeypatch.setattr(nf, "_step_parallel", fail)
    polar_decode_attention(cache.layer_codec_state(0), q, 0.125)


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
    # float16 rows: the recent-token window plus the first (sink) tokens when the cache keeps them
    assert codec.n_quantized + codec.n_window == n and codec.n_window >= window
    q = rng.standard_normal((b, 2 * g, 1, d)).astype(np.float32)
    want = np.asarray(_exact_over_dequantized(cache, q, 0.125), np.float64)
    got = np.asarray(polar_decode_attention(codec, q, 0.125), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_query_dtype_is_the_output_dtype(dtype, rng):
    cache, q, _ = _filled("pqo4", 64, 2, 1, 100, rng)
    codec = cache.layer_codec_state(0)
    out = polar_decode_attention(codec, q.astype(dtype), 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    want = _reference(codec, q.astype(dtype), 0.125)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_more_than_one_query_token_is_rejected(rng):
    cache, q, _ = _filled("pqo4", 64, 2, 1, 40, rng)
    with pytest.raises(ValueError, match="one new token"):
        polar_decode_attention(cache.layer_codec_state(0), np.concatenate([q, q], axis=2), 0.125)


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

    small, large = peak(_first_tokens(full, 1000)), peak(full)
    # dense float32 K/V of the extra 7000 tokens would be 7000*4*128*4*2 = 28 MB
    assert large <= small + 64 * 1024, (small, large)


@pytest.mark.parametrize("method", ["pqo4", "tq3"])
def test_cache_decode_returns_fused_on_numpy_and_matches_dequantized(method, rng):
    d, g = 64, 4
    caches = {
        path: arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=d, decode_path=path)
        for path in ("auto", "fused", "dequantized")
    }
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
        q40 = rng.standard_normal((1, 1, 40, d)).astype(np.float32)  # the same calibration for both
        for c in (auto, fused):
            c.prefill(0, k, k, q40)
        a = auto.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
        f = fused.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
    assert isinstance(a, arraykv.Dequantized) and isinstance(f, arraykv.Fused)
    want = arraykv.attention(q, a.result.k, a.result.v, softmax_scale=0.2)
    np.testing.assert_allclose(f.output, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="decode_path"):
        arraykv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=d, decode_path="fast")
