"""A one-token store into a polar layer whose window is full refuses non-finite keys and values.

That store (``PolarCache._slide_one``) checks NaN and infinity through its op's float16 rows
instead of a pass over the token on admission: the error, the layer left as it was, and the
steps after a refused one must be those of a check on admission.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv

H, G, D = 2, 2, 64


def _tokens(t, seed, dtype):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, H, t, D)).astype(dtype)
    v = rng.standard_normal((1, H, t, D)).astype(dtype)
    q = rng.standard_normal((1, H * G, t, D)).astype(dtype)
    return k, v, q


def _filled(method, dtype):
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=H, head_dim=D)
    k, v, q = _tokens(48, 0, dtype)
    cache.prefill(0, k, v, q)
    cfg = arraykv.AttendConfig(D**-0.5, G)
    for j in range(3):  # sinks and window full: the next one-token store slides
        kj, vj, qj = _tokens(1, 10 + j, dtype)
        cache.decode(0, kj, vj, qj, cfg)
    return cache, cfg


@pytest.mark.parametrize("method", ["pqo4", "tq3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["k", "v"])
def test_non_finite_token_refused_and_layer_unchanged(method, dtype, bad, which):
    cache, cfg = _filled(method, dtype)
    twin, _ = _filled(method, dtype)
    before = cache.layer_arrays(0)
    length = cache.seq_len(0)
    k, v, q = _tokens(1, 99, dtype)
    poisoned = (k if which == "k" else v).copy()
    poisoned[0, 1, 0, 7] = bad
    args = (poisoned, v) if which == "k" else (k, poisoned)
    with pytest.raises(ValueError, match=f"^{which} holds non-finite values"):
        cache.decode(0, *args, q, cfg)
    assert cache.seq_len(0) == length
    after = cache.layer_arrays(0)
    assert sorted(after) == sorted(before)
    for name in before:
        assert np.array_equal(after[name], before[name]), name
    # the steps after the refused call are those of a cache that never saw it
    for j in range(6):
        kj, vj, qj = _tokens(1, 200 + j, dtype)
        out = cache.decode(0, kj, vj, qj, cfg)
        ref = twin.decode(0, kj, vj, qj, cfg)
        assert np.array_equal(out.output, ref.output)


def test_non_finite_token_refused_inside_a_transaction():
    cache, cfg = _filled("pqo4", np.float32)
    before = cache.layer_arrays(0)
    k, v, q = _tokens(1, 7, np.float32)
    bad = k.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="^k holds non-finite values"):
        with cache.transaction():
            cache.decode(0, k, v, q, cfg)
            cache.decode(0, bad, v, q, cfg)
    after = cache.layer_arrays(0)
    for name in before:
        assert np.array_equal(after[name], before[name]), name


def test_float16_overflow_still_named():
    cache, cfg = _filled("pqo4", np.float32)
    k, v, q = _tokens(1, 5, np.float32)
    big = k.copy()
    big[0, 0, 0, 3] = 1e6  # finite in float32, infinite in the float16 window
    with pytest.raises(ValueError, match="overflow the float16"):
        cache.decode(0, big, v, q, cfg)
