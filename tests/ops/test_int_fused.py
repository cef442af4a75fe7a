"""Fused decode attention from the packed codes of the int2/int4/int8 caches."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

import arraykv
from arraykv.attention.int_fused import int_decode_attention_reference
from arraykv.ops import int_decode_attention, lookup, set_kernels_enabled

from conftest import asarray, to_np
from naive import int_decode_attention_loops

#: contexts (tokens held when attending) for group_size 32: shorter than one group, exactly at
#: one and at two group boundaries, partial groups (and for int2 quantized values short of a
#: group), and long with a partial residual
CONTEXTS = {"short": 5, "one_group": 32, "two_groups": 64, "partial": 45, "long": 301}
METHODS = ["int2", "int4", "int8"]


def _fill(method, d, g, b, tokens, rng, h=3, dtype=np.float32, **opts):
    """A cache holding ``tokens`` tokens, the last one stored by ``decode``; (cache, q, decode output)."""
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=h, head_dim=d, **opts)
    offset = rng.standard_normal(d) * 2.0
    spread = np.ones(d)
    spread[rng.choice(d, min(3, d), replace=False)] = 10.0  # outlier key channels, as real keys have
    k = (rng.standard_normal((b, h, tokens, d)) * spread + offset).astype(dtype)
    v = (rng.standard_normal((b, h, tokens, d)) + 0.5).astype(dtype)
    if tokens > 1:
        cache.prefill(0, k[:, :, :-1], v[:, :, :-1], rng.standard_normal((b, h * g, tokens - 1, d)).astype(dtype))
    q = rng.standard_normal((b, h * g, 1, d)).astype(dtype)
    out = cache.decode(0, k[:, :, -1:], v[:, :, -1:], q, arraykv.AttendConfig(d**-0.5, g))
    return cache, q, out


def _over_dequantized(cache, q, scale):
    r = cache.dequantize(0)
    return np.asarray(arraykv.attention(q, r.k, r.v, softmax_scale=scale), np.float64)


def _close(got, want, tol=1e-4):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= tol, err


def _first_tokens(codec, n):
    """The codec state of the first ``n`` tokens (views); ``n`` a multiple of the group size, all quantized."""
    G = codec.group_size
    ng = n // G
    assert ng <= codec.n_groups and n <= codec.v_codes.shape[2]
    return dataclasses.replace(
        codec,
        n_tokens=n,
        n_groups=ng,
        n_residual=0,
        k_codes=codec.k_codes[:, :, :ng],
        k_scale=codec.k_scale[:, :, :ng],
        k_offset=codec.k_offset[:, :, :ng],
        k_residual=codec.k_residual[:, :, :0],
        v_codes=codec.v_codes[:, :, :n],
        v_scale=codec.v_scale[:, :, :n],
        v_offset=codec.v_offset[:, :, :n],
        n_window=0,
        v_window=None,
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("d", [64, 128, 33])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("context", list(CONTEXTS))
def test_fused_equals_reference_equals_attention_over_dequantized(method, d, g, b, context, rng):
    n = CONTEXTS[context]
    cache, q, out = _fill(method, d, g, b, n, rng)
    assert isinstance(out, arraykv.Fused)
    codec = cache.layer_codec_state(0)
    assert codec.n_tokens == n and codec.n_groups == n // 32 and codec.n_residual == n % 32
    assert codec.n_window == (min(n, 32) if method == "int2" else 0)
    scale = d**-0.5
    want = _over_dequantized(cache, q, scale)
    _close(out.output, want)
    _close(int_decode_attention(codec, q, scale), want)
    _close(int_decode_attention_reference(codec, q, scale), want)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("group_size", [1, 7, 16, 128])
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_group_sizes_and_scale_dtypes(method, group_size, scale_dtype, rng):
    """Odd groups end mid-byte (int4, int2), one-token groups, groups longer than a tile; float32 scales."""
    window = {"residual_window": 2 * group_size} if method == "int2" else {}
    cache, q, out = _fill(
        method, 40, 2, 2, 2 * group_size + 9, rng, h=2, group_size=group_size, scale_dtype=scale_dtype, **window
    )
    codec = cache.layer_codec_state(0)
    assert codec.k_scale.dtype == np.dtype(scale_dtype) and codec.v_scale.dtype == np.dtype(scale_dtype)
    want = _over_dequantized(cache, q, 40**-0.5)
    _close(out.output, want)
    _close(int_decode_attention_reference(codec, q, 40**-0.5), want)


def test_float16_tokens_and_query_dtypes(rng):
    """float16 residual keys are read exactly; the output has the query's dtype."""
    cache, q, out = _fill("int4", 64, 3, 1, 50, rng, dtype=np.float16)
    assert out.output.dtype == np.float16 and cache.layer_codec_state(0).k_residual.dtype == np.float16
    codec = cache.layer_codec_state(0)
    want = np.asarray(int_decode_attention_reference(codec, q.astype(np.float32), 0.125), np.float64)
    for dtype, tol in ((np.float16, 2e-3), (np.float32, 1e-4), (np.float64, 1e-4)):
        got = int_decode_attention(codec, q.astype(dtype), 0.125)
        assert got.dtype == dtype and got.shape == q.shape
        _close(got, want, tol)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("method", METHODS)
