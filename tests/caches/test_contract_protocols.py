"""Every cache the registry makes has, or visibly lacks, each capability of :mod:`arraykv.protocol`.

For every method name and every capability: :func:`~arraykv.protocol.supports` answers as the
class declares by its bases, a capability granted works (each of its members is called and
does what the protocol says), and one refused is absent (no member to call by mistake).
"""

from __future__ import annotations

import numpy as np
import pytest

import arraykv
from arraykv.protocol import (
    BATCH_ROWS,
    CAPABILITIES,
    INCREMENTAL,
    KV_CACHE,
    LAYER_ROUTING,
    SNAPSHOTS,
    TRANSACTIONS,
    TRUNCATION,
    WINDOW_TAIL,
    AttendConfig,
    DequantResult,
    TruncatableKVCache,
    capabilities,
    declares,
    supports,
)

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32)
OPTIONS = {
    "polar": dict(key_bits=3, value_bits=2),
    "int": dict(bits=4),
    "window": dict(window=8),
    "hybrid": dict(layer_types=["sliding_attention", "full_attention"], window=8, full_method="pqo4"),
}
METHODS = arraykv.available_methods(generic=True)
#: What each kind of cache has; everything else it must lack.
EXPECTED = {
    "window": {"kv_cache", "incremental", "truncation", "transactions", "snapshots", "batch_rows", "window_tail"},
    "hybrid": {"kv_cache", "incremental", "truncation", "transactions", "snapshots", "batch_rows", "layer_routing"},
}
GLOBAL = {"kv_cache", "incremental", "truncation", "transactions", "snapshots", "batch_rows"}
#: (method, capability) a class has but does not declare by its bases yet.
UNDECLARED: set = set()  # every class declares what it has by its bases


def _make(method):
    return arraykv.make_cache(method, **GEOM, **OPTIONS.get(method, {}))


def _kvq(t, seed=0):
    r = np.random.default_rng(seed)
    k = r.standard_normal((1, 2, t, 32)).astype(np.float32)
    v = r.standard_normal((1, 2, t, 32)).astype(np.float32)
    q = r.standard_normal((1, 4, t, 32)).astype(np.float32)
    return k, v, q


def _fill(cache, t=40):
    for layer in range(GEOM["num_layers"]):
        cache.prefill(layer, *_kvq(t, seed=layer))
    return cache


def _lengths(cache):
    return [cache.seq_len(i) for i in range(GEOM["num_layers"])]


def _exercise_kv_cache(cache):
    assert isinstance(cache.prefill(0, *_kvq(40)), DequantResult)
    k, v, q = _kvq(1, seed=3)
    out = cache.decode(0, k, v, q, AttendConfig(softmax_scale=32**-0.5, n_kv_groups=2))
    assert isinstance(out, (arraykv.Fused, arraykv.Dequantized))
    assert cache.seq_len(0) == 41 and cache.memory_usage() > 0
    cache.reset()
    assert _lengths(cache) == [0, 0]


def _exercise_incremental(cache):
    cache.append(1, *_kvq(40))
    s = cache.stable_length(1)
    assert 0 <= s <= cache.seq_len(1) == 40
    whole, tail = cache.dequantize(1), cache.dequantize(1, start=s)
    held = whole.k.shape[2]  # every token, or a window layer's last ones (whose s is 0)
    assert held == 40 or (s == 0 and 0 < held < 40)
    np.testing.assert_array_equal(np.asarray(tail.k), np.asarray(whole.k)[:, :, s:])


def _exercise_truncation(cache):
    _fill(cache)
    assert cache.can_truncate(1, 0) and not cache.can_truncate(1, 41)
    low = cache.min_truncate_length(1)
    assert 0 < low <= 40
    cache.truncate(1, low)
    assert cache.seq_len(1) == low
    cache.truncate_all(0)
    assert _lengths(cache) == [0, 0]


def _exercise_transactions(cache):
    with pytest.raises(KeyboardInterrupt):
        with cache.transaction():
            cache.prefill(0, *_kvq(40))
            raise KeyboardInterrupt
    txn = cache.begin_transaction()
    assert txn.open
    cache.prefill(1, *_kvq(40))
    txn.rollback()
    assert not txn.open and _lengths(cache) == [0, 0]


def _exercise_snapshots(cache):
    _fill(cache)
    twin = arraykv.make_cache(**cache.get_config())
    twin.restore(cache.snapshot())
    assert _lengths(twin) == _lengths(cache) == [40, 40]
    np.testing.assert_array_equal(np.asarray(twin.dequantize(1).k), np.asarray(cache.dequantize(1).k))


