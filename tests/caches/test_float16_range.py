"""Inputs beyond float16's range are refused by the caches whose state holds float16, never stored as inf."""

from __future__ import annotations

import numpy as np
import pytest

import arraykv

from cache_contract import assert_same_snapshot, snapshot

HALF = ["pqo4", "pqo3", "pqo2", "pq4", "tq4", "lowrank", "vq"]


def _kvq(r, t, scale=1.0):
    k = (r.standard_normal((1, 2, t, 64)) * scale).astype(np.float32)
    v = (r.standard_normal((1, 2, t, 64)) * scale).astype(np.float32)
    q = r.standard_normal((1, 4, t, 64)).astype(np.float32)
    return k, v, q


@pytest.mark.parametrize("method", HALF)
def test_one_huge_value_is_refused_and_the_cache_keeps_working(method):
    r = np.random.default_rng(0)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    cache.prefill(0, *_kvq(r, 80))
    cfg = arraykv.AttendConfig(0.125, 2)
    k, v, q = _kvq(r, 1)
    v[0, 1, 0, 5] = 7e4  # finite in float32, inf in float16
    before = snapshot(cache)
    with pytest.raises(ValueError, match="float16"):
        cache.decode(0, k, v, q, cfg)
    assert_same_snapshot(before, snapshot(cache))
    for _ in range(40):  # the refused token never reaches the window, so later steps stay finite
        res = cache.decode(0, *_kvq(r, 1), cfg)
        out = res.output if isinstance(res, arraykv.Fused) else res.result.v
        assert np.all(np.isfinite(np.asarray(out)))
    for a in cache.layer_arrays(0).values():
        if np.asarray(a).dtype.kind == "f":
            assert np.all(np.isfinite(np.asarray(a)))


@pytest.mark.parametrize("method", ["pqo4", "pqo2", "tq4"])
def test_keys_whose_norms_pass_65504_are_refused(method):
    r = np.random.default_rng(1)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    k, v, q = _kvq(r, 80, scale=1e4)  # every |x| < 65504, norms about 8e4
    assert np.abs(k).max() < 65504 and np.linalg.norm(k, axis=-1).max() > 65504
    with pytest.raises(ValueError, match="float16"):
        cache.prefill(0, k, v, q)
    assert cache.seq_len(0) == 0


@pytest.mark.parametrize("method", HALF + ["int8", "int4", "int2", "dense"])
def test_large_but_representable_inputs_are_accepted(method):
    r = np.random.default_rng(2)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    k, v, q = _kvq(r, 80, scale=100.0)
    cache.prefill(0, k, v, q)
    d = cache.dequantize(0)
    assert np.all(np.isfinite(np.asarray(d.k))) and np.all(np.isfinite(np.asarray(d.v)))