def test_parallel_kernel_and_token_splits(splits, method, rng, monkeypatch):
    """The threaded kernel, forced on a small cache, with 1–7 spans per head (empty ones included)."""
    from arraykv.ops.numba import int_fused as nf

    cache, q, _ = _fill(method, 64, 3, 2, 45 + 40 * splits, rng)
    codec = cache.layer_codec_state(0)
    serial = np.asarray(int_decode_attention(codec, q, 0.125), np.float64)
    calls = []
    real = nf._step_parallel

    def spy(*args):
        calls.append(args[-2])
        return real(*args)

    monkeypatch.setattr(nf, "_plan", lambda bh, n, d, group: (nf.nb.get_num_threads(), splits))
    monkeypatch.setattr(nf, "_step_parallel", spy)
    par = int_decode_attention(codec, q, 0.125)
    assert calls == [splits]
    _close(par, serial, 1e-5)
    _close(par, np.asarray(int_decode_attention_reference(codec, q, 0.125), np.float64))
    # more spans than key groups: trailing spans are empty
    few = _first_tokens(codec, 32)
    monkeypatch.setattr(nf, "_plan", lambda bh, n, d, group: (nf.nb.get_num_threads(), 5))
    _close(int_decode_attention(few, q, 0.125), np.asarray(int_decode_attention_reference(few, q, 0.125), np.float64))


