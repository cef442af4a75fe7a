"""``append``, ``stable_length`` and ``dequantize(layer, start)`` on every registered method.

What an incremental reader (the ONNX Runtime hook) relies on: ``append`` stores exactly what
``prefill`` stores; ``dequantize(layer, start)`` is the tail of ``dequantize(layer)``; and the
first ``stable_length`` tokens of the reconstruction never change as more tokens arrive.
"""

import numpy as np
import pytest

import arraykv

from cache_contract import assert_same_snapshot, random_kvq, snapshot
from conftest import BUILTIN_METHODS, to_np

H, D = 2, 64
METHODS = list(BUILTIN_METHODS)


def make(method):
    return arraykv.make_cache(method, num_layers=2, num_kv_heads=H, head_dim=D)


def script(rng, xp, steps):
    """Prefills of 40 and 7 tokens, then single tokens."""
    for t in [40, 7] + [1] * steps:
        yield random_kvq(rng, xp, 2, H, 2, t, D)


def has_readback(cache):
    return all(hasattr(cache, n) for n in ("append", "stable_length"))


@pytest.mark.parametrize("method", METHODS)
def test_append_stores_what_prefill_stores(xp, rng, method):
    a, b = make(method), make(method)
    if not has_readback(a):
        pytest.skip("a third-party cache without append")
    for k, v, q in script(rng, xp, 30):
        a.prefill(1, k, v, q)
        assert b.append(1, k, v, q) is None
    assert_same_snapshot(snapshot(a), snapshot(b))


@pytest.mark.parametrize("method", METHODS)
def test_dequantize_from_start_is_the_tail(xp, rng, method):
    cache = make(method)
    if not has_readback(cache):
        pytest.skip("a third-party cache without stable_length")
    assert cache.stable_length(0) == 0 and cache.dequantize(0) is None
    for i, (k, v, q) in enumerate(script(rng, xp, 40)):
        cache.append(0, k, v, q)
        if i % 7 and i != 41:
            continue
        n = cache.seq_len(0)
        full = cache.dequantize(0)
        for start in sorted({0, 1, 3, n // 2, cache.stable_length(0), n - 1, n}):
            part = cache.dequantize(0, start)
            assert part.k.shape == (2, H, n - start, D) and part.k.dtype == full.k.dtype
            np.testing.assert_allclose(to_np(part.k), to_np(full.k)[:, :, start:], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(to_np(part.v), to_np(full.v)[:, :, start:], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="start"):
        cache.dequantize(0, cache.seq_len(0) + 1)
    with pytest.raises(ValueError, match="start"):
        cache.dequantize(0, -1)


@pytest.mark.parametrize("method", METHODS)
def test_the_stable_prefix_never_changes(rng, method):
    cache = make(method)
    if not has_readback(cache):
        pytest.skip("a third-party cache without stable_length")
    seen = []  # (stable length, its reconstruction) after each call
    for k, v, q in script(rng, np, 60):
        cache.append(0, k, v, q)
        s = cache.stable_length(0)
        assert 0 <= s <= cache.seq_len(0)
        r = cache.dequantize(0)
        for s_old, k_old, v_old in seen[-5:] + seen[:2]:
            np.testing.assert_allclose(to_np(r.k)[:, :, :s_old], k_old, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(to_np(r.v)[:, :, :s_old], v_old, rtol=1e-6, atol=1e-6)
        seen.append((s, to_np(r.k)[:, :, :s].copy(), to_np(r.v)[:, :, :s].copy()))
    if method == "dense":
        assert seen[-1][0] == cache.seq_len(0)
    elif method != "test-noisy-f16":
        # after 107 tokens every codec has encoded most of them for good
        assert seen[-1][0] >= cache.seq_len(0) - 40, (method, seen[-1][0])


@pytest.mark.parametrize("method", METHODS)
def test_a_rejected_append_changes_nothing(rng, method):
    cache = make(method)
    if not has_readback(cache):
        pytest.skip("a third-party cache without append")
    for k, v, q in script(rng, np, 3):
        cache.append(0, k, v, q)
    before = snapshot(cache)
    k, v, q = random_kvq(rng, np, 2, H, 2, 1, D)
    bad = [(0, k[:, :1], v, q), (2, k, v, q), (0, k, v[..., :-1], q), (0, k.astype(np.int32), v, q)]
    k_nan = k.copy()
    k_nan[0, 0, 0, 0] = np.nan
    bad.append((0, k_nan, v, q))
    for args in bad:
        with pytest.raises((ValueError, TypeError)):
            cache.append(*args)
        assert_same_snapshot(before, snapshot(cache))
