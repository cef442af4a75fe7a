import threading

import numpy as np
import pytest

import arraykv

from cache_contract import assert_same_snapshot, attend, random_kvq, snapshot
from conftest import asarray, to_np


def make(**kw):
    opts = dict(num_layers=3, num_kv_heads=2, head_dim=16)
    opts.update(kw)
    return arraykv.make_cache("dense", **opts)


def test_is_a_compressed_kv_cache():
    assert isinstance(make(), arraykv.CompressedKVCache)
    assert "dense" in arraykv.available_methods()


@pytest.mark.parametrize("g", [1, 4])
def test_prefill_then_decodes_match_full_attention(xp, rng, g):
    cache = make()
    scale = 0.25
    cfg = arraykv.AttendConfig(scale, g)
    ks, vs = [], []
    k, v, q = random_kvq(rng, xp, 2, 2, g, 7, 16)
    r = cache.prefill(1, k, v, q)
    ks.append(to_np(k))
    vs.append(to_np(v))
    np.testing.assert_array_equal(to_np(r.k), ks[0])
    assert r.logit_bias is None
    for _ in range(40):
        k, v, q = random_kvq(rng, xp, 2, 2, g, 1, 16)
        out = cache.decode(1, k, v, q, cfg)
        ks.append(to_np(k))
        vs.append(to_np(v))
        full_k, full_v = np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)
        np.testing.assert_array_equal(to_np(out.result.k), full_k)
        np.testing.assert_array_equal(to_np(out.result.v), full_v)
        want = arraykv.attention(q, asarray(xp, full_k), asarray(xp, full_v), softmax_scale=scale)
        np.testing.assert_array_equal(to_np(attend(out, q, scale)), to_np(want))
    assert cache.seq_len(1) == 47 and cache.seq_len(0) == 0


def test_several_prefills_and_prefill_after_decode(xp, rng):
    cache = make()
    parts = []
    for t in (5, 1, 3):
        k, v, q = random_kvq(rng, xp, 1, 2, 2, t, 16)
        if t == 1:
            cache.decode(0, k, v, q, arraykv.AttendConfig(1.0, 2))
        else:
            cache.prefill(0, k, v, q)
        parts.append(to_np(k))
    r = cache.dequantize(0)
    np.testing.assert_array_equal(to_np(r.k), np.concatenate(parts, axis=2))


def test_seq_len_reset_memory_usage(xp, rng):
    cache = make()
    assert cache.memory_usage() == 0 and cache.dequantize(0) is None
    k, v, q = random_kvq(rng, xp, 1, 2, 1, 10, 16)
    cache.prefill(0, k, v, q)
    cache.prefill(2, k, v, q)
    assert cache.memory_usage() == 2 * 2 * (1 * 2 * 10 * 16 * 4)
    assert cache.reserved_bytes() >= cache.memory_usage()
    cache.reset()
    assert [cache.seq_len(i) for i in range(3)] == [0, 0, 0]
    assert cache.memory_usage() == 0
    cache.prefill(0, k, v, q)
    assert cache.seq_len(0) == 10


def test_growth_is_amortized(rng):
    cache = make(num_layers=1)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 1, 16)
    cfg = arraykv.AttendConfig(1.0)
    for _ in range(2000):
        cache.decode(0, k, v, q, cfg)
    buf = cache._states[0].buf
    # steps of 64 tokens (10 % while that is more): ceil(2000 / 64) = 32 copies, each of the tokens
    # held, once per 64 appended (see TokenBuffers' Notes)
    assert buf.reallocations <= 32
    assert cache.used_bytes() == 2000 * 2 * 2 * 16 * 4
    assert cache.memory_usage() <= (2000 + 64) * 2 * 2 * 16 * 4


def test_max_tokens(rng):
    cache = make(max_tokens=8)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 6, 16)
    cache.prefill(0, k, v, q)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_tokens"):
        cache.prefill(0, k, v, q)
    assert_same_snapshot(before, snapshot(cache))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dtype_preserved(rng, dtype):
    cache = make()
    k, v, q = random_kvq(rng, np, 1, 2, 2, 4, 16, dtype)
    r = cache.prefill(0, k, v, q)
    assert r.k.dtype == np.dtype(dtype) and r.v.dtype == np.dtype(dtype)
    k, v, q = random_kvq(rng, np, 1, 2, 2, 1, 16, dtype)
    out = cache.decode(0, k, v, q, arraykv.AttendConfig(0.25, 2))
    assert out.result.k.dtype == np.dtype(dtype)
    assert attend(out, q, 0.25).dtype == np.dtype(dtype)


def _run_layer(cache, layer, seed, steps=30):
    rng = np.random.default_rng(seed)
    cfg = arraykv.AttendConfig(0.2, 2)
    outs = []
    k, v, q = random_kvq(rng, np, 2, 2, 2, 12, 16)
    cache.prefill(layer, k, v, q)
    for _ in range(steps):
        k, v, q = random_kvq(rng, np, 2, 2, 2, 1, 16)
        outs.append(np.array(attend(cache.decode(layer, k, v, q, cfg), q, 0.2)))
    return outs


def test_threads_on_different_layers_match_sequential():
    seq = make(num_layers=8)
    want = [_run_layer(seq, i, 100 + i) for i in range(8)]
    par = make(num_layers=8)
    got = [None] * 8
    errors = []

    def work(i):
        try:
            got[i] = _run_layer(par, i, 100 + i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            np.testing.assert_array_equal(a, b)
    assert_same_snapshot(snapshot(seq), snapshot(par))


def test_reset_concurrent_with_decodes_never_half_resets():
    cache = make(num_layers=4)
    cfg = arraykv.AttendConfig(0.2, 1)
    rng = np.random.default_rng(0)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 1, 16)
    stop = threading.Event()
    errors = []

    def decoder(layer):
        try:
            while not stop.is_set():
                out = cache.decode(layer, k, v, q, cfg)
                assert out.result.k.shape[2] >= 1
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):
        cache.reset()
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    for i in range(4):
        n = cache.seq_len(i)
        assert to_np(cache.dequantize(i).k).shape[2] == n if n else cache.dequantize(i) is None


def test_buffers_are_sized_exactly_for_a_prompt_and_within_ten_percent_after_chunks(rng):
    cache = make(num_layers=1)
    k, v, q = random_kvq(rng, np, 1, 2, 1, 1000, 16)
    cache.prefill(0, k, v, q)
    assert cache.memory_usage() == cache.used_bytes()  # one prompt: no spare room
    chunked = make(num_layers=1)
    for i in range(0, 1000, 100):
        chunked.prefill(0, k[:, :, i : i + 100], v[:, :, i : i + 100], q[:, :, i : i + 100])
    assert chunked.used_bytes() == cache.used_bytes()
    assert chunked.memory_usage() <= 1.1 * chunked.used_bytes() + 64 * 2 * 2 * 16 * 4
    assert chunked._states[0].buf.reallocations <= 10