def test_threshold_picks_the_parallel_kernel(rng, monkeypatch):
    """Below PARALLEL_MIN_WORK the serial kernel runs; with the threshold at 1 the threaded one."""
    from arraykv.ops.numba import int_fused as nf
    from arraykv.ops.numba.threads import PARALLEL_MIN_WORK, serial_below

    assert nf._plan(3, (PARALLEL_MIN_WORK // 64 - 1) // 3, 64, 32) == (1, 1)
    cache, q, _ = _fill("int4", 64, 3, 1, 512, rng)  # the SmolLM2-135M shape
    codec = cache.layer_codec_state(0)

    def fail(*args):
        raise AssertionError("the threaded kernel ran for a small step")

    monkeypatch.setattr(nf, "_step_parallel", fail)
    serial = np.asarray(int_decode_attention(codec, q, 0.125), np.float64)
    monkeypatch.undo()
    calls = []
    real = nf._step_parallel

    def spy(*args):
        calls.append(args[-2])
        return real(*args)

    monkeypatch.setattr(nf, "_step_parallel", spy)
    with serial_below(1):
        par = int_decode_attention(codec, q, 0.125)
    assert len(calls) == 1 and calls[0] >= 1
    _close(par, serial, 1e-5)


@pytest.mark.parametrize("threaded", [False, True])
def test_step_memory_does_not_grow_with_context(threaded, rng, monkeypatch):
    """Peak traced allocation of one fused step is about the same at 1k and 8k tokens.

    Each task of the threaded kernel holds its own tile buffers (~50 KB here) while it runs,
    so that path is allowed a margin per thread; dense float32 K/V of the extra ~7000 tokens
    would be 7000*4*128*4*2 = 28 MB.
    """
    from arraykv.ops.numba import int_fused as nf
    from arraykv.ops.numba.threads import serial_below

    cache, q, _ = _fill("int4", 128, 4, 1, 8000, rng, h=4)
    full = cache.layer_codec_state(0)

    def peak(codec):
        with serial_below(1 if threaded else 1 << 62):
            int_decode_attention(codec, q, 0.1)  # compiled and warm
            tracemalloc.start()
            int_decode_attention(codec, q, 0.1)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(_first_tokens(full, 1024)), peak(full)
    margin = 128 * 1024 * nf.nb.get_num_threads() if threaded else 16 * 1024
    assert large <= small + margin, (small, large)


def test_kernel_is_registered_for_numpy():
    assert lookup("int_decode_attention", arraykv._compat.namespace(np.zeros(1))) is not None


@pytest.mark.parametrize("method", METHODS)
def test_decode_paths_agree(method, rng):
    """'auto' and 'fused' return Fused on NumPy, 'dequantized' Dequantized; the outputs agree."""
    d, g = 64, 3
    caches = {
        path: arraykv.make_cache(method, num_layers=1, num_kv_heads=3, head_dim=d, decode_path=path)
        for path in ("auto", "fused", "dequantized")
    }
    k = rng.standard_normal((1, 3, 40, d)).astype(np.float32)
    v = rng.standard_normal((1, 3, 40, d)).astype(np.float32)
    q = rng.standard_normal((1, 3 * g, 40, d)).astype(np.float32)
    for c in caches.values():
        c.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(d**-0.5, g)
    for _ in range(30):  # crosses a group boundary: the residual becomes a quantized group
        k1, v1 = (rng.standard_normal((1, 3, 1, d)).astype(np.float32) for _ in range(2))
        q1 = rng.standard_normal((1, 3 * g, 1, d)).astype(np.float32)
        out = {p: c.decode(0, k1, v1, q1, cfg) for p, c in caches.items()}
        assert isinstance(out["auto"], arraykv.Fused) and isinstance(out["fused"], arraykv.Fused)
        assert isinstance(out["dequantized"], arraykv.Dequantized)
        r = out["dequantized"].result
        want = np.asarray(arraykv.attention(q1, r.k, r.v, softmax_scale=cfg.softmax_scale), np.float64)
        for p in ("auto", "fused"):
            _close(out[p].output, want)


def test_decode_path_without_kernels(rng):
    """'auto' falls back to Dequantized without a kernel; 'fused' uses the array-API version."""
    d = 32
    k = rng.standard_normal((1, 1, 40, d)).astype(np.float32)
    q = rng.standard_normal((1, 1, 1, d)).astype(np.float32)
    with set_kernels_enabled(False):
        auto = arraykv.make_cache("int4", num_layers=1, num_kv_heads=1, head_dim=d)
        fused = arraykv.make_cache("int4", num_layers=1, num_kv_heads=1, head_dim=d, decode_path="fused")
        for c in (auto, fused):
            c.prefill(0, k, k, k)
        a = auto.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
        f = fused.decode(0, k[:, :, :1], k[:, :, :1], q, arraykv.AttendConfig(0.2))
    assert isinstance(a, arraykv.Dequantized) and isinstance(f, arraykv.Fused)
    want = np.asarray(arraykv.attention(q, a.result.k, a.result.v, softmax_scale=0.2), np.float64)
    _close(f.output, want)


@pytest.mark.parametrize("method", ["int2", "int4"])
def test_reference_in_any_namespace(xp, rng, method):
    """The array-API reference agrees with attention over the dequantized cache in every namespace."""
    d, g, n = 48, 2, 77
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=d, group_size=16, decode_path="fused")
    cache.prefill(
        0,
        asarray(xp, rng.standard_normal((2, 2, n, d)), "float32"),
        asarray(xp, rng.standard_normal((2, 2, n, d)), "float32"),
        asarray(xp, rng.standard_normal((2, 2 * g, n, d)), "float32"),
    )
    q = asarray(xp, rng.standard_normal((2, 2 * g, 1, d)), "float32")
    out = cache.decode(
        0,
        asarray(xp, rng.standard_normal((2, 2, 1, d)), "float32"),
        asarray(xp, rng.standard_normal((2, 2, 1, d)), "float32"),
        q,
        arraykv.AttendConfig(0.15, g),
    )
    assert isinstance(out, arraykv.Fused)
    r = cache.dequantize(0)
    want = to_np(arraykv.attention(q, r.k, r.v, softmax_scale=0.15)).astype(np.float64)
    _close(to_np(out.output), want)
    _close(to_np(int_decode_attention_reference(cache.layer_codec_state(0), q, 0.15)), want)


@pytest.mark.parametrize("bad", ["fast", "Fused", None, 1])
def test_bad_decode_path_is_rejected(bad):
    with pytest.raises(ValueError, match="decode_path must be one of auto, fused, dequantized"):
        arraykv.make_cache("int8", num_layers=1, num_kv_heads=1, head_dim=8, decode_path=bad)


def test_decode_path_in_config_and_saved_file(tmp_path, rng):
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=1, head_dim=16, decode_path="dequantized")
    assert cache.get_config()["decode_path"] == "dequantized"
    assert arraykv.make_cache(**cache.get_config()).decode_path == "dequantized"
    cache.prefill(0, *(rng.standard_normal((1, 1, 9, 16)).astype(np.float32) for _ in range(3)))
    from arraykv.persist import load_cache

    cache.save(tmp_path / "c.akv")
    back = load_cache(tmp_path / "c.akv")
    assert back.decode_path == "dequantized" and back.get_config() == cache.get_config()
    assert arraykv.make_cache("int4", num_layers=1, num_kv_heads=1, head_dim=16).get_config()["decode_path"] == "auto"


