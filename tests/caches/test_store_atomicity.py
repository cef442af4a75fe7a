"""Every store of every method is all-or-nothing when an allocation fails part-way."""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.storage import TokenBuffers

from cache_contract import assert_same_snapshot, snapshot
from conftest import BUILTIN_METHODS


def _kvq(r, tokens):
    k = r.standard_normal((1, 2, tokens, 16)).astype(np.float32)
    v = r.standard_normal((1, 2, tokens, 16)).astype(np.float32)
    q = r.standard_normal((1, 4, tokens, 16)).astype(np.float32)
    return k, v, q


@pytest.mark.parametrize("method", BUILTIN_METHODS)
def test_a_failed_allocation_leaves_the_layer_as_it_was(method, monkeypatch):
    r = np.random.default_rng(0)
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=16)
    cache.prefill(0, *_kvq(r, 60))
    cfg = arraykv.AttendConfig(0.25, 2)
    real = TokenBuffers._grow
    failures = 0
    # Fail the n-th buffer growth for n = 1, 2, 3 while tokens keep coming: every growth the
    # stores trigger (in any of the layer's buffers) is hit once.
    for nth in (1, 2, 3):
        calls = {"n": 0}

        def flaky(self, template, need, *rest, _nth=nth, _calls=calls):
            _calls["n"] += 1
            if _calls["n"] == _nth:
                raise MemoryError("injected")
            return real(self, template, need, *rest)

        monkeypatch.setattr(TokenBuffers, "_grow", flaky)
        for _ in range(200):
            before = snapshot(cache)
            try:
                cache.decode(0, *_kvq(r, 1), cfg)
            except MemoryError:
                failures += 1
                assert_same_snapshot(before, snapshot(cache))
                break
        monkeypatch.setattr(TokenBuffers, "_grow", real)
    assert failures >= 1  # the injection was reached
    n = cache.seq_len(0)
    res = cache.decode(0, *_kvq(r, 1), cfg)  # and the cache still works
    assert cache.seq_len(0) == n + 1 and res is not None
    d = cache.dequantize(0)
    assert d.k.shape[2] == d.v.shape[2] == n + 1


def test_int_keys_and_values_stay_in_step_when_the_value_buffer_cannot_grow(monkeypatch):
    r = np.random.default_rng(1)
    cache = arraykv.make_cache("int8", num_layers=1, num_kv_heads=2, head_dim=16)
    cache.prefill(0, *_kvq(r, 64))
    st = cache._states[0]
    real = TokenBuffers._grow

    def only_values_fail(self, template, need, *rest):
        if "v_codes" in template:
            raise MemoryError("injected")
        return real(self, template, need, *rest)

    monkeypatch.setattr(TokenBuffers, "_grow", only_values_fail)
    before = snapshot(cache)
    with pytest.raises(MemoryError):  # a full key group and a value buffer that must grow, in one call
        cache.prefill(0, *_kvq(r, 32))
    assert_same_snapshot(before, snapshot(cache))
    assert st.kq.length * 32 + int(st.k_residual.shape[2]) == st.vq.length + int(st.v_window.shape[2])


def _outputs(cache, r, steps):
    """Three decode steps of one layer: their outputs as NumPy arrays (fused or attended K/V)."""
    cfg = arraykv.AttendConfig(0.25, 2)
    out = []
    for _ in range(steps):
        res = cache.decode(0, *_kvq(r, 1), cfg)
        out.append(
            np.asarray(res.output)
            if isinstance(res, arraykv.Fused)
            else np.concatenate([np.asarray(res.result.k), np.asarray(res.result.v)], axis=2)
        )
    return out


@pytest.mark.parametrize("method", BUILTIN_METHODS + ("window-pq4",))
@pytest.mark.parametrize("call, tokens", [("decode", 1), ("prefill", 5), ("prefill", 40)])
def test_a_failure_after_the_store_is_taken_back(method, call, tokens, monkeypatch):
    """The tokens are stored, then building the result fails (a MemoryError reconstructing the
    layer, the attention kernel): the layer answers afterwards as if the call never happened
    (truncated back within the rollback margin; a longer call, 40 > 16, from a copy of the layer)."""
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=16)
    if method == "window-pq4":
        cache = arraykv.make_cache("window", window=24, storage="pq4", **kw)
    else:
        cache = arraykv.make_cache(method, **kw)
    r = np.random.default_rng(3)
    cache.prefill(0, *_kvq(r, 60))
    twin = cache.fork()
    n = cache.seq_len(0)
    before = cache.dequantize(0)

    def fail(*a, **k):
        raise MemoryError("injected after the store")

    # (a window layer's prefill decodes its held rows before it stores: a failure there changes nothing)
    for name in ("_decoded", "_attend", "_result", "_window_codec") + (("_decode_rows",) if call == "prefill" else ()):
        if hasattr(type(cache), name):
            monkeypatch.setattr(type(cache), name, fail)
    monkeypatch.setattr(arraykv.ops, "polar_decode_attention", fail)
    monkeypatch.setattr(arraykv.ops, "int_decode_attention", fail)
    k, v, q = _kvq(np.random.default_rng(4), tokens)
    with pytest.raises(MemoryError):
        if call == "decode":
            cache.decode(0, k, v, q, arraykv.AttendConfig(0.25, 2))
        else:
            cache.prefill(0, k, v, q)
    monkeypatch.undo()
    assert cache.seq_len(0) == n
    if tokens > 16:  # put back from a copy: the very state it had
        assert_same_snapshot(snapshot(cache), snapshot(twin))
    after = cache.dequantize(0)
    m = int(after.k.shape[2])  # a window layer may hold fewer rows of the past, as after truncate
    assert m == int(before.k.shape[2]) or (method == "window-pq4" and m >= 24)
    np.testing.assert_array_equal(np.asarray(after.k), np.asarray(before.k)[:, :, -m:])
    np.testing.assert_array_equal(np.asarray(after.v), np.asarray(before.v)[:, :, -m:])
    for a, b in zip(_outputs(cache, np.random.default_rng(5), 3), _outputs(twin, np.random.default_rng(5), 3)):
        np.testing.assert_array_equal(a, b)