def _exercise_batch_rows(cache):
    _fill(cache)
    cache.select_rows([0, 0, 0])
    assert cache.batch_size() == 3


def _exercise_layer_routing(cache):
    _fill(cache)
    for layer in range(GEOM["num_layers"]):
        part = cache.cache_of(layer)
        assert supports(part, KV_CACHE) and part.seq_len(layer) == cache.seq_len(layer)


def _exercise_window_tail(cache):
    assert isinstance(cache.keep, int) and cache.keep > 0
    k, v, q = _kvq(cache.keep)
    cache.append_last(0, k, v, q, cache.keep + 100)
    assert cache.seq_len(0) == cache.keep + 100


EXERCISE = {
    "kv_cache": _exercise_kv_cache,
    "incremental": _exercise_incremental,
    "truncation": _exercise_truncation,
    "transactions": _exercise_transactions,
    "snapshots": _exercise_snapshots,
    "batch_rows": _exercise_batch_rows,
    "layer_routing": _exercise_layer_routing,
    "window_tail": _exercise_window_tail,
}


def test_every_capability_has_an_exercise():
    assert set(EXERCISE) == {c.name for c in CAPABILITIES}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.name)
@pytest.mark.parametrize("method", METHODS)
def test_a_cache_has_what_it_declares_and_it_works(method, capability):
    cache = _make(method)
    has = supports(cache, capability)
    assert has == (capability.name in EXPECTED.get(method, GLOBAL))
    if (method, capability.name) not in UNDECLARED:
        assert declares(type(cache), capability) == has, f"{type(cache).__name__} declares otherwise"
    if has:
        EXERCISE[capability.name](cache)
    else:  # visibly not: no member left to call by mistake
        present = [m for m in capability.members if getattr(cache, m, None) is not None]
        assert not present, f"{method} lacks {capability.name} but has {present}"


def test_capabilities_lists_them_in_order():
    cache = _make("hybrid")
    assert capabilities(cache) == tuple(c.name for c in CAPABILITIES if supports(cache, c))
    assert capabilities(object()) == ()


def test_the_protocols_own_empty_declaration_does_not_count():
    class Declared(TruncatableKVCache):  # subclasses the protocol, implements nothing
        pass

    class Half(TruncatableKVCache):
        def truncate(self, layer: int, length: int) -> None:
            pass

    assert not supports(Declared(), TRUNCATION) and not supports(Half(), TRUNCATION)


def test_a_class_refuses_a_member_by_setting_it_to_none():
    class NoTail(type(_make("window"))):
        append_last = None

    cache = NoTail(**GEOM, window=8)
    assert supports(_make("window"), WINDOW_TAIL) and not supports(cache, WINDOW_TAIL)
    assert supports(cache, TRUNCATION)


def test_a_third_party_cache_is_answered_by_what_it_defines():
    class Rows:
        def select_rows(self, indices):
            self.rows = list(indices)

        def batch_size(self):
            return len(self.rows)

    assert supports(Rows(), BATCH_ROWS)
    assert not any(supports(Rows(), c) for c in (KV_CACHE, INCREMENTAL, SNAPSHOTS, TRANSACTIONS, LAYER_ROUTING))


def test_the_answer_is_kept_per_class():
    first, second = _make("dense"), _make("dense")
    supports(first, BATCH_ROWS)
    assert BATCH_ROWS._answers[type(first)] is True
    assert supports(second, BATCH_ROWS) and len([c for c in BATCH_ROWS._answers if c is type(first)]) == 1


class _Forwarding:
    """A wrapper that forwards every attribute to the cache it wraps (as test harnesses and
    instrumenting proxies do): its class defines none of the members."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_forwarding_wrapper_is_answered_by_what_each_one_wraps():
    from arraykv.caches import HybridCache

    plain = _Forwarding(_make("pqo4"))
    hybrid = _Forwarding(
        HybridCache(
            num_layers=2,
            num_kv_heads=1,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"],
            window=8,
            full_method="pqo4",
        )
    )
    # the first wrapper asked must not answer for the second (both are _Forwarding)
    assert not supports(plain, LAYER_ROUTING) and supports(hybrid, LAYER_ROUTING)
    assert supports(plain, TRUNCATION) and supports(hybrid, TRUNCATION)
    assert not supports(_Forwarding(object()), KV_CACHE)


def test_members_set_on_instances_are_looked_for_on_each_instance():
    class Tail:
        def append_last(self, *args):
            return None

    with_keep, without = Tail(), Tail()
    with_keep.keep = 3
    assert supports(with_keep, WINDOW_TAIL) and not supports(without, WINDOW_TAIL)
    assert supports(with_keep, WINDOW_TAIL)  # asked again after the other instance