def test_more_than_one_query_token_is_rejected(rng):
    cache, q, _ = _fill("int4", 64, 2, 1, 40, rng)
    with pytest.raises(ValueError, match="one new token"):
        int_decode_attention(cache.layer_codec_state(0), np.concatenate([q, q], axis=2), 0.125)
    with pytest.raises(ValueError, match="one new token"):
        int_decode_attention_reference(cache.layer_codec_state(0), np.concatenate([q, q], axis=2), 0.125)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize(
    "method,opts",
    [("int2", {}), ("int2", {"residual_window": 16}), ("int4", {}), ("int8", {}), ("int4", {"residual_window": 8})],
)
@pytest.mark.parametrize("d,g,b,n", [(16, 1, 1, 5), (16, 3, 2, 40), (33, 4, 1, 70), (8, 2, 2, 100)])
def test_fused_equals_plain_loops(kernels, method, opts, d, g, b, n, rng):
    """Keys and values rebuilt element by element from the codec's documented formulas, then attention by loops."""
    with set_kernels_enabled(kernels):
        cache, q, out = _fill(method, d, g, b, n, rng, h=2, group_size=8, decode_path="fused", **opts)
        codec = cache.layer_codec_state(0)
        got = int_decode_attention(codec, q, d**-0.5)
    want = int_decode_attention_loops(codec, q, d**-0.5)
    _close(out.output, want)
    _close(got, want)


def test_inconsistent_codec_is_rejected(rng):
    cache, q, _ = _fill("int2", 64, 2, 1, 50, rng)
    codec = cache.layer_codec_state(0)
    for bad in (
        dataclasses.replace(codec, n_window=0, v_window=None),
        dataclasses.replace(codec, n_tokens=49),
        dataclasses.replace(codec, n_residual=codec.n_residual - 1),
    ):
        for fn in (int_decode_attention, int_decode_attention_reference):
            with pytest.raises(ValueError, match="codec counts disagree"):
                fn(bad, q, 0.125)
